"""The HTTP server: the Starlette app and its endpoints (app, choices, utility_routes), `kiln serve`'s
uvicorn runner (server), the plumbing the endpoints share (http_io), OpenAI-style errors (errors)
and the server's Prometheus metrics (metrics)."""
