"""Smoke test of benchmarks/soak.py with its after-phases, attached to the session's `megapod up` (real vLLM on
CPU, two workers, two codec replicas; --attach): a short soak with a cap of one stream (the stack's other slots
held by silent contexts), then --doors (time to first byte by format, a barge-in) and --overload (the held
slot under a flood, /health beside it). Asserts what the soak judges (no audio lost, every refusal a 429,
the barge-in's resources freed, the held slots given back) and that the JSON holds every figure; performance
is claimed from benchmark runs, never from timed tests. The soak's own stack (without --attach) is the same
LocalStack as the session's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
FORMATS = ["pcm", "wav", "mp3", "opus", "aac", "flac"]


def test_a_short_soak_with_doors_and_overload_passes_and_writes_its_figures(megapod, tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--minutes", "0.1", "--concurrency", "1", "--doors", "1",
                           "--overload", "--overload-rounds", "2", "--replays", "1", "--kinds", "short",
                           "--attach", str(megapod["proc"].pid), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and not result["failures"]
    held = 2 * megapod["max_streams"] - 1  # every slot of the two workers but the soak's one
    assert f"holding {held} slots" in done.stderr and result["attached"] and result["config"]["max_streams"] == 1
    assert result["audio"]["exact"] and result["audio"]["samples_lost"] == 0 and result["audio"]["frames_generated"] > 0
    assert result["replays"] and all(r["same"] for r in result["replays"])
    ttfb = result["doors"]["ttfb_s"]
    assert list(ttfb) == FORMATS and all(v["p50"] > 0 for v in ttfb.values())
    barge_in = result["doors"]["barge_in"]
    assert barge_in["all_released"] and len(barge_in["runs"]) == 1
    assert sum(barge_in["runs"][0]["held_at_cancel"].values()) > 0, "the cancelled context held resources first"
    runs = result["overload"]["runs"]
    assert [run["flooded"] for run in runs] == [False, True, False, True]
    # every run's admitted stream was admitted: a knock let in by the last flood had let go of its slot
    assert all(s["status"] == 200 and s["audio_s"] > 0 for run in runs for s in run["streams"])
    for flooded in [run["flood"] for run in runs if run["flooded"]]:
        assert flooded["requests"] > 0 and set(flooded["statuses"]) <= {"429", "200"} and flooded["statuses"]["429"] > 0
        assert flooded["health_latency_s"]["p50"] is not None
    # the servers' own event-loop lag over the soak (orpheus_event_loop_lag_seconds) and the worst since start
    for name in ("worker", "front"):
        assert result[f"{name}_loop_lag_observed"] > 0, name  # every 50 ms of the soak
        for field in ("p50", "p99", "max"):
            value = result[f"{name}_loop_lag_{field}_ms"]
            assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, (name, field, value)
        assert result[f"{name}_loop_lag_p50_ms"] <= result[f"{name}_loop_lag_p99_ms"]
    assert "loop lag  worker: p50/p99" in done.stdout
    end = result["end_state"]  # after the soak let its held slots go
    assert end["active_streams"] == 0 and end["engine_unfinished"] == 0 and end["health"]["ok"]
