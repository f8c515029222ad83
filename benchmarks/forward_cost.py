"""Why the CPU runner caps frames per forward (snac_server/runner.py CPU_STEP_FRAMES).

Decodes streaming steps of 4 frames as one forward of 1 to 48 rows (4 to 192 frames), side by side
in one run, and prints milliseconds per frame for each size. Writes
benchmarks/results/forward_cost-cpu.json.

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
from snac_server.session import StreamStep  # noqa: E402
from snac_server.streaming import OPEN_END, StreamingDecoder  # noqa: E402

STEP, ROWS, REPEATS = 4, (1, 2, 4, 8, 12, 48), 3


def rows(n: int) -> list[StreamStep]:
    rng = np.random.default_rng(0)
    return [StreamStep(i, rng.integers(0, 4096, size=(STEP, 7)).astype(np.int32), 30 * i, OPEN_END, 1, False)
            for i in range(n)]


def ms_per_frame(runner: DecoderRunner, batch: list[StreamStep]) -> float:
    runner.decode(batch, lambda *_: None)  # first call of a shape: allocator and oneDNN set-up, not timed
    started = time.perf_counter()
    for _ in range(REPEATS):
        runner.decode(batch, lambda *_: None)
    return (time.perf_counter() - started) / REPEATS / (len(batch) * STEP) * 1000


def main() -> dict:
    decoder = build_decoder("random-24khz", "cpu", "float32", max_batch=max(ROWS))
    streaming = StreamingDecoder(decoder, num_slots=max(ROWS))
    runner = DecoderRunner(decoder, streaming, max(ROWS), (STEP,), cuda_graphs=False, max_step_frames=10_000)
    load = os.getloadavg()[0]
    figures = {n * STEP: round(ms_per_frame(runner, rows(n)), 1) for n in ROWS}
    for frames, ms in figures.items():
        print(f"{frames:4d} frames a forward: {ms:6.1f} ms per frame")
    best = min(figures, key=figures.get)
    print(f"cheapest per frame: {best}-frame forwards (load average at start {load:.2f})")
    result = {"benchmark": "forward_cost", "ms_per_frame_by_forward_frames": figures, "cheapest_forward_frames": best,
              "load_average_start": round(load, 2), "cores": len(os.sched_getaffinity(0)), "git_commit": git_commit(),
              "versions": versions(("torch", "snac", "numpy"))}
    out = REPO_ROOT / "benchmarks" / "results" / "forward_cost-cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
