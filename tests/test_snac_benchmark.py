"""Smoke test of benchmarks/snac_tier.py: both modes run end to end at tiny sizes and write their JSON.

Figures are not asserted beyond being positive: performance is claimed from benchmark runs,
never from timed tests.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "snac_tier.py"


@pytest.fixture(scope="module")
def snac_tier():
    """The benchmark script, imported as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("snac_tier", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_throughput_mode_writes_comparison(snac_tier, tmp_path):
    out = tmp_path / "tier.json"
    returned = snac_tier.main(["--streams", "2", "--frames", "6", "--device", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    for key in ("device", "streams", "server_audio_s_per_s", "reference_audio_s_per_s", "ratio", "frames_per_stream",
                "policy", "dtype", "max_batch", "max_wait_ms", "versions", "git_commit", "timestamp"):
        assert key in result, key
    assert result["streams"] == 2 and result["frames_per_stream"] == 6 and result["policy"] == "adaptive"
    assert result["server_audio_s_per_s"] > 0 and result["reference_audio_s_per_s"] > 0 and result["ratio"] > 0
    assert {"torch", "snac", "grpcio"} <= result["versions"].keys()
    server = result["server"]
    assert server["errors"] == [] and server["frames_delivered"] == 12, "every frame of every stream came back"
    assert server["time_to_first_chunk_ms"]["p50"] > 0 and server["chunk_gap_ms"]["p99"] >= 0
    assert sum(int(k) * v for k, v in server["chunk_frames_histogram"].items()) == 12
    assert server["window_frames_per_emitted_frame"] >= 1.0


def test_realtime_search_reports_a_stream_count(snac_tier, tmp_path):
    out = tmp_path / "realtime.json"
    snac_tier.main(["--realtime-search", "--frames", "5", "--max-streams-search", "1", "--device", "cpu",
                    "--out", str(out)])
    realtime = json.loads(out.read_text())["realtime"]
    assert realtime["max_realtime_streams"] in (0, 1), "a 2-core CPU may or may not keep one stream real time"
    trial = realtime["trials"][0]
    assert trial["streams"] == 1 and trial["errors"] == []
    assert trial["chunk_latency_ms"]["p99"] > 0
    assert sum(int(k) * v for k, v in trial["chunk_frames_histogram"].items()) == 5


def test_reference_windows_stay_inside_the_stream(snac_tier):
    assert [snac_tier.reference_window(j, 6) for j in range(6)] == [(0, 4), (0, 4), (1, 5), (2, 6), (2, 6), (2, 6)]
    assert snac_tier.reference_window(1, 3) == (0, 3)
