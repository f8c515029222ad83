"""`megapod up` on GPUs: one GPU per worker, the codec replicas on their own, no GPU oversubscribed."""

from __future__ import annotations

from pathlib import Path

import pytest

from megapod.gpu_layout import GpuLayoutError, codec_share, plan_gpus
from megapod.launcher import Launcher
from megapod.topology import MegaPodConfig


def _visible(children) -> list[str | None]:
    return [c.env.get("CUDA_VISIBLE_DEVICES") for c in children]


def test_the_cluster_layout_on_one_eight_gpu_machine(tmp_path: Path):
    """7 workers on GPUs 0..6, 3 codec replicas sharing GPU 7: the Helm chart's MegaPod."""
    launcher = Launcher(MegaPodConfig(workers=7, replicas=3), tmp_path, gpu_count=8)
    assert _visible(launcher.workers) == [str(i) for i in range(7)]
    assert _visible(launcher.replicas) == ["7"] * 3


def test_two_workers_on_one_gpu_are_refused(tmp_path: Path):
    """Each engine would claim 90% of GPU 0: the second fails to start, or both starve."""
    with pytest.raises(GpuLayoutError, match=r"GPU 0 would be oversubscribed: worker 0, worker 1"):
        Launcher(MegaPodConfig(workers=2), tmp_path, gpu_count=1)


def test_one_gpu_holds_one_worker_and_the_codec():
    layout = plan_gpus(MegaPodConfig(workers=1), gpu_count=1)
    assert (layout.workers, layout.codec) == ((0,), 0)


def test_more_workers_than_gpus_share_them_when_their_shares_fit():
    layout = plan_gpus(MegaPodConfig(workers=2, llm_gpu_memory_utilization=0.45), gpu_count=1)
    assert (layout.workers, layout.codec) == ((0, 0), 0)


def test_workers_may_share_a_gpu_when_their_shares_fit():
    layout = plan_gpus(MegaPodConfig(workers=2, llm_gpus="0,0", llm_gpu_memory_utilization=0.45), gpu_count=2)
    assert (layout.workers, layout.codec) == ((0, 0), 1)


@pytest.mark.parametrize("changes, message", [
    (dict(workers=2, llm_gpus="0,5"), r"GPU\(s\) \[5\] requested but this machine has 4"),
    (dict(workers=2, llm_gpus="0"), "names 1 GPUs for 2 workers"),
    # 97% for vLLM and 2 x 1,891 MiB (4.6% of an H100) for the replicas: 101.6%
    (dict(workers=1, replicas=2, snac_gpu="0", llm_gpu_memory_utilization=0.97), "GPU 0 would be oversubscribed: worker 0, the codec"),
])
def test_impossible_layouts_name_the_problem(changes, message):
    with pytest.raises(GpuLayoutError, match=message):
        plan_gpus(MegaPodConfig(**changes), gpu_count=4)


def test_a_cpu_megapod_pins_nothing(tmp_path: Path):
    launcher = Launcher(MegaPodConfig(workers=2, llm_device="cpu", snac_device="cpu"), tmp_path, gpu_count=8)
    assert _visible(launcher.children) == [None] * 4


def _engine_nice(child) -> str | None:
    return child.argv[child.argv.index("--engine-nice") + 1] if "--engine-nice" in child.argv else None


def test_with_no_gpu_the_workers_engines_run_below_the_codec_replicas_on_the_shared_cores(tmp_path: Path):
    """Issue 43: on a CPU the engine generated frames ahead on the cores the codec needed for the audio owed now."""
    on_cpu = Launcher(MegaPodConfig(workers=2), tmp_path, gpu_count=0)
    assert [_engine_nice(w) for w in on_cpu.workers] == ["5", "5"]
    assert all("--engine-nice" not in r.argv for r in on_cpu.replicas)
    assert _engine_nice(Launcher(MegaPodConfig(cpu_engine_nice=0), tmp_path, gpu_count=0).workers[0]) is None
    codec_on_gpu = Launcher(MegaPodConfig(llm_device="cpu"), tmp_path, gpu_count=1)
    assert _engine_nice(codec_on_gpu.workers[0]) is None, "only where both tiers share the cores"
    assert _engine_nice(Launcher(MegaPodConfig(workers=2), tmp_path, gpu_count=3).workers[0]) is None


def test_with_no_gpu_the_workers_hold_a_reserve_of_their_limit_back_while_they_refuse(tmp_path: Path):
    """Issue 43, run 55: refusals' work on the shared cores took 5 % of the codec's at 3x the capacity."""
    def reserve(child) -> str | None:
        argv = child.argv
        return argv[argv.index("--refusal-reserve") + 1] if "--refusal-reserve" in argv else None

    assert [reserve(w) for w in Launcher(MegaPodConfig(workers=2), tmp_path, gpu_count=0).workers] == ["0.1", "0.1"]
    assert reserve(Launcher(MegaPodConfig(cpu_refusal_reserve=0), tmp_path, gpu_count=0).workers[0]) is None
    assert reserve(Launcher(MegaPodConfig(llm_device="cpu"), tmp_path, gpu_count=1).workers[0]) is None
    assert reserve(Launcher(MegaPodConfig(workers=2), tmp_path, gpu_count=3).workers[0]) is None


def test_workers_on_gpus_with_the_codec_on_cpu():
    layout = plan_gpus(MegaPodConfig(workers=2, snac_device="cpu"), gpu_count=2)
    assert (layout.workers, layout.codec) == ((0, 1), None)


def test_every_worker_gets_its_memory_share_as_a_flag():
    args = MegaPodConfig(llm_gpu_memory_utilization=0.8).worker_flags(0)
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.8"


class StubChild:
    """A test double for launcher.Child: records when it starts and when it first probes ready,
    becoming ready on its second probe (so a start that waits for it is visible in the record)."""

    def __init__(self, name: str, record: list[str]) -> None:
        self.name, self.record = name, record
        self.pid, self.log_path, self.started_at, self.probes = 0, None, 0.0, 0

    def start(self) -> StubChild:
        self.record.append(f"start {self.name}")
        return self

    def ready(self) -> bool:
        self.probes += 1
        if self.probes == 2:
            self.record.append(f"ready {self.name}")
        return self.probes >= 2


def _stubbed(launcher: Launcher) -> list[str]:
    """Swap the launcher's processes for StubChilds; returns the record they write."""
    record: list[str] = []
    launcher.replicas = [StubChild(c.name, record) for c in launcher.replicas]
    launcher.workers = [StubChild(c.name, record) for c in launcher.workers]
    return record


async def test_a_worker_on_the_codec_gpu_starts_once_the_replicas_are_ready(tmp_path: Path):
    """Replicas capturing CUDA Graphs free cached memory while a worker beside them profiles its
    GPU's memory, which vLLM refuses; a worker on a GPU of its own has nothing to wait for."""
    launcher = Launcher(MegaPodConfig(workers=2, replicas=2), tmp_path, gpu_count=2)
    # llm-1 shares GPU 1 with the codec replicas; llm-0 has GPU 0 to itself
    assert (_visible(launcher.workers), _visible(launcher.replicas)) == (["0", "1"], ["1", "1"])
    record = _stubbed(launcher)
    await launcher.start(timeout_s=30)
    replicas_ready = max(record.index("ready snac-0"), record.index("ready snac-1"))
    assert record.index("start llm-1") > replicas_ready, record
    assert record.index("start llm-0") < min(record.index("ready snac-0"), record.index("ready snac-1")), record
    assert "ready llm-0" in record and "ready llm-1" in record


async def test_a_cpu_megapod_starts_every_process_at_once(tmp_path: Path):
    config = MegaPodConfig(workers=2, replicas=2, llm_device="cpu", snac_device="cpu")
    launcher = Launcher(config, tmp_path, gpu_count=0)
    record = _stubbed(launcher)
    await launcher.start(timeout_s=30)
    assert record[:4] == ["start snac-0", "start snac-1", "start llm-0", "start llm-1"], record


def test_the_codec_share_is_what_its_replicas_were_measured_to_hold():
    """Not a flat guess (it was 10% for any number of replicas): 3 replicas at snac-server's defaults held
    3 x 1,891 MiB on a GPU, 7.0% of an H100; 6 of them would not fit beside a worker at 0.9."""
    assert codec_share(3) == pytest.approx(3 * 1891 / 81559)
    plan_gpus(MegaPodConfig(workers=1, replicas=3, snac_gpu="0"), gpu_count=1)  # 90% + 7.0%: fits
    with pytest.raises(GpuLayoutError, match=r"13\.9% for 6 codec replica"):
        plan_gpus(MegaPodConfig(workers=1, replicas=6, snac_gpu="0"), gpu_count=1)

