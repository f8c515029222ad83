"""A trivial /v1/audio/speech: paced PCM chunks on an exact schedule, no model. For the client-headroom check.

Each response waits `--ttfa-ms`, then sends one frame of audio (2048 samples, 4096 bytes) every
85.33 ms / pace for `--audio-s` seconds. Everything the client measures beyond that schedule is
the client's (or this server's) own delay. Run as a process of its own, so its event loop is not
the client's:

    python benchmarks/concurrency_bench/fake_endpoint.py --port 8799
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from llm_server.speech.encoding import S16_BYTES as SAMPLE_BYTES, SAMPLE_RATE

FRAME_SAMPLES = 2048
FRAME_BYTES = FRAME_SAMPLES * SAMPLE_BYTES
FRAME_S = FRAME_SAMPLES / SAMPLE_RATE
# A loud square wave, so the client's first-audible detector fires on the first chunk.
FRAME = (b"\x00\x20" * 8 + b"\x00\xe0" * 8) * (FRAME_BYTES // 32)


def create_app(ttfa_s: float, audio_s: float, pace: float) -> FastAPI:
    app = FastAPI()
    frames = max(1, round(audio_s / FRAME_S))

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> StreamingResponse:
        await request.body()
        start = time.perf_counter() + ttfa_s

        async def pcm() -> AsyncIterator[bytes]:
            for k in range(frames):
                delay = start + k * FRAME_S / pace - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                yield FRAME

        return StreamingResponse(pcm(), media_type="audio/pcm")

    @app.get("/ready")
    async def ready() -> dict:
        return {"status": "ready"}

    return app


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttfa-ms", type=float, default=50.0)
    p.add_argument("--audio-s", type=float, default=4.0)
    p.add_argument("--pace", type=float, default=1.0)
    args = p.parse_args(argv)
    uvicorn.run(create_app(args.ttfa_ms / 1000, args.audio_s, args.pace), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
