"""The launcher's supervisor with children that die: one report a death with restart off, restarts that back
off while a child keeps dying, the count starting afresh after a child that stayed up, and `megapod up`
ending with the dying child's name and log tail. Real processes that exit at once; no servers, no vLLM."""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time

import pytest

from megapod import cli
from megapod import launcher as launcher_module
from megapod.launcher import Child, ChildKeptDying, Launcher, free_ports
from megapod.topology import MegaPodConfig

CRASH = "import sys; print('boom: no such checkpoint', file=sys.stderr); sys.exit(3)"


@pytest.fixture
def quick_backoff(monkeypatch):
    """Delays of 10, 20, 40, 40, ... ms; giving up at the 6th death in a row; stable after a minute."""
    monkeypatch.setattr(launcher_module, "RESTART_DELAY_FIRST_S", 0.01)
    monkeypatch.setattr(launcher_module, "RESTART_DELAY_MAX_S", 0.04)
    monkeypatch.setattr(launcher_module, "MAX_DEATHS_IN_A_ROW", 6)
    monkeypatch.setattr(launcher_module, "STABLE_AFTER_S", 60.0)


def launcher_over(tmp_path, *children: Child, restart_dead: bool = True) -> Launcher:
    """A CPU MegaPod's launcher whose only children are these (started, as `Launcher.start` leaves them)."""
    config = MegaPodConfig(llm_device="cpu", snac_device="cpu", restart_dead=restart_dead)
    launcher = Launcher(config, tmp_path, gpu_count=0)
    launcher.replicas, launcher.workers = [], list(children)
    for child in children:
        child.start()
    return launcher


def crashing_child(tmp_path, name: str = "llm-0") -> Child:
    return Child(name, [sys.executable, "-c", CRASH], tmp_path / f"{name}.log")


def record_starts(monkeypatch, child: Child, on_start=None) -> list[float]:
    """The started_at of each of the child's processes, in order (on_start(n) runs after the n-th start)."""
    starts: list[float] = []
    start = child.start

    def recorded() -> Child:
        start()
        starts.append(child.started_at)
        if on_start:
            on_start(len(starts))
        return child

    monkeypatch.setattr(child, "start", recorded)
    return starts


def chosen_delays(caplog, name: str) -> list[float]:
    return [r.restart_in_s for r in caplog.records if getattr(r, "child", None) == name and hasattr(r, "restart_in_s")]


async def supervise_until_it_raises(launcher: Launcher) -> ChildKeptDying:
    with pytest.raises(ChildKeptDying) as raised:
        await asyncio.wait_for(launcher.supervise(asyncio.Event(), period_s=0.005), 60.0)
    await launcher.stop()
    return raised.value


async def test_a_dead_child_is_reported_once_when_restart_is_off(tmp_path, monkeypatch, caplog):
    child = crashing_child(tmp_path)
    launcher = launcher_over(tmp_path, child, restart_dead=False)
    child.popen.wait()
    stop, looks = asyncio.Event(), []
    exited = child.exited

    def looked() -> int | None:  # the supervisor's look at the child: stop after 20 periods, however long they took
        looks.append(1)
        if len(looks) == 20:
            stop.set()
        return exited()

    monkeypatch.setattr(child, "exited", looked)
    with caplog.at_level(logging.INFO, logger="megapod"):
        await asyncio.wait_for(launcher.supervise(stop, period_s=0.005), 60.0)
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("llm-0")]
    assert len(looks) == 20
    assert len(reports) == 1, reports
    assert "died with exit code 3" in reports[0] and "not restarting" in reports[0]
    assert child.restarts == 0 and not child.alive()


async def test_a_child_that_keeps_dying_is_restarted_after_delays_that_double_up_to_the_cap(
        tmp_path, monkeypatch, caplog, quick_backoff):
    child = crashing_child(tmp_path)
    launcher = launcher_over(tmp_path, child)
    first, starts = child.started_at, record_starts(monkeypatch, child)
    with caplog.at_level(logging.INFO, logger="megapod"):
        await supervise_until_it_raises(launcher)
    starts = [first, *starts]
    delays = chosen_delays(caplog, "llm-0")
    assert delays == [0.01, 0.02, 0.04, 0.04, 0.04]  # deaths 1-5; the 6th ends it
    assert [launcher_module.restart_delay(n) for n in range(1, 6)] == delays
    assert len(starts) == 6 and child.restarts == 5
    # Each restart came at least its delay after the previous start (a lower bound: never flaky on a slow machine).
    assert all(later - earlier >= delay for earlier, later, delay in zip(starts, starts[1:], delays))


def test_the_default_backoff_doubles_from_half_a_second_to_a_cap():
    delays = [launcher_module.restart_delay(n) for n in range(1, launcher_module.MAX_DEATHS_IN_A_ROW)]
    assert delays[0] == launcher_module.RESTART_DELAY_FIRST_S
    assert all(b == min(2 * a, launcher_module.RESTART_DELAY_MAX_S) for a, b in itertools.pairwise(delays))
    assert delays[-1] == launcher_module.RESTART_DELAY_MAX_S
    assert launcher_module.STABLE_AFTER_S > launcher_module.RESTART_DELAY_MAX_S


async def test_supervise_gives_up_on_a_child_that_keeps_dying_naming_it_with_its_log_tail(
        tmp_path, quick_backoff):
    steady = Child("snac-0", [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "snac-0.log")
    child = crashing_child(tmp_path, "llm-1")
    launcher = launcher_over(tmp_path, steady, child)
    error = await supervise_until_it_raises(launcher)
    message = str(error)
    assert message.startswith("llm-1 died 6 times in a row"), message
    assert "exit code 3" in message and str(child.log_path) in message
    assert "boom: no such checkpoint" in message  # the log's tail
    assert child.restarts == 5
    assert not steady.alive()  # launcher.stop() took the rest down


async def test_a_child_that_stayed_up_starts_its_count_afresh(tmp_path, monkeypatch, caplog, quick_backoff):
    child = crashing_child(tmp_path)
    launcher = launcher_over(tmp_path, child)

    def third_stays_up(n: int) -> None:  # the 3rd process (2nd restart) as if it had served for 1000 s
        if n == 2:
            child.started_at -= 1000.0

    starts = record_starts(monkeypatch, child, third_stays_up)
    with caplog.at_level(logging.INFO, logger="megapod"):
        await supervise_until_it_raises(launcher)
    # Deaths: 2 quick ones, the one that stayed up (count back to 1), then quick ones up to 6 in a row.
    assert chosen_delays(caplog, "llm-0") == [0.01, 0.02, 0.01, 0.02, 0.04, 0.04, 0.04]
    assert len(starts) == child.restarts == 7


def test_megapod_up_exits_non_zero_naming_the_child_after_stopping_everything(monkeypatch, capsys):
    stopped = []

    class DyingLauncher:
        def __init__(self, config, log_dir, gpu_count=None) -> None:
            pass

        async def start(self) -> None:
            pass

        async def supervise(self, stop: asyncio.Event) -> None:
            await asyncio.sleep(0.1)
            raise ChildKeptDying("llm-0 died 8 times in a row; the last time with exit code 3; llm-0.log:\nboom")

        async def stop(self) -> None:
            stopped.append(time.monotonic())

    monkeypatch.setattr("megapod.up.Launcher", DyingLauncher)
    argv = ["up", "--front-port", str(free_ports(1)[0]), "--llm-device", "cpu", "--snac-device", "cpu"]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == ("megapod up: llm-0 died 8 times in a row; the last time with exit code 3; "
                                 "llm-0.log:\nboom")
    assert len(stopped) == 1
