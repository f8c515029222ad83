"""`megapod doctor --device cpu`: every check runs (the same code paths a GPU takes, eager and with the
tiny model) and lands in the JSON; on CPU the attention comparison says it does not apply. The codec checked
is the tests' small one (--snac-model): test_gpu_kit.py runs the codec part on the real architecture."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from processes import TEST_CODEC, TINY_CACHE

from llm_server.selfcheck import STEP_BUDGET_MS, realtime_streams

CHECKS = {"codec_warm_up", "codec_graph_equals_eager", "codec_streaming_equals_full_decode", "codec_step_never_syncs",
          "codec_replica_serves", "llm_engine_starts", "llm_frame_constraint"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor") / "doctor.json"
    done = subprocess.run([sys.executable, "-m", "megapod", "doctor", "--device", "cpu", "--quick", "--max-batch", "2", "-o", str(out),
                           "--cache-dir", TINY_CACHE, "--snac-model", TEST_CODEC], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "real-time streams per codec device" in done.stdout and "admission settles at" in done.stdout
    return json.loads(out.read_text())


def test_every_check_ran_and_passed(report):
    assert set(report["checks"]) == CHECKS
    assert all(check["ok"] for check in report["checks"].values()), report["checks"]
    assert report["ok"] and report["advice"] == []


def test_the_codec_part_ran_too(report):
    """The codec checks' own fields are held by test_gpu_kit.py (the codec-only doctor); here, they ran too,
    on the codec asked for."""
    assert report["figures"]["codec"]["model"] == TEST_CODEC
    assert report["figures"]["realtime_streams_per_codec_gpu"] == report["figures"]["codec"]["float32"]["streaming"]["realtime_streams"] > 0


def test_the_llm_checks_ran_the_worker_engine(report):
    constraint = report["checks"]["llm_frame_constraint"]
    assert constraint["tokens"] > 0 and constraint["violations"] == []
    engine = report["checks"]["llm_engine_starts"]["engine"]
    assert engine["backends"] == ["CPU_ATTN"] and engine["runner"] == "V1"
    assert all(ms > 0 for ms in report["figures"]["llm"]["step_ms"].values())
    # the worker's controller on these step times (CPU target pace), within the batches timed
    steps = report["figures"]["llm"]["step_ms"]
    assert 1 <= report["figures"]["admitted_streams_per_llm_gpu"] <= max(int(b) for b in steps)
    assert report["figures"]["llm"]["precisions"] == []  # FP8 is timed on a GPU only


def test_the_llm_is_timed_with_new_streams_arriving_too(report):
    """Uniform decode (every stream admitted at once, one prompt) is optimistic: serving's steps carry new
    prompts beside the decodes. The steady-arrival timing is reported beside it, at the same batches (issue 44,
    finding 3)."""
    llm, steady = report["figures"]["llm"], report["figures"]["llm"]["steady"]
    assert set(steady["step_ms"]) == set(llm["step_ms"]) and all(ms > 0 for ms in steady["step_ms"].values())
    assert report["figures"]["steady_realtime_streams_per_llm_gpu"] == steady["realtime_streams"]
    assert report["figures"]["steady_admitted_streams_per_llm_gpu"] == steady["admission_settles_at"]


def test_on_cpu_gpu_only_parts_say_so(report):
    assert report["attention"]["note"].startswith("not applicable on CPU") and report["attention"]["comparisons"] == []
    assert "GPU figures need a GPU" in report["note"]
    assert report["checks"]["codec_warm_up"]["cuda_graphs"] == 0


@pytest.mark.parametrize("step_ms, streams", [
    ({1: 5.0, 64: 10.0, 128: 20.0}, 64 + 64 * (STEP_BUDGET_MS - 10.0) / 10.0),  # interpolated past 64
    ({1: 5.0, 256: 11.0}, 256.0),  # every batch real time: at least the largest measured
    ({1: 30.0, 4: 40.0}, 0.0),  # one stream is already too slow
])
def test_realtime_streams_from_step_times(step_ms, streams):
    assert realtime_streams(step_ms) == pytest.approx(streams)
