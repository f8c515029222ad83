"""Smoke test of benchmarks/clone_first_audio_cpu.py: a voice's first and later requests are timed and the JSON is
written. On the prefix-caching engine alone (--prefix-caching on: the reference engine, caching off, is another
vLLM start of the same code), eager as the tests' engines are (torch.compile was 12 s of the engine's 14 s of
initialisation), with 1 GiB of KV cache (allocated whole at start: beside the session's stack, where this machine
is slow to hand out fresh memory, the default 2 GiB made a run some 15 s longer). Figures are only checked to be
readings: performance is claimed from benchmark runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from processes import TINY_CACHE

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "clone_first_audio_cpu.py"
KV_CACHE = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB, read by vLLM's CPU backend (llm_server/engine/vllm.py)


def test_first_and_later_requests_are_timed(tmp_path):
    out = tmp_path / "clone.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--voices", "1", "--reference-s", "2",
                           "--prefix-caching", "on", "--enforce-eager", "--cache-dir", TINY_CACHE, "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env={**os.environ, **KV_CACHE})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    [run] = result["runs"]
    assert run["prefix_caching"] and result["voices"] == 1 and result["reference_s"] == 2 and result["enforce_eager"]
    assert len(run["first_readings_ms"]) == 1 and len(run["later_readings_ms"]) == 4
    assert run["first_request_ms"] > 0 and run["later_requests_ms"] > 0
    assert run["reference_frames"] == 23 and run["prompt_tokens"] > 23 * 7  # 2 s of reference: 23 frames
    assert "prefix caching on : first frame" in done.stdout
