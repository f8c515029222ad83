"""Smoke test of benchmarks/front_relay.py: one small level through a real `megapod front` over worker
doubles and straight at them; the JSON holds every figure. Its performance is claimed from benchmark runs,
never from timed tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "front_relay.py"


def test_a_small_level_writes_its_figures(tmp_path):
    out = tmp_path / "front_relay.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--streams", "12", "--workers", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["provenance"]["command"].startswith("python benchmarks/front_relay.py")
    [level] = result["levels"]
    front, direct = level["through_front"], level["straight_at_workers"]
    assert front["whole"] == direct["whole"] == 12 and front["refused"] == 0
    assert front["ready_probes"]["sent"] > 0 and front["ready_probes"]["answered_200"] == front["ready_probes"]["sent"]
    assert front["front_cpu_ms_per_stream"] > 0 and front["front_rss_mib"] > 0
    assert all(level["first_chunk_added_by_front_s"][q] is not None for q in ("p50", "p99"))
    assert (tmp_path / "front_relay.png").stat().st_size > 0
