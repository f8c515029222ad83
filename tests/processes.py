"""Start the real servers as processes on free loopback ports, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

TINY_CACHE = os.environ.get("MEGAPOD_TEST_CACHE", str(Path.home() / ".cache" / "orpheus-megapod"))


def free_block(n: int) -> int:
    """A base port with n free consecutive ports after it."""
    for _ in range(100):
        base = random.randint(20000, 60000)
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base
    raise RuntimeError("no free port block")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A server process and where it listens."""

    args: list[str]
    port: int
    metrics_port: int | None = None
    log: Path | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, log_dir: Path) -> Proc:
        self.log = log_dir / f"{Path(self.args[2]).name}-{self.port}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(self.args, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if not self.alive():
            return self.popen.returncode if self.popen else None
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:]) if self.log and self.log.exists() else ""


def snac_process(port: int | None = None, *extra: str) -> Proc:
    port = port or free_port()
    metrics = free_port()
    args = [sys.executable, "-m", "snac_server", "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", str(metrics), "--device", "cpu", "--max-wait-ms", "10", *extra]
    return Proc(args, port, metrics)


def llm_process(snac_ports: list[int], *extra: str) -> Proc:
    port = free_port()
    args = [sys.executable, "-m", "llm_server", "--host", "127.0.0.1", "--port", str(port),
            "--snac", ",".join(f"127.0.0.1:{p}" for p in snac_ports), "--model", "tiny", "--cache-dir", TINY_CACHE,
            "--device", "cpu", "--enforce-eager", "true", "--max-model-len", "1024", "--max-num-seqs", "16", *extra]
    return Proc(args, port)


def wait_snac_serving(proc: Proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{proc.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"snac-server exited:\n{proc.tail()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.3)
    raise TimeoutError(f"snac-server not serving:\n{proc.tail()}")


def wait_http_ready(proc: Proc, path: str = "/ready", timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"llm-server exited:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{proc.port}{path}", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"llm-server not ready:\n{proc.tail()}")


def scrape(port: int, name: str) -> float:
    """Sum of a Prometheus metric's samples from a /metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def wait_metric_zero(port: int, name: str, within_s: float) -> float:
    """Poll a metric until it reads 0 or `within_s` passes; returns the last reading."""
    deadline = time.perf_counter() + within_s
    while (value := scrape(port, name)) > 0 and time.perf_counter() < deadline:
        time.sleep(0.05)
    return value


def hang(proc: Proc) -> None:
    """SIGSTOP a server: hung, not dead. Its sockets stay open and the kernel still accepts connections."""
    proc.popen.send_signal(signal.SIGSTOP)


def unhang(proc: Proc) -> None:
    """SIGCONT a server stopped by hang() (a stopped process ignores SIGTERM until then)."""
    if proc.alive():
        proc.popen.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def megapod_up(log_dir: Path, workers: int, replicas: int, max_streams: int) -> Iterator[dict]:
    """`megapod up` on a free port block (real vLLM on the CPU, random weights), as a user runs it,
    until it says it is ready; SIGINT (then SIGKILL) at the end. Yields proc, log, url and ports
    (front, workers / snac / metrics: each tier's base port)."""
    base = free_block(1 + 2 * workers + replicas)
    ports = {"front": base, "workers": base + 1, "snac": base + 1 + workers, "metrics": base + 1 + workers + replicas}
    log = log_dir / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megapod", "up", "--workers", str(workers), "--replicas", str(replicas),
             "--front-port", str(ports["front"]), "--worker-base-port", str(ports["workers"]),
             "--snac-base-port", str(ports["snac"]), "--snac-metrics-base-port", str(ports["metrics"]),
             "--enforce-eager", "true", "--max-model-len", "1024", "--llm-device", "cpu", "--snac-device", "cpu",
             "--max-streams-per-worker", str(max_streams)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "MEGAPOD_LOG_DIR": str(log_dir)},
        )
    try:
        deadline = time.monotonic() + 420
        while "MegaPod ready" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "megapod up never became ready"
            time.sleep(1)
        yield {"proc": proc, "log": log, "url": f"http://127.0.0.1:{ports['front']}", "ports": ports}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
