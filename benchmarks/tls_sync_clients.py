"""How often a Python sync WebSocket client's upgrade is lost over TLS, against the stack's TLS settings
(orpheus_common/tls.py: no session tickets) and the reference (the same server sending TLS 1.3's default two
tickets), in one run.

websockets.sync (under ElevenLabs' SDK) reads in one thread and writes in another on one SSL object. A TLS 1.3
server's tickets reach the client after its handshake; when its reading thread takes them while the writing
thread sends the upgrade request, the request can be lost: no answer comes, and the client's reading thread never
returns (CI's ElevenLabs test waited out pytest's 300 s so). A client thread descheduled for a moment on a loaded
machine is when that happens; here each client waits a random 0..--jitter-ms between its TLS handshake and its
upgrade request to stand in for it.

- servers: uvicorn with the stack's TLS settings and WebSocket protocol, one process each, serving a socket that
  answers "hi" and closes; the reference also sends tickets;
- clients: --connects upgrades to each, one at a time, alternating servers; an upgrade is lost when no "hi"
  came within --timeout-s (a hang or an error).

    .venv/bin/python benchmarks/tls_sync_clients.py --connects 5000
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from websockets.sync.client import ClientConnection, connect

from benchmarks.provenance import REPO_ROOT, record
from megapod.launcher import Child, free_ports
from megapod.local_tls import ensure_local_tls

PACKAGES = ("uvicorn", "websockets", "starlette")
REFERENCE_TICKETS = 2  # OpenSSL's default for a TLS 1.3 server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connects", type=int, default=5000, help="upgrades to each server")
    p.add_argument("--jitter-ms", type=float, default=4.0, help="most a client waits between handshake and request")
    p.add_argument("--timeout-s", type=float, default=5.0, help="an upgrade without its answer by then is lost")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "tls_sync_clients-cpu.json")
    p.add_argument("--serve", nargs=3, metavar=("PORT", "TLS_DIR", "TICKETS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def serve(port: int, tls_dir: Path, tickets: int) -> None:
    """One server: the stack's TLS settings and WebSocket protocol; `tickets` > 0 puts them back (the reference)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route, WebSocketRoute

    from orpheus_common.draining import server_config
    from orpheus_common.tls import TlsSettings

    async def hello(ws) -> None:
        await ws.accept()
        await ws.send_text("hi")
        await ws.close()

    async def health(request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    made = ensure_local_tls(tls_dir)
    settings = TlsSettings(ssl_certfile=str(made.certfile), ssl_keyfile=str(made.keyfile)).uvicorn_settings()
    stack_context = settings["ssl_context_factory"]

    def context(config, default) -> ssl.SSLContext:
        made_context = stack_context(config, default)
        if tickets:
            made_context.num_tickets = tickets
        return made_context

    app = Starlette(routes=[WebSocketRoute("/ws", hello), Route("/health", health)])
    uvicorn.Server(server_config(app, "127.0.0.1", port, 1.0, log_level="warning",
                                 **{**settings, "ssl_context_factory": context})).run()


class LateClient(ClientConnection):
    """websockets.sync's client, its thread descheduled for a random 0..jitter_s after the TLS handshake."""

    def __init__(self, *args, jitter_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.jitter_s = jitter_s

    def handshake(self, *args, **kwargs) -> None:
        time.sleep(random.uniform(0.0, self.jitter_s))
        super().handshake(*args, **kwargs)


def upgrade(url: str, context: ssl.SSLContext, client: Callable[..., ClientConnection], timeout_s: float) -> str | None:
    """One sync client's upgrade and first message: None when "hi" came in time, else what happened."""
    outcome: dict[str, str] = {}

    def run() -> None:
        try:
            with connect(url, ssl=context, open_timeout=timeout_s, create_connection=client) as ws:
                outcome["said"] = ws.recv(timeout=timeout_s)
        except Exception as exc:  # every failure is the figure: counted by kind
            outcome["error"] = type(exc).__name__

    thread = threading.Thread(target=run, daemon=True)  # a hung client's threads are left behind: they never return
    thread.start()
    thread.join(2 * timeout_s + 1)
    if thread.is_alive():
        return "hung"
    return None if outcome.get("said") == "hi" else outcome.get("error", "no hi")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), Path(args.serve[1]), int(args.serve[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        made = ensure_local_tls(Path(tmp) / "tls")
        context = ssl.create_default_context(cafile=str(made.ca))
        ports = dict(zip(("stack", "reference"), free_ports(2)))
        tickets = {"stack": 0, "reference": REFERENCE_TICKETS}
        servers = [Child(name, [sys.executable, "-m", "benchmarks.tls_sync_clients", "--serve", str(port),
                                str(made.ca.parent), str(tickets[name])], Path(tmp) / f"{name}.log").start()
                   for name, port in ports.items()]
        try:
            wait_ready(list(ports.values()), context)
            lost: dict[str, dict[str, int]] = {name: {} for name in ports}
            client = functools.partial(LateClient, jitter_s=args.jitter_ms / 1000)
            started = time.monotonic()
            for _ in range(args.connects):
                for name, port in ports.items():
                    failure = upgrade(f"wss://127.0.0.1:{port}/ws", context, client, args.timeout_s)
                    if failure:
                        lost[name][failure] = lost[name].get(failure, 0) + 1
            seconds = time.monotonic() - started
        finally:
            for child in servers:
                child.stop()
    result = {"provenance": record(PACKAGES), "openssl": ssl.OPENSSL_VERSION, "connects_each": args.connects,
              "jitter_ms": args.jitter_ms, "timeout_s": args.timeout_s, "seconds": round(seconds, 1),
              "servers": {name: {"session_tickets": tickets[name], "lost": sum(lost[name].values()), "how": lost[name]}
                          for name in ports}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["servers"]))


def wait_ready(ports: list[int], context: ssl.SSLContext, within_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + within_s
    for port in ports:
        while True:
            try:
                if httpx.get(f"https://127.0.0.1:{port}/health", verify=context, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


if __name__ == "__main__":
    main()
