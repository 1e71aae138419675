"""The ground floor that every other layer imports, and that imports none of them:
Settings, the tier table, job states, Redis names, connection, scripts and the queue
codec, metrics, logging and prompt token counting. No SQL, no HTTP, no engine.
"""
