"""Hostile socket clients: a flood of tiny messages on each socket door (issue 41), for the tests
(tests/test_socket_budget.py) and the benchmark (benchmarks/hostile.py) alike."""

from __future__ import annotations

import asyncio
import json
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from benchmarks.soak import cartesia_message

FLOOD = 100_000  # the flood; the server closes the socket long before
BUDGET_SAID = "over its budget"  # what every door's refusal says


# Each door's flood: (path, the first message if the protocol opens with one, the message sent over and over).
DOORS = {
    "cartesia": ("/tts/websocket", None, cartesia_message("flood", " ", more=True)),
    "elevenlabs": ("/v1/text-to-speech/tara/multi-stream-input?output_format=pcm_24000", None,
                   json.dumps({"text": " ", "context_id": "flood"})),
    "deepgram": ("/v1/speak?model=tara&encoding=linear16&sample_rate=24000", None, json.dumps({"type": "Speak", "text": " "})),
    "together": ("/v1/audio/speech/websocket?voice=tara", None,
                 json.dumps({"type": "input_text_buffer.append", "text": " "})),
    "baseten": ("/environments/production/websocket", json.dumps({"voice": "tara"}), " "),
    "vllm-omni": ("/v1/audio/speech/stream", json.dumps({"type": "session.config", "voice": "tara"}),
                  json.dumps({"type": "input.text", "text": " "})),
    "slng": ("/v1/bridges/unmute/tts/canopylabs/orpheus:en", json.dumps({"type": "init", "voice": "tara"}),
             json.dumps({"type": "text", "text": " "})),
}


def flood(url: str, first: str | None, message: str, count: int = FLOOD, within_s: float = 20.0
          ) -> tuple[int, int | None, list[str]]:
    """In a thread with a loop of its own (the server's loop is not the flooder's): send `message` as fast as the
    socket takes it until the server closes it (or `count` messages, or `within_s`); (messages sent, the close
    code, the text frames received)."""

    async def run() -> tuple[int, int | None, list[str]]:
        texts: list[str] = []
        async with connect(url, max_queue=None) as ws:
            async def read() -> None:
                try:
                    async for received in ws:
                        if isinstance(received, str):
                            texts.append(received)
                except ConnectionClosed:
                    pass

            reader = asyncio.create_task(read())
            sent = 0
            try:
                if first is not None:
                    await ws.send(first)
                deadline = time.monotonic() + within_s
                while sent < count and time.monotonic() < deadline:
                    await ws.send(message)
                    sent += 1
            except ConnectionClosed:
                pass
            try:  # a flood that ended within the server's patience may be left open: closed here then (1000)
                await asyncio.wait_for(asyncio.shield(reader), 5)
            except TimeoutError:
                await ws.close()
            await reader
            return sent, ws.close_code, texts

    return asyncio.run(run())


