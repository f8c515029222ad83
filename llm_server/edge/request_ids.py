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
from dataclasses import dataclass, field

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
HEADER = b"x-request-id"
# What uvicorn logs when an app returns mid-response; for our deliberate aborts it is not news.
_UVICORN_INCOMPLETE = "ASGI callable returned without completing response."


@dataclass
class RequestContext:
    """The request being served: its id, and how to cut its connection on purpose."""

    request_id: str
    transport: object = field(default=None, repr=False)  # the server's transport, when it exposes one
    aborted: bool = False

    def end_response_early(self) -> None:
        """The response will end without its last chunk: uvicorn closes the connection after
        flushing what was sent (the client sees an incomplete body); no error line for it."""
        self.aborted = True

    def reset_connection(self) -> None:
        """Drop the connection now, unsent data included (a client that stopped reading would
        otherwise hold the socket until its buffer drains)."""
        self.aborted = True
        abort = getattr(self.transport, "abort", None)
        if abort is not None:
            abort()


_current: ContextVar[RequestContext | None] = ContextVar("orpheus_request", default=None)


def current() -> RequestContext | None:
    return _current.get()


def choose_id(offered: bytes | None) -> str:
    """The client's id if it is [A-Za-z0-9._-]{1,64}; otherwise a fresh one."""
    if offered is not None:
        text = offered.decode("latin-1")
        if _SAFE_ID.fullmatch(text):
            return text
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Outermost middleware: sets the request's context and adds X-Request-Id to its response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = RequestContext(choose_id(dict(scope["headers"]).get(HEADER)))
        # uvicorn's send is a method of its request cycle, which holds the connection's transport.
        ctx.transport = getattr(getattr(send, "__self__", None), "transport", None)
        # Not reset afterwards: the task is this request's alone, and the server's own lines
        # about it (access log, an incomplete response) come after the app returns.
        _current.set(ctx)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = ctx.request_id  # replaces an app's own
            await send(message)

        await self.app(scope, receive, send_with_id)


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record as `request_id`; drops uvicorn's complaint
    about a response we ended early on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _current.get()
        record.request_id = ctx.request_id if ctx else "-"
        return not (ctx is not None and ctx.aborted and record.msg == _UVICORN_INCOMPLETE)


def quiet_deliberate_aborts() -> None:
    """Install the filter on uvicorn's error logger (once), wherever its records are handled."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, RequestIdFilter) for f in logger.filters):
        logger.addFilter(RequestIdFilter())


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


def install(level: int = logging.INFO) -> None:
    """Root logging with the request id on every line (uvicorn's loggers propagate to it)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    quiet_deliberate_aborts()
