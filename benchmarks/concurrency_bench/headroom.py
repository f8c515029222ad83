"""Client headroom: the load generator must not be what limits a level.

The same client code drives a trivial endpoint (fake_endpoint.py, its own process: paced PCM
frames on an exact schedule, fixed time to first audio) with several times the streams, and at
a higher chunk rate, than the heaviest level it drove. Whatever delay the client then measures
beyond the schedule is its own (or the trivial server's, so the check is conservative). It passes
when that delay stays under a tenth of the run's own targets: the buffer a stream may use and the
time to first audio.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from megapod.launcher import Child, free_ports

from .corpus import Corpus
from .levels import level_record
from .load import Endpoint, Level, LoadShape, Progress
from .metrics import Targets

FAKE = Path(__file__).resolve().parent / "fake_endpoint.py"
SERVED_TTFA_S = 0.05
SERVED_AUDIO_S = 4.0


async def headroom_check(streams: int, seconds: float, run_targets: Targets, corpus: Corpus,
                         heaviest: dict[str, Any] | None) -> dict[str, Any]:
    """Drive the trivial endpoint with `streams` real-time streams for `seconds`; judge the client."""
    port = free_ports(1)[0]
    endpoint = Child("the trivial endpoint", [sys.executable, str(FAKE), "--port", str(port), "--ttfa-ms",
                                              str(SERVED_TTFA_S * 1000), "--audio-s", str(SERVED_AUDIO_S), "--pace", "1"],
                     None, f"http://127.0.0.1:{port}/ready")
    try:
        endpoint.start().wait_ready(30)
        allowance_buffer = 0.1 * run_targets.buffer_s
        allowance_ttfa = 0.1 * run_targets.ttfa_s
        targets = Targets(ttfa_s=SERVED_TTFA_S + allowance_ttfa, buffer_s=allowance_buffer, pace=1.0,
                          success_share=run_targets.success_share, realtime_share=run_targets.realtime_share,
                          ttfa_quantile=run_targets.ttfa_quantile)
        shape = LoadShape(mode="closed", stagger_s=1.0, warmup_s=2.0, window_s=seconds, max_level_s=seconds + 60,
                          read_timeout_s=30.0)
        level = Level(Endpoint("trivial endpoint", f"http://127.0.0.1:{port}"), shape, targets, corpus, streams,
                      progress=Progress(f"client headroom, {streams} streams"))
        record = level_record(await level.run_level(), targets, None)
    finally:
        endpoint.stop(timeout_s=10)
    factor = {}
    if heaviest:
        for key in ("chunks_per_s", "audio_s_per_s"):
            if heaviest.get(key):
                factor[key] = round(record[key] / heaviest[key], 1)
        factor["streams"] = round(streams / heaviest["n"], 1)
    ttfa_p95 = record["ttfa_s"]["p95"]
    return {
        "passed": record["passed"],
        "reasons": record["reasons"],
        "streams": streams,
        "served": {"ttfa_s": SERVED_TTFA_S, "audio_s_per_request": SERVED_AUDIO_S, "pace": 1.0,
                   "chunk": "one 2048-sample frame every 85.33 ms"},
        "allowance": {"buffer_s": allowance_buffer, "ttfa_overhead_s": allowance_ttfa},
        "ttfa_overhead_s_p95": None if ttfa_p95 is None else round(ttfa_p95 - SERVED_TTFA_S, 4),
        "required_buffer_s": record["required_buffer_s"],
        "gap_s": record["gap_s"],
        "chunks_per_s": record["chunks_per_s"],
        "audio_s_per_s": record["audio_s_per_s"],
        "load_vs_heaviest_level": factor,
        "client": record["client"],
        "level": record,
    }

