"""Serving: an OpenAI-compatible HTTP server over the runtime's EngineClient (`kiln serve`), and
the Triton backend, by concern:

  openai/    the OpenAI surface: request models (protocol) -> prompt ids + SamplingParams
             (requests, structured_requests, tools, tool_formats, reasoning) ... response bodies and
             SSE chunks (responses)
  traffic/   where a prepared request gets its tokens and who may wait: admission, per-key budgets,
             flights (one engine generation, shared by identical requests), generations
  cache/     the exact-match response cache and the semantic cache (its embedder, guards, index)
  http/      the Starlette app, `kiln serve`'s uvicorn server, HTTP plumbing, errors, the utility
             routes, a request's choices, the server's Prometheus metrics
  console/   the playground and dashboard at /
  triton/    the Triton Python backend and its launcher
  engine_metrics.py  the engine's metric names, shared by /metrics and Triton's metrics port
"""
