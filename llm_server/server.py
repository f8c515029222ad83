"""llm-server: one worker (engine + HTTP API) under uvicorn, drained on SIGTERM."""

from __future__ import annotations

import logging

import uvicorn

from .api import create_app
from .config import LlmServerConfig, llm_config_from_cli


def run(config: LlmServerConfig) -> None:
    """Serve until SIGTERM/SIGINT; in-flight streams get `grace_s` to finish."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level="info",
            timeout_graceful_shutdown=int(config.grace_s),
            timeout_keep_alive=30,
        )
    )
    server.run()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: `llm-server --port ... --model ... --snac ADDR[,ADDR...]`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(llm_config_from_cli(argv))
