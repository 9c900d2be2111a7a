"""Serving: an OpenAI-compatible HTTP server over the runtime's EngineClient (`kiln serve`).

protocol (request models) -> requests (prompt ids + SamplingParams) -> flights (one engine
generation, shared by identical requests) -> responses (OpenAI bodies and SSE chunks).
admission, response_cache and metrics sit beside that path; app wires them into Starlette.
"""
