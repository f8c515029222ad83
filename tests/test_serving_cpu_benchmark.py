"""Smoke test of benchmarks/serving_cpu.py: the worker and codec replica with their doubles start,
serve a level, and the JSON and plot are written. Figures are not asserted beyond being counted:
performance is claimed from benchmark runs, never from timed tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "serving_cpu.py"


def test_a_small_level_writes_its_figures(tmp_path):
    """Its logs and loop-lag lines go to a folder of this run's own (a shared fixed one let a second run
    truncate and mix into the first's lag file)."""
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--streams", "2", "--seconds", "3", "--frames", "12",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    logs = Path(result["logs"])
    assert logs.parent == tmp_path and (logs / "lag.jsonl").stat().st_size > 0 and (logs / "worker.log").exists()
    (level,) = result["levels"]
    assert level["streams"] == 2 and level["errors"] == 0 and level["requests"] >= 2
    # the worker counted the engine double's tokens, the replica the frames it decoded
    assert level["tokens"] > 0 and level["codec_frames"] > 0
    assert level["worker_us_per_token"] > 0 and level["codec_us_per_frame"] > 0
    assert set(level["cores"]) == {"worker", "codec", "client"}
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_codec_alone_writes_its_figures(tmp_path):
    """--codec-streams: the replica driven straight over gRPC; every frame sent comes back as audio
    the replica counted, and each level says whether the replica kept its chunks within a frame."""
    out = tmp_path / "codec.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--codec-streams", "4", "--seconds", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (level,) = json.loads(out.read_text())["levels"]
    assert level["streams"] == 4 and level["frames_per_s"] > 0 and level["codec_us_per_frame"] > 0
    assert set(level["cores"]) == {"codec", "driver"}
    assert 0.0 <= level["replica_chunks_within_a_frame"] <= 1.0
    assert level["codec_loop_lag_ms"]["max"] is not None, "the replica's own loop watcher reported"
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_capacity_run_writes_its_figures(tmp_path):
    """--capacity: the worker's admission unconfigured under 1.5 x what the engine double's curve keeps in
    real time (2 + 1 ms a stream: 10 streams). Its figures are counted, not judged (benchmarks/README.md
    has the judged runs); more clients than the first limit (4) asked, so some were refused."""
    out = tmp_path / "capacity.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--capacity", "--step-curve", "2,1.0", "--seconds", "8",
                           "--frames", "24", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["capacity_known"] == 10 and result["offered_clients"] == 15
    assert 1 <= result["admitted_settled"] <= 512 and 0.0 <= result["realtime_share"] <= 1.0
    assert result["streams_admitted"] > 0 and result["refusals"] > 0 and result["refusal_p95_ms"] > 0
    assert {"t", "limit", "active", "pace"} <= set(result["timeline"][0]) and len(result["timeline"]) > 4
    assert out.with_suffix(".png").stat().st_size > 0
