"""Smoke test of benchmarks/serving_cpu.py: the worker and codec replica with their doubles start,
serve a level, and the JSON and plot are written. Figures are not asserted beyond being counted:
performance is claimed from benchmark runs, never from timed tests.

The three runs start together: each is mostly paced waiting (the engine double's steps, the levels'
windows), so together they take little longer than the longest one alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "serving_cpu.py"
RUNS = {
    "serving": ["--streams", "2", "--seconds", "2", "--warm-up-s", "1", "--frames", "12"],
    "codec": ["--codec-streams", "4", "--seconds", "2", "--warm-up-s", "1"],
    # the worker's admission unconfigured under 1.5 x what the engine double's curve keeps in real time
    "capacity": ["--capacity", "--step-curve", "2,1.0", "--seconds", "4", "--frames", "24"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, Path, str]]:
    """Each run's folder (its TMPDIR too: the run's logs and loop-lag lines go to a folder of its own; a shared
    fixed one let a second run truncate and mix into the first's lag file), its JSON, and its failure (empty
    when it exited 0), once every run has ended."""
    started = {}
    for name, args in RUNS.items():
        folder = tmp_path_factory.mktemp(name)
        argv = [sys.executable, str(BENCHMARK), *args, "--out", str(folder / "out.json")]
        with open(folder / "output.log", "w") as log:
            started[name] = folder, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                     env={**os.environ, "TMPDIR": str(folder)})
    ended = {}
    for name, (folder, proc) in started.items():
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = f"killed after 300 s ({proc.wait()})"
        failure = "" if code == 0 else f"exit {code}: {(folder / 'output.log').read_text()[-3000:]}"
        ended[name] = folder, folder / "out.json", failure
    return ended


def test_a_small_level_writes_its_figures(runs):
    folder, out, failure = runs["serving"]
    assert not failure, failure
    result = json.loads(out.read_text())
    logs = Path(result["logs"])
    assert logs.parent == folder and (logs / "lag.jsonl").stat().st_size > 0 and (logs / "worker.log").exists()
    (level,) = result["levels"]
    assert level["streams"] == 2 and level["errors"] == 0 and level["requests"] >= 2
    # the worker counted the engine double's tokens, the replica the frames it decoded
    assert level["tokens"] > 0 and level["codec_frames"] > 0
    assert level["worker_us_per_token"] > 0 and level["codec_us_per_frame"] > 0
    assert set(level["cores"]) == {"worker", "codec", "client"}
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_codec_alone_writes_its_figures(runs):
    """--codec-streams: the replica driven straight over gRPC; every frame sent comes back as audio
    the replica counted, and each level says whether the replica kept its chunks within a frame."""
    _, out, failure = runs["codec"]
    assert not failure, failure
    (level,) = json.loads(out.read_text())["levels"]
    assert level["streams"] == 4 and level["frames_per_s"] > 0 and level["codec_us_per_frame"] > 0
    assert set(level["cores"]) == {"codec", "driver"}
    assert 0.0 <= level["replica_chunks_within_a_frame"] <= 1.0
    assert level["codec_loop_lag_ms"]["max"] is not None, "the replica's own loop watcher reported"
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_capacity_run_writes_its_figures(runs):
    """--capacity: the worker's admission unconfigured under 1.5 x what the engine double's curve keeps in
    real time (2 + 1 ms a stream: 10 streams). Its figures are counted, not judged (benchmarks/README.md
    has the judged runs); more clients than the first limit (4) asked, so some were refused."""
    _, out, failure = runs["capacity"]
    assert not failure, failure
    result = json.loads(out.read_text())
    assert result["capacity_known"] == 10 and result["offered_clients"] == 15
    assert 1 <= result["admitted_settled"] <= 512 and 0.0 <= result["realtime_share"] <= 1.0
    assert result["streams_admitted"] > 0 and result["refusals"] > 0 and result["refusal_p95_ms"] > 0
    assert {"t", "limit", "active", "pace"} <= set(result["timeline"][0]) and len(result["timeline"]) > 4
    assert out.with_suffix(".png").stat().st_size > 0
