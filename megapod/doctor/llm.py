"""The doctor's LLM-tier checks: vLLM on this machine, frame-constrained, and how fast it steps.

On a GPU the engine runs the Orpheus 3B architecture (its config ships here, weights are vLLM's
`dummy` random ones: nothing is downloaded) with the worker's own engine adapter and attention
settings; on CPU the tiny model. Both use the tiny model's tokenizer, which has Orpheus's ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import statistics
import time
from pathlib import Path

from llm_server.audio_tokens import frame_violations
from llm_server.config import LlmServerConfig
from llm_server.engine import Sampling
from llm_server.model_source import resolve_model
from llm_server.prompt import TOKENS_PER_SECOND, prompt_ids
from llm_server.vllm_engine import VllmEngine

ORPHEUS_3B_CONFIG = Path(__file__).with_name("orpheus-3b-config.json")
STEP_BUDGET_MS = 1000.0 / TOKENS_PER_SECOND  # one token per step per stream keeps a stream real time
TEXT = "The quick brown fox jumps over the lazy dog, and the doctor listens to every frame."


@dataclasses.dataclass(frozen=True)
class LlmPlan:
    """What to run: the engine's settings and the batch sizes to time."""

    config: LlmServerConfig
    model_dir: str
    batches: tuple[int, ...]
    constrained_streams: int
    tokens_per_stream: int


def plan(device: str, workdir: Path, cache_dir: str, quick: bool) -> LlmPlan:
    """The 3B architecture with dummy weights on a GPU, the tiny model on CPU."""
    tiny = resolve_model("tiny", cache_dir)
    if device == "cpu":
        config = LlmServerConfig(device="cpu", model="tiny", cache_dir=cache_dir, enforce_eager=True,
                                 max_model_len=1024, max_num_seqs=16)
        return LlmPlan(config, tiny, (1, 4) if quick else (1, 4, 16), 4 if quick else 8, 49 if quick else 84)
    model_dir = workdir / "orpheus-3b-architecture"
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(ORPHEUS_3B_CONFIG, model_dir / "config.json")
    config = LlmServerConfig(device="cuda", model=str(model_dir), tokenizer=tiny, load_format="dummy",
                             max_model_len=2048, max_num_seqs=256, attention_backend="FLASHINFER", trtllm_attention="on")
    return LlmPlan(config, str(model_dir), (1, 16, 64, 128, 256), 64, 196)


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


async def step_time_ms(engine: VllmEngine, prompt: list[int], batch: int, tokens: int) -> float:
    """Time per token of a stream while all `batch` streams decode together (the median over streams).
    Tokens arrive a frame at a time (STREAM_INTERVAL), so it is a span over the tokens it brought."""
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
    finally:
        await engine.shutdown()
    return result


async def check_llm(plan_: LlmPlan) -> dict[str, object]:
    """The engine as the worker runs it; on a GPU, the same batches again with TRT-LLM attention off."""
    main = await run_engine(plan_, plan_.config, check_constraint=True)
    if plan_.config.resolved_device == "cpu":
        main["trtllm_attention"] = "not applicable on CPU: vLLM's CPU backend has its own attention"
        return main
    off = await run_engine(plan_, dataclasses.replace(plan_.config, trtllm_attention="off"), check_constraint=False)
    main["trtllm_attention"] = {"on": main["step_ms"], "off": off["step_ms"], "off_engine": off["engine"]}
    return main
