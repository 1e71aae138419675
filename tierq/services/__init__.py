"""Domain services shared by the API and the workers: the normalised request and its checks,
OpenAI's protocol shapes, what no request may carry, the tenant policy the dispatcher reads,
asking Celery to advance a batch, and first-start tenant keys. Imports the core and `tierq/models/`,
never `tierq/api/` or `tierq/workers/`."""
