"""Smoke test of benchmarks/clone_first_audio_cpu.py: both engines start, each voice's first and later requests are
timed, the JSON is written. Figures are only checked to be readings: performance is claimed from benchmark runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from processes import TINY_CACHE

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "clone_first_audio_cpu.py"


def test_first_and_later_requests_are_timed_with_prefix_caching_on_and_off(tmp_path):
    out = tmp_path / "clone.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--voices", "1", "--reference-s", "2", "--cache-dir", TINY_CACHE,
                           "--out", str(out)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["prefix_caching"] for r in runs] == [True, False]
    assert all(len(r["first_readings_ms"]) == 1 and len(r["later_readings_ms"]) == 4 and r["first_request_ms"] > 0
               for r in runs)
    assert runs[0]["prompt_tokens"] == runs[1]["prompt_tokens"] > 23 * 7  # 2 s of reference: 23 frames
