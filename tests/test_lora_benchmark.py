"""Smoke test of benchmarks/lora_cpu.py: every case of the LoRA engine is measured and the JSON is written. On that
engine alone (--lora on: the reference engine, LoRA off, is another vLLM start of the same code), eager as the
tests' engines are (torch.compile was 12 s of the engine's 14 s of initialisation), with 1 GiB of KV cache
(allocated whole at start: beside the session's stack, where this machine is slow to hand out fresh memory, the
default 2 GiB made a run some 15 s longer). Figures are only checked to be readings: performance is claimed from
benchmark runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from processes import TINY_CACHE

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "lora_cpu.py"
KV_CACHE = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB, read by vLLM's CPU backend (llm_server/engine/vllm.py)


def test_every_case_of_the_lora_engine_is_measured(tmp_path):
    out = tmp_path / "lora.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--streams", "2", "--tokens", "29", "--repeats", "1",
                           "--lora", "on", "--enforce-eager", "--cache-dir", TINY_CACHE, "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env={**os.environ, **KV_CACHE})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = {c["case"]: c for c in result["cases"]}
    assert list(cases) == ["lora on, unused", "one lora voice", "4 lora voices"]
    assert all(c["tokens_per_s"] > 0 and len(c["readings"]) == 1 and c["engine_start_s"] > 0 for c in cases.values())
    assert all(c["relative_to_lora_off"] is None for c in cases.values()), "no reference was run"
    assert result["streams"] == 2 and result["rank"] == 16 and result["enforce_eager"]
    assert "peft" in result["provenance"]["versions"]
    assert "4 lora voices" in done.stdout
