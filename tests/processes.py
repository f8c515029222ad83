"""Start the real servers as processes on free loopback ports, for end-to-end tests (megapod's launcher)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.concurrency_bench.stack import LocalStack
from megapod.launcher import Child, free_ports

TINY_CACHE = os.environ.get("MEGAPOD_TEST_CACHE", str(Path.home() / ".cache" / "orpheus-megapod"))
UNBUFFERED = {"PYTHONUNBUFFERED": "1"}  # a log's tail is up to date when a test fails
MAX_MODEL_LEN = 1024  # the context of the session's workers (tests of prompts over it count on it)
WORKER_MAX_STREAMS = 8  # the admission cap of each worker of the session's `megapod up` (conftest.megapod)
# The codec of end-to-end stacks and of the tests' codec servers (conftest.server_config): the real layout
# at 1/16 width (snac_server.codec_model.RANDOM_MODELS), so their audio costs a fraction of the real
# decoder's CPU; the codec's numerics are tested at the real width (test_streaming.py, test_codec_model.py).
TEST_CODEC = "random-24khz-small"


@dataclass
class Server(Child):
    """A server process whose log goes into the test's directory, given at start."""

    metrics_port: int | None = None

    def start(self, log_dir: Path) -> Server:
        self.log_path = log_dir / f"{self.name}-{self.port}.log"
        return super().start()


def snac_process(port: int | None = None, *extra: str) -> Server:
    metrics, fresh = free_ports(2)  # distinct: two separate calls could return the same port
    port = port or fresh
    args = [sys.executable, "-m", "snac_server", "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", str(metrics), "--device", "cpu", "--model", TEST_CODEC, "--max-wait-ms", "10", *extra]
    return Server("snac_server", args, None, f"grpc://127.0.0.1:{port}", UNBUFFERED, metrics_port=metrics)


@dataclass
class Part:
    """One server of a `megapod up` (llm-0, snac-1), seen from outside: its ports, its log, and its pid now (the
    launcher restarts a part that dies, under a new pid). A worker serves its metrics on its own port."""

    name: str
    port: int
    metrics_port: int
    log_dir: Path
    launcher_log: Path

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def pid(self) -> int:
        return int(re.findall(rf"(?:started|restarted) {re.escape(self.name)} \(pid (\d+)\)", self._launcher_text())[-1])

    def restarts(self) -> int:
        return len(re.findall(rf"restarted {re.escape(self.name)} \(pid", self._launcher_text()))

    def deaths(self) -> int:
        """Deaths the launcher has logged (it notices one within its supervision period, 0.5 s)."""
        return len(re.findall(rf"{re.escape(self.name)} \(pid \d+\) died", self._launcher_text()))

    def wait_restarted(self, restarts: int, within_s: float = 300.0) -> None:
        """Until the launcher has restarted this part `restarts` times in all and the new one is ready."""
        deadline = time.monotonic() + within_s
        while True:
            # what the launcher logged after this part's restarts-th restart ("" until it has happened)
            since = "".join(self._launcher_text().split(f"restarted {self.name} (pid")[restarts:])
            if f"{self.name} ready (" in since:
                return
            assert f"{self.name} did not come back" not in since, since[-2000:]
            assert time.monotonic() < deadline, f"{self.name} not back after {within_s:.0f} s"
            time.sleep(0.2)

    def _launcher_text(self) -> str:
        return self.launcher_log.read_text()


def scrape(port: int, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples (those with `labels`, when given) from a /metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def wait_metric_zero(port: int, name: str, within_s: float) -> float:
    """Poll a metric until it reads 0 or `within_s` passes; returns the last reading."""
    deadline = time.perf_counter() + within_s
    while (value := scrape(port, name)) > 0 and time.perf_counter() < deadline:
        time.sleep(0.05)
    return value


def hang(proc: Child) -> None:
    """SIGSTOP a server: hung, not dead. Its sockets stay open and the kernel still accepts connections."""
    proc.popen.send_signal(signal.SIGSTOP)


def unhang(proc: Child) -> None:
    """SIGCONT a server stopped by hang() (a stopped process ignores SIGTERM until then)."""
    if proc.alive():
        proc.popen.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def megapod_up(log_dir: Path, workers: int, replicas: int, max_streams: int | None = None,
               grace_s: float | None = None) -> Iterator[dict]:
    """`megapod up` on free ports (real vLLM on the CPU, random weights), as a user runs it, until its
    front is ready; SIGINT (then SIGKILL of all it started) at the end: the benchmarks' LocalStack.
    Yields proc (the Popen), log, url and front_port, llm and snac (each server as a Part), max_streams (per
    worker) and grace_s."""
    flags = ["--workers", str(workers), "--replicas", str(replicas), "--enforce-eager", "true",
             "--max-model-len", str(MAX_MODEL_LEN), "--llm-device", "cpu", "--snac-device", "cpu", "--snac-model", TEST_CODEC,
             "--voices-dir", str(log_dir / "voices")]
    # A fixed limit when given (floor = ceiling): the tests count on it; else measured, as deployed.
    flags += ["--max-streams-per-worker", str(max_streams), "--min-streams-per-worker", str(max_streams)] if max_streams else []
    flags += ["--grace-s", str(grace_s)] if grace_s is not None else []
    # 1 GiB of KV cache a worker (vLLM's CPU default is what --cpu-kv-cache-gb sets, 2): ample for the tests' streams
    # of MAX_MODEL_LEN tokens on the tiny model, and the engines the other tests start beside this stack get the
    # memory (fresh pages came slowly with 8 GB held: the clone benchmark's smoke test took 58 s beside it, 29 s so).
    stack = LocalStack("up", flags, log_dir, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    stack.plan(set())
    try:
        stack.start()
        stack.wait_ready(420)  # the front serves once every worker and replica is ready
        config, parts = stack.config, stack.log_dir / stack.name
        yield {"proc": stack.child.popen, "log": stack.child.log_path, "url": stack.url, "front_port": config.front_port,
               "llm": [Part(f"llm-{i}", p, p, parts, stack.child.log_path) for i, p in enumerate(config.worker_ports())],
               "snac": [Part(f"snac-{j}", p, config.snac_metrics_base_port + j, parts, stack.child.log_path)
                        for j, p in enumerate(config.snac_ports())],
               "max_streams": config.max_streams_per_worker, "grace_s": config.grace_s}
    finally:
        stack.stop(60)
