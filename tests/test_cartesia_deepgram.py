"""The Cartesia- and Deepgram-compatible front doors, against the in-process worker (engine double, real
codec server): contexts, timestamps, encodings, barge-in, capacity, auth, and hostile input that gets
the protocol's error and leaves nothing held; Cartesia's GET /voices."""

from __future__ import annotations

import asyncio
import base64
import json
import random

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from served import (
    FRAME_BYTES,
    NOTHING_HELD,
    ScriptedEngineDouble,
    baseline,
    cartesia,
    serve_app,
    serving,
    settled,
    ws_url,
)

from llm_server.voices import CLONE, Voice
from orpheus_front.front import create_front_app

FRAME_SAMPLES = 2048


async def until_done(ws, context_ids: set[str], timeout_s: float = 60.0) -> dict[str, list[dict]]:
    """Every message per context until each one's `done`."""
    got: dict[str, list[dict]] = {c: [] for c in context_ids}
    open_ = set(context_ids)
    async with asyncio.timeout(timeout_s):
        while open_:
            message = json.loads(await ws.recv())
            got.setdefault(message["context_id"], []).append(message)
            if message["type"] == "done":
                open_.discard(message["context_id"])
    return got


def audio_bytes(messages: list[dict]) -> bytes:
    return b"".join(base64.b64decode(m["data"]) for m in messages if m["type"] == "chunk")


async def test_cartesia_context_streams_words_in_and_audio_timestamps_done_out(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=12)) as served:
        async with connect(ws_url(served, "/tts/websocket"), additional_headers={"X-API-Key": "unused"}) as ws:
            for word in ["Hello ", "there, ", "friend. ", "How ", "are ", "you?"]:
                await ws.send(cartesia("c1", word, add_timestamps=True))
            await ws.send(cartesia("c1", "", more=False, add_timestamps=True))
            messages = (await until_done(ws, {"c1"}))["c1"]
    kinds = [m["type"] for m in messages]
    assert kinds[-1] == "done" and kinds.count("done") == 1 and "error" not in kinds
    pcm = audio_bytes(messages)
    assert len(pcm) == 2 * 12 * FRAME_BYTES, "two sentences of 12 frames each, every sample"
    stamps = [m["word_timestamps"] for m in messages if m["type"] == "timestamps"]
    assert [w for s in stamps for w in s["words"]] == ["Hello", "there,", "friend.", "How", "are", "you?"]
    starts = [t for s in stamps for t in s["start"]]
    assert starts == sorted(starts) and starts[0] == 0.0, "seconds from the start of the context's audio"


async def test_cartesia_contexts_on_one_socket_each_get_their_own_audio(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=6)) as served:
        async with connect(ws_url(served, "/tts/websocket")) as ws:
            await ws.send(cartesia("a", "First context speaks.", more=False))
            await ws.send(cartesia("b", "Second one too.", more=False,
                                   output_format={"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000}))
            got = await until_done(ws, {"a", "b"})
    assert len(audio_bytes(got["a"])) == 6 * FRAME_BYTES
    assert abs(len(audio_bytes(got["b"])) - 6 * FRAME_SAMPLES / 3) <= 2, "mu-law at 8 kHz: one byte a sample"


async def test_cartesia_flush_speaks_the_buffer_and_answers_after_its_audio(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=6)) as served:
        async with connect(ws_url(served, "/tts/websocket")) as ws:
            await ws.send(cartesia("f", "An unfinished thought", flush=True))  # no sentence end: only the flush speaks it
            await ws.send(cartesia("f", "and the rest.", more=False))
            messages = (await until_done(ws, {"f"}))["f"]
    kinds = [m["type"] for m in messages]
    assert kinds.count("flush_done") == 1 and "error" not in kinds
    at = kinds.index("flush_done")
    assert messages[at]["flush_id"] == 1
    assert len(audio_bytes(messages[:at])) == 6 * FRAME_BYTES, "after the flushed text's audio, before the rest's"
    assert len(audio_bytes(messages[at:])) == 6 * FRAME_BYTES


async def test_cartesia_cancel_stops_the_audio_and_frees_everything(snac_server):
    engine = ScriptedEngineDouble(frames=400, batch_delay_s=0.02)  # a long reply, being spoken
    async with serving(snac_server, engine) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, "/tts/websocket")) as ws:
            await ws.send(cartesia("long", "A reply that goes on.", more=False))
            while json.loads(await ws.recv())["type"] != "chunk":
                pass
            await ws.send(json.dumps({"context_id": "long", "cancel": True}))
            assert await settled(served, snac_server, quiet, count_tasks=False) == NOTHING_HELD
            # The socket carries on, with a short reply: 400 more frames through the real-size codec took more
            # than until_done's 60 s hang guard beside stress-ng --cpu 2 (a machine's speed, not the point here)
            engine.frames = 12
            await ws.send(cartesia("next", "Still serving.", more=False))
            assert (await until_done(ws, {"next"}))["next"][-1]["type"] == "done"
        assert await settled(served, snac_server, quiet) == NOTHING_HELD  # the socket's tasks too, once it closed
    assert served.outcome("cancelled") == 1


async def test_cartesia_over_capacity_refuses_the_context_and_then_the_socket(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, batch_delay_s=0.02), max_streams=1) as served:
        async with connect(ws_url(served, "/tts/websocket")) as ws:
            await ws.send(cartesia("held", "Holding the only slot.", more=False))
            await ws.send(cartesia("extra", "One too many.", more=False))
            refusal = None
            while refusal is None:
                message = json.loads(await ws.recv())
                if message["type"] == "error":
                    refusal = message
            assert (refusal["context_id"], refusal["status_code"], refusal["done"]) == ("extra", 429, False)
            async with connect(ws_url(served, "/tts/websocket")) as second:
                with pytest.raises(ConnectionClosed) as closed:
                    await second.recv()
            assert closed.value.rcvd.code == 1013


HOSTILE = {
    "not JSON": "{transcript: hi",
    "not an object": "[1, 2]",
    "no transcript": json.dumps({"context_id": "x", "continue": True}),
    "transcript not a string": json.dumps({"context_id": "x", "transcript": 5}),
    "context id not a string": json.dumps({"context_id": 7, "transcript": "hi"}),
    "voice embedding": json.dumps({"context_id": "x", "transcript": "hi", "voice": {"mode": "embedding", "embedding": [0.1]}}),
    "unknown encoding": cartesia("x", "hi", output_format={"container": "raw", "encoding": "opus", "sample_rate": 24000}),
    "odd sample rate": cartesia("x", "hi", output_format={"container": "raw", "encoding": "pcm_s16le", "sample_rate": 11025}),
    "speed": cartesia("x", "hi", generation_config={"speed": 1.5}),
    "huge message": json.dumps({"context_id": "x", "transcript": "a" * 70_000}),
}


async def test_cartesia_hostile_messages_get_errors_and_the_socket_lives_on(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=4)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, "/tts/websocket"), max_size=2**22) as ws:
            for case, message in HOSTILE.items():
                await ws.send(message)
                reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert reply["type"] == "error" and reply["status_code"] == 400 and not reply["done"], case
                assert "context_id" in reply, "Pipecat reads context_id from every message"
            await ws.send(b"\x00\xff binary garbage")
            assert json.loads(await ws.recv())["type"] == "error"
            await ws.send(cartesia("y", "Ended.", more=False))
            await ws.send(cartesia("y", "After the end."))
            replies = [json.loads(await asyncio.wait_for(ws.recv(), 30)) for _ in range(2)]
            assert any(r["type"] == "error" and "has ended" in r["error"] for r in replies)
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_clients_vanishing_at_random_points_leave_nothing_held(snac_server):
    rng = random.Random(5)
    async with serving(snac_server, ScriptedEngineDouble(frames=60, batch_delay_s=0.005)) as served:
        quiet = await baseline(served, snac_server)
        for i in range(12):
            path = rng.choice(["/tts/websocket", "/v1/speak?model=tara"])
            async with connect(ws_url(served, path)) as ws:
                if path.startswith("/tts"):
                    await ws.send(cartesia(f"v{i}", "Leaving at some point. Maybe now.", more=rng.random() < 0.5))
                else:
                    await ws.send(json.dumps({"type": "Speak", "text": "Leaving at some point. "}))
                    if rng.random() < 0.5:
                        await ws.send(json.dumps({"type": "Flush"}))
                for _ in range(rng.randrange(0, 4)):
                    await ws.recv()
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_deepgram_words_then_flush_then_again_on_one_socket(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=5)) as served:
        async with connect(ws_url(served, "/v1/speak?model=aura-2-helena-en&encoding=linear16&sample_rate=24000"),
                           additional_headers={"Authorization": "Token unused"}) as ws:
            first = json.loads(await ws.recv())
            warning = json.loads(await ws.recv())
            assert first["type"] == "Metadata" and warning["type"] == "Warning" and "tara" in warning["warn_msg"]
            for turn in range(2):
                for word in ["Hello ", "there, ", "friend."]:
                    await ws.send(json.dumps({"type": "Speak", "text": word}))
                await ws.send(json.dumps({"type": "Flush"}))
                audio = b""
                while isinstance(message := await asyncio.wait_for(ws.recv(), 30), bytes):
                    audio += message
                assert json.loads(message) == {"type": "Flushed", "sequence_id": turn + 1}
                assert len(audio) == 5 * FRAME_BYTES


async def test_deepgram_clear_stops_the_audio_and_frees_everything(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, batch_delay_s=0.02)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, "/v1/speak?model=tara&encoding=mulaw&sample_rate=8000")) as ws:
            await ws.recv()  # Metadata
            await ws.send(json.dumps({"type": "Speak", "text": "A long answer the user talks over. "}))
            while not isinstance(await ws.recv(), bytes):
                pass
            await ws.send(json.dumps({"type": "Clear"}))
            while isinstance(message := await asyncio.wait_for(ws.recv(), 10), bytes):
                pass  # what was already on its way
            assert json.loads(message)["type"] == "Cleared"
            assert await settled(served, snac_server, quiet, count_tasks=False) == NOTHING_HELD
            await ws.send(json.dumps({"type": "Unknown"}))
            assert json.loads(await ws.recv())["type"] == "Warning"
            await ws.send("{not json")
            assert json.loads(await ws.recv())["type"] == "Error"
            await ws.send(json.dumps({"type": "Close"}))
            with pytest.raises(ConnectionClosed):
                while True:
                    await ws.recv()
        assert await settled(served, snac_server, quiet) == NOTHING_HELD  # the socket's tasks too, once it closed


async def test_a_bad_query_is_an_error_message_then_a_close(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=4)) as served:
        async with connect(ws_url(served, "/v1/speak?model=tara&encoding=flac")) as ws:
            error = json.loads(await ws.recv())
            assert error["type"] == "Error" and "encoding" in error["err_msg"]
            with pytest.raises(ConnectionClosed):
                await ws.recv()


async def test_http_twins_stream_the_bytes(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=6)) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            cartesia_reply = await client.post("/tts/bytes", json={
                "model_id": "sonic-3", "transcript": "Bytes please.", "voice": {"mode": "id", "id": "leo"},
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}})
            deepgram_reply = await client.post("/v1/speak?model=tara&encoding=linear16&container=none&sample_rate=16000",
                                               json={"text": "Bytes please."})
    assert cartesia_reply.status_code == 200 and len(cartesia_reply.content) == 6 * FRAME_BYTES
    assert deepgram_reply.status_code == 200 and abs(len(deepgram_reply.content) - 6 * FRAME_BYTES * 2 / 3) <= 4


async def test_sockets_present_keys_the_way_their_protocol_does(snac_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("agent:agent-secret-key\n")
    async with serving(snac_server, ScriptedEngineDouble(frames=4), api_keys_file=str(keys)) as served:
        with pytest.raises(InvalidStatus):
            async with connect(ws_url(served, "/tts/websocket")):
                pass
        async with connect(ws_url(served, "/tts/websocket"), additional_headers={"X-API-Key": "agent-secret-key"}) as ws:
            await ws.send(cartesia("k", "Keyed.", more=False))
            assert (await until_done(ws, {"k"}))["k"][-1]["type"] == "done"
        async with connect(ws_url(served, "/tts/websocket?api_key=agent-secret-key")) as ws:
            await ws.send(cartesia("q", "Keyed by query.", more=False))
            assert (await until_done(ws, {"q"}))["q"][-1]["type"] == "done"
        async with connect(ws_url(served, "/v1/speak?model=tara"), additional_headers={"Authorization": "Token agent-secret-key"}) as ws:
            assert json.loads(await ws.recv())["type"] == "Metadata"


async def test_a_prompt_over_the_context_is_a_client_error_on_both_sockets(snac_server):
    """A segment whose prompt the worker's context cannot hold (max_model_len 64, a 100-character sentence)
    is the client's input, not a server failure: Cartesia answers 400, Deepgram INPUT_TOO_LONG; each
    socket serves on, and nothing is held afterwards."""
    long = "x" * 100 + "."
    async with serving(snac_server, ScriptedEngineDouble(frames=3), max_model_len=64) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, "/tts/websocket")) as ws:
            await ws.send(cartesia("long", long, more=False))
            reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert reply["type"] == "error" and reply["status_code"] == 400 and reply["context_id"] == "long", reply
            assert "64 tokens" in reply["error"]
            await ws.send(cartesia("short", "Hi.", more=False))
            assert (await until_done(ws, {"short"}))["short"][-1]["type"] == "done"
        async with connect(ws_url(served, "/v1/speak?model=tara&encoding=linear16&sample_rate=24000")) as ws:
            assert json.loads(await ws.recv())["type"] == "Metadata"
            await ws.send(json.dumps({"type": "Speak", "text": long}))
            await ws.send(json.dumps({"type": "Flush"}))
            error = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert error["type"] == "Error" and error["err_code"] == "INPUT_TOO_LONG" and "64 tokens" in error["err_msg"]
            await ws.send(json.dumps({"type": "Speak", "text": "Hi."}))
            await ws.send(json.dumps({"type": "Flush"}))
            audio, flushed = b"", []
            async with asyncio.timeout(30):
                while len(flushed) < 2:  # the failed flush is answered too, then this one
                    message = await ws.recv()
                    if isinstance(message, bytes):
                        audio += message
                    else:
                        flushed.append(json.loads(message))
            assert [m["sequence_id"] for m in flushed] == [1, 2] and len(audio) == 3 * FRAME_BYTES
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_an_engine_failure_mid_stream_is_reported_on_both_sockets(snac_server):
    """Generation that fails after audio went out: Cartesia says so with a 500 for the context, Deepgram
    with SYNTHESIS_FAILED; both sockets stay open, and nothing is held afterwards."""
    engine = ScriptedEngineDouble(frames=40)
    async with serving(snac_server, engine) as served:
        quiet = await baseline(served, snac_server)
        engine.fail_after_frames = 12  # each request then waits at its 13th frame until the gate opens
        async with connect(ws_url(served, "/tts/websocket")) as ws:
            await ws.send(cartesia("doomed", "This answer breaks halfway.", more=False))
            assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "chunk"
            engine.fail_gate.set()
            async with asyncio.timeout(30):
                while (reply := json.loads(await ws.recv()))["type"] == "chunk":
                    pass
            assert reply["type"] == "error" and reply["status_code"] == 500 and reply["context_id"] == "doomed", reply
        engine.fail_gate.clear()
        async with connect(ws_url(served, "/v1/speak?model=tara&encoding=linear16&sample_rate=24000")) as ws:
            assert json.loads(await ws.recv())["type"] == "Metadata"
            await ws.send(json.dumps({"type": "Speak", "text": "This answer breaks halfway."}))
            await ws.send(json.dumps({"type": "Flush"}))
            assert isinstance(await asyncio.wait_for(ws.recv(), 30), bytes)
            engine.fail_gate.set()
            async with asyncio.timeout(30):
                while isinstance(message := await ws.recv(), bytes):
                    pass
            error = json.loads(message)
            assert error["type"] == "Error" and error["err_code"] == "SYNTHESIS_FAILED", error
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_cartesia_list_voices_pages_the_registry_in_cartesia_s_shape_on_the_worker_and_the_front(snac_server):
    """GET /voices as Cartesia's List Voices: {data, has_more, next_page}, each Voice an id the socket's
    voice: {mode: "id", id} takes; cursors both ways, the filters; a clone (the registry's own voice) is the owner's."""
    async with serving(snac_server, ScriptedEngineDouble(frames=4)) as served, \
            serve_app(create_front_app([served.url])) as front_port:
        served.runtime.voices.update_own([Voice("mine", CLONE, None)])
        names = served.runtime.voices.names()
        async with httpx.AsyncClient(timeout=30) as client:
            for base in (served.url, f"http://127.0.0.1:{front_port}"):
                page = (await client.get(f"{base}/voices", params={"limit": 3})).json()
                assert [v["id"] for v in page["data"]] == names[:3]
                assert page["has_more"] and page["next_page"] == names[2]
                assert set(page["data"][0]) >= {"id", "name", "description", "is_owner", "is_public", "language",
                                                "created_at"}
                rest = (await client.get(f"{base}/voices", params={"limit": 100, "starting_after": names[2]})).json()
                assert [v["id"] for v in rest["data"]] == names[3:]
                assert not rest["has_more"] and rest["next_page"] is None
                back = (await client.get(f"{base}/voices", params={"limit": 2, "ending_before": names[3]})).json()
                assert [v["id"] for v in back["data"]] == names[1:3] and back["has_more"]
                owned = (await client.get(f"{base}/voices", params={"is_owner": "true"})).json()["data"]
                assert owned == [{"id": "mine", "name": "mine", "description": "Orpheus clone voice mine",
                                  "is_owner": True, "is_public": False, "language": None, "gender": None,
                                  "created_at": None}]
                assert [v["id"] for v in (await client.get(f"{base}/voices", params={"q": "LE"})).json()["data"]] == \
                    [n for n in names if "le" in n]
                english = (await client.get(f"{base}/voices", params={"language": "en_US", "limit": 100})).json()
                assert [v["id"] for v in english["data"]] == [n for n in names if n != "mine"]
                assert (await client.get(f"{base}/voices", params={"gender": "feminine"})).json()["data"] == []
                for params, said in (({"limit": 0}, "limit"), ({"starting_after": "nobody"}, "starting_after")):
                    refused = await client.get(f"{base}/voices", params=params)
                    assert refused.status_code == 400 and said in refused.json()["error"]["message"]
        async with connect(ws_url(served, "/tts/websocket")) as ws:  # a listed id is a voice the socket speaks
            await ws.send(cartesia("c1", "Hi.", more=False).replace('"tara"', f'"{names[3]}"'))
            assert json.loads(await ws.recv())["type"] == "chunk"


async def test_cartesia_list_voices_takes_the_key_as_cartesia_s_clients_send_it(snac_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("agent:cartesia-key-01\n")
    async with serving(snac_server, ScriptedEngineDouble(frames=4), api_keys_file=str(keys)) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=30) as client:
        assert (await client.get("/voices")).status_code == 401
        listed = await client.get("/voices", headers={"X-API-Key": "cartesia-key-01", "Cartesia-Version": "2025-04-16"})
        assert listed.status_code == 200 and listed.json()["data"][0]["id"] == served.runtime.voices.names()[0]
