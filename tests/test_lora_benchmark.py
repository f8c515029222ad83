"""Smoke test of benchmarks/lora_cpu.py: both engines start, every case is measured against LoRA off, and the
JSON is written. Figures are only checked to be readings: performance is claimed from benchmark runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from processes import TINY_CACHE

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "lora_cpu.py"


def test_every_case_is_measured_against_lora_off(tmp_path):
    out = tmp_path / "lora.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--streams", "2", "--tokens", "29", "--repeats", "1",
                           "--cache-dir", TINY_CACHE, "--out", str(out)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = {c["case"]: c for c in result["cases"]}
    assert list(cases) == ["lora off", "lora on, unused", "one lora voice", "4 lora voices"]
    assert cases["lora off"]["relative_to_lora_off"] == 1.0
    assert all(c["tokens_per_s"] > 0 and len(c["readings"]) == 1 for c in cases.values())
    assert "peft" in result["provenance"]["versions"] and "4 lora voices" in done.stdout
