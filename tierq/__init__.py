"""tierq: a queue-backed asynchronous job platform for tiered LLM workloads.

This package is the ground floor that every other layer imports, and that imports none of
them: Settings, the tier table, job states, Redis names, connection and the queue codec,
metrics, logging and prompt token counting. No SQL, no HTTP, no engine.
"""

__version__ = "0.1.0"
