"""OpenAI error objects: every failure leaves the frontend as one of these, never as a stack trace.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with the HTTP status that says
what happened: 400 invalid request, 404 unknown model or route, 503 Triton or the model not ready, 500
anything else. Triton's gRPC status codes map onto them in :func:`from_grpc_status`.
"""

from __future__ import annotations

from typing import Any

# HTTP status -> OpenAI error type.
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "server_error", 504: "server_error"}


class APIError(Exception):
    """A request that ends with an OpenAI error object and ``status``.

    ``param`` names the offending request field (dotted path) when there is one; ``code`` is a
    machine-readable reason such as ``invalid_type``, ``unsupported_value`` or ``model_not_found``.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_value")


def model_not_found(model: str, why: str = "") -> APIError:
    return APIError(404, f"The model `{model}` does not exist{why}.", param="model", code="model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="service_unavailable")


def internal(message: str) -> APIError:
    return APIError(500, message, code="internal_error")


def from_grpc_status(code_name: str, message: str, where: str) -> APIError:
    """Map a Triton gRPC status (``StatusCode`` name, e.g. ``INVALID_ARGUMENT``) to an API error."""
    if code_name == "INVALID_ARGUMENT":
        return invalid(message)
    if code_name == "NOT_FOUND":
        return APIError(404, message, code="model_not_found")
    if code_name == "UNAVAILABLE":
        if "failed to connect" in message.lower() or "connection refused" in message.lower():
            return unavailable(f"the Triton server at {where} is not reachable: {message}")
        return unavailable(message)
    if code_name == "DEADLINE_EXCEEDED":
        return APIError(504, f"the request timed out: {message}", code="timeout")
    if code_name == "CANCELLED":
        return unavailable(f"the server cancelled the request: {message}")
    return internal(message)
