"""An LLM worker in-process for fast edge tests: the real app, Runtime, codec client, snac server and
uvicorn on loopback; only the engine and the tokenizer are test doubles (they need no model).

Also how to tell that nothing of any stream is left: admission slots, the active-streams gauge, the
engine's live generators, the codec tier's streams and this loop's tasks.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import uvicorn

from llm_server.api import create_app
from llm_server.config import LlmServerConfig
from llm_server.engine import Adapter, EngineError, Sampling
from llm_server.engine.audio_tokens import END_OF_SPEECH, code_to_token
from llm_server.runtime import Runtime, codec_client_config
from llm_server.speech.codec_client import CodecClient
from orpheus_common.fair_websockets import FairWebSocketProtocol

FRAME_BYTES = 2048 * 2  # s16 samples per frame
BYTES_PER_SECOND = 24000 * 2

class ScriptedEngineDouble:
    """A test double of the Engine protocol: valid audio-token batches, fast (faster than real
    time, like a GPU), `frames` per request whatever the token budget, and a scripted failure
    after `fail_after_frames`, once `fail_gate` is set (by a test that has seen audio arrive)."""

    def __init__(self, frames: int = 48, frames_per_batch: int = 2, batch_delay_s: float = 0.002,
                 fail_after_frames: int | None = None, loop_after: int | None = None, loop_period: int = 4,
                 end_of_speech: bool = True, prefill_s: float = 0.0) -> None:
        self.frames = frames
        self.prefill_s = prefill_s  # before a request's first batch, as a long prompt's prefill
        self.frames_per_batch = frames_per_batch
        self.batch_delay_s = batch_delay_s
        self.fail_after_frames = fail_after_frames
        self.fail_gate = asyncio.Event()
        self.loop_after, self.loop_period = loop_after, loop_period  # then one block of frames, over and over
        self.end_of_speech = end_of_speech  # False: generation stops at `frames` without it (a spent budget)
        self.live = 0  # generators started and not yet finalized
        self.prompts: dict[str, list[int]] = {}  # request id -> the prompt it was given
        self.adapters: dict[str, Adapter | None] = {}  # request id -> the LoRA adapter it was given
        self.loaded: list[Adapter] = []  # adapters load_adapter took, in order
        self.unloadable: set[str] = set()  # paths load_adapter refuses, as an engine refuses a broken adapter

    async def start(self) -> None:
        pass

    async def load_adapter(self, adapter: Adapter) -> None:
        if adapter.path in self.unloadable:
            raise EngineError(f"scripted refusal of {adapter.path}")
        self.loaded.append(adapter)

    async def generate(self, prompt_ids: list[int], sampling: Sampling, request_id: str, adapter: Adapter | None = None):
        self.live += 1
        self.prompts[request_id] = list(prompt_ids)
        self.adapters[request_id] = adapter
        rng = random.Random(request_id)
        try:
            await asyncio.sleep(self.prefill_s)
            sent = 0
            while sent < self.frames:
                if self.fail_after_frames is not None and sent >= self.fail_after_frames:
                    await self.fail_gate.wait()
                    raise EngineError("scripted engine failure")
                n = min(self.frames_per_batch, self.frames - sent)
                await asyncio.sleep(self.batch_delay_s)
                yield [code_to_token(self._code(rng, sent + i, slot), slot) for i in range(n) for slot in range(7)]
                sent += n
            if self.end_of_speech:
                yield [END_OF_SPEECH]
        finally:
            self.live -= 1

    def _code(self, rng: random.Random, frame: int, slot: int) -> int:
        if self.loop_after is not None and frame >= self.loop_after:
            return (frame - self.loop_after) % self.loop_period * 7 + slot  # the block's frames differ, then repeat
        return rng.randrange(4096)

    async def abort(self, request_id: str) -> None:
        pass

    def num_unfinished(self) -> int:
        return self.live

    def describe(self) -> dict[str, object]:
        return {"engine": "scripted test double"}

    async def shutdown(self) -> None:
        pass


class CharTokenizerDouble:
    """A tokenizer test double: one id per character (the prompt's content does not matter here)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1000 + ord(c) % 1000 for c in text]


@dataclass
class Served:
    url: str
    port: int
    runtime: Runtime
    engine: ScriptedEngineDouble
    app: object  # the ASGI app uvicorn serves

    def outcome(self, outcome: str) -> float:
        value = self.runtime.metrics.registry.get_sample_value("orpheus_requests_total", {"outcome": outcome})
        return value or 0.0


@asynccontextmanager
async def serving(snac_server, engine: ScriptedEngineDouble | None = None, sndbuf: int = 0, model_dir: str | None = None,
                  tls_poll_s: float = 0.2, **overrides):
    """The real app over a real Runtime (engine double) under uvicorn, in this event loop; its codec
    client goes to `snac_server` unless `snac=` says otherwise; `model_dir`: the checkpoint's directory,
    for what the worker reads there besides the weights (its voices.json). Over TLS when the overrides give
    ssl_certfile/ssl_keyfile, as the worker serves it, its files looked at every `tls_poll_s`."""
    # A fixed limit (min_streams = max_streams) unless a test asks otherwise: the engine double's pace is no GPU's.
    overrides.setdefault("max_streams", 64)
    overrides.setdefault("min_streams", overrides["max_streams"])
    overrides.setdefault("admission_queue_s", 0.0)  # refused at once past the limit, unless a test asks for the queue
    config = LlmServerConfig(host="127.0.0.1", port=0, **{"snac": snac_server.address, **overrides})
    engine = engine or ScriptedEngineDouble()
    runtime = Runtime.assemble(config, engine, CodecClient(codec_client_config(config)), CharTokenizerDouble(), model_dir)
    app = create_app(config, runtime)
    async with serve_app(app, sndbuf, log_level="info", timeout_graceful_shutdown=2,
                         **config.uvicorn_settings(tls_poll_s)) as port:
        yield Served(f"{config.scheme}://127.0.0.1:{port}", port, runtime, engine, app)


@asynccontextmanager
async def serve_app(app, sndbuf: int = 0, **config):
    """Any ASGI app served by uvicorn (`config`: more of its settings; WebSockets as the stack's servers take them)
    on a free loopback port, in this event loop: yields the port."""
    sock = socket.socket()
    if sndbuf:  # inherited by accepted connections: a small send buffer, no autotuning
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, **{"ws": FairWebSocketProtocol, **config}))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


def ws_url(served: Served, path: str) -> str:
    return served.url.replace("http", "ws", 1) + path  # https: wss


def body(text: str = "Hello there.", **kw) -> dict:
    return {"model": "tts-1", "input": text, "voice": "tara", "response_format": "pcm", **kw}


def cartesia(context_id: str, transcript: str, more: bool = True, **extra) -> str:
    """One Cartesia WebSocket message: a context's text (`more`: the context stays open), raw PCM at 24 kHz."""
    message = {"transcript": transcript, "continue": more, "context_id": context_id, "model_id": "sonic-3",
               "voice": {"mode": "id", "id": "tara"},
               "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}, **extra}
    return json.dumps(message)


def pending_tasks() -> set[asyncio.Task]:
    """Unfinished tasks of this loop, less the snac server's own (grpc.aio keeps spare call
    tasks and the codec client's health watch there; its Decode streams are counted apart)."""
    return {t for t in asyncio.all_tasks() if not t.done() and not _grpc_server_task(t)}


def _grpc_server_task(task: asyncio.Task) -> bool:
    frames = task.get_stack(limit=1)
    return bool(frames) and "aio/server.pyx" in frames[0].f_code.co_filename


async def settled(served: Served, snac_server, baseline: set[asyncio.Task], within_s: float = 10.0,
                  count_tasks: bool = True) -> dict:
    """Wait until nothing of any stream is held; returns the readings (all zero when settled).
    `count_tasks=False` while a client socket is still open: its handler is rightly alive."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        leaked = pending_tasks() - baseline - {asyncio.current_task()}
        readings = {
            "admission": served.runtime.admission.active,
            "per_key": sum(served.runtime.admission.active_per_key.values()),
            "listeners": len(served.runtime.admission.listeners),
            "active_streams": served.runtime.metrics.registry.get_sample_value("orpheus_active_streams"),
            "engine_generators": served.engine.live,
            "codec_streams": snac_server.service.active,
            "tasks": len(leaked) if count_tasks else 0,
        }
        if not any(readings.values()) or loop.time() > deadline:
            if leaked and count_tasks:
                readings["leaked"] = [repr(t.get_coro()) for t in leaked]
            return readings
        await asyncio.sleep(0.05)  # the server runs on this loop: let it work


NOTHING_HELD = {k: 0 for k in ("admission", "per_key", "listeners", "active_streams", "engine_generators", "codec_streams",
                                "tasks")}


async def baseline(served: Served, snac_server) -> set[asyncio.Task]:
    """Tasks that belong to the server itself, taken after one short request warmed every channel up."""
    frames, served.engine.frames = served.engine.frames, 8
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            assert (await client.post("/v1/audio/speech", json=body())).status_code == 200
    finally:
        served.engine.frames = frames
    await asyncio.sleep(0.3)
    return pending_tasks()
