"""tierq: a queue-backed asynchronous job platform for tiered LLM workloads.

Everything the package installs lives under this one import name, in the layers of
docs/design/layout.md (each imports only those below it):

    cli                     the `tierq` command and the `tierq run` supervisor's commands
    launch | client         process supervision; the admin and batch HTTP clients
    api | workers           the FastAPI app; the engine host, the inbox loop, Celery tasks
    services | migrations   what the API and the workers both do; the Alembic versions
    models | dispatcher     all SQL; the pure scheduling policy and its loop
    core                    Settings, tiers, states, Redis names and scripts, the codec,
                            metrics, logging: no SQL, no HTTP, no engine

The benchmarks are not part of it: they live beside it in the repository
(`benchmarks/`, their own distribution) and add `tierq bench` when installed.
"""

__version__ = "0.1.0"
