"""tierq: a queue-backed asynchronous job platform for tiered LLM workloads.

This package is the small shared core: settings, the tier table, Redis names and
the message codec, job states, the bundled model, and the command line.
"""

__version__ = "0.1.0"
