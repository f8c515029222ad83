"""A client error the endpoints raise, answered as the OpenAI error body (orpheus_common.http)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from orpheus_common.http import error_response


class ApiError(Exception):
    """A client error with its HTTP status, OpenAI error fields, and optional headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)
