"""What crosses between the ingress and a replica (pickled by Ray): plain tuples and dataclasses.

A replica's stream for one request:
  ("admitted", replica_id)                         first, once admission took the request
  ("refused", replica_id, status, message, param, code, headers)   first and last, instead
  ("delta", StreamDelta) ...                       the engine's deltas
  ("usage", Usage)                                 last, after the final delta
  ("failed", message)                              last, instead, when the engine failed mid-way
"""

from __future__ import annotations

from dataclasses import replace

from kiln.serving.http.errors import ApiError
from kiln.serving.openai.requests import PreparedRequest


def portable(prepared: PreparedRequest) -> PreparedRequest:
    """The request without its compiled grammar (a native matcher that does not pickle); the
    replica's engine client compiles it again from the spec when it makes the engine request."""
    spec = prepared.params.structured
    if spec is None or spec.compiled is None:
        return prepared
    return replace(prepared, params=replace(prepared.params, structured=spec.with_compiled(None)))


def refusal(replica_id: str, e: ApiError) -> tuple:
    return ("refused", replica_id, e.status, e.message, e.param, e.code, dict(e.headers))


def refusal_error(item: tuple) -> ApiError:
    _, _, status, message, param, code, headers = item
    return ApiError(status, message, param, code, headers)
