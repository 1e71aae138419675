"""The flags every tierq Celery worker runs with (`tierq run`, docker-compose.yml, the
tests), beside `worker_enable_remote_control=False` in tierq/workers/celery_app.py: no consumer
step that holds a pub/sub subscription or chatters on one.

tierq uses none of Celery's remote control, gossip, mingle or event heartbeats. With them,
every dropped pub/sub connection (a Redis failover, a proxy's idle timeout, `CLIENT KILL
TYPE pubsub`) restarted the worker's consumer, and each restart left Celery's per-task
request classes and kombu's Redis clients behind: a worker's memory grew with every drop.
"""

QUIET_WORKER_FLAGS = ("--without-gossip", "--without-mingle", "--without-heartbeat")
