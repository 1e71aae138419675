"""The `tierq run` supervisor: every process of the platform on one machine, started,
watched, restarted and stopped together (embedded SQLite and Redis unless URLs are set)."""
