"""A local MegaPod started with `megapod up`, on free ports, and the CPU its processes use.

The stack is the product's own launcher, started as a process (a megapod.launcher Child) with the flags
given: what is measured is exactly what `megapod up` runs. Its processes are found through psutil's process
tree (the launcher starts its children in process groups of their own), both to account their CPU and to
make sure none is left behind.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.provenance import machine_busy_s
from megapod.launcher import Child, free_block
from megapod.topology import MegaPodConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LocalStack:
    """One `megapod up` on this machine; `flags` are its own flags, ports are chosen here."""

    name: str
    flags: list[str]
    log_dir: Path
    argv: list[str] = field(default_factory=list)
    config: MegaPodConfig | None = None  # what `argv` starts, as `megapod up` parses it
    child: Child | None = None  # the `megapod up` process, when started here
    attached: psutil.Process | None = None  # the `megapod up` process, when someone else started it (attach)
    procs: dict[int, psutil.Process] = field(default_factory=dict)  # everything seen under ours, by pid
    startup_s: float | None = None
    # Gauges that others hold on purpose (e.g. slots the soak keeps taken): idle means down to these, not 0.
    held: dict[str, float] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # added to the environment `megapod up` and its children get

    @classmethod
    def attach(cls, pid: int, log_dir: Path) -> LocalStack:
        """A `megapod up` already running, started by someone else: its settings read from its own command
        line and environment. Measured and driven here; never stopped here."""
        proc = psutil.Process(pid)
        argv = proc.cmdline()
        if "up" not in argv:
            raise ValueError(f"pid {pid} is not `megapod up`: {' '.join(argv)[:200]}")
        flags = argv[argv.index("up") + 1:]
        config = MegaPodConfig.from_cli(flags, environ=proc.environ())
        return cls("attached", flags, log_dir, argv=argv, config=config, attached=proc)

    @property
    def pid(self) -> int:
        return self.attached.pid if self.attached else self.child.pid

    def running(self) -> bool:
        if self.attached:
            return self.attached.is_running()
        return self.child is not None and self.child.alive()

    def plan(self, taken: set[int]) -> None:
        """Choose ports and build the command line; `taken` collects every port used."""
        probe = MegaPodConfig.from_cli(self.flags)  # the benchmark's own flags parse the same way
        ports = {}
        for flag, count in (("--front-port", 1), ("--worker-base-port", probe.workers),
                            ("--snac-base-port", probe.replicas), ("--snac-metrics-base-port", probe.replicas)):
            ports[flag] = free_block(count, taken)
            taken.update(range(ports[flag], ports[flag] + count))
        flags = [*self.flags, *(x for kv in ports.items() for x in (kv[0], str(kv[1])))]
        self.config = MegaPodConfig.from_cli(flags)
        self.argv = [sys.executable, "-m", "megapod", "up", *flags]

    @property
    def topology(self) -> dict[str, Any]:
        return self.config.model_dump()

    @property
    def command(self) -> str:
        """The stack's command line as a user types it: `megapod up --workers 1 ...`."""
        return " ".join(["megapod", *self.argv[self.argv.index("up"):]])

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.front_port}"

    def start(self) -> None:
        env = {**self.env, "MEGAPOD_LOG_DIR": str(self.log_dir / self.name), "PYTHONUNBUFFERED": "1"}
        # In this client's session, not one of its own: Linux's autogroup schedules each session as one unit, and a
        # client in a session apart from a busy stack got no CPU for seconds at a time (its event loop woke a 50 ms
        # timer 1-6 s late in 60 of the 92 levels of issue 43's runs 33-35, none of runs 37-38's 57; a bare probe
        # process beside the stack, 3.0 s), so chunks were timed late and levels failed on stalls of its own making.
        self.child = Child(f"megapod up ({self.name})", self.argv, self.log_dir / f"{self.name}-megapod-up.log",
                           f"{self.url}/ready", env, cwd=REPO_ROOT).start()

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Until the front answers /ready (served once every process is ready); returns the start-up seconds."""
        self.startup_s = self.child.wait_ready(timeout_s)
        self.remember()
        return self.startup_s

    async def wait_idle(self, timeout_s: float = 60.0) -> float:
        """Until no worker has a stream or an engine request left (cancelled ones drain) beyond those `held`
        on purpose; returns seconds waited."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            now = await self.worker_metrics("orpheus_active_streams", "orpheus_engine_unfinished_requests")
            if all(v <= self.held.get(name, 0.0) for name, v in now.items()):  # nan (unreadable): not idle
                break
            await asyncio.sleep(0.25)
        return time.perf_counter() - t0

    async def worker_metrics(self, *names: str) -> dict[str, float]:
        """Counters or gauges, each summed over every worker, from one scrape of each (nan when a page
        cannot be read or lacks one)."""
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            try:
                pages = [(await client.get(f"http://{self.config.host}:{p}/metrics")).text
                         for p in self.config.worker_ports()]
            except httpx.HTTPError:
                return dict.fromkeys(names, float("nan"))
        per_page = [gauges(page, names) for page in pages]  # each page parsed once, however many names
        return {name: sum(values[name] for values in per_page) for name in names}

    def remember(self) -> None:
        """Note every process under ours, so CPU is accounted and none outlives the benchmark."""
        if self.running():
            try:
                root = psutil.Process(self.pid)
                for proc in (root, *root.children(recursive=True)):
                    self.procs.setdefault(proc.pid, proc)
            except psutil.Error:
                pass

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by the stack's live processes, by tier: `codec` (the
        snac_server replicas), `llm` (the workers, their engine cores included) and `other` (launcher, front)."""
        self.remember()
        out = {"codec": 0.0, "llm": 0.0, "other": 0.0}
        for proc in self.procs.values():
            out[_tier(proc)] += cpu_seconds(proc)
        return out

    def gpus(self) -> int:
        """GPUs this stack uses. The local launcher pins no worker to a device, so all CUDA work shares one."""
        import torch

        devices = {self.config.llm_device, self.config.snac_device}
        cuda = any(d.startswith("cuda") or (d == "auto" and torch.cuda.is_available()) for d in devices)
        return 1 if cuda else 0

    def stop(self, timeout_s: float = 90.0) -> None:
        """SIGINT the launcher (it drains workers, then replicas); SIGKILL anything of ours left after.
        An attached stack is left running: whoever started it stops it."""
        if self.attached:
            return
        self.remember()
        if self.child is not None:
            self.child.stop(signal.SIGINT, timeout_s)
        for proc in self.procs.values():
            try:
                proc.kill()  # psutil refuses a pid reused by another process
            except psutil.Error:
                pass

    def tail(self, lines: int = 30) -> str:
        out = []
        for path in sorted(self.log_dir.rglob("*.log")):
            if self.name in str(path.relative_to(self.log_dir)):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name} ---\n" + "\n".join(text))
        return "\n".join(out)


def gauge(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus text page (nan when absent or not a metrics page)."""
    return gauges(text, (name,))[name]


def gauges(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each metric's samples summed, from one parse of a Prometheus text page (nan when absent or not a metrics page)."""
    sums: dict[str, list[float]] = {name: [] for name in names}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name].append(sample.value)
    except ValueError:
        return dict.fromkeys(names, float("nan"))
    return {name: sum(values) if values else float("nan") for name, values in sums.items()}


def cpu_snapshot(stacks: Sequence[LocalStack]) -> dict[str, Any]:
    """CPU seconds so far: the machine's, this process's, and each started stack's."""
    return {"wall": time.perf_counter(), "machine": machine_busy_s(), "client": time.process_time(),
            "stacks": {s.name: s.cpu_seconds() for s in stacks}}


def cpu_cores(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Average cores busy over a level: each started stack (and its tiers), this client, and everything else."""
    wall = b["wall"] - a["wall"]
    tiers = {(k, t): max(0.0, b["stacks"][k][t] - a["stacks"][k][t]) for k in a["stacks"] for t in a["stacks"][k]}
    stacks = {k: sum(v for (name, _), v in tiers.items() if name == k) for k in a["stacks"]}
    client = b["client"] - a["client"]
    other = max(0.0, b["machine"] - a["machine"] - sum(stacks.values()) - client)
    return {**{f"stack {k}": round(v / wall, 3) for k, v in stacks.items()},
            **{f"stack {k} {t}": round(v / wall, 3) for (k, t), v in tiers.items()},
            "client": round(client / wall, 3), "other_processes": round(other / wall, 3)}


def _tier(proc: psutil.Process) -> str:
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    return "codec" if "snac_server" in cmdline else "llm" if "llm_server" in cmdline or "EngineCore" in proc.name() else "other"


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU seconds of a live process; 0 when it is gone."""
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system
