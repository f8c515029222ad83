"""`megapod up`: a MegaPod on this machine: the launcher's children, the front endpoint over them,
supervision, and a drain on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import uvicorn

from orpheus_common.draining import server_config
from orpheus_common.tls import TlsSettings
from orpheus_front.front import create_front_app

from .launcher import Launcher
from .local_tls import LOOPBACK, ensure_local_tls
from .topology import MegaPodConfig

log = logging.getLogger("megapod")

RANDOM_WEIGHTS_BANNER = """
  ************************************************************************************
  *  RANDOM WEIGHTS: the LLM is `tiny` and/or SNAC is `random-24khz*`. The stack runs *
  *  end to end, but the audio is noise. Give real checkpoints for real speech:       *
  *    megapod up --llm-model canopylabs/orpheus-3b-0.1-ft \\                          *
  *               --snac-model hubertsiuzdak/snac_24khz   (or MEGAPOD_LLM_MODEL=...)  *
  ************************************************************************************
"""


class _FrontServer(uvicorn.Server):
    """uvicorn without its own signal handling: the launcher decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def log_dir() -> Path:
    return Path(os.environ.get("MEGAPOD_LOG_DIR", Path.home() / ".cache" / "orpheus-megapod" / "logs"))


async def up(config: MegaPodConfig) -> None:
    """Start the MegaPod, serve the front endpoint, supervise; drain and stop on SIGINT/SIGTERM, or when a
    process keeps dying (raising ChildKeptDying once all is stopped)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if config.random_weights:
        print(RANDOM_WEIGHTS_BANNER, file=sys.stderr, flush=True)
    launcher = Launcher(config, log_dir())
    front = _FrontServer(server_config(  # grace_s: the drain budget of every tier
        create_front_app([f"http://{config.host}:{p}" for p in config.worker_ports()]),
        config.host, config.front_port, config.grace_s, log_level="warning", **front_tls(config).uvicorn_settings(),
    ))
    try:
        starting = asyncio.create_task(launcher.start())
        await asyncio.wait([starting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return
        starting.result()
        serving = asyncio.create_task(front.serve())
        _print_endpoints(config)
        try:
            await launcher.supervise(stop)  # ChildKeptDying: a process that keeps dying ends the MegaPod
        finally:
            front.should_exit = True
            await serving
    finally:
        log.info("stopping: draining workers, then codec replicas")
        await launcher.stop()


def front_tls(config: MegaPodConfig) -> TlsSettings:
    """The front's TLS: the files given, or those tls_dir holds (made there first if missing), or none."""
    if not config.tls_dir:
        return config
    names = LOOPBACK + (() if config.host in (*LOOPBACK, "0.0.0.0", "::") else (config.host,))
    made = ensure_local_tls(Path(config.tls_dir).expanduser(), names)
    return TlsSettings(ssl_certfile=str(made.certfile), ssl_keyfile=str(made.keyfile), ssl_ca_certs=config.ssl_ca_certs)


def _print_endpoints(config: MegaPodConfig) -> None:
    front = f"{config.front_scheme}://{config.host}:{config.front_port}"
    print(f"\nMegaPod ready: {config.workers} worker(s), {config.replicas} SNAC replica(s)", file=sys.stderr)
    print(f"  endpoint   {front}/v1/audio/speech   (OpenAI-compatible; least-active worker)", file=sys.stderr)
    print(f"  playground {front}/   (type, pick a voice, hear it stream)", file=sys.stderr)
    for port in config.worker_ports():
        print(f"  worker     http://{config.host}:{port}", file=sys.stderr)
    for port in config.snac_ports():
        print(f"  snac       {config.host}:{port} (gRPC)", file=sys.stderr)
    if config.tls_dir:
        print(f"  trust      SSL_CERT_FILE={Path(config.tls_dir).expanduser() / 'ca.pem'}   (the local CA)", file=sys.stderr)
    endpoint = "" if front == "http://127.0.0.1:8000" else f" --endpoint {front}"
    print(f'  try        megapod say "Hello there." --voice tara -o hello.wav{endpoint}\n', file=sys.stderr, flush=True)
