"""OpenAI-style errors: one exception type carrying the status, and the body every error response has.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the API refuses; the handler turns it into `status` and `body()`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def error_type(self) -> str:
        """OpenAI's error type for the status."""
        return ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unknown_model(name: str, served: str) -> ApiError:
    return ApiError(404, f"the model {name!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")  # fmt: skip


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")


def too_many_in_flight(limit: int) -> ApiError:
    return ApiError(429, f"{limit} requests are in flight already; retry when one finishes", code="too_many_requests")
