"""A local MegaPod started with `megapod up`, on free ports, and the CPU its processes use.

The stack is the product's own launcher, started as a process with the flags given: what is
measured is exactly what `megapod up` runs. Its processes are found through /proc (the
launcher's children run in sessions of their own), both to account their CPU and to make sure
none is left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from provenance import descendants

REPO_ROOT = Path(__file__).resolve().parents[2]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_block(count: int, avoid: set[int]) -> int:
    """The first port of `count` consecutive free loopback ports, none of them in `avoid`."""
    for base in range(20000 + (os.getpid() % 200) * 50, 60000, 37):
        ports = range(base, base + count)
        if avoid.intersection(ports):
            continue
        try:
            socks = []
            for p in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


@dataclass
class LocalStack:
    """One `megapod up` on this machine; `flags` are its own flags, ports are chosen here."""

    name: str
    flags: list[str]
    log_dir: Path
    argv: list[str] = field(default_factory=list)
    topology: dict = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    pids: dict[int, int | None] = field(default_factory=dict)  # pid -> start time, everything seen under ours
    startup_s: float | None = None

    def plan(self, taken: set[int]) -> None:
        """Choose ports and build the command line; `taken` collects every port used."""
        from megapod.topology import megapod_config_from_cli  # the benchmark's own flags parse the same way

        probe = megapod_config_from_cli(self.flags)
        ports = {}
        for flag, count in (("--front-port", 1), ("--worker-base-port", probe.workers),
                            ("--snac-base-port", probe.replicas), ("--snac-metrics-base-port", probe.replicas)):
            ports[flag] = free_block(count, taken)
            taken.update(range(ports[flag], ports[flag] + count))
        flags = [*self.flags, *(x for kv in ports.items() for x in (kv[0], str(kv[1])))]
        config = megapod_config_from_cli(flags)
        self.argv = [sys.executable, "-m", "megapod", "up", *flags]
        self.topology = {k: getattr(config, k) for k in config.__dataclass_fields__}
        self.config = config

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.front_port}"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "MEGAPOD_LOG_DIR": str(self.log_dir / self.name), "PYTHONUNBUFFERED": "1"}
        log = (self.log_dir / f"{self.name}-megapod-up.log").open("ab")
        self._t_start = time.perf_counter()
        self.popen = subprocess.Popen(self.argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Until the front and every worker answer /ready; returns the start-up seconds."""
        urls = [f"{self.url}/ready", *(f"http://{self.config.host}:{p}/ready" for p in self.config.worker_ports())]
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"megapod up ({self.name}) exited with {self.popen.returncode}:\n{self.tail()}")
                try:
                    if all(client.get(u).status_code == 200 for u in urls):
                        self.startup_s = time.perf_counter() - self._t_start
                        self.remember()
                        return self.startup_s
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    async def wait_idle(self, timeout_s: float = 60.0) -> float:
        """Until no worker has a stream or an engine request left (cancelled ones drain); returns seconds waited."""
        t0 = time.perf_counter()
        urls = [f"http://{self.config.host}:{p}/metrics" for p in self.config.worker_ports()]
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while time.perf_counter() - t0 < timeout_s:
                try:
                    texts = [(await client.get(u)).text for u in urls]
                except httpx.HTTPError:
                    texts = None
                if texts is not None and all(_gauge(t, "orpheus_active_streams") == 0
                                             and _gauge(t, "orpheus_engine_unfinished_requests") == 0 for t in texts):
                    break
                await asyncio.sleep(0.25)
        return time.perf_counter() - t0

    def remember(self) -> None:
        """Note every process under ours, so CPU is accounted and none outlives the benchmark."""
        if self.popen is not None and self.popen.poll() is None:
            self.pids.setdefault(self.popen.pid, start_time(self.popen.pid))
            for pid in descendants(self.popen.pid):
                self.pids.setdefault(pid, start_time(pid))

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the stack's live processes."""
        self.remember()
        return sum(cpu_seconds(pid) for pid in self.pids)

    def gpus(self) -> int:
        """GPUs this stack uses. The local launcher pins no worker to a device, so all CUDA work shares one."""
        import torch

        devices = {self.config.llm_device, self.config.snac_device}
        cuda = any(d.startswith("cuda") or (d == "auto" and torch.cuda.is_available()) for d in devices)
        return 1 if cuda else 0

    def stop(self, timeout_s: float = 90.0) -> None:
        """SIGINT the launcher (it drains workers, then replicas); SIGKILL anything of ours left after."""
        self.remember()
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for pid, started in self.pids.items():
            if started is not None and start_time(pid) == started:  # the same process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def tail(self, lines: int = 30) -> str:
        out = []
        for path in sorted(self.log_dir.rglob("*.log")):
            if self.name in str(path.relative_to(self.log_dir)):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name} ---\n" + "\n".join(text))
        return "\n".join(out)


def _gauge(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus text page (nan when absent)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#") and line.split("{")[0].split(" ")[0] == name]
    return sum(values) if values else float("nan")


def cpu_snapshot(stacks: Sequence[LocalStack]) -> dict[str, Any]:
    """CPU seconds so far: the machine's, this process's, and each started stack's."""
    return {"wall": time.perf_counter(), "machine": machine_busy_s(), "client": time.process_time(),
            "stacks": {s.name: s.cpu_seconds() for s in stacks}}


def cpu_cores(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Average cores busy over a level: each started stack, this client, and everything else."""
    wall = b["wall"] - a["wall"]
    stacks = {k: max(0.0, b["stacks"][k] - a["stacks"][k]) for k in a["stacks"]}
    client = b["client"] - a["client"]
    other = max(0.0, b["machine"] - a["machine"] - sum(stacks.values()) - client)
    return {**{f"stack {k}": round(v / wall, 3) for k, v in stacks.items()}, "client": round(client / wall, 3),
            "other_processes": round(other / wall, 3)}



# -- /proc -----------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process; 0 when it is gone."""
    try:
        fields = _stat(pid)
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


def start_time(pid: int) -> int | None:
    try:
        return int(_stat(pid)[19])
    except (OSError, ValueError, IndexError):
        return None


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, all processes)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK
