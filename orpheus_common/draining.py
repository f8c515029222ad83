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

log = logging.getLogger(__name__)


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
