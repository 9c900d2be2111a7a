"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

import logging
import uuid

from starlette.responses import JSONResponse

log = logging.getLogger("kiln.serving")

# The `type` OpenAI clients expect for each status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def engine_failure(error: BaseException) -> ApiError:
    """A 500 for a request the engine failed mid-step. The client gets an incident id, never the
    error's own text (a native library's message can name files, devices or other requests'
    shapes); the server's log has the text under the same id."""
    incident = uuid.uuid4().hex[:12]
    log.error("engine failure, incident %s: %s: %s", incident, type(error).__name__, error)
    return ApiError(500, f"the engine failed while running this request (incident {incident}); "
                         "the cause is in the server's log", code="engine_error")
