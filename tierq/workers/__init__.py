"""Workers: the engine host, the inbox loop, streaming, result persistence; Celery tasks."""
