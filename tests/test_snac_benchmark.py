"""Smoke test of benchmarks/snac_tier.py: both modes run end to end at tiny sizes and write their JSON.

Figures are not asserted beyond being positive: performance is claimed from benchmark runs,
never from timed tests. They run the tests' small codec (the real layout at 1/16 width): the same code
paths for a fraction of the CPU.
"""

from __future__ import annotations

import json

from processes import TEST_CODEC

from benchmarks import snac_tier


def test_both_policies_in_both_regimes_write_the_comparison(tmp_path):
    out = tmp_path / "tier.json"
    returned = snac_tier.main(["--streams", "2", "--frames", "6", "--device", "cpu", "--model", TEST_CODEC, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    for key in ("device", "streams", "frames_per_stream", "dtype", "max_batch", "provenance"):
        assert key in result, key
    assert result["model"] == TEST_CODEC
    assert result["provenance"]["versions"]["torch"] and result["provenance"]["command"].endswith("--out " + str(out))
    assert set(result["regimes"]) == {"trickle", "unpaced"}
    for regime in result["regimes"].values():
        streaming, reference = regime["streaming"], regime["reference"]
        assert streaming["audio_s_per_s"] > 0 and reference["audio_s_per_s"] > 0 and regime["ratio"] > 0
        # 6 frames + 3 flush frames per stream, against a 4-frame window per frame: the server's counters
        assert streaming["decoded_per_emitted_frame"] == 1.5 and reference["decoded_per_emitted_frame"] == 4.0
    assert result["regimes"]["trickle"]["streaming"]["decode_steps"] >= 6, "one frame per stream per step"


def test_forward_sizes_times_each_size(tmp_path):
    """--forward-sizes: one decoder forward per size, ms per frame keyed by frames a forward."""
    out = tmp_path / "forward.json"
    result = snac_tier.main(["--forward-sizes", "1,2", "--device", "cpu", "--model", TEST_CODEC, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    figures = result["ms_per_frame_by_forward_frames"]
    assert list(figures) == [4, 8] and all(ms > 0 for ms in figures.values())
    assert result["cheapest_forward_frames"] in figures


def test_forward_sizes_by_threads_alone_and_beside_busy_loops(tmp_path):
    """--threads and --busy: each thread count timed alone and beside busy loops."""
    out = tmp_path / "threads.json"
    result = snac_tier.main(["--forward-sizes", "1", "--threads", "1,2", "--busy", "1", "--device", "cpu", "--model", TEST_CODEC, "--out", str(out)])
    by_threads = json.loads(out.read_text())["ms_per_frame_by_threads"]
    assert list(by_threads) == ["1", "2"]
    for runs in by_threads.values():
        assert list(runs) == ["alone", "beside 1 busy loops"] and all(ms > 0 for f in runs.values() for ms in f.values())
    assert result["ms_per_frame_by_forward_frames"] == result["ms_per_frame_by_threads"][1]["alone"]
