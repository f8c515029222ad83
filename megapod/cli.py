"""The `megapod` command: `up` runs a MegaPod here, `deploy` puts one on Kubernetes, `say` speaks through one,
`doctor` checks a machine (its GPU, if it has one) and says how many streams it carries, `front` runs the
front endpoint alone (orpheus_front, as the front's image runs it with `python -m orpheus_front`).

Each subcommand imports what it needs when it runs: `megapod doctor --codec-only` must work on a GPU node
that has torch and the codec tier but no web stack or vLLM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from .doors import DOORS


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
    speak.add_argument("--door", choices=DOORS, default="openai",
                       help="the front door (protocol) to speak through")
    if argv and argv[0] == "up":
        from .gpu_layout import GpuLayoutError
        from .launcher import ChildKeptDying
        from .topology import MegaPodConfig
        from .up import up

        try:
            asyncio.run(up(MegaPodConfig.from_cli(argv[1:])))
        except (GpuLayoutError, ChildKeptDying) as exc:
            sys.exit(f"megapod up: {exc}")
        return
    if argv and argv[0] == "front":
        from orpheus_front.front import main as front_main  # the front's own package, as its image runs it

        front_main(argv[1:])
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
    from websockets.exceptions import WebSocketException

    from .say import say_through

    to_stdout = args.output == "-"
    fmt = "pcm" if to_stdout or args.output.endswith(".pcm") else "wav"
    try:
        if to_stdout:
            say_through(args.door, args.endpoint, args.text, args.voice, sys.stdout.buffer, fmt, args.seed)
        else:
            with open(args.output, "wb") as out:
                say_through(args.door, args.endpoint, args.text, args.voice, out, fmt, args.seed)
            print(f"wrote {args.output}", file=sys.stderr)
    except (RuntimeError, OSError, WebSocketException) as exc:
        sys.exit(f"megapod say: {exc}")
