"""The HTTP API: the app factory, one router per feature, auth dependencies, SSE."""
