"""llm-server: one worker (engine + HTTP API) under uvicorn, drained on SIGTERM.

On SIGTERM uvicorn stops listening (new connections are refused, so a load balancer sends new
streams elsewhere), closes idle keep-alive connections, lets in-flight StreamingResponses run
to their end for up to `grace_s` (then cancels them, which releases their slots and engine
requests), and runs the lifespan shutdown. Two gaps are filled here: /ready answers 503 from
the signal on (for connections still open), and the process exits 0 after a drain instead of
uvicorn re-raising the signal at itself (a worker that drained cleanly did not fail).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from uvicorn.server import HANDLED_SIGNALS
from fastapi import FastAPI

from . import request_log
from .api import create_app
from .auth import ApiKeysError
from .config import LlmServerConfig, llm_config_from_cli

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, marking the app as draining on SIGTERM/SIGINT and exiting normally after."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app: FastAPI = self.config.app
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


def run(config: LlmServerConfig) -> None:
    """Serve until SIGTERM/SIGINT; in-flight streams get `grace_s` to finish."""
    app = create_app(config)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="info",
            log_config=None,  # uvicorn's loggers propagate to ours: one format, request ids on its lines too
            timeout_graceful_shutdown=int(config.grace_s),
            timeout_keep_alive=30,
        ),
    )
    server.run()
    if not server.started:  # the lifespan (engine, codec client) failed: not a clean exit
        sys.exit(3)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: `llm-server --port ... --model ... --snac ADDR[,ADDR...]`."""
    request_log.install()
    config = llm_config_from_cli(argv)
    try:
        run(config)
    except ApiKeysError as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
