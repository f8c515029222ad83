"""SLNG's Unmute Bridge door (llm_server/doors/slng.py, issue 46): the messages LiveKit's slng.TTS sends (init, text,
flush; close) and reads (ready, audio_chunk, flushed, done, error), at the path the plugin builds for
canopylabs/orpheus:en, on the worker and through the front; clear, cancel and a closed socket are barge-ins that free
everything at once; hostile input gets the Bridge's `error` (and a close before an init is in force) with nothing
held."""

from __future__ import annotations

import base64
import json

import pytest
from served import (
    FRAME_BYTES,
    NOTHING_HELD,
    CharTokenizerDouble,
    ScriptedEngineDouble,
    baseline,
    serve_app,
    serving,
    settled,
    ws_url,
)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from llm_server.speech.prompt import prompt_ids
from orpheus_front.front import create_front_app

FRAMES = 4
PATH = "/v1/bridges/unmute/tts/canopylabs/orpheus:en"
# What the plugin sends first (gateway_adapter.build_tts_init_payload).
INIT = {"type": "init", "model": "canopylabs/orpheus:en", "voice": "leo", "language": "en",
        "config": {"language": "en", "encoding": "linear16", "sample_rate": 24000, "speed": 1.0}}


def text(piece: str) -> str:
    return json.dumps({"type": "text", "text": piece})


FLUSH = json.dumps({"type": "flush"})


async def until(ws, kind: str, count: int = 1) -> tuple[list[dict], bytes]:
    """Every event until the `count`th of type `kind`, inclusive, and the audio of the audio_chunks among them."""
    events = []
    while sum(e["type"] == kind for e in events) < count:
        events.append(json.loads(await ws.recv()))
    return events, b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "audio_chunk")


async def opened(ws, init: dict = INIT) -> dict:
    await ws.send(json.dumps(init))
    ready = json.loads(await ws.recv())
    assert ready["type"] == "ready" and ready["session_id"]
    return ready


async def test_flushes_are_spoken_in_order_each_answered_with_flushed_and_close_ends_with_done(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH), additional_headers={"X-API-Key": "unused"}) as ws:
            await opened(ws)
            for message in (text("Hello "), text("there. How are "), text("you?"), FLUSH, FLUSH, text("Bye."),
                            json.dumps({"type": "keepalive"}), json.dumps({"type": "close"})):
                await ws.send(message)
            events, audio = await until(ws, "done")
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 1000 and len(audio) == 3 * FRAMES * FRAME_BYTES
        assert [e["type"] for e in events if e["type"] != "audio_chunk"] == ["flushed", "flushed", "flushed", "done"]
        chunks = [e["sequence"] for e in events if e["type"] == "audio_chunk"]
        assert chunks == list(range(1, len(chunks) + 1))
        assert events[-1]["duration"] == pytest.approx(3 * FRAMES * 2048 / 24000, abs=0.002)
        tok = CharTokenizerDouble()
        assert sorted(p for p in served.engine.prompts.values() if p != prompt_ids(tok, "tara", "Hello there.")) == \
            sorted(prompt_ids(tok, "leo", t) for t in ("Hello there.", "How are you?", "Bye."))
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_the_init_s_encoding_and_rate_are_what_comes_back(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        async with connect(ws_url(served, PATH)) as ws:
            await opened(ws, {**INIT, "config": {"encoding": "mulaw", "sample_rate": 8000}})
            await ws.send(text("Telephone."))
            await ws.send(FLUSH)
            _, audio = await until(ws, "flushed")
        assert abs(len(audio) - FRAMES * 2048 / 3) <= 8  # one byte a sample at a third of the rate (soxr's edges)


@pytest.mark.parametrize("stop, answer", [("clear", "cleared"), ("cancel", None)])
async def test_clear_and_cancel_stop_the_audio_at_once_and_free_everything(snac_server, stop, answer):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, batch_delay_s=0.01)) as served:
        quiet = await baseline(served, snac_server)
        before = served.outcome("cancelled")
        async with connect(ws_url(served, PATH)) as ws:
            await opened(ws)
            await ws.send(text("A long answer the user talks over."))
            await ws.send(FLUSH)
            await until(ws, "audio_chunk")
            await ws.send(json.dumps({"type": stop}))
            if answer is None:  # cancel: the socket closes
                with pytest.raises(ConnectionClosed):
                    while True:
                        await ws.recv()
                assert ws.close_code == 1000
            else:  # clear: said, and the socket takes the next turn
                await until(ws, answer)
                served.engine.frames, served.engine.batch_delay_s = FRAMES, 0.0
                await ws.send(text("Next turn."))
                await ws.send(FLUSH)
                _, audio = await until(ws, "flushed")
                assert len(audio) == FRAMES * FRAME_BYTES
        assert served.outcome("cancelled") == before + 1
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_closing_the_socket_mid_speech_is_a_barge_in_through_the_front_too(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, batch_delay_s=0.01)) as served, \
            serve_app(create_front_app([served.url])) as front_port:
        quiet = await baseline(served, snac_server)
        for url in (ws_url(served, PATH), f"ws://127.0.0.1:{front_port}{PATH}"):
            before = served.outcome("disconnected")
            async with connect(url) as ws:
                await opened(ws)
                await ws.send(text("A long answer the user talks over."))
                await ws.send(FLUSH)
                await until(ws, "audio_chunk")
            assert await settled(served, snac_server, quiet) == NOTHING_HELD, url
            assert served.outcome("disconnected") == before + 1, url


async def test_through_the_front_it_speaks(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served, \
            serve_app(create_front_app([served.url])) as front_port:
        async with connect(f"ws://127.0.0.1:{front_port}{PATH}") as ws:
            await opened(ws)
            await ws.send(text("Through the front."))
            await ws.send(FLUSH)
            _, audio = await until(ws, "flushed")
        assert len(audio) == FRAMES * FRAME_BYTES


@pytest.mark.parametrize("first, said", [
    ("{not json", "Expecting property name"),
    (b"\x00\x01", "the first message is init"),
    (text("Hi."), "the first message must be init"),
    (json.dumps({**INIT, "voice": "thalia"}), "unknown voice 'thalia'"),
    (json.dumps({**INIT, "config": {"encoding": "opus"}}), "encoding 'opus' is not one of"),
    (json.dumps({**INIT, "config": {"sample_rate": 12345}}), "sample_rate 12345"),
    (json.dumps({**INIT, "config": {"speed": 1.3}}), "speed other than 1"),
    (json.dumps({**INIT, "config": "fast"}), "config must be an object"),
], ids=["not-json", "binary", "text-first", "unknown-voice", "encoding", "rate", "speed", "config-not-object"])
async def test_a_bad_init_gets_a_config_error_and_a_close_with_nothing_held(snac_server, first, said):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(first)
            error = json.loads(await ws.recv())
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert error["type"] == "error" and error["code"] == "config_error" and said in error["message"]
        assert ws.close_code == 1008
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


@pytest.mark.parametrize("message, said", [
    ("[1]", "a message must be a JSON object"),
    (b"\x00", "binary frames are not part of this protocol"),
    (json.dumps({"type": "text", "text": ["a"]}), "text needs text (a string)"),
    (json.dumps({"type": "speak", "text": "a"}), "unknown message type 'speak'"),
    (text("x" * 4000) + "|" + text("y" * 200), "over 4096 characters before a flush"),
], ids=["not-object", "binary", "text-not-string", "unknown-type", "too-long"])
async def test_hostile_input_after_init_gets_an_error_and_the_socket_lives_on(snac_server, message, said):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await opened(ws)
            for part in (message.split("|") if isinstance(message, str) else [message]):
                await ws.send(part)
            error = json.loads(await ws.recv())
            assert error == {"type": "error", "code": "invalid_request", "message": error["message"]}
            assert said in error["message"]
            await ws.send(FLUSH)  # whatever was accepted before the refusal ends here
            await until(ws, "flushed")
            await ws.send(text("Still here."))
            await ws.send(FLUSH)
            _, audio = await until(ws, "flushed")
        assert len(audio) == FRAMES * FRAME_BYTES
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_keys_are_taken_as_the_plugin_sends_them(snac_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("agent:slng-key-0001\n")
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), api_keys_file=str(keys)) as served:
        sent = {"Authorization": "Bearer slng-key-0001", "X-API-Key": "slng-key-0001"}  # both, as the plugin does
        async with connect(ws_url(served, PATH), additional_headers=sent) as ws:
            await opened(ws)
            await ws.send(text("Hi."))
            await ws.send(FLUSH)
            _, audio = await until(ws, "flushed")
        assert len(audio) == FRAMES * FRAME_BYTES
        with pytest.raises(InvalidStatus, match="403"):
            async with connect(ws_url(served, PATH), additional_headers={"Authorization": "Bearer wrong-key-0001"}):
                pass
