"""`megapod up`: the MegaPod's processes on one machine, supervised.

Starts M snac-server replicas and N llm-server workers as child processes (each worker its
own engine), waits until every one is ready, restarts any that dies, and on stop drains the
workers first (their streams finish) and then the replicas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .gpu_layout import plan_gpus
from .topology import MegaPodConfig

log = logging.getLogger("megapod")


@dataclass
class Child:
    """One supervised server process."""

    name: str
    argv: list[str]
    log_path: Path
    ready_url: str  # http://... for workers, grpc://host:port for replicas
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment (GPU pinning)
    popen: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A process group of its own: Ctrl-C in the terminal reaches the launcher only, which then
        # stops the children in order (workers drain before replicas go). Not a session of its own:
        # Linux's autogroup schedules each session as one unit, and a codec replica in its own
        # session got no CPU for seconds while a CPU worker generated (benchmarks/codec_beside_engine.py).
        self.popen = subprocess.Popen(
            self.argv, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT, process_group=0,
            env={**os.environ, **self.env},
        )
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def exited(self) -> int | None:
        return self.popen.poll() if self.popen else None

    async def ready(self) -> bool:
        if self.ready_url.startswith("grpc://"):
            return await _grpc_serving(self.ready_url.removeprefix("grpc://"))
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return (await client.get(self.ready_url)).status_code == 200
        except httpx.HTTPError:
            return False

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM (the servers drain), then SIGKILL after timeout_s."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.popen.wait, timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", self.name, timeout_s)
            self.popen.kill()
            await asyncio.to_thread(self.popen.wait)


async def _grpc_serving(address: str) -> bool:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError:
        return False


def visible_gpus(config: MegaPodConfig) -> int:
    """How many GPUs this machine offers the MegaPod (0 when both tiers run on the CPU)."""
    if config.llm_device == "cpu" and config.snac_device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


class Launcher:
    """Starts, watches and stops the processes of one MegaPod."""

    def __init__(self, config: MegaPodConfig, log_dir: Path, gpu_count: int | None = None) -> None:
        self.config = config
        layout = plan_gpus(config, visible_gpus(config) if gpu_count is None else gpu_count)
        python = sys.executable
        self.replicas = [
            Child(f"snac-{j}", [python, "-m", "snac_server", *config.snac_args(j)], log_dir / f"snac-{j}.log",
                  f"grpc://{config.host}:{port}", layout.codec_env())
            for j, port in enumerate(config.snac_ports())
        ]
        self._watchers: set[asyncio.Task] = set()
        self.workers = [
            Child(f"llm-{i}", [python, "-m", "llm_server", *config.worker_args(i)], log_dir / f"llm-{i}.log",
                  f"http://{config.host}:{port}/ready", layout.worker_env(i))
            for i, port in enumerate(config.worker_ports())
        ]

    @property
    def children(self) -> list[Child]:
        return [*self.replicas, *self.workers]

    async def start(self, timeout_s: float = 600.0) -> None:
        """Start everything and wait until every process is ready."""
        for child in self.children:
            child.start()
            log.info("started %s (pid %d), log %s", child.name, child.pid, child.log_path)
        await self.wait_ready(self.children, timeout_s)

    async def wait_ready(self, children: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if child.exited() is not None:
                    raise RuntimeError(f"{child.name} exited with {child.exited()} during start-up; see {child.log_path}")
                if await child.ready():
                    log.info("%s ready (%.0f s)", child.name, time.monotonic() - child.started_at)
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: {[c.name for c in pending]}")
            await asyncio.sleep(0.5)

    async def supervise(self, stop: asyncio.Event, period_s: float = 0.5) -> None:
        """Restart any process that dies, until `stop` is set."""
        while not stop.is_set():
            for child in self.children:
                code = child.exited()
                if code is None or stop.is_set():
                    continue
                log.error("%s (pid %d) died with exit code %d; restarting it", child.name, child.pid, code)
                if self.config.restart_dead:
                    child.restarts += 1
                    child.start()
                    task = asyncio.create_task(self._announce_ready(child))
                    self._watchers.add(task)
                    task.add_done_callback(self._watchers.discard)
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except TimeoutError:
                pass

    async def _announce_ready(self, child: Child) -> None:
        try:
            await self.wait_ready([child], 600.0)
        except (RuntimeError, TimeoutError) as exc:
            log.error("%s did not come back: %s", child.name, exc)

    async def stop(self) -> None:
        """Drain workers first (their streams need the codec tier), then the replicas."""
        for task in list(self._watchers):
            task.cancel()
        grace = self.config.grace_s + 5.0
        await asyncio.gather(*(w.stop(grace) for w in self.workers))
        await asyncio.gather(*(r.stop(grace) for r in self.replicas))
        log.info("all MegaPod processes stopped")
