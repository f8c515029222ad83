"""Why the CPU runner caps frames per forward (snac_server/runner.py CPU_STEP_FRAMES).

Decodes the same 24-frame windows as one forward of 1, 2 and 8 rows (24, 48 and 192 window
frames), side by side in one run, and prints milliseconds per window frame and the ratio of the
192-frame forward to the 48-frame one. Writes benchmarks/results/forward_cost-cpu.json.

    .venv/bin/python benchmarks/forward_cost.py        # ~1 min on 2 cores
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
for _path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from provenance import git_commit, versions  # noqa: E402
from snac_server.codec_model import build_decoder  # noqa: E402
from snac_server.runner import DecoderRunner  # noqa: E402
from snac_server.session import DecodeRow  # noqa: E402

WINDOW, ROWS, REPEATS = 24, (1, 2, 8), 3


def rows(n: int) -> list[DecodeRow]:
    rng = np.random.default_rng(0)
    return [DecodeRow(rng.integers(0, 4096, size=(WINDOW, 7)), frame0=30 * i, seed=1, keep_start=0, keep_end=WINDOW,
                      pad_ok=True, first_frame=30 * i, final=False) for i in range(n)]


def ms_per_frame(runner: DecoderRunner, batch: list[DecodeRow]) -> float:
    runner.decode(batch)  # first call of a shape: allocator and oneDNN set-up, not timed
    started = time.perf_counter()
    for _ in range(REPEATS):
        runner.decode(batch)
    return (time.perf_counter() - started) / REPEATS / (len(batch) * WINDOW) * 1000


def main() -> dict:
    decoder = build_decoder("random-24khz", "cpu", "float32", max_batch=max(ROWS))
    runner = DecoderRunner(decoder, (WINDOW,), max_batch=max(ROWS), cuda_graphs=False, max_step_frames=10_000)
    load = os.getloadavg()[0]
    figures = {n * WINDOW: round(ms_per_frame(runner, rows(n)), 1) for n in ROWS}
    for frames, ms in figures.items():
        print(f"{frames:4d} window frames a forward: {ms:6.1f} ms per frame")
    ratio = figures[192] / figures[48]
    print(f"192-frame forward / 48-frame forward, per frame: {ratio:.2f}x (load average at start {load:.2f})")
    result = {"benchmark": "forward_cost", "ms_per_frame_by_forward_frames": figures, "ratio_192_vs_48": round(ratio, 2),
              "load_average_start": round(load, 2), "cores": len(os.sched_getaffinity(0)), "git_commit": git_commit(),
              "versions": versions(("torch", "snac", "numpy"))}
    out = REPO_ROOT / "benchmarks" / "results" / "forward_cost-cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
