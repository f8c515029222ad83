"""The LLM tier's self-check, which `megapod doctor` runs: vLLM on this machine, frame-constrained, and how
fast it steps.

On a GPU the engine runs the Orpheus 3B architecture (its config ships here, weights are vLLM's
`dummy` random ones: nothing is downloaded) with the worker's own engine adapter and its default
attention (`auto`: vLLM's choice, FlashAttention 3 on Hopper); on CPU the tiny model. Both use the
tiny model's tokenizer, which has Orpheus's ids.

On a GPU, FlashInfer (with TRT-LLM attention on, then off) runs afterwards as comparisons, each with
the kernels its engine actually ran beside its figures. A comparison runs only where FlashInfer's
precompiled kernels are installed: without them vLLM 0.33 compiles FlashInfer's kernels at start-up
(minutes) or, with NVIDIA's artifactory out of reach, turns TRT-LLM attention off without an error
(`vllm/utils/flashinfer.py`: `has_nvidia_artifactory`, `supports_trtllm_attention`), so "on" and
"off" would time the same kernels. Where they are missing it is skipped, naming what to install.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import math
import os
import shutil
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

from .capacity import CapacityLimit, measured_curve, settled_limit
from .config import LlmServerConfig
from .engine import Sampling
from .engine.audio_tokens import frame_violations
from .engine.model_source import ORPHEUS_3B_CONFIG, resolve_model
from .engine.vllm import VllmEngine
from .speech.prompt import TOKENS_PER_SECOND, prompt_ids

STEP_BUDGET_MS = 1000.0 / TOKENS_PER_SECOND  # one token per step per stream keeps a stream real time
TEXT = "The quick brown fox jumps over the lazy dog, and the doctor listens to every frame."
KERNELS_INSTALL = "`vllm download-kernels` (vLLM's own command; it runs `python -m flashinfer download-kernels`)"


class PreflightError(RuntimeError):
    """The engine would compile kernels at start-up or run others than it asks for: said before it starts."""


@dataclasses.dataclass(frozen=True)
class AttentionComparison:
    """Attention settings timed beside the main run (LlmServerConfig's attention fields)."""

    name: str
    attention_backend: str
    trtllm_attention: str

    @property
    def settings(self) -> dict[str, str]:
        return {"attention_backend": self.attention_backend, "trtllm_attention": self.trtllm_attention}


GPU_COMPARISONS = (AttentionComparison("flashinfer+trtllm", "FLASHINFER", "on"),
                   AttentionComparison("flashinfer", "FLASHINFER", "off"))


@dataclasses.dataclass(frozen=True)
class LlmPlan:
    """What to run: the engine's settings, the batch sizes to time, the attention comparisons and the
    precisions timed beside the main run (name -> the settings that change, e.g. FP8 weights and KV cache)."""

    config: LlmServerConfig
    model_dir: str
    batches: tuple[int, ...]
    constrained_streams: int
    tokens_per_stream: int
    comparisons: tuple[AttentionComparison, ...] = ()
    precisions: tuple[tuple[str, Mapping[str, object]], ...] = ()


GPU_BATCHES = (1, 16, 64, 128, 256, 384, 512)


def plan(device: str, workdir: Path, cache_dir: str, quick: bool, engine: Mapping[str, object] | None = None,
         precisions: tuple[tuple[str, Mapping[str, object]], ...] = ()) -> LlmPlan:
    """The 3B architecture with dummy weights on a GPU, with `engine`'s settings (a deployed profile's batch,
    graph and token budget) and the worker's default attention, timed at every batch up to max_num_seqs, then
    again in each of `precisions`; the tiny model on CPU."""
    tiny = resolve_model("tiny", cache_dir)
    if device == "cpu":
        config = LlmServerConfig(device="cpu", model="tiny", cache_dir=cache_dir, enforce_eager=True,
                                 max_model_len=1024, max_num_seqs=16)
        return LlmPlan(config, tiny, (1, 4) if quick else (1, 4, 16), 4 if quick else 8, 49 if quick else 84)
    model_dir = workdir / "orpheus-3b-architecture"
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(ORPHEUS_3B_CONFIG, model_dir / "config.json")
    config = LlmServerConfig(**{"device": "cuda", "model": str(model_dir), "tokenizer": tiny, "load_format": "dummy",
                                "max_model_len": 2048, "max_num_seqs": 256, **(engine or {})})
    batches = tuple(b for b in GPU_BATCHES if b <= config.max_num_seqs)
    return LlmPlan(config, str(model_dir), batches, 64, 196, GPU_COMPARISONS, precisions)


def _installed(distribution: str) -> str | None:
    """A distribution's public version (no local `+cu130` part, as vLLM compares them), or None."""
    from packaging.version import Version

    try:
        return Version(importlib.metadata.version(distribution)).public
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_tag(cuda_version: str) -> str:
    return "cu" + "".join(cuda_version.split(".")[:2])


def missing_kernel_packages(cuda_version: str | None, env: Mapping[str, str]) -> str | None:
    """What FlashInfer lacks to run precompiled kernels here, and how to install it; None if nothing.

    vLLM 0.33's own test (`warn_if_flashinfer_kernels_missing`): flashinfer-cubin (unless
    VLLM_HAS_FLASHINFER_CUBIN=1) and, for torch built with CUDA >= 12.9, flashinfer-jit-cache, each of
    exactly flashinfer-python's version. `cuda_version` is torch.version.cuda.
    """
    from packaging.version import Version

    flashinfer = _installed("flashinfer-python")
    if flashinfer is None:
        return ("flashinfer-python is not installed (vLLM's GPU wheel depends on it: reinstall vllm), so vLLM "
                "has no FLASHINFER attention backend")
    wanted = [] if env.get("VLLM_HAS_FLASHINFER_CUBIN", "0") not in ("", "0") else ["flashinfer-cubin"]
    if cuda_version and Version(cuda_version) >= Version("12.9"):
        wanted.append("flashinfer-jit-cache")
    found = {name: _installed(name) for name in wanted}
    wrong = [name for name, got in found.items() if got != flashinfer]
    if not wrong:
        return None
    problems = "; ".join(_package_problem(name, found[name], flashinfer) for name in wrong)
    pins = " ".join(f"{name}=={flashinfer}" + (f"+{_cuda_tag(cuda_version)}" if name == "flashinfer-jit-cache" else "")
                    for name in wrong)
    return (f"{problems}: FlashInfer would compile its kernels at engine start (minutes) or, offline, vLLM turns "
            f"TRT-LLM attention off without an error. Install with {KERNELS_INSTALL}, or `pip install {pins}` "
            "(FlashInfer's wheel index has every version; PyPI may not)")


def _package_problem(name: str, got: str | None, flashinfer: str) -> str:
    return f"{name} not installed" if got is None else f"{name} {got} does not match flashinfer-python {flashinfer}"


def trtllm_unsupported(capability: tuple[int, int] | None) -> str | None:
    """Why this GPU has no TRT-LLM attention kernels in vLLM 0.33 (`supports_trtllm_attention`), or None:
    SM90 and SM12x have the XQA decode kernel, SM100/103 trtllm-gen for prefill and decode."""
    if capability is None:
        return "the GPU's compute capability could not be read"
    major, minor = capability
    if (major, minor) == (9, 0) or major in (10, 12):
        return None
    return f"vLLM runs TRT-LLM attention on SM90, SM100/103 and SM12x only; this GPU is SM{major}{minor}"


def preflight(config: LlmServerConfig, cuda_version: str | None, capability: tuple[int, int] | None,
              env: Mapping[str, str]) -> str | None:
    """Why an engine with `config` would not run the kernels it asks for on this machine, or would compile
    FlashInfer's at start-up (minutes, or a failed start offline), or None. FlashInfer runs in the engine for its
    attention backend, and for its fused sampler only where an operator turned that on again
    (VLLM_USE_FLASHINFER_SAMPLER: the worker turns it off on CUDA, engine/vllm.py)."""
    sampler = env.get("VLLM_USE_FLASHINFER_SAMPLER", "0") not in ("", "0")
    reasons = [missing_kernel_packages(cuda_version, env) if config.attention_backend == "FLASHINFER" or sampler
               else None,
               trtllm_unsupported(capability) if config.trtllm_attention == "on" else None]
    reasons = [r for r in reasons if r]
    return "; ".join(reasons) if reasons else None


def skip_reason(plan_: LlmPlan, comparison: AttentionComparison, cuda_version: str | None,
                capability: tuple[int, int] | None, env: Mapping[str, str]) -> str | None:
    """Why `comparison` cannot measure the kernels it names on this machine, or None."""
    return preflight(plan_.config.replace(**comparison.settings), cuda_version, capability, env)


def kernels_as_asked(comparison: AttentionComparison, engine: Mapping[str, object]) -> bool:
    """Whether the engine ran the backend and TRT-LLM decode kernel the comparison asked for."""
    backend = comparison.attention_backend
    backend_ok = backend.lower() == "auto" or backend in engine.get("backends", [])
    trtllm = engine.get("trtllm_decode", "none") != "none"
    return backend_ok and {"on": trtllm, "off": not trtllm}.get(comparison.trtllm_attention, True)


def _gpu_kernel_facts() -> tuple[str | None, tuple[int, int] | None]:
    """torch's CUDA version and GPU 0's compute capability (vLLM reads it through NVML: no CUDA context)."""
    import torch
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability()
    return torch.version.cuda, (capability.major, capability.minor) if capability is not None else None


async def _stream(engine: VllmEngine, prompt: list[int], sampling: Sampling, request_id: str) -> tuple[list[int], list[float]]:
    """A request's tokens and the time each arrived."""
    tokens: list[int] = []
    times: list[float] = []
    async for delta in engine.generate(prompt, sampling, request_id):
        now = time.perf_counter()
        tokens += delta
        times += [now] * len(delta)
    return tokens, times


def _prompt(engine_config: LlmServerConfig, plan_: LlmPlan) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine_config.tokenizer or plan_.model_dir)
    return prompt_ids(tokenizer, "tara", TEXT)


async def constraint_check(engine: VllmEngine, prompt: list[int], streams: int, tokens: int) -> dict[str, object]:
    """Concurrent frame-constrained streams: every token in its slot, end of speech only at a frame boundary."""
    runs = await asyncio.gather(*(
        _stream(engine, prompt, Sampling(max_tokens=tokens, seed=i), f"doctor-constraint-{i}") for i in range(streams)))
    violations = [(i, v) for i, (toks, _) in enumerate(runs) for v in frame_violations(toks)]
    generated = sum(len(toks) for toks, _ in runs)
    return {"ok": not violations and generated > 0, "streams": streams, "tokens": generated,
            "violations": violations[:10], "detail": f"{generated} tokens from {streams} concurrent streams, "
            f"{len(violations)} outside their frame slot"}


async def step_time_ms(engine: VllmEngine, prompt: list[int], batch: int, tokens: int, tries: int = 3) -> float:
    """Time per token of a stream while all `batch` streams decode together (the median over streams).
    Tokens arrive a frame at a time (audio_tokens.STREAM_INTERVAL), so it is a span over the tokens it brought.
    A run in which the streams never decoded together (on a CPU that other work starves, one can finish before
    the last is past its prefill: seen in `make test` beside other test runs) measures nothing: run again."""
    for _ in range(tries):
        if not math.isnan(ms := await _step_time_once(engine, prompt, batch, tokens)):
            return ms
    return ms


async def _step_time_once(engine: VllmEngine, prompt: list[int], batch: int, tokens: int) -> float:
    runs = await asyncio.gather(*(
        _stream(engine, prompt, Sampling(max_tokens=tokens, seed=1000 + i), f"doctor-step-{batch}-{i}") for i in range(batch)))
    start = max(times[0] for _, times in runs if times)  # every stream is past its prefill
    end = min(times[-1] for _, times in runs if times)  # none has finished yet
    per_token = []
    for _, times in runs:
        inside = [t for t in times if start <= t <= end]
        later = sum(1 for t in inside if t > inside[0]) if inside else 0  # tokens after the window's first arrival
        if later:
            per_token.append((inside[-1] - inside[0]) / later)
    return 1000.0 * statistics.median(per_token) if per_token else float("nan")


async def steady_step_time_ms(engine: VllmEngine, prompt: list[int], batch: int, tokens: int, rounds: int = 2) -> float:
    """Time per token of a stream while `batch` streams decode and new ones keep arriving, as in serving: `batch`
    lanes each run streams back to back, the first of lane i cut to (i + 1) / batch of `tokens`, so the lanes'
    new prompts are spread over the steps (about batch / tokens a step) instead of all in the first; the median
    over streams of their time per token while every lane is busy past its first stream. Uniform decode
    (step_time_ms) never carries a prompt beside the decodes; serving nearly always does."""
    async def lane(i: int) -> list[list[float]]:
        lengths = [max(1, round(tokens * (i + 1) / batch))] + [tokens] * rounds
        return [(await _stream(engine, prompt, Sampling(max_tokens=n, seed=5000 + i * 10 + k),
                               f"doctor-steady-{batch}-{i}-{k}"))[1] for k, n in enumerate(lengths)]

    lanes = await asyncio.gather(*(lane(i) for i in range(batch)))
    if not all(all(times) for runs in lanes for times in runs):
        return float("nan")
    start = max(runs[1][0] for runs in lanes)  # every lane past its first (staggering) stream
    end = min(runs[-1][-1] for runs in lanes)  # none has run out of streams
    per_token = []
    for times in (times for runs in lanes for times in runs[1:]):
        inside = [t for t in times if start <= t <= end]
        later = sum(1 for t in inside if t > inside[0]) if inside else 0
        if later:
            per_token.append((inside[-1] - inside[0]) / later)
    return 1000.0 * statistics.median(per_token) if per_token else float("nan")


def realtime_streams(step_ms: dict[int, float]) -> float:
    """Streams one engine keeps real time: where the step time reaches the budget, interpolated between
    the measured batch sizes; 0 when one stream is already too slow, the largest batch when none is."""
    points = sorted((b, ms) for b, ms in step_ms.items() if ms == ms)  # NaN: not measured
    if not points or points[0][1] > STEP_BUDGET_MS:
        return 0.0
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if t1 > STEP_BUDGET_MS:
            return b0 + (b1 - b0) * (STEP_BUDGET_MS - t0) / (t1 - t0)
    return float(points[-1][0])


def admission_settles_at(config: LlmServerConfig, step_ms: Mapping[int, float]) -> int | None:
    """The streams a worker with `config` admits once its capacity limit settles on an engine of these step
    times (capacity.settled_limit: the worker's own controller; its target pace, not real time itself);
    None when no step was timed. Past the largest batch timed the limit is not predicted."""
    try:
        curve = measured_curve(step_ms)
    except ValueError:
        return None
    ceiling = min(config.stream_ceiling, max(step_ms))
    limit = CapacityLimit(config.initial_streams, min(config.stream_floor, ceiling), ceiling, config.resolved_target_pace)
    return settled_limit(curve, limit)


async def run_engine(plan_: LlmPlan, config: LlmServerConfig, check_constraint: bool) -> dict[str, object]:
    """Start one engine with `config`, run the checks, stop it."""
    engine = VllmEngine(config, plan_.model_dir)
    started = time.perf_counter()
    await engine.start()
    result: dict[str, object] = {"engine": engine.describe(), "start_s": round(time.perf_counter() - started, 1)}
    try:
        prompt = _prompt(config, plan_)
        if check_constraint:
            result["frame_constraint"] = await constraint_check(engine, prompt, plan_.constrained_streams, plan_.tokens_per_stream)
        steps = {b: await step_time_ms(engine, prompt, b, plan_.tokens_per_stream) for b in plan_.batches}
        result["step_ms"] = {b: round(ms, 2) for b, ms in steps.items()}
        result["realtime_streams"] = round(realtime_streams(steps), 1)
        result["admission_settles_at"] = admission_settles_at(config, steps)
        steady = {b: await steady_step_time_ms(engine, prompt, b, plan_.tokens_per_stream) for b in plan_.batches}
        result["steady"] = {"step_ms": {b: round(ms, 2) for b, ms in steady.items()},
                            "realtime_streams": round(realtime_streams(steady), 1),
                            "admission_settles_at": admission_settles_at(config, steady)}
    finally:
        await engine.shutdown()
    return result


async def compare(plan_: LlmPlan, comparison: AttentionComparison, reason: str | None) -> dict[str, object]:
    """One comparison: skipped with `reason`, or its step times beside the kernels its engine ran."""
    entry: dict[str, object] = {"name": comparison.name, "settings": comparison.settings}
    if reason is not None:
        return {**entry, "skipped": reason}
    config = plan_.config.replace(**comparison.settings)
    try:
        measured = await run_engine(plan_, config, check_constraint=False)
    except Exception as exc:  # a comparison that cannot start leaves the main figures standing
        return {**entry, "failed": f"{type(exc).__name__}: {exc}"}
    return {**entry, **measured, "kernels_as_asked": kernels_as_asked(comparison, measured["engine"])}


async def time_precision(plan_: LlmPlan, name: str, settings: Mapping[str, object]) -> dict[str, object]:
    """The main run's engine with `settings` changed (an engine of its own), timed the same way."""
    entry: dict[str, object] = {"name": name, "settings": dict(settings)}
    try:
        return {**entry, **await run_engine(plan_, plan_.config.replace(**settings), check_constraint=False)}
    except Exception as exc:  # a precision that cannot start leaves the main figures standing
        return {**entry, "failed": f"{type(exc).__name__}: {exc}"}


async def check_llm(plan_: LlmPlan) -> dict[str, object]:
    """The engine as the worker runs it (attention auto), each precision the plan names, then each attention
    comparison that this machine can run. On a GPU the main engine is checked before it starts, as each
    comparison is: PreflightError where it would compile FlashInfer's kernels or not run those it asks for."""
    gpu = plan_.config.resolved_device != "cpu"
    cuda_version, capability = _gpu_kernel_facts() if gpu else (None, None)
    if gpu and (why := preflight(plan_.config, cuda_version, capability, os.environ)):
        raise PreflightError(f"the engine would not start as the worker runs it: {why}")
    main = await run_engine(plan_, plan_.config, check_constraint=True)
    main["precisions"] = [await time_precision(plan_, name, settings) for name, settings in plan_.precisions]
    if not gpu:
        return {**main, "attention_comparisons": [],
                "attention_note": "not applicable on CPU: vLLM's CPU backend has its own attention"}
    main["attention_comparisons"] = [
        await compare(plan_, c, skip_reason(plan_, c, cuda_version, capability, os.environ)) for c in plan_.comparisons]
    main["attention_note"] = ("step_ms above: attention auto (the worker's default), kernels in engine; each "
                              "comparison lists the kernels its own engine ran")
    return main
