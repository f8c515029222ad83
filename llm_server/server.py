"""llm-server: one worker (engine + HTTP API) under uvicorn, drained on SIGTERM (orpheus_common/draining.py):
in-flight streams run to their end for up to `grace_s` (then are cancelled, which releases their slots
and engine requests), /ready answers 503 from the signal on, and a clean drain exits 0.
"""

from __future__ import annotations

import logging
import sys

from orpheus_common.draining import DrainingServer, server_config

from .api import create_app
from .config import LlmServerConfig
from .edge import request_ids
from .edge.auth import ApiKeysError

log = logging.getLogger(__name__)


def run(config: LlmServerConfig) -> None:
    """Serve until SIGTERM/SIGINT; in-flight streams get `grace_s` to finish."""
    app = create_app(config)
    server = DrainingServer(
        server_config(
            app,
            config.host,
            config.port,
            config.grace_s,
            log_level="info",
            log_config=None,  # uvicorn's loggers propagate to ours: one format, request ids on its lines too
            **config.uvicorn_settings(),
        ),
    )
    server.run()
    if not server.started:  # the lifespan (engine, codec client) failed: not a clean exit
        sys.exit(3)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: `llm-server --port ... --model ... --snac ADDR[,ADDR...]`."""
    request_ids.install()
    config = LlmServerConfig.from_cli(argv)
    try:
        run(config)
    except ApiKeysError as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
