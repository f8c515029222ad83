"""The shapes every HTTP and WebSocket door speaks, whether a worker or the front answers.

The OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, as one JSONResponse. A
JSONResponse is itself an ASGI app, so pure-ASGI middlewares (body limit, API keys) answer with the
same builder the endpoints use: `await error_response(...)(scope, receive, send)`.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from starlette.responses import JSONResponse

TRY_AGAIN_LATER = 1013  # RFC 6455 close code: the server is overloaded; the client should reconnect later
# On a worker's replies and WebSocket handshakes (past its API-key check): the streams it would admit now, beside the one
# the reply is for (its measured limit less its active streams); the front routes by it.
CAPACITY_FREE = "x-capacity-free"
# On a speech request to a worker: the longest it may wait in its admission queue for a slot, in seconds, below its
# own (0: refuse at once). The front sends 0 to every worker after the first one that answers, so a request waits
# once, not once a worker.
ADMISSION_WAIT = "x-admission-wait-s"
# On a request: how many times the client has retried it (the openai SDK's header, and every Stainless-generated
# SDK's); a worker's admission queue hands a slot first to the request refused most often before.
RETRY_COUNT = "x-stainless-retry-count"
# On every worker response where it has LoRA voices: those whose adapters its engine holds (most recent last),
# which the front prefers for their requests when capacities are equal.
LOADED_VOICES = "x-loaded-voices"


def whole_number(value: str | None) -> int | None:
    """A header's non-negative whole number (Retry-After's seconds, RETRY_COUNT), or None if it is not one."""
    return int(value) if value and value.isascii() and value.isdigit() else None


def voices_header(names: list[str]) -> bytes:
    """Voice names (any script) as LOADED_VOICES' value: percent-encoded UTF-8, comma-separated."""
    return ",".join(quote(name, safe="") for name in names).encode("ascii")


def voices_of_header(value: str | None) -> set[str]:
    """LOADED_VOICES' names, lower-cased as voices are matched."""
    return {unquote(name).lower() for name in (value or "").split(",") if name}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
