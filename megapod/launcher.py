"""`megapod up`: the MegaPod's processes on one machine, supervised.

Starts M snac-server replicas and N llm-server workers as child processes (each worker its
own engine; a worker on the replicas' GPU once they are ready), waits until every one is ready,
restarts any that dies (after a delay that doubles while it keeps dying, and gives up after
MAX_DEATHS_IN_A_ROW), and on stop drains the workers first (their streams finish) and then the
replicas.

`Child` and `free_ports`/`free_block` are also how the tests and benchmarks start servers: one launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .gpu_layout import plan_gpus
from .topology import MegaPodConfig

log = logging.getLogger("megapod")

# Restarting a child that dies: the first restart after RESTART_DELAY_FIRST_S, each further death in a row
# doubling the delay up to RESTART_DELAY_MAX_S (a child that crashes at start-up is not respawned twice a
# second, its log not flooded); the MAX_DEATHS_IN_A_ROW-th death in a row ends `megapod up` (ChildKeptDying)
# instead: 0.5 + 1 + 2 + 4 + 8 + 16 + 30 s, about a minute of waiting besides the start-ups, is long
# enough for a passing cause (a port another process still held, GPU memory it was giving back) to pass.
RESTART_DELAY_FIRST_S = 0.5
RESTART_DELAY_MAX_S = 30.0
MAX_DEATHS_IN_A_ROW = 8
# A child up this long before it died was serving, not failing to start: its count starts afresh (a
# worker killed by the OOM killer once an hour is restarted after RESTART_DELAY_FIRST_S every time).
# Longer than a worker's start-up however slow (vLLM loads the weights, profiles memory and captures CUDA
# Graphs: a minute or two on a GPU, more on a cold disk), so a child that dies late in start-up, every
# time, still counts as one that keeps dying.
STABLE_AFTER_S = 300.0


class ChildKeptDying(RuntimeError):
    """A child died MAX_DEATHS_IN_A_ROW times in a row, each time within STABLE_AFTER_S of its start."""


def restart_delay(deaths_in_a_row: int) -> float:
    """Seconds to wait before restarting a child that has died this many times in a row (1: the first)."""
    return min(RESTART_DELAY_FIRST_S * 2 ** (deaths_in_a_row - 1), RESTART_DELAY_MAX_S)


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, chosen below the kernel's ephemeral range: a server started on one
    seconds later cannot find it taken by a port the kernel handed out meanwhile (an outgoing
    connection's, or vLLM's engine binding port 0), which a kernel-chosen port could be."""
    lo, hi = _fixed_port_range()
    ports: list[int] = []
    for _ in range(100 * n):
        port = random.randint(lo, hi)
        if port not in ports and _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports in {lo}-{hi}")


def free_block(n: int, avoid: Collection[int] = ()) -> int:
    """The first of n consecutive free loopback ports, none in `avoid` (`megapod up` numbers each tier from
    a base); below the ephemeral range too, and random, so concurrent runs rarely pick the same block."""
    lo, hi = _fixed_port_range()
    for _ in range(200):
        base = random.randint(lo, hi - n + 1)
        if set(avoid).isdisjoint(range(base, base + n)) and all(_bindable(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in {lo}-{hi}")


def _fixed_port_range() -> tuple[int, int]:
    """Ports the kernel never picks by itself: from 10000 to just below net.ipv4.ip_local_port_range
    (10000-20000 where that range starts lower: then they may overlap it)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    return 10000, max(ephemeral_low - 1, 20000)


def _bindable(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


def probe(url: str) -> bool:
    """Whether a server is ready: grpc://host:port answers the gRPC health check SERVING, http://... a 200."""
    if url.startswith("grpc://"):
        try:
            with grpc.insecure_channel(url.removeprefix("grpc://")) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
    import httpx  # here, not at the top: a bare GPU node has no httpx, and benchmarks/snac_replicas.py starts replicas there

    try:
        return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200  # loopback: never via a proxy
    except httpx.HTTPError:
        return False


@dataclass
class Child:
    """One server process: started, probed until ready, stopped."""

    name: str
    argv: list[str]
    log_path: Path | None  # stdout and stderr appended here; None: discarded
    ready_url: str = ""  # http://... (a 200) or grpc://host:port (health SERVING)
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment (GPU pinning)
    cwd: Path | None = None
    log_stdout: bool = True  # False: stdout discarded, only stderr logged
    own_session: bool = False  # True only where a benchmark wants its own scheduler autogroup (see start)
    popen: subprocess.Popen | None = field(default=None, repr=False)
    restarts: int = 0
    started_at: float = field(default=0.0)

    def start(self) -> Child:
        out = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = self.log_path.open("ab")
        # A process group of its own: Ctrl-C in the terminal reaches the launcher only, which then
        # stops the children in order (workers drain before replicas go). Not a session of its own
        # (by default): Linux's autogroup schedules each session as one unit, and a codec replica in its
        # own session got no CPU for seconds while a CPU worker generated (benchmarks/README.md, "Why `megapod up`
        # keeps its children in its own session").
        try:
            self.popen = subprocess.Popen(
                self.argv, stdout=out if self.log_stdout else subprocess.DEVNULL, stderr=out, cwd=self.cwd,
                env={**os.environ, **self.env}, start_new_session=self.own_session,
                process_group=None if self.own_session else 0,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own descriptor
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def port(self) -> int | None:
        """The port its ready URL names."""
        return urlsplit(self.ready_url).port

    def exited(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def ready(self) -> bool:
        """Ready now; raises if the process has exited (a dead server is never going to be ready)."""
        if (code := self.exited()) is not None:
            raise RuntimeError(f"{self.name} exited with {code} during start-up; {self.log_path}:\n{self.tail()}")
        return probe(self.ready_url)

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Until ready; returns the seconds since start. Fails at once, with the log's tail, if it exits."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.3)
        return time.monotonic() - self.started_at

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """`sig` (SIGTERM: the servers drain), then SIGKILL after timeout_s; returns the exit code. What is
        left of its process group once it has gone (a child it did not stop) is killed too."""
        if self.popen is None or self.popen.poll() is not None:
            return self.exited()
        if sig != signal.SIGKILL:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", self.name, timeout_s)
        # Its whole process group: a worker killed alone left vLLM's engine processes running. The group's
        # id cannot be taken by a new process while any of its members lives.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.wait()


def visible_gpus(config: MegaPodConfig) -> int:
    """How many GPUs this machine offers the MegaPod (0 when both tiers run on the CPU)."""
    if config.llm_device == "cpu" and config.snac_device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


@dataclass
class _Deaths:
    """What the supervisor knows of one child's deaths."""

    in_a_row: int = 0
    handled: subprocess.Popen | None = None  # the process whose death was last reported (once, not each period)
    restart_at: float | None = None  # time.monotonic() when the dead child is due to start again


class Launcher:
    """Starts, watches and stops the processes of one MegaPod."""

    def __init__(self, config: MegaPodConfig, log_dir: Path, gpu_count: int | None = None) -> None:
        self.config = config
        self.layout = layout = plan_gpus(config, visible_gpus(config) if gpu_count is None else gpu_count)
        python = sys.executable
        self.replicas = [
            Child(f"snac-{j}", [python, "-m", "snac_server", *config.replica_flags(j)], log_dir / f"snac-{j}.log",
                  f"grpc://{config.host}:{port}", layout.codec_env())
            for j, port in enumerate(config.snac_ports())
        ]
        self._watchers: set[asyncio.Task] = set()
        self._deaths: dict[str, _Deaths] = {}  # by child name
        self.workers = [
            Child(f"llm-{i}", [python, "-m", "llm_server", *config.worker_flags(i, layout.on_cpu)], log_dir / f"llm-{i}.log",
                  f"http://{config.host}:{port}/ready", layout.worker_env(i))
            for i, port in enumerate(config.worker_ports())
        ]

    @property
    def children(self) -> list[Child]:
        return [*self.replicas, *self.workers]

    async def start(self, timeout_s: float = 600.0) -> None:
        """Start everything and wait until every process is ready, within timeout_s in all.

        A worker on the codec replicas' GPU starts only once every replica is ready: a replica's CUDA
        Graph capture empties its caching allocator, so that GPU's free memory grows while vLLM
        profiles memory at start-up, and vLLM fails when it does ("Error in memory profiling").
        Everything else (workers on GPUs of their own, a MegaPod on CPU) starts at once.
        """
        deadline = time.monotonic() + timeout_s
        beside_codec, alone = [], []
        for i, worker in enumerate(self.workers):
            (beside_codec if self.layout.worker_shares_codec_gpu(i) else alone).append(worker)
        self._start([*self.replicas, *alone])
        if not beside_codec:
            await self.wait_ready(self.children, timeout_s)
            return
        await self.wait_ready(self.replicas, deadline - time.monotonic())
        self._start(beside_codec)
        await self.wait_ready([*alone, *beside_codec], deadline - time.monotonic())

    @staticmethod
    def _start(children: list[Child]) -> None:
        for child in children:
            child.start()
            log.info("started %s (pid %d), log %s", child.name, child.pid, child.log_path)

    async def wait_ready(self, children: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if await asyncio.to_thread(child.ready):  # a probe blocks: off the loop that supervises and serves
                    log.info("%s ready (%.0f s)", child.name, time.monotonic() - child.started_at)
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: {[c.name for c in pending]}")
            await asyncio.sleep(0.5)

    async def supervise(self, stop: asyncio.Event, period_s: float = 0.5) -> None:
        """Restart any process that dies, until `stop` is set: one that keeps dying after a delay that doubles
        with each death in a row (restart_delay); raises ChildKeptDying at its MAX_DEATHS_IN_A_ROW-th. With
        config.restart_dead off, each death is logged once and the process left dead."""
        while not stop.is_set():
            now = time.monotonic()
            for child in self.children:
                if stop.is_set():
                    break
                if (code := child.exited()) is not None:
                    self._dead(child, code, now)
            due = [d.restart_at for d in self._deaths.values() if d.restart_at is not None]
            wait_s = min([period_s, *(at - time.monotonic() for at in due)])
            try:
                await asyncio.wait_for(stop.wait(), max(wait_s, 0.0))
            except TimeoutError:
                pass

    def _dead(self, child: Child, code: int, now: float) -> None:
        """A child found dead: report its death once, schedule its restart, restart it when due."""
        deaths = self._deaths.setdefault(child.name, _Deaths())
        if deaths.handled is child.popen:  # reported already: left dead, or waiting for its restart
            if deaths.restart_at is not None and now >= deaths.restart_at:
                deaths.restart_at = None
                child.restarts += 1
                child.start()
                log.info("restarted %s (pid %d), restart %d", child.name, child.pid, child.restarts)
                task = asyncio.create_task(self._announce_ready(child))
                self._watchers.add(task)
                task.add_done_callback(self._watchers.discard)
            return
        deaths.handled = child.popen
        if not self.config.restart_dead:
            log.error("%s (pid %d) died with exit code %d; not restarting it (restart_dead is off)",
                      child.name, child.pid, code)
            return
        deaths.in_a_row = 1 if now - child.started_at >= STABLE_AFTER_S else deaths.in_a_row + 1
        if deaths.in_a_row >= MAX_DEATHS_IN_A_ROW:
            raise ChildKeptDying(
                f"{child.name} died {deaths.in_a_row} times in a row, each within {STABLE_AFTER_S:.0f} s of its "
                f"start; the last time with exit code {code}; {child.log_path}:\n{child.tail()}")
        delay_s = restart_delay(deaths.in_a_row)
        deaths.restart_at = now + delay_s
        log.error("%s (pid %d) died with exit code %d (%d in a row); restarting it in %.3g s",
                  child.name, child.pid, code, deaths.in_a_row, delay_s,
                  extra={"child": child.name, "restart_in_s": delay_s})

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
        for tier in (self.workers, self.replicas):
            codes = await asyncio.gather(*(asyncio.to_thread(c.stop, signal.SIGTERM, grace) for c in tier))
            for child, code in zip(tier, codes):  # 0: drained and exited by itself
                log.info("%s stopped with exit code %s", child.name, code)
        log.info("all MegaPod processes stopped")
