"""`megapod up` on GPUs: one GPU per worker, the codec replicas on their own, no GPU oversubscribed."""

from __future__ import annotations

from pathlib import Path

import pytest

from megapod.gpu_layout import GpuLayoutError, plan_gpus
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
    (dict(workers=1, snac_gpu="0", llm_gpu_memory_utilization=0.95), "GPU 0 would be oversubscribed: worker 0, the codec"),
])
def test_impossible_layouts_name_the_problem(changes, message):
    with pytest.raises(GpuLayoutError, match=message):
        plan_gpus(MegaPodConfig(**changes), gpu_count=4)


def test_a_cpu_megapod_pins_nothing(tmp_path: Path):
    launcher = Launcher(MegaPodConfig(workers=2, llm_device="cpu", snac_device="cpu"), tmp_path, gpu_count=8)
    assert _visible(launcher.children) == [None] * 4


def test_workers_on_gpus_with_the_codec_on_cpu():
    layout = plan_gpus(MegaPodConfig(workers=2, snac_device="cpu"), gpu_count=2)
    assert (layout.workers, layout.codec) == ((0, 1), None)


def test_every_worker_gets_its_memory_share_as_a_flag():
    args = MegaPodConfig(llm_gpu_memory_utilization=0.8).worker_args(0)
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.8"
