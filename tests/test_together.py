"""The Together-compatible door (llm_server/doors/together.py, issue 27): the events Pipecat's TogetherTTSService sends
(session update, append, commit, clear) and those it reads (session.created, audio deltas, done, errors); the clear
is a cancel that frees everything at once; hostile input gets an `error` event and the socket lives on."""

from __future__ import annotations

import base64
import json

import pytest
from served import FRAME_BYTES, NOTHING_HELD, CharTokenizerDouble, ScriptedEngineDouble, baseline, serving, settled, ws_url
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from llm_server.speech.prompt import prompt_ids

FRAMES = 4
PATH = "/v1/audio/speech/websocket?model=canopylabs/orpheus-3b-0.1-ft&voice=tara&language=en"


def append(text: str) -> str:
    return json.dumps({"type": "input_text_buffer.append", "text": text})


COMMIT = json.dumps({"type": "input_text_buffer.commit"})
CLEAR = json.dumps({"type": "input_text_buffer.clear"})


async def events_until(ws, kind: str, count: int = 1) -> list[dict]:
    """Every event until the `count`th of type `kind`, inclusive."""
    events = []
    while sum(e["type"] == kind for e in events) < count:
        events.append(json.loads(await ws.recv()))
    return events


def audio(events: list[dict], item_id: str | None = None) -> bytes:
    return b"".join(base64.b64decode(e["delta"]) for e in events
                    if e["type"] == "conversation.item.audio_output.delta" and item_id in (None, e["item_id"]))


async def test_committed_items_are_spoken_in_order_as_deltas_then_done(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created" and created["session"]["voice"] == "tara"
            await ws.send(json.dumps({"type": "tts_session.updated", "session": {"voice": "leo"}}))
            assert json.loads(await ws.recv()) == {"type": "session.updated", "session": {"voice": "leo"}}
            for message in (append("Hello "), append("there."), COMMIT, append("And you?"), COMMIT):
                await ws.send(message)
            events = await events_until(ws, "conversation.item.audio_output.done", 2)
        received = [e for e in events if e["type"] == "conversation.item.input_text.received"]
        assert [e["text"] for e in received] == ["Hello there.", "And you?"]
        first, second = (e["item_id"] for e in received)
        done = [e["item_id"] for e in events if e["type"] == "conversation.item.audio_output.done"]
        assert done == [first, second] and len(audio(events, first)) == len(audio(events, second)) == FRAMES * FRAME_BYTES
        assert [e["item_id"] for e in events if "item_id" in e] == sorted(
            [e["item_id"] for e in events if "item_id" in e], key=[first, second].index)  # the first item's all first
        tok = CharTokenizerDouble()
        assert {tuple(prompt_ids(tok, "leo", t)) for t in ("Hello there.", "And you?")} <= set(map(tuple, served.engine.prompts.values()))
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_clear_mid_speech_is_a_cancel_that_frees_everything_and_the_socket_speaks_on(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, batch_delay_s=0.01)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.recv()  # session.created
            for message in (append("A long answer the user talks over."), COMMIT, append("And more."), COMMIT):
                await ws.send(message)
            await events_until(ws, "conversation.item.audio_output.delta")
            await ws.send(CLEAR)
            events = await events_until(ws, "input_text_buffer.cleared")
            assert not [e for e in events if e["type"] == "conversation.item.audio_output.done"]
            assert await settled(served, snac_server, quiet, count_tasks=False) == NOTHING_HELD  # the socket is open
            served.engine.frames = FRAMES
            await ws.send(append("Hi."))
            await ws.send(COMMIT)
            events = await events_until(ws, "conversation.item.audio_output.done")
            assert len(audio(events)) == FRAMES * FRAME_BYTES
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


@pytest.mark.parametrize("message, code, said", [
    ("{not json", "invalid_event", "malformed event"),
    ('["append"]', "invalid_event", "a message must be a JSON object"),
    ('{"type": "response.create"}', "invalid_event", "unknown event type 'response.create'"),
    ('{"type": "input_text_buffer.append", "text": 5}', "invalid_event", "needs text"),
    (b"\x00\x01", "invalid_event", "binary frames"),
    (append("x" * 5000), "input_too_long", "over 4096 characters"),
    ('{"type": "tts_session.updated", "session": {"voice": "thalia"}}', "invalid_voice", "unknown voice 'thalia'"),
], ids=["not-json", "not-object", "unknown-type", "text-not-string", "binary", "too-long", "unknown-voice"])
async def test_hostile_events_get_an_error_event_and_the_socket_speaks_on(snac_server, message, code, said):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.recv()
            await ws.send(message)
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["error"]["code"] == code and said in error["error"]["message"]
            await ws.send(append("Still here."))
            await ws.send(COMMIT)
            events = await events_until(ws, "conversation.item.audio_output.done")
            assert len(audio(events)) == FRAMES * FRAME_BYTES
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_an_unknown_voice_in_the_url_is_an_error_and_a_close(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        async with connect(ws_url(served, "/v1/audio/speech/websocket?voice=af_heart")) as ws:
            error = json.loads(await ws.recv())
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert error["error"]["code"] == "invalid_voice" and ws.close_code == 1008


async def test_a_client_gone_mid_speech_frees_everything(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, batch_delay_s=0.01)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.recv()
            await ws.send(append("Talking until the client leaves."))
            await ws.send(COMMIT)
            await events_until(ws, "conversation.item.audio_output.delta")
        assert await settled(served, snac_server, quiet) == NOTHING_HELD
