"""uvicorn drained on SIGTERM, for every HTTP server of the stack (the LLM worker and the front).

On SIGTERM uvicorn stops listening (new connections are refused, so a load balancer sends new
streams elsewhere), closes idle keep-alive connections, lets in-flight StreamingResponses run to
their end for up to timeout_graceful_shutdown, and runs the lifespan shutdown. Two gaps are filled
here: `app.state.draining` turns true at the signal (the app's /ready answers 503 from then on, for
connections still open), and the process exits normally after a drain instead of uvicorn re-raising
the signal at itself (a server that drained cleanly did not fail).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from uvicorn.server import HANDLED_SIGNALS

from .fair_websockets import FairWebSocketProtocol

log = logging.getLogger(__name__)

# How long every server of the stack keeps an idle client connection open: longer than clients' pools keep
# one for reuse (httpx 5 s, aiohttp 15 s), so a client never sends a request down a connection the server
# is closing. uvicorn's default, 5 s, met httpx's 5 s at `megapod up`'s front, which built its config
# apart: under load a request now and then arrived as the server closed, and got a reset (issue 23).
IDLE_KEEP_ALIVE_S = 30


def server_config(app: Starlette, host: str, port: int, grace_s: float, **settings) -> uvicorn.Config:
    """uvicorn's config as every HTTP server of the stack runs (the worker, the front pod, `megapod up`'s
    front): in-flight streams get grace_s to finish, idle connections stay IDLE_KEEP_ALIVE_S, WebSocket reads are
    parsed a slice per loop turn (fair_websockets.py)."""
    return uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=int(grace_s),
                          timeout_keep_alive=IDLE_KEEP_ALIVE_S, ws=FairWebSocketProtocol, **settings)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, marking the app as draining on SIGTERM/SIGINT and exiting normally after."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app: Starlette = self.config.app
        if not app.state.draining:
            app.state.draining = True
            log.info("%s: draining in-flight streams (up to %s s), refusing new connections",
                     signal.Signals(sig).name, self.config.timeout_graceful_shutdown)
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn 0.54's capture_signals without its re-raising of the signal once the drain is done."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
