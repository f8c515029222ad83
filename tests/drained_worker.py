"""`python tests/drained_worker.py HOST PORT SNAC GRACE_S`: one LLM worker as the pod runs it (the real app
under the real drain, llm_server/server.py), its engine a double that needs no model: test_chart_parity's
rolling update. A script of its own, so that each worker starts without the chart tests' imports."""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn
from served import CharTokenizerDouble, ScriptedEngineDouble

from llm_server.api import create_app
from llm_server.speech.codec_client import CodecClient
from llm_server.config import LlmServerConfig
from llm_server.runtime import Runtime, codec_client_config
from orpheus_common.draining import DrainingServer

WORKER_FRAMES = 16


async def serve(host: str, port: int, snac_address: str, grace_s: float) -> None:
    config = LlmServerConfig(host=host, port=port, snac=snac_address, grace_s=grace_s, max_streams=64, min_streams=64)
    # Streams of 1.6 s or more (longer than the test's endpoint delay): some are in flight at SIGTERM.
    engine = ScriptedEngineDouble(frames=WORKER_FRAMES, frames_per_batch=1, batch_delay_s=0.1)
    runtime = Runtime.assemble(config, engine, CodecClient(codec_client_config(config)), CharTokenizerDouble())
    server = DrainingServer(uvicorn.Config(create_app(config, runtime), host=host, port=port, log_config=None,
                                           timeout_graceful_shutdown=int(config.grace_s)))
    await server.serve()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # the drain's log lines, which the test reads
    asyncio.run(serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
