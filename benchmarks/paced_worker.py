"""A test double of an llm-server worker for the front's tests and its benchmark (front_relay.py): every speech POST
gets CHUNKS chunks of silent PCM, one every INTERVAL_S, and /stats says how its streams ended: `whole` (every
chunk sent) or `cut` (the connection closed before the last), and the most streams it held at once (`peak`). POST
/hold {"streams": N} makes every stream wait after its first chunk until N are open at once (0: no wait): a
client's N concurrent streams then end only if all N reached the worker together, whatever the machine's speed.
POST /ready_mode {"hung": true} makes /ready never answer, as a hung worker's (false: answer again); /stats
counts the /ready requests it got (`probes`). Run as `python -m benchmarks.paced_worker PORT`."""

from __future__ import annotations

import asyncio
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

CHUNKS, INTERVAL_S, CHUNK_BYTES = 30, 0.1, 4800  # 3 s of 24 kHz s16 audio, 0.1 s a chunk
SPEECH_PATHS = ("/v1/audio/speech", "/tts/bytes", "/v1/speak")
stats = {"active": 0, "started": 0, "whole": 0, "cut": 0, "peak": 0, "probes": 0}
ready_mode = {"hung": False, "answer": asyncio.Event()}  # answer: set when hung ends, so no probe is left waiting
hold = {"streams": 0, "all_open": asyncio.Event()}


class CountedStream(StreamingResponse):
    """Counts a stream `whole` when its last chunk went out, else `cut` (Starlette stops the body when
    the client disconnects: uvicorn's httptools protocol speaks ASGI 2.3)."""

    def __init__(self) -> None:
        self.sent = 0
        super().__init__(self._pcm(), media_type="audio/pcm")

    async def _pcm(self):
        for i in range(CHUNKS):
            if i:
                await asyncio.sleep(INTERVAL_S)
            yield b"\0" * CHUNK_BYTES
            self.sent += 1
            if i == 0 and hold["streams"]:
                await hold["all_open"].wait()

    async def __call__(self, scope, receive, send) -> None:
        stats["active"] += 1
        stats["started"] += 1
        stats["peak"] = max(stats["peak"], stats["active"])
        if hold["streams"] and stats["active"] >= hold["streams"]:
            hold["all_open"].set()
        try:
            await super().__call__(scope, receive, send)
        finally:
            stats["active"] -= 1
            stats["whole" if self.sent == CHUNKS else "cut"] += 1


async def speech(request) -> StreamingResponse:
    await request.body()
    return CountedStream()


async def ready(request) -> JSONResponse:
    stats["probes"] += 1
    if ready_mode["hung"]:
        await ready_mode["answer"].wait()  # no answer while hung: its client times out
    return JSONResponse({"status": "ready"})


async def set_ready_mode(request) -> JSONResponse:
    ready_mode["hung"] = bool((await request.json())["hung"])
    if ready_mode["hung"]:
        ready_mode["answer"] = asyncio.Event()
    else:
        ready_mode["answer"].set()  # the probes still waiting answer now: none holds the shutdown up
    return JSONResponse({"hung": ready_mode["hung"]})


async def report(request) -> JSONResponse:
    return JSONResponse(stats)


async def set_hold(request) -> JSONResponse:
    hold["streams"] = int((await request.json())["streams"])
    hold["all_open"] = asyncio.Event()
    stats["peak"] = stats["active"]
    return JSONResponse({"streams": hold["streams"]})


app = Starlette(routes=[*(Route(p, speech, methods=["POST"]) for p in SPEECH_PATHS), Route("/ready", ready),
                        Route("/stats", report),
                        Route("/hold", set_hold, methods=["POST"]), Route("/ready_mode", set_ready_mode, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
