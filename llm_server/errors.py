"""The OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, as one JSONResponse.

A JSONResponse is itself an ASGI app, so pure-ASGI middlewares (body limit, API keys) answer
with the same builder the endpoints use: `await error_response(...)(scope, receive, send)`.
"""

from __future__ import annotations

from starlette.responses import JSONResponse


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class ApiError(Exception):
    """A client error with its HTTP status, OpenAI error fields, and optional headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)
