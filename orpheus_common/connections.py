"""Cutting a response's connection on purpose: a stream that fails after its audio started ends without its last
chunk (how HTTP says "incomplete"), and a client that stopped reading is dropped at once. A worker's doors do it
(llm_server/doors/http.py), and the front passes a worker's cut on to its client (orpheus_front/front.py).

A pure ASGI middleware keeps the connection's transport (uvicorn's send is a method of its request cycle, which
holds it) in a context variable for everything the request's task runs; a log filter drops uvicorn's complaint
about a response ended early on purpose.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

# What uvicorn logs when an app returns mid-response; for our deliberate aborts it is not news.
_UVICORN_INCOMPLETE = "ASGI callable returned without completing response."


@dataclass
class Connection:
    """The connection of the request being served, and whether it was cut on purpose."""

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


_current: ContextVar[Connection | None] = ContextVar("orpheus_connection", default=None)


def current() -> Connection | None:
    return _current.get()


class ConnectionMiddleware:
    """Keeps each HTTP request's connection where the response can cut it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # Not reset afterwards: the task is this request's alone, and uvicorn's line about an incomplete
            # response comes after the app returns.
            _current.set(Connection(getattr(getattr(send, "__self__", None), "transport", None)))
        await self.app(scope, receive, send)


class DeliberateAbortFilter(logging.Filter):
    """Drops uvicorn's complaint about a response we ended early on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        connection = _current.get()
        return not (connection is not None and connection.aborted and record.msg == _UVICORN_INCOMPLETE)


def quiet_deliberate_aborts() -> None:
    """Install the filter on uvicorn's error logger (once), wherever its records are handled."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DeliberateAbortFilter) for f in logger.filters):
        logger.addFilter(DeliberateAbortFilter())
