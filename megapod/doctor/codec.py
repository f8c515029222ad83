"""The doctor's codec-tier checks: the decoder as a replica runs it, and how many streams it carries.

The runner warms up exactly as snac-server does (on a GPU: every CUDA Graph captured), a seeded
stream goes through it a frame at a time and must equal one eager decode of the whole sequence,
the step a graph captures runs under the sync detector, and steps of 1 frame per stream (the
regime of an LLM tier at capacity) are timed at several batch sizes.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from codec_contract.audio import FRAME_SAMPLES, FRAME_SECONDS
from megapod.sync_detector import host_syncs
from snac_server.codec_model import WARN_SNR_DB, build_decoder
from snac_server.noise import fold_seed
from snac_server.runner import DecoderRunner
from snac_server.session import StreamStep
from snac_server.streaming import OPEN_END, StreamingDecoder, flush_frames

TOLERANCE = 1e-4  # max |streamed - full decode| in fp32, the same bound the CPU tests hold
FRAME_BUCKETS = (1, 2, 4, 8, 16)


def _frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7)).astype(np.int32)


def _stream_through(runner: DecoderRunner, frames: np.ndarray, seed: int, steps: list[int]) -> np.ndarray:
    """Decode one stream (slot 0) in the given step sizes, flush included; its samples in order."""
    delay = runner.streaming.delay
    padded = np.concatenate([frames, np.zeros((flush_frames(delay), 7), np.int32)])
    out = np.zeros((len(padded) * FRAME_SAMPLES,), np.float32)
    fed = 0
    for n in steps:
        n = min(n, len(padded) - fed)
        if n == 0:
            break
        end = len(frames) if fed + n > len(frames) else OPEN_END
        row = StreamStep(0, padded[fed : fed + n], fed, end, seed, fed == 0)
        pcm: list[np.ndarray] = []
        runner.decode([row], lambda _, p: pcm.extend(p))
        start = fed * FRAME_SAMPLES - delay
        lo, hi = max(0, start), start + len(pcm[0])
        if hi > lo:
            out[lo:hi] = pcm[0][lo - start :]
        fed += n
    return out[: len(frames) * FRAME_SAMPLES]


def _time_steps(runner: DecoderRunner, batch: int, frames: int, repeats: int) -> float:
    """Seconds per step of `batch` streams advancing `frames` frames each (after one untimed step)."""
    rows = [StreamStep(i, _frames(frames, i), 0, OPEN_END, i, True) for i in range(batch)]
    runner.decode(rows, lambda *_: None)
    started = time.perf_counter()
    for r in range(repeats):
        rows = [StreamStep(i, row.codes, (r + 1) * frames, OPEN_END, i, False) for i, row in enumerate(rows)]
        runner.decode(rows, lambda *_: None)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def check_codec(device: str, quick: bool) -> dict[str, object]:
    """Warm-up (graphs), exactness, the sync detector, step timing, half-precision SNR."""
    batches = (1, 8) if device == "cpu" else (1, 8, 64)
    decoder = build_decoder("random-24khz", device, "float32", max(batches))
    streaming = StreamingDecoder(decoder, num_slots=max(batches))
    runner = DecoderRunner(decoder, streaming, max(batches), FRAME_BUCKETS, cuda_graphs=True)
    result: dict[str, object] = {"model": "random-24khz (SNAC 24 kHz architecture)", "dtype": "float32"}
    started = time.perf_counter()
    runner.bind_thread()
    runner.warm_up()
    result["warm_up"] = {"ok": True, "seconds": round(time.perf_counter() - started, 2),
                         "cuda_graphs": len(runner._graphs), "detail": "CUDA Graphs captured" if runner.use_graphs else
                         "eager (CUDA Graphs are GPU only)"}
    frames, seed = _frames(24, 7), 7
    reference = decoder.decode_full(frames, seed)
    diffs = {name: float(np.abs(_stream_through(runner, frames, fold_seed(seed), steps) - reference).max())
             for name, steps in (("1-frame steps", [1] * 40), ("mixed steps", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]))}
    result["streaming_equals_full_decode"] = {
        "ok": max(diffs.values()) <= TOLERANCE, "max_abs_diff": diffs, "tolerance": TOLERANCE,
        "detail": f"a seeded 24-frame stream through the {'graphs' if runner.use_graphs else 'eager decoder'} "
                  f"against one eager decode of the whole sequence",
    }
    args = [t.to(decoder.device) for t in (torch.tensor([0]), torch.zeros(1, 1, 7, dtype=torch.int64), torch.tensor([0]),
                                           torch.tensor([OPEN_END]), torch.tensor([1]), torch.tensor([False]))]
    findings = host_syncs(streaming, *args)
    result["step_never_syncs"] = {"ok": not findings, "findings": [str(f) for f in findings],
                                  "detail": "the captured step under megapod.sync_detector"}
    repeats = 2 if device == "cpu" else 20
    steps = {b: _time_steps(runner, b, 1, repeats) for b in batches}
    result["audio_s_per_s"] = {b: round(b * FRAME_SECONDS / s, 2) for b, s in steps.items()}
    result["step_ms"] = {b: round(1000 * s, 2) for b, s in steps.items()}
    result["realtime_streams"] = round(max(result["audio_s_per_s"].values()), 1)
    dtypes = ("bfloat16",) if device == "cpu" or quick else ("bfloat16", "float16")
    result["half_precision_snr_db"] = {dt: round(build_decoder("random-24khz", device, dt, 1).snr_db, 1) for dt in dtypes}
    result["half_precision_warn_below_db"] = WARN_SNR_DB
    return result
