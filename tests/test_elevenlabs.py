"""The ElevenLabs-compatible door (llm_server/doors/elevenlabs.py) on the real app, Runtime and codec tier, the
engine a test double: contexts, flush and close_context as Pipecat's and LiveKit's clients send them,
barge-in releasing everything, the single-context socket, the HTTP streams, formats, keys and hostile
input answered in the protocol's own shape (issue 27). The clients themselves: client_tests/."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest
from served import FRAME_BYTES, NOTHING_HELD, ScriptedEngineDouble, baseline, serving, settled, ws_url
from test_edge import _dechunk, _open_raw, _read_head, _read_to_end
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from llm_server.doors.elevenlabs import Refusal, char_alignment, output_of
from llm_server.doors.sockets import MAX_CONTEXTS
from llm_server.speech.session import Words

FRAMES = 4  # the engine double's frames per sentence
MULTI = "/v1/text-to-speech/tara/multi-stream-input?model_id=eleven_flash_v2_5&output_format=pcm_24000"


async def replies(ws, until, within_s: float = 60.0) -> list[dict]:
    """Messages until `until(message)` holds for one (included)."""
    got = []
    async with asyncio.timeout(within_s):
        while True:
            got.append(json.loads(await ws.recv()))
            if until(got[-1]):
                return got


def audio_of(messages: list[dict], context_id: str | None = None) -> bytes:
    return b"".join(base64.b64decode(m["audio"]) for m in messages
                    if m.get("audio") and (context_id is None or m.get("contextId") == context_id))


def final(context_id: str):
    return lambda m: m.get("contextId") == context_id and m.get("isFinal") is True


async def test_contexts_speak_their_sentences_with_alignment_and_end_with_is_final_alone(snac_server):
    """Pipecat's turn: an opening " ", sentences, a flush without text and close_context; two contexts at once."""
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        async with connect(ws_url(served, MULTI), additional_headers={"xi-api-key": "unused"}) as ws:
            for cid in ("a", "b"):
                await ws.send(json.dumps({"text": " ", "context_id": cid}))
                await ws.send(json.dumps({"text": "Hello there. ", "context_id": cid}))
                await ws.send(json.dumps({"text": "How are you?", "context_id": cid}))
            await ws.send(json.dumps({"text": ""}))  # a keep-alive changes nothing
            for cid in ("a", "b"):
                await ws.send(json.dumps({"context_id": cid, "flush": True}))
                await ws.send(json.dumps({"context_id": cid, "close_context": True}))
            messages = await replies(ws, final("a"))
            messages += await replies(ws, final("b")) if not any(final("b")(m) for m in messages) else []
    for cid in ("a", "b"):
        mine = [m for m in messages if m.get("contextId") == cid]
        assert len(audio_of(mine)) == 2 * FRAMES * FRAME_BYTES, "two sentences, every sample"
        assert mine[-1] == {"contextId": cid, "isFinal": True}, "isFinal alone: Pipecat skips the rest of its message"
        aligned = [m["alignment"] for m in mine if "alignment" in m]
        assert [m["normalizedAlignment"] for m in mine if "alignment" in m] == aligned
        assert "".join("".join(a["chars"]) for a in aligned) == "Hello there. How are you? "
        for a in aligned:  # without sync_alignment: from the start of each message
            assert a["charStartTimesMs"][0] == 0 and len(a["chars"]) == len(a["charStartTimesMs"]) == len(a["charDurationsMs"])
    assert not [m for m in messages if "error" in m]


async def test_with_sync_alignment_times_count_from_the_start_of_the_context(snac_server):
    """LiveKit's turn: sync_alignment=true, each sentence with flush, then an empty flush and close_context."""
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        async with connect(ws_url(served, MULTI + "&sync_alignment=true&auto_mode=true")) as ws:
            await ws.send(json.dumps({"text": " ", "voice_settings": {}, "context_id": "c"}))
            await ws.send(json.dumps({"text": "One two. ", "context_id": "c", "flush": True}))
            await ws.send(json.dumps({"text": "Three four. ", "context_id": "c", "flush": True}))
            await ws.send(json.dumps({"text": "", "context_id": "c", "flush": True}))
            await ws.send(json.dumps({"context_id": "c", "close_context": True}))
            messages = await replies(ws, final("c"))
    aligned = [m["alignment"] for m in messages if "alignment" in m]
    first_sentence = audio_of(messages[:next(i for i, m in enumerate(messages) if "alignment" in m)])
    assert len(aligned) == 2 and aligned[0]["charStartTimesMs"][0] == 0
    # the second sentence's first character at the first sentence's audio's end
    assert aligned[1]["charStartTimesMs"][0] == pytest.approx(1000 * len(first_sentence) / 2 / 24000, abs=1)
    assert len(audio_of(messages)) == 2 * FRAMES * FRAME_BYTES


async def test_close_context_mid_speech_is_a_barge_in_that_frees_everything(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, frames_per_batch=1, batch_delay_s=0.01)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, MULTI)) as ws:
            await ws.send(json.dumps({"text": "A long answer the user talks over.", "context_id": "x"}))
            await ws.send(json.dumps({"context_id": "x", "flush": True}))
            await ws.send(json.dumps({"text": "More.", "context_id": "x"}))  # text after the flush: not the end
            await replies(ws, lambda m: bool(m.get("audio")))
            await ws.send(json.dumps({"context_id": "x", "close_context": True}))
            await replies(ws, final("x"))
            assert await settled(served, snac_server, quiet, count_tasks=False) == NOTHING_HELD  # the socket is open
            assert served.outcome("cancelled") == 1
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_close_context_from_a_client_already_gone_ends_quietly(snac_server, caplog):
    """A barge-in's close_context whose client dropped the connection right after sending it (LiveKit's stream
    closed mid-speech): the context is cancelled and its isFinal has no one to go to, which is no error."""
    async with serving(snac_server, ScriptedEngineDouble(frames=400, frames_per_batch=1, batch_delay_s=0.01)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, MULTI)) as ws:
            await ws.send(json.dumps({"text": "A long answer the user talks over.", "context_id": "x", "flush": True}))
            await replies(ws, lambda m: bool(m.get("audio")))
            await ws.send(json.dumps({"context_id": "x", "close_context": True}))
            ws.transport.close()  # what was sent goes out, then the connection ends without a close frame
        assert await settled(served, snac_server, quiet) == NOTHING_HELD
        assert served.outcome("cancelled") == 1
    assert "Exception in ASGI application" not in caplog.text


async def test_close_socket_and_a_vanished_client_free_everything(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, frames_per_batch=1, batch_delay_s=0.01)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, MULTI)) as ws:
            for cid in ("p", "q"):
                await ws.send(json.dumps({"text": "Speak at length.", "context_id": cid, "flush": True}))
            await replies(ws, lambda m: bool(m.get("audio")))
            await ws.send(json.dumps({"close_socket": True}))
            with pytest.raises(ConnectionClosed):
                while True:
                    await ws.recv()
        assert await settled(served, snac_server, quiet) == NOTHING_HELD
        async with connect(ws_url(served, MULTI)) as ws:
            await ws.send(json.dumps({"text": "Speak at length.", "context_id": "r", "flush": True}))
            await replies(ws, lambda m: bool(m.get("audio")))
        assert await settled(served, snac_server, quiet) == NOTHING_HELD  # the client just left


async def test_the_single_context_socket_ends_on_empty_text_and_closes_after_is_final(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        async with connect(ws_url(served, "/v1/text-to-speech/leo/stream-input?output_format=ulaw_8000")) as ws:
            await ws.send(json.dumps({"text": " ", "voice_settings": {"stability": 0.5}}))
            await ws.send(json.dumps({"text": "Hello there. ", "try_trigger_generation": True}))
            await ws.send(json.dumps({"text": ""}))
            messages = await replies(ws, lambda m: m.get("isFinal") is True)
            with pytest.raises(ConnectionClosed):
                await ws.recv()
    assert "contextId" not in messages[0]
    assert abs(len(audio_of(messages)) - FRAMES * 2048 / 3) <= 4, "μ-law at 8 kHz: a byte a sample, a third of the samples"


async def test_http_streams_the_audio_and_with_timestamps_the_alignment(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            plain = await client.post("/v1/text-to-speech/tara/stream?output_format=pcm_16000",
                                      json={"text": "Hello there.", "model_id": "eleven_flash_v2_5"})
            whole = await client.post("/v1/text-to-speech/tara", json={"text": "Hello there."})  # mp3_44100_128
            timed = await client.post("/v1/text-to-speech/tara/stream/with-timestamps?output_format=pcm_24000",
                                      json={"text": "Hello there. How are you?", "previous_text": "Hi."},
                                      headers={"xi-api-key": "unused"})
    assert plain.status_code == 200 and plain.headers["content-type"].startswith("audio/")
    assert abs(len(plain.content) - FRAMES * FRAME_BYTES * 2 // 3) <= 4
    assert whole.status_code == 200 and whole.headers["content-type"] == "audio/mpeg" and len(whole.content) > 0
    lines = [json.loads(line) for line in timed.text.splitlines() if line]
    audio = b"".join(base64.b64decode(line["audio_base64"]) for line in lines if "audio_base64" in line)
    assert len(audio) == FRAMES * FRAME_BYTES  # one segment: a request's text is spoken whole
    aligned = [line["alignment"] for line in lines if "alignment" in line]
    assert "".join(c for a in aligned for c in a["characters"]) == "Hello there. How are you? "
    ends = [t for a in aligned for t in a["character_end_times_seconds"]]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(FRAMES * 2048 / 24000, abs=0.002)


async def test_keys_are_taken_from_xi_api_key(snac_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("agent:agent-secret-key\n")
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), api_keys_file=str(keys)) as served:
        with pytest.raises(InvalidStatus):
            async with connect(ws_url(served, MULTI)):
                pass
        async with connect(ws_url(served, MULTI), additional_headers={"xi-api-key": "agent-secret-key"}) as ws:
            await ws.send(json.dumps({"text": "Keyed.", "context_id": "k"}))
            await ws.send(json.dumps({"context_id": "k", "flush": True}))
            await ws.send(json.dumps({"context_id": "k", "close_context": True}))
            assert len(audio_of(await replies(ws, final("k")))) == FRAMES * FRAME_BYTES
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            refused = await client.post("/v1/text-to-speech/tara/stream", json={"text": "Hi."})
            keyed = await client.post("/v1/text-to-speech/tara/stream", json={"text": "Hi."},
                                       headers={"xi-api-key": "agent-secret-key"})
    assert refused.status_code == 401 and keyed.status_code == 200


async def test_hostile_messages_get_errors_and_the_socket_lives_on(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), max_input_chars=64) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, MULTI)) as ws:
            errors = []
            for bad in ("{not json", "[1, 2]", json.dumps({"text": 7, "context_id": "h"}),
                        json.dumps({"context_id": "h"}), json.dumps({"text": "x" * 65, "context_id": "h2"})):
                await ws.send(bad)
                errors.append(json.loads(await ws.recv()))
            await ws.send(b"\x00binary")
            errors.append(json.loads(await ws.recv()))
            for i in range(MAX_CONTEXTS):
                await ws.send(json.dumps({"text": "Open.", "context_id": f"c{i}"}))
            await ws.send(json.dumps({"text": "One too many.", "context_id": "extra"}))
            over = await replies(ws, lambda m: "error" in m)
            await ws.send(json.dumps({"context_id": "never-opened", "close_context": True}))  # nothing to close
            for i in range(MAX_CONTEXTS):
                await ws.send(json.dumps({"context_id": f"c{i}", "close_context": True}))
            await ws.send(json.dumps({"text": "Still here.", "context_id": "ok", "flush": True}))
            await ws.send(json.dumps({"text": "", "context_id": "ok", "flush": True}))
            await ws.send(json.dumps({"context_id": "ok", "close_context": True}))
            done = await replies(ws, final("ok"))
        assert await settled(served, snac_server, quiet) == NOTHING_HELD
    assert all("error" in e and e["error"] == e["message"] for e in errors)
    assert "malformed" in errors[0]["error"] and "text must be a string" in errors[2]["error"]
    assert "over 64 characters" in errors[4]["error"] and "binary" in errors[5]["error"]
    assert over[-1]["contextId"] == "extra" and f"{MAX_CONTEXTS} open contexts" in over[-1]["error"]
    assert len(audio_of(done, "ok")) == FRAMES * FRAME_BYTES


async def test_a_format_it_cannot_serve_is_an_error_then_a_close_and_an_unknown_voice_the_default_or_refused(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), vendor_voice_fallback=False) as served:
        async with connect(ws_url(served, "/v1/text-to-speech/tara/multi-stream-input?output_format=wav_22050")) as ws:
            error = json.loads(await ws.recv())
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            unknown = await client.post("/v1/text-to-speech/21m00Tcm4TlvDq8ikWAM/stream", json={"text": "Hi."})
            listed = (await client.get("/v1/voices")).json()
    assert "output_format 'wav_22050'" in error["error"]
    assert unknown.status_code == 400 and "unknown voice '21m00Tcm4TlvDq8ikWAM'" in unknown.json()["error"]["message"]
    assert {"voice_id": "tara", "name": "tara", "category": "checkpoint"} in listed["voices"]  # ElevenLabs' list_voices


@pytest.mark.parametrize("name, fmt, rate", [("pcm_24000", "pcm", 24000), ("pcm_16000", "pcm", 16000), ("ulaw_8000", "mulaw", 8000),
                                             ("alaw_8000", "alaw", 8000), ("mp3_22050_32", "mp3", 22050),
                                             ("mp3_44100_128", "mp3", 44100), ("opus_48000_64", "opus", 48000)])
def test_output_formats(name, fmt, rate):
    output = output_of(name)
    assert (output.format, output.sample_rate) == (fmt, rate)


@pytest.mark.parametrize("name", ["wav_24000", "pcm", "pcm_12345", "mp3_x_128"])
def test_output_formats_it_cannot_serve(name):
    with pytest.raises(Refusal, match="output_format"):
        output_of(name)


def test_character_alignment_shares_a_word_among_its_characters_and_spaces_take_no_time():
    words = Words(["Hi", "you."], [1.0, 1.3], [1.3, 1.8])
    aligned = char_alignment(words, origin=1.0)
    assert aligned["chars"] == list("Hi you. ")
    assert aligned["charStartTimesMs"] == [0, 150, 300, 300, 425, 550, 675, 800]
    assert aligned["charDurationsMs"] == [150, 150, 0, 125, 125, 125, 125, 0]
    assert char_alignment(words, origin=0.0)["charStartTimesMs"][0] == 1000


TIMESTAMPS = "/v1/text-to-speech/tara/stream/with-timestamps?output_format=pcm_24000"


async def test_with_timestamps_fails_before_audio_with_a_status_and_after_it_with_a_last_error_line(snac_server):
    """The same response path as the other HTTP doors (issue 46, item 5): an engine failure before the first audio
    is a 503, not a 200 carrying an error line; after audio went out the body ends with one error line."""
    engine = ScriptedEngineDouble(frames=40)
    async with serving(snac_server, engine) as served:
        quiet = await baseline(served, snac_server)  # warmed up before any failure is scripted
        engine.fail_after_frames = 0
        engine.fail_gate.set()
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            before = await client.post(TIMESTAMPS, json={"text": "Hello there."})
            engine.fail_after_frames, lines = 12, []  # past the codec's first chunk
            engine.fail_gate.clear()
            async with client.stream("POST", TIMESTAMPS, json={"text": "Hello there."}) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    lines.append(json.loads(line))
                    engine.fail_gate.set()  # audio is out: now the engine fails
        assert await settled(served, snac_server, quiet) == NOTHING_HELD
    assert before.status_code == 503 and before.json()["error"]["code"] == "generation_failed", before.text
    assert status == 200 and "audio_base64" in lines[0]
    assert "scripted engine failure" in lines[-1]["error"] and sum("error" in line for line in lines) == 1


async def test_with_timestamps_cuts_off_a_client_that_stops_reading(snac_server):
    frames = 1200  # 102 s of audio: far more than any buffer on the way holds
    async with serving(snac_server, ScriptedEngineDouble(frames=frames, frames_per_batch=4), sndbuf=16384,
                       max_client_lag_s=1.0) as served:
        quiet = await baseline(served, snac_server)
        sock = await _open_raw(served.port, {"text": "Hello there."}, rcvbuf=4096, path=TIMESTAMPS)
        try:
            head, early = await _read_head(sock)
            assert head.startswith(b"HTTP/1.1 200") and b"application/x-ndjson" in head
            async with asyncio.timeout(30):
                while served.outcome("slow_client") < 1:
                    await asyncio.sleep(0.1)  # not reading
            assert await settled(served, snac_server, quiet) == NOTHING_HELD
            payload, complete = _dechunk(early + await _read_to_end(sock))
            assert not complete and len(payload) < frames * FRAME_BYTES, "cut off long before the end"
        finally:
            sock.close()
