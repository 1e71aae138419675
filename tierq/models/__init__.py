"""SQLAlchemy tables and the repository functions that own all SQL."""
