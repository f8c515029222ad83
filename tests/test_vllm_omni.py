"""vLLM-Omni's speech socket (llm_server/doors/vllm_omni.py, issue 46): the messages LiveKit's
baseten.TTS(model="qwen3-tts") sends (session.config, input.text, input.done, session.close) and reads (audio.start
with its sample rate, binary PCM, audio.done with word alignment, session.done, error), on the worker and through
the front; closing the socket mid-speech is a barge-in that frees everything; hostile input gets the protocol's
`error` (and a close before a config is in force) with nothing held. voice.add (as qwen3_tts.register_voice sends
it: first, with the recording in base64) makes a clone as POST /v1/voices does, which speaks in the same socket's
next config, on the worker and through the front with a recording over the relay's byte burst; refused, nothing
is written and the socket lives on."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import pytest_asyncio
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
from test_clones import TRANSCRIPT, wav
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from llm_server.speech.prompt import clone_prompt_ids, prompt_ids
from orpheus_front.front import RELAY_LIMITS, create_front_app

FRAMES = 4
PATH = "/v1/audio/speech/stream"
# What the plugin sends with word_timestamps=True (qwen3_tts._build_session_config).
CONFIG = {"type": "session.config", "task_type": "Base", "response_format": "pcm", "stream_audio": True, "speed": 1.0,
          "voice": "leo", "language": "Auto", "timestamp_type": "word", "timestamp_transport_strategy": "sync"}


def text(piece: str) -> str:
    return json.dumps({"type": "input.text", "text": piece})


DONE = json.dumps({"type": "input.done"})


async def until(ws, kind: str, count: int = 1) -> tuple[list[dict], bytes]:
    """Every event until the `count`th of type `kind`, inclusive, and the audio between."""
    events, audio = [], b""
    while sum(e["type"] == kind for e in events) < count:
        message = await ws.recv()
        if isinstance(message, bytes):
            audio += message
        else:
            events.append(json.loads(message))
    return events, audio


async def test_utterances_are_spoken_sentence_by_sentence_with_alignment_then_session_done(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(json.dumps(CONFIG))
            for message in (text("Hello "), text("there. How are"), text(" you?"), DONE, DONE, text("Bye."), DONE):
                await ws.send(message)
            events, audio = await until(ws, "session.done", 3)
            await ws.send(json.dumps({"type": "session.close"}))
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 1000 and len(audio) == 3 * FRAMES * FRAME_BYTES
        kinds = [e["type"] for e in events]
        assert kinds == ["audio.start", "audio.done"] * 2 + ["session.done"] * 2 + ["audio.start", "audio.done",
                                                                                    "session.done"]
        starts = [e for e in events if e["type"] == "audio.start"]
        assert all(e["sample_rate"] == 24000 and e["channels"] == 1 and e["format"] == "pcm" for e in starts)
        assert [(e["utterance_index"], e["sentence_index"]) for e in starts] == [(0, 0), (0, 1), (2, 0)]
        dones = [e for e in events if e["type"] == "session.done"]
        assert [(e["utterance_index"], e["total_sentences"]) for e in dones] == [(0, 2), (1, 0), (2, 1)]
        second = [e for e in events if e["type"] == "audio.done"][1]
        assert second["sentence_text"] == "How are you?" and second["total_bytes"] == FRAMES * FRAME_BYTES
        alignment = second["timestamp_info"]["word_alignment"]
        assert alignment["words"] == ["How", "are", "you?"]
        # From the sentence's own start (the plugin adds the bytes before it), ending with its audio.
        assert alignment["word_start_times_seconds"][0] == 0.0
        assert alignment["word_end_times_seconds"][-1] == pytest.approx(FRAMES * 2048 / 24000, abs=0.002)
        tok = CharTokenizerDouble()
        assert sorted(p for p in served.engine.prompts.values() if p != prompt_ids(tok, "tara", "Hello there.")) == \
            sorted(prompt_ids(tok, "leo", t) for t in ("Hello there.", "How are you?", "Bye."))
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_without_timestamps_audio_done_carries_no_alignment_and_a_new_config_changes_the_voice(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "tara"}))
            await ws.send(text("One."))
            await ws.send(DONE)
            first, _ = await until(ws, "session.done")
            await ws.send(json.dumps({"type": "session.config", "voice": "leo"}))
            await ws.send(text("Two."))
            await ws.send(DONE)
            await until(ws, "session.done")
        assert "timestamp_info" not in [e for e in first if e["type"] == "audio.done"][0]
        tok = CharTokenizerDouble()
        assert sorted(served.engine.prompts.values()) == sorted([prompt_ids(tok, "tara", "One."),
                                                                 prompt_ids(tok, "leo", "Two.")])


async def test_closing_the_socket_mid_speech_is_a_barge_in_that_frees_everything(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, batch_delay_s=0.01)) as served:
        quiet = await baseline(served, snac_server)
        before = served.outcome("disconnected")
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(text("A long answer the user talks over. And more of it."))
            await ws.send(DONE)
            assert json.loads(await ws.recv())["type"] == "audio.start"
            assert isinstance(await ws.recv(), bytes)
        assert await settled(served, snac_server, quiet) == NOTHING_HELD
        assert served.outcome("disconnected") == before + 1


async def test_through_the_front_it_speaks_and_a_barge_in_reaches_the_worker(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served, \
            serve_app(create_front_app([served.url])) as front_port:
        quiet = await baseline(served, snac_server)
        url = f"ws://127.0.0.1:{front_port}{PATH}"
        async with connect(url) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(text("Through the front."))
            await ws.send(DONE)
            events, audio = await until(ws, "session.done")
        assert len(audio) == FRAMES * FRAME_BYTES and events[-1] == {"type": "session.done", "utterance_index": 0,
                                                                     "total_sentences": 1}
        served.engine.frames, served.engine.batch_delay_s = 400, 0.01
        async with connect(url) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(text("Cut off through the front."))
            await ws.send(DONE)
            await ws.recv()
            assert isinstance(await ws.recv(), bytes)
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


@pytest.mark.parametrize("messages, said", [
    (["{not json"], "malformed message"),
    ([b"\x00\x01"], "binary frames are not part of this protocol"),
    ([text("Hi.")], "Expected session.config, got: input.text"),
    ([json.dumps({**CONFIG, "voice": "thalia"})], "unknown voice 'thalia'"),
    ([json.dumps({**CONFIG, "voice": 7})], "voice must be a string"),
    ([json.dumps({**CONFIG, "response_format": "wav"})], "response_format 'wav' is not supported"),
    ([json.dumps({**CONFIG, "speed": 1.5})], "speed other than 1"),
    ([json.dumps({**CONFIG, "ref_audio": "https://example.com/a.wav"})], "inline cloning"),
], ids=["not-json", "binary", "text-first", "unknown-voice", "voice-not-string", "wav", "speed", "ref-audio"])
async def test_a_bad_handshake_gets_an_error_and_a_close_with_nothing_held(snac_server, messages, said):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            for message in messages:
                await ws.send(message)
            error = json.loads(await ws.recv())
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert error["type"] == "error" and said in error["message"] and ws.close_code == 1008
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


@pytest.mark.parametrize("message, said", [
    ("[1]", "a message must be a JSON object"),
    (b"\x00", "binary frames are not part of this protocol"),
    (json.dumps({"type": "input.text", "text": 5}), "input.text requires a string"),
    (json.dumps({"type": "audio.append"}), "Unknown message type: audio.append"),
    (json.dumps({"type": "voice.add", "name": "me", "ref_text": "Hi.", "audio_data": "AAAA"}),
     "voice.add refused: this worker has no voices directory"),
    (json.dumps({**CONFIG, "voice": "thalia"}), "unknown voice 'thalia'"),
    (text("x" * 4000) + "|" + text("y" * 200), "over 4096 characters in one utterance"),
    (text("Half a sentence") + "|" + json.dumps(CONFIG), "while an utterance is in progress"),
], ids=["not-object", "binary", "text-not-string", "unknown-type", "voice-add", "bad-reconfig", "too-long",
        "config-mid-utterance"])
async def test_hostile_input_on_a_configured_socket_gets_an_error_and_the_socket_lives_on(snac_server, message, said):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(json.dumps(CONFIG))
            for part in (message.split("|") if isinstance(message, str) else [message]):
                await ws.send(part)
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and said in error["message"]
            await ws.send(DONE)  # whatever was accepted before the refusal ends here
            await until(ws, "session.done")
            await ws.send(text("Still here."))
            await ws.send(DONE)
            events, audio = await until(ws, "session.done")
        assert events[-1]["total_sentences"] == 1 and len(audio) == FRAMES * FRAME_BYTES
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_voice_list_names_the_registry_s_voices(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(json.dumps({"type": "voice.list"}))
            listed = json.loads(await ws.recv())
        assert listed == {"type": "voice.list", "voices": served.runtime.voices.names(), "uploaded_voices": []}


async def test_keys_are_taken_as_the_plugin_sends_them(snac_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("agent:omni-key-0001\n")
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), api_keys_file=str(keys)) as served:
        async with connect(ws_url(served, PATH), additional_headers={"Authorization": "Api-Key omni-key-0001"}) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(text("Hi."))
            await ws.send(DONE)
            _, audio = await until(ws, "session.done")
        assert len(audio) == FRAMES * FRAME_BYTES
        with pytest.raises(InvalidStatus, match="403"):
            async with connect(ws_url(served, PATH), additional_headers={"Authorization": "Api-Key wrong-key-0001"}):
                pass


def voice_add(name: str = "ava", audio: bytes | None = None, **fields) -> str:
    """voice.add as qwen3_tts.register_voice sends it."""
    audio = wav(2.0, rate=24000, channels=1) if audio is None else audio
    return json.dumps({"type": "voice.add", "name": name, "consent": "user_consent",
                       "audio_data": base64.b64encode(audio).decode(), "audio_format": "wav", "ref_text": TRANSCRIPT,
                       **fields})


MAX_REFERENCE_BYTES = 200_000  # the clone worker's bound: a voice.add of up to 332,204 characters


@pytest_asyncio.fixture(scope="module")
async def clone_worker(snac_server, tmp_path_factory):
    voices_dir = tmp_path_factory.mktemp("voices")
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), voices_dir=str(voices_dir),
                       max_model_len=2048, max_reference_bytes=MAX_REFERENCE_BYTES) as served:
        served.voices_dir = voices_dir
        yield served


async def spoken_as(served, voice: str, ws) -> bytes:
    """One utterance in `voice` on the socket: its audio, and the prompt it was asked with checked by the caller."""
    await ws.send(json.dumps({**CONFIG, "voice": voice}))
    await ws.send(text("Hi."))
    await ws.send(DONE)
    _, audio = await until(ws, "session.done")
    return audio


async def test_voice_add_makes_a_clone_that_speaks_in_the_same_socket_and_is_listed(clone_worker, snac_server):
    served = clone_worker
    quiet = await baseline(served, snac_server)
    async with connect(ws_url(served, PATH)) as ws:
        await ws.send(voice_add("ava"))  # first, before any config, as the plugin sends it
        added = json.loads(await ws.recv())
        assert added["type"] == "voice.add.result" and added["success"] is True, added
        assert added["voice"]["name"] == "ava" and added["voice"]["kind"] == "clone" and added["voice"]["frames"] == 24
        await ws.send(json.dumps({"type": "voice.list"}))
        listed = json.loads(await ws.recv())
        assert listed["uploaded_voices"] == ["ava"] and "ava" not in listed["voices"]
        assert len(await spoken_as(served, "ava", ws)) == FRAMES * FRAME_BYTES
        await ws.send(voice_add("ava"))  # the name is taken now
        taken = json.loads(await ws.recv())
        assert taken == {"type": "error", "message": "voice.add refused: a voice named 'ava' exists; DELETE "
                                                    "/v1/voices/ava first"}
    stored = json.loads((served.voices_dir / "ava" / "clone.json").read_text())
    assert stored["transcript"] == TRANSCRIPT and len(stored["frames"]) == 24
    assert clone_prompt_ids(CharTokenizerDouble(), TRANSCRIPT, np.array(stored["frames"]), "Hi.") in \
        served.engine.prompts.values()
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        assert {v["id"]: v["kind"] for v in (await client.get("/v1/voices")).json()["data"]}["ava"] == "clone"
        assert (await client.delete("/v1/voices/ava")).status_code == 200
    assert await settled(served, snac_server, quiet) == NOTHING_HELD


def over(chars: int) -> str:
    """A voice.add whose audio_data is `chars` characters of base64."""
    return json.dumps({"type": "voice.add", "name": "bob", "ref_text": TRANSCRIPT, "audio_data": "A" * chars})


@pytest.mark.parametrize("message, said", [
    (voice_add("tara"), "voice.add refused: a voice named 'tara' exists"),
    (voice_add("bob", audio=b"RIFF not really a wave file"), "could not be decoded"),
    (json.dumps({"type": "voice.add", "name": "bob", "ref_text": TRANSCRIPT, "audio_data": "not base64!"}),
     "audio_data is not base64"),
    (voice_add("bob", ref_text=None), "voice.add requires 'ref_text'"),
    (voice_add("two words"), "name: letters, digits and marks"),
    (over(266_672), f"over this worker's limit of {MAX_REFERENCE_BYTES} bytes"),  # the base64 of 200,001 bytes
    (over(340_000), "message of 340114 characters is over the limit of 332204"),  # unparsed
    (text("x" * 70_000), "only a voice.add may be longer"),
], ids=["name-taken", "undecodable", "bad-base64", "no-ref-text", "bad-name", "over-max-reference-bytes",
        "over-the-message-cap", "large-but-not-voice-add"])
async def test_a_refused_voice_add_writes_nothing_and_the_socket_lives_on(clone_worker, snac_server, message, said):
    served = clone_worker
    quiet = await baseline(served, snac_server)
    before = sorted(served.voices_dir.iterdir())
    async with connect(ws_url(served, PATH)) as ws:
        await ws.send(message)
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and said in error["message"], error
        assert len(await spoken_as(served, "leo", ws)) == FRAMES * FRAME_BYTES
    assert sorted(served.voices_dir.iterdir()) == before
    assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_through_the_front_a_recording_over_the_relay_s_byte_burst_is_added_and_speaks(snac_server, tmp_path):
    recording = wav(9.0)  # 48 kHz stereo: 1.7 MB, 2.3 MB of base64
    message = voice_add("big", audio=recording)
    assert RELAY_LIMITS.byte_burst < len(message) < 16 << 20  # over the relay's burst and the worker's; under uvicorn's
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), voices_dir=str(tmp_path),
                       max_model_len=2048) as served, serve_app(create_front_app([served.url])) as front_port:
        quiet = await baseline(served, snac_server)
        async with connect(f"ws://127.0.0.1:{front_port}{PATH}") as ws:
            await ws.send(message)
            added = json.loads(await ws.recv())
            assert added["type"] == "voice.add.result" and added["voice"]["name"] == "big", added
            assert len(await spoken_as(served, "big", ws)) == FRAMES * FRAME_BYTES
        assert (tmp_path / "big" / "clone.json").exists()
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_with_api_keys_only_a_key_with_the_voices_permission_adds_a_voice(snac_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("speaker:omni-key-0001\nadmin:omni-key-0002::voices\n")
    voices_dir = tmp_path / "voices"
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), voices_dir=str(voices_dir),
                       api_keys_file=str(keys), max_model_len=2048) as served:
        async with connect(ws_url(served, PATH), additional_headers={"Authorization": "Api-Key omni-key-0001"}) as ws:
            await ws.send(voice_add("ava"))
            refused = json.loads(await ws.recv())
            assert refused["type"] == "error" and "'speaker' may not create or delete voices" in refused["message"]
            assert not voices_dir.exists() or list(voices_dir.iterdir()) == []
        async with connect(ws_url(served, PATH), additional_headers={"Authorization": "Api-Key omni-key-0002"}) as ws:
            await ws.send(voice_add("ava"))
            assert json.loads(await ws.recv())["success"] is True
        async with connect(ws_url(served, PATH), additional_headers={"Authorization": "Api-Key omni-key-0001"}) as ws:
            assert len(await spoken_as(served, "ava", ws)) == FRAMES * FRAME_BYTES  # any key speaks with it
