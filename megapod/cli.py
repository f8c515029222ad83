"""The `megapod` command: `up` runs a MegaPod here, `deploy` puts one on Kubernetes, `say` speaks through one,
`doctor` checks a machine (its GPU, if it has one) and says how many streams it carries, `front` runs the
front endpoint alone (the chart's front pods)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import uvicorn

from .front import create_front_app, front_config_from_cli, serve_front
from .gpu_layout import GpuLayoutError
from .launcher import Launcher
from .say import say
from .topology import MegaPodConfig, megapod_config_from_cli

log = logging.getLogger("megapod")

RANDOM_WEIGHTS_BANNER = """
  ************************************************************************************
  *  RANDOM WEIGHTS: the LLM is `tiny` and/or SNAC is `random-24khz`. The stack runs  *
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
    """Start the MegaPod, serve the front endpoint, supervise; drain and stop on SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if config.random_weights:
        print(RANDOM_WEIGHTS_BANNER, file=sys.stderr, flush=True)
    launcher = Launcher(config, log_dir())
    front = _FrontServer(uvicorn.Config(
        create_front_app([f"http://{config.host}:{p}" for p in config.worker_ports()]),
        host=config.host, port=config.front_port, log_level="warning",
        timeout_graceful_shutdown=int(config.grace_s),  # the drain budget of every tier
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
        await launcher.supervise(stop)
        front.should_exit = True
        await serving
    finally:
        log.info("stopping: draining workers, then codec replicas")
        await launcher.stop()


def _print_endpoints(config: MegaPodConfig) -> None:
    front = f"http://{config.host}:{config.front_port}"
    print(f"\nMegaPod ready: {config.workers} worker(s), {config.replicas} SNAC replica(s)", file=sys.stderr)
    print(f"  endpoint   {front}/v1/audio/speech   (OpenAI-compatible; least-active worker)", file=sys.stderr)
    for port in config.worker_ports():
        print(f"  worker     http://{config.host}:{port}", file=sys.stderr)
    for port in config.snac_ports():
        print(f"  snac       {config.host}:{port} (gRPC)", file=sys.stderr)
    print('  try        megapod say "Hello there." --voice tara -o hello.wav\n', file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # readiness polls would flood the console
    parser = argparse.ArgumentParser(prog="megapod", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run a MegaPod on this machine (flags: megapod up --help)", add_help=False)
    sub.add_parser("deploy", help="deploy a MegaPod to Kubernetes (flags: megapod deploy --help)", add_help=False)
    sub.add_parser("front", help="run the front endpoint alone, over given or resolved workers "
                   "(flags: megapod front --help)", add_help=False)
    sub.add_parser("doctor", help="check this machine's GPU (or CPU) and measure it (flags: megapod doctor --help)",
                   add_help=False)
    speak = sub.add_parser("say", help="speak text through a running endpoint")
    speak.add_argument("text")
    speak.add_argument("--voice", default="tara")
    speak.add_argument("-o", "--output", default="out.wav", help="file to write, or - for raw PCM on stdout")
    speak.add_argument("--endpoint", default=os.environ.get("MEGAPOD_ENDPOINT", "http://127.0.0.1:8000"))
    speak.add_argument("--seed", type=int, default=None)
    if argv and argv[0] == "up":
        try:
            asyncio.run(up(megapod_config_from_cli(argv[1:])))
        except GpuLayoutError as exc:
            sys.exit(f"megapod up: {exc}")
        return
    if argv and argv[0] == "front":
        serve_front(front_config_from_cli(argv[1:]))
        return
    if argv and argv[0] == "doctor":
        from .doctor import main as doctor_main  # torch and vLLM load only for the doctor

        doctor_main(argv[1:])
        return
    if argv and argv[0] == "deploy":
        from .deploy_cli import main as deploy_main  # the kubernetes client loads only when deploying

        deploy_main(argv[1:])
        return
    args = parser.parse_args(argv)
    if args.command == "say":
        _say(args)


def _say(args: argparse.Namespace) -> None:
    to_stdout = args.output == "-"
    fmt = "pcm" if to_stdout or args.output.endswith(".pcm") else "wav"
    try:
        if to_stdout:
            say(args.endpoint, args.text, args.voice, sys.stdout.buffer, fmt, args.seed)
        else:
            with open(args.output, "wb") as out:
                say(args.endpoint, args.text, args.voice, out, fmt, args.seed)
            print(f"wrote {args.output}", file=sys.stderr)
    except (RuntimeError, OSError) as exc:
        sys.exit(f"megapod say: {exc}")
