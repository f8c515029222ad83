"""The shapes every HTTP and WebSocket door speaks, whether a worker or the front answers.

The OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, as one JSONResponse. A
JSONResponse is itself an ASGI app, so pure-ASGI middlewares (body limit, API keys) answer with the
same builder the endpoints use: `await error_response(...)(scope, receive, send)`.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

TRY_AGAIN_LATER = 1013  # RFC 6455 close code: the server is overloaded; the client should reconnect later
# On a worker's replies and WebSocket handshakes (past its API-key check): the streams it would admit now, beside the one
# the reply is for (its measured limit less its active streams); the front routes by it.
CAPACITY_FREE = "x-capacity-free"
# How long every server of the stack (worker, front, `megapod up`'s front) keeps an idle client connection
# open: longer than clients' pools keep one for reuse (httpx 5 s, aiohttp 15 s), so a client never sends a
# request down a connection the server is closing. uvicorn's default, 5 s, met httpx's 5 s at `megapod up`'s
# front: under load a request now and then arrived as the server closed, and got a reset (issue 23).
IDLE_KEEP_ALIVE_S = 30


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
