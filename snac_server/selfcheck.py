"""The codec tier's self-check, which `megapod doctor` runs: the decoder as a replica runs it, and how many
streams it carries.

Needs only torch, numpy, snac, grpcio (+ health, reflection), protobuf and prometheus-client, so it
runs on a bare GPU node (deploy/gpu/first_contact.sh). In order, each part on its own (one that
raises is a failed check, the rest still run):

- warm-up exactly as snac-server's: the streaming step compiled on a GPU (compile_step auto), every CUDA Graph of
  the batch ladder x frame buckets and the reference window captured, with the seconds and the memory it took;
- a replayed graph (of the compiled step, on a GPU) against the eager forward (same inputs, same state rows), and
  a seeded stream fed in steps against one eager decode of the whole sequence;
- no host sync in the eager and the replayed step: the sync detector on any device, and on a GPU
  torch.cuda.set_sync_debug_mode("error"), which also sees the syncs inside C++ ops;
- steps timed at batch 1, 2, 4 ... max_batch for the streaming decoder (1 frame per stream) and the
  reference decoder (one 4-frame window per frame), in fp32 (and the eager step beside the compiled one),
  fp16 and bf16 with the eager step (with their SNR to fp32), and the precision a replica should run: the
  fastest, eager against eager, whose SNR to fp32 is at least SERVE_SNR_DB;
- a gRPC replica with snac-server's defaults on the device serving concurrent streams, each equal
  to a full decode.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from codec_contract.audio import FRAME_SAMPLES, FRAME_SECONDS
from orpheus_common.checks import failed
from orpheus_common.sync_detector import host_syncs

from .codec_model import WARN_SNR_DB, build_decoder
from .config import SnacServerConfig
from .noise import fold_seed
from .runner import REFERENCE_WINDOW, DecoderRunner
from .session import StreamStep, Window
from .streaming import OPEN_END, StreamingDecoder, flush_frames

log = logging.getLogger(__name__)
TOLERANCE = 1e-4  # max |streamed - full decode| in fp32, the same bound the CPU tests hold
FRAME_BUCKETS = SnacServerConfig.default("frame_buckets")
DEFAULT_MODEL = SnacServerConfig.default("model")  # random-24khz: the real architecture at its real cost
NOT_ON_CPU = "not measured: cpu"
MIB = 2**20
HALF_PRECISIONS = ("float16", "bfloat16")
# The quality bound of the precision the doctor recommends: the server's own warning level (codec_model.WARN_SNR_DB):
# fp16 measures ~58 dB to fp32 on SNAC 24 kHz, better than 8-bit linear PCM; bf16 ~39 dB, audible hiss in quiet passages.
SERVE_SNR_DB = WARN_SNR_DB


def _frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7)).astype(np.int32)


def _run(name: str, fn: Callable[[], dict]) -> dict:
    """One part's result, or what stopped it (the doctor reports what broke and goes on); logged at once,
    so it is in the log even if a later part hangs."""
    try:
        found = fn()
    except Exception as exc:
        found = failed(exc)
    log.info("%s: %s", name, json.dumps(found, default=str))
    return found


def _part(checks: dict[str, dict], name: str, fn: Callable[[], dict]) -> bool:
    """Run one check into `checks`; whether it passed."""
    checks[name] = _run(name, fn)
    return bool(checks[name].get("ok"))


def _runner(device: str, dtype: str, max_batch: int, buckets: tuple[int, ...], model: str,
            compile_step: bool | None = None) -> DecoderRunner:
    """A runner as a replica builds it: graphs, and the step compiled where snac-server's `auto` compiles it (a GPU)."""
    decoder = build_decoder(model, device, dtype, max_batch)
    if compile_step is None:
        compile_step = SnacServerConfig(device=device, compile_step="auto").compiled_step
    return DecoderRunner(decoder, StreamingDecoder(decoder, num_slots=max_batch), max_batch, buckets, cuda_graphs=True,
                         compile_step=compile_step)


def _mib(n_bytes: int) -> float:
    return round(n_bytes / MIB, 1)


def warm_up(runner: DecoderRunner) -> dict[str, object]:
    """Capture (GPU) or run (CPU) every shape, as a replica does at start-up, and what it cost."""
    on_gpu = runner.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reserved, allocated = (torch.cuda.memory_reserved(), torch.cuda.memory_allocated()) if on_gpu else (0, 0)
    started = time.perf_counter()
    runner.bind_thread()
    runner.warm_up()
    seconds = round(time.perf_counter() - started, 2)
    state = sum(t.numel() * t.element_size() for t in runner.streaming.state)
    result: dict[str, object] = {
        "ok": True, "seconds": seconds, "cuda_graphs": len(runner._graphs), "compiled_step": runner.compiled,
        "batch_ladder": list(runner.batch_sizes), "frame_buckets": list(runner.frame_buckets),
        "max_step_frames": runner.max_step_frames, "graph_ladders": runner.graph_ladders() if runner.use_graphs else NOT_ON_CPU,
        "reference_window": REFERENCE_WINDOW, "state_mib": _mib(state),
        "state_kib_per_stream": round(state / (runner.streaming.num_slots + 1) / 1024, 1),
        "detail": f"{len(runner._graphs)} CUDA Graphs captured in {seconds} s" if runner.use_graphs else
                  f"eager on {runner.device.type} (CUDA Graphs are GPU only), every shape run once in {seconds} s",
    }
    if on_gpu:  # the caching allocator's growth: the graphs' shared pool plus what warm-up left cached
        result["graph_pool_mib"] = _mib(torch.cuda.memory_reserved() - reserved)
        result["peak_allocated_mib"] = _mib(torch.cuda.max_memory_allocated() - allocated)
    else:
        result["graph_pool_mib"] = result["peak_allocated_mib"] = NOT_ON_CPU
    return result


def _step_inputs(runner: DecoderRunner, batch: int, step: int, fresh: bool) -> list[torch.Tensor]:
    rows = [StreamStep(i, _frames(1, 100 * step + i), step, OPEN_END, i, fresh) for i in range(batch)]
    return runner._stage("step", rows)


def graph_equals_eager(runner: DecoderRunner) -> dict[str, object]:
    """A replayed step against the eager forward from the same state rows, and the state each leaves;
    and a replayed reference window against the eager one. Batch 3 pads to a captured 4."""
    if not runner.use_graphs:
        return {"ok": True, "detail": NOT_ON_CPU, "max_abs_diff": NOT_ON_CPU}
    batch = min(3, runner.max_batch)
    for step in range(3):  # state rows that are not zeros
        runner._forward("step", 1, _step_inputs(runner, batch, step, step == 0))
    args = _step_inputs(runner, batch, 3, False)
    saved = [s.clone() for s in runner.streaming.state]
    replayed = runner._forward("step", 1, args).clone()
    after_graph = [s.clone() for s in runner.streaming.state]
    for buffer, old in zip(runner.streaming.state, saved):
        buffer.copy_(old)
    eager = runner.streaming(*(t.to(runner.device) for t in args))
    diffs = {"step audio": float((replayed - eager).abs().max()),
             "step state": max(float((a[:batch] - b[:batch]).abs().max()) for a, b in zip(after_graph, runner.streaming.state))}
    window = runner._stage("window", [Window(_frames(REFERENCE_WINDOW, i), 5, i) for i in range(batch)])
    diffs["window audio"] = float((runner._forward("window", REFERENCE_WINDOW, window)
                                   - runner.full(*(t.to(runner.device) for t in window))).abs().max())
    return {"ok": max(diffs.values()) <= TOLERANCE, "max_abs_diff": diffs, "tolerance": TOLERANCE,
            "detail": f"replayed graphs (batch {batch} padded to a captured size) against the eager forwards"}


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
        pcm: list[np.ndarray] = []
        runner.decode([StreamStep(0, padded[fed : fed + n], fed, end, seed, fed == 0)], lambda _, p: pcm.extend(p))
        start = fed * FRAME_SAMPLES - delay
        lo, hi = max(0, start), start + len(pcm[0])
        if hi > lo:
            out[lo:hi] = pcm[0][lo - start :]
        fed += n
    return out[: len(frames) * FRAME_SAMPLES]


def streaming_equals_full_decode(runner: DecoderRunner) -> dict[str, object]:
    frames, seed = _frames(24, 7), 7
    reference = runner.full.decode_full(frames, seed)
    diffs = {name: float(np.abs(_stream_through(runner, frames, fold_seed(seed), steps) - reference).max())
             for name, steps in (("1-frame steps", [1] * 40), ("mixed steps", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]))}
    return {"ok": max(diffs.values()) <= TOLERANCE, "max_abs_diff": diffs, "tolerance": TOLERANCE,
            "detail": f"a seeded 24-frame stream through the {'graphs' if runner.use_graphs else 'eager decoder'} "
                      f"against one eager decode of the whole sequence"}


def _cuda_syncs(fn: Callable[[], object]) -> str | None:
    """None if `fn` ran with torch.cuda.set_sync_debug_mode("error") on, else the error it raised."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def step_never_syncs(runner: DecoderRunner) -> dict[str, object]:
    """The step under the sync detector; on a GPU, the eager and the replayed step (inputs staged in
    pinned memory first, as decode does) under CUDA's own sync check."""
    eager_args = [t.to(runner.device) for t in _step_inputs(runner, 1, 0, True)]
    findings = [str(f) for f in host_syncs(runner.streaming, *eager_args)]
    result: dict[str, object] = {"detector_findings": findings}
    if runner.device.type == "cuda":  # the doctor's runners capture graphs wherever there is a GPU
        staged = _step_inputs(runner, min(3, runner.max_batch), 0, True)
        result["cuda_sync_debug"] = {"eager step": _cuda_syncs(lambda: runner.streaming(*eager_args)),
                                     "replayed step": _cuda_syncs(lambda: runner._forward("step", 1, staged))}
        ok = not findings and not any(result["cuda_sync_debug"].values())
    else:
        result["cuda_sync_debug"] = NOT_ON_CPU
        ok = not findings
    result.update(ok=ok, detail="orpheus_common.sync_detector on the step" + (
        "; torch.cuda.set_sync_debug_mode('error') on the eager and the replayed step" if runner.device.type == "cuda" else ""))
    return result


def _rows(kind: str, batch: int, r: int) -> list:
    if kind == "streaming":
        return [StreamStep(i, _frames(1, i), r, OPEN_END, i, r == 0) for i in range(batch)]
    return [Window(_frames(REFERENCE_WINDOW, i), r, i) for i in range(batch)]


def step_seconds(runner: DecoderRunner, kind: str, batch: int, repeats: int) -> float:
    """Median seconds of a decode (staging, copies, forward, PCM back) of `batch` streams advancing one frame:
    a 1-frame streaming step each, or a 4-frame reference window each (after one untimed step)."""
    runner.decode(_rows(kind, batch, 0), lambda *_: None)
    times = []
    for r in range(1, repeats + 1):
        rows = _rows(kind, batch, r)
        started = time.perf_counter()
        runner.decode(rows, lambda *_: None)  # ends with the PCM on the host: the step is done
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def speed(runner: DecoderRunner, repeats: int) -> dict[str, object]:
    """Per decoder: step ms and audio-seconds a second by batch, and the real-time streams the best batch carries."""
    out: dict[str, object] = {}
    for kind in ("streaming", "reference"):
        steps = {b: step_seconds(runner, kind, b, repeats) for b in runner.batch_sizes}
        audio = {b: round(b * FRAME_SECONDS / s, 3) for b, s in steps.items()}  # a slow CPU carries a fraction
        out[kind] = {"step_ms": {b: round(1000 * s, 3) for b, s in steps.items()}, "audio_s_per_s": audio,
                     "realtime_streams": max(audio.values())}
    return out


async def _serve_streams(config: SnacServerConfig, streams: int, frames: int) -> tuple[list[np.ndarray], DecoderRunner]:
    import grpc

    from codec_contract.api import codec_pb2_grpc
    from codec_contract.client import decode, header_request, paced_requests
    from .server import build_server

    server, port = build_server(config)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = codec_pb2_grpc.SnacCodecStub(channel)
            got = await asyncio.gather(*(decode(stub, paced_requests(header_request(s), _frames(frames, s), 1), 120)
                                         for s in range(streams)))
    finally:
        await server.stop(0)
    return [g.audio() for g in got], server.batcher._runner


def replica_serves(device: str, streams: int, quick: bool, model: str) -> dict[str, object]:
    """snac-server's defaults on the device (graphs captured at start-up), `streams` concurrent streams
    one frame a message, each stream's audio against one full decode of its frames."""
    frames = 8 if quick else 24
    config = SnacServerConfig(host="127.0.0.1", port=0, metrics_port=-1, device=device, model=model)
    on_gpu = config.resolved_device.startswith("cuda")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    audio, runner = asyncio.run(_serve_streams(config, streams, frames))
    diffs = [float(np.abs(a - runner.full.decode_full(_frames(frames, s), s)).max()) if len(a) == frames * FRAME_SAMPLES
             else float("inf") for s, a in enumerate(audio)]
    memory: dict[str, object] = {"peak_reserved_mib": NOT_ON_CPU, "process_gpu_mib": NOT_ON_CPU}
    if on_gpu:  # what one replica takes from a shared GPU: torch's pool at its peak, and all of it (context too)
        free, total = torch.cuda.mem_get_info()
        memory = {"peak_reserved_mib": _mib(torch.cuda.max_memory_reserved()), "process_gpu_mib": _mib(total - free),
                  "gpu_total_mib": _mib(total), "max_streams": config.max_streams}
    return {"ok": max(diffs) <= TOLERANCE, "streams": streams, "frames_per_stream": frames, "max_abs_diff": max(diffs),
            "tolerance": TOLERANCE, "seconds": round(time.perf_counter() - started, 1), "memory": memory,
            "detail": f"a replica with snac-server's defaults (max_batch {config.max_batch}) served {streams} concurrent "
                      f"gRPC streams; each against one full decode"}


def half_precision(device: str, dtype: str, max_batch: int, repeats: int, model: str) -> dict[str, object]:
    """fp16's or bf16's SNR to fp32; on a GPU its speed, on graphs of the timed shapes only (1-frame steps, windows),
    with the eager step: compared with fp32's eager step (a compile per precision would take minutes of the doctor)."""
    runner = _runner(device, dtype, max_batch, (1,), model, compile_step=False)
    found: dict[str, object] = {"snr_db_to_fp32": round(runner.full.snr_db, 1)}
    if not runner.use_graphs:  # CPUs without bf16 units emulate it (~40x slower here): a figure of no use to anyone
        return {**found, "speed": NOT_ON_CPU}
    runner.bind_thread()
    runner.warm_up()
    return {**found, **speed(runner, repeats)}


def eager_speed(device: str, max_batch: int, repeats: int, model: str) -> dict[str, object]:
    """fp32 with the step not compiled, beside the compiled figures (a GPU's: a CPU's step is eager already)."""
    if not device.startswith("cuda"):
        return {"speed": NOT_ON_CPU}
    runner = _runner(device, "float32", max_batch, (1,), model, compile_step=False)
    runner.bind_thread()
    runner.warm_up()
    return {"streaming": speed(runner, repeats)["streaming"]}


def chosen_precision(figures: dict[str, object]) -> dict[str, object]:
    """The fastest precision whose SNR to fp32 is at least SERVE_SNR_DB, by its streaming real-time streams with the
    eager step, like against like (fp32 where no half precision was timed: a CPU's, or one whose timing failed)."""
    def streams(dtype: str) -> float:
        found = figures.get("float32_eager" if dtype == "float32" else dtype, {})
        return found.get("streaming", {}).get("realtime_streams", 0.0) if isinstance(found, dict) else 0.0

    fit = ["float32"] + [d for d in HALF_PRECISIONS if figures.get(d, {}).get("snr_db_to_fp32", 0) >= SERVE_SNR_DB]
    best = max(fit, key=lambda d: (streams(d), d == "float32"))
    return {"dtype": best, "snr_bound_db": SERVE_SNR_DB, "realtime_streams": streams(best) or NOT_ON_CPU,
            "detail": "the fastest precision within the SNR bound (snac-server --dtype)"}


def _free_device_memory() -> None:
    """Give back what a dropped runner held (its graphs' pool too), so the next part starts from empty."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def check_codec(device: str, max_batch: int, quick: bool, model: str = DEFAULT_MODEL) -> tuple[dict[str, dict], dict[str, object]]:
    """Every codec check (name -> result with `ok`) and figure of `model` (snac-server's --model: by
    default the SNAC 24 kHz architecture with random weights), fp32 first, then bf16, then a replica."""
    checks: dict[str, dict] = {}
    figures: dict[str, object] = {"model": model, "max_batch": max_batch}
    repeats = 3 if device == "cpu" else 20
    runner = None
    try:
        runner = _runner(device, "float32", max_batch, FRAME_BUCKETS, model)
    except Exception as exc:  # the decoder could not even be built
        checks["codec_warm_up"] = failed(exc)
    if runner is not None and _part(checks, "codec_warm_up", lambda: warm_up(runner)):
        _part(checks, "codec_graph_equals_eager", lambda: graph_equals_eager(runner))
        _part(checks, "codec_streaming_equals_full_decode", lambda: streaming_equals_full_decode(runner))
        _part(checks, "codec_step_never_syncs", lambda: step_never_syncs(runner))
        figures["float32"] = _run("float32", lambda: speed(runner, repeats))  # a figure: it fails no check
    runner = None
    _free_device_memory()
    figures["float32_eager"] = _run("float32_eager", lambda: eager_speed(device, max_batch, repeats, model))
    _free_device_memory()
    for dtype in HALF_PRECISIONS:
        figures[dtype] = _run(dtype, lambda: half_precision(device, dtype, max_batch, repeats, model))
        _free_device_memory()
    figures["half_precision_warn_below_db"] = WARN_SNR_DB
    figures["chosen_precision"] = chosen_precision(figures)
    _part(checks, "codec_replica_serves", lambda: replica_serves(device, 2 if quick else 16, quick, model))
    return checks, figures
