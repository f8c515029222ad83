"""Request ids: one per HTTP request, on its response and on every log line about it.

A pure ASGI middleware picks the id (the client's `X-Request-Id` if short and safe, else a new
one), keeps it in a context variable for everything the request's task runs (tasks it starts
copy the context), and puts it on the response, errors included. `RequestIdFilter` stamps it
on log records as `request_id` ("-" outside a request).
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orpheus_common import connections

_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
HEADER = b"x-request-id"

_current: ContextVar[str | None] = ContextVar("orpheus_request_id", default=None)


def choose_id(offered: bytes | None) -> str:
    """The client's id if it is [A-Za-z0-9._-]{1,64}; otherwise a fresh one."""
    if offered is not None:
        text = offered.decode("latin-1")
        if _SAFE_ID.fullmatch(text):
            return text
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Outermost middleware: sets the request's id and adds X-Request-Id to its response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = choose_id(dict(scope["headers"]).get(HEADER))
        # Not reset afterwards: the task is this request's alone, and the server's own lines
        # about it (access log, an incomplete response) come after the app returns.
        _current.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id  # replaces an app's own
            await send(message)

        await self.app(scope, receive, send_with_id)


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record as `request_id`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _current.get() or "-"
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


def install(level: int = logging.INFO) -> None:
    """Root logging with the request id on every line (uvicorn's loggers propagate to it)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    connections.quiet_deliberate_aborts()
