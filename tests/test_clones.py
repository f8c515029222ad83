"""Clone voices (issue 26, item 3): POST /v1/voices turns a recording and its transcript into a voice through the
codec tier's Encode (a real replica of the test codec), stored in the voices directory; its requests carry the
zero-shot prompt; DELETE removes it; every refusal is a 4xx saying why, with nothing written and nothing held.
The engine is the test double (the prompt it receives is what is checked); the prefix cache on the real engine
is in test_vllm_engine.py."""

from __future__ import annotations

import io
import json
import wave

import httpx
import numpy as np
import pytest
import pytest_asyncio
from served import NOTHING_HELD, CharTokenizerDouble, ScriptedEngineDouble, baseline, body, serving, settled

from llm_server.engine.audio_tokens import (AUDIO_TOKEN_BASE, BEGIN_OF_TEXT, END_OF_AI, END_OF_HUMAN, END_OF_SPEECH,
                                     END_OF_TURN, START_OF_AI, START_OF_HUMAN, START_OF_SPEECH)

TRANSCRIPT = "The quick brown fox jumps over the lazy dog."


def wav(seconds: float, rate: int = 48000, channels: int = 2, amplitude: float = 0.3) -> bytes:
    """A generated WAV: a tone with some noise, s16, at `rate` with `channels` (resampled and mixed by the server)."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(1)
    mono = amplitude * (np.sin(2 * np.pi * 220 * t) + 0.1 * rng.standard_normal(t.size)) / 1.1
    samples = np.repeat((mono * 32767).astype("<i2")[:, None], channels, axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return out.getvalue()


def form(name: str = "ava", transcript: str = TRANSCRIPT, audio: bytes | None = None, **more) -> dict:
    return {"data": {"name": name, "transcript": transcript, **more},
            "files": {"audio": ("reference.wav", wav(2.0) if audio is None else audio, "audio/wav")}}


@pytest_asyncio.fixture(scope="module")
async def clone_worker(snac_server, tmp_path_factory):
    voices_dir = tmp_path_factory.mktemp("voices")
    async with serving(snac_server, ScriptedEngineDouble(frames=12), voices_dir=str(voices_dir),
                       max_model_len=2048) as served:
        served.voices_dir = voices_dir
        yield served


@pytest_asyncio.fixture
async def client(clone_worker):
    async with httpx.AsyncClient(base_url=clone_worker.url, timeout=120) as c:
        yield c


async def test_a_clone_made_from_a_recording_is_listed_and_speaks_with_the_zero_shot_prompt(clone_worker, client):
    made = await client.post("/v1/voices", **form("ava"))
    assert made.status_code == 201, made.text
    stored = json.loads((clone_worker.voices_dir / "ava" / "clone.json").read_text())
    frames = stored["frames"]
    assert made.json()["frames"] == len(frames) == 24  # 2 s at 24 kHz: 48,000 samples, 23.4 frames, padded to 24
    assert stored["transcript"] == TRANSCRIPT and all(len(f) == 7 and max(f) < 4096 for f in frames)
    assert {v["id"]: v["kind"] for v in (await client.get("/v1/voices")).json()["data"]}["ava"] == "clone"

    spoken = await client.post("/v1/audio/speech", json=body("Hi.", voice="ava"))
    assert spoken.status_code == 200 and len(spoken.content) == 12 * 2048 * 2
    request_id = next(r for r, p in clone_worker.engine.prompts.items() if len(p) > 100)
    text = CharTokenizerDouble().encode
    audio = [AUDIO_TOKEN_BASE + slot * 4096 + code for frame in frames for slot, code in enumerate(frame)]
    assert clone_worker.engine.prompts[request_id] == [
        START_OF_HUMAN, BEGIN_OF_TEXT, *text(TRANSCRIPT), END_OF_TURN, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH,
        *audio, END_OF_SPEECH, END_OF_AI,
        START_OF_HUMAN, BEGIN_OF_TEXT, *text("Hi."), END_OF_TURN, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
    assert clone_worker.engine.adapters[request_id] is None

    gone = await client.delete("/v1/voices/ava")
    assert gone.status_code == 200 and gone.json() == {"id": "ava", "object": "voice.deleted", "deleted": True}
    assert not (clone_worker.voices_dir / "ava").exists()
    assert "ava" not in [v["id"] for v in (await client.get("/v1/voices")).json()["data"]]
    assert (await client.post("/v1/audio/speech", json=body("Hi.", voice="ava"))).status_code == 400
    assert (await client.delete("/v1/voices/ava")).status_code == 404


@pytest.mark.parametrize("request_form, status, said", [
    (form(audio=b"RIFF not really a wave file"), 400, "could not be decoded"),
    (form(audio=wav(1.0, amplitude=0.0)), 400, "holds no sound"),
    (form(audio=wav(31.0, rate=8000, channels=1)), 400, "longer than 30 s"),
    (form(transcript="   "), 400, "transcript"),
    (form(transcript="x" * 1001), 400, "transcript"),
    (form(name="two words"), 400, "name"),
    (form(name="tara"), 409, "a voice named 'tara' exists"),
    (form(name="alloy"), 409, "a voice named 'alloy' exists"),  # an alias
    ({"data": {"name": "ava"}, "files": {"audio": ("r.wav", wav(1.0), "audio/wav")}}, 400, "transcript"),
    ({"data": {"name": "ava", "transcript": TRANSCRIPT}}, 400, "audio"),
], ids=["undecodable", "silent", "too-long", "blank-transcript", "long-transcript", "bad-name", "taken", "alias",
        "no-transcript", "no-audio"])
async def test_what_cannot_be_a_voice_is_refused_saying_why_with_nothing_written_or_held(
        clone_worker, client, snac_server, request_form, status, said):
    before = await baseline(clone_worker, snac_server)
    refused = await client.post("/v1/voices", **request_form)
    assert refused.status_code == status and said in refused.json()["error"]["message"], refused.text
    assert list(clone_worker.voices_dir.iterdir()) == []
    assert await settled(clone_worker, snac_server, before) == NOTHING_HELD


async def test_an_upload_over_max_reference_bytes_is_413_before_it_is_read(snac_server, tmp_path):
    async with serving(snac_server, voices_dir=str(tmp_path), max_reference_bytes=100_000) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=60) as c:
        refused = await c.post("/v1/voices", **form(audio=wav(3.0)))
    assert refused.status_code == 413 and list(tmp_path.iterdir()) == []


async def test_a_reference_whose_prompt_leaves_no_room_for_speech_in_the_context_is_refused(snac_server, tmp_path):
    async with serving(snac_server, voices_dir=str(tmp_path), max_model_len=200) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=60) as c:
        refused = await c.post("/v1/voices", **form(audio=wav(2.0)))  # 24 frames: 168 audio tokens
    assert refused.status_code == 400 and "200-token context (max_model_len)" in refused.json()["error"]["message"]
    assert list(tmp_path.iterdir()) == []


async def test_without_a_voices_directory_clones_are_not_made_and_only_clones_are_deleted(snac_server, clone_worker,
                                                                                       client):
    async with serving(snac_server) as served, httpx.AsyncClient(base_url=served.url, timeout=60) as c:
        refused = await c.post("/v1/voices", **form())
    assert refused.status_code == 501 and "--voices-dir" in refused.json()["error"]["message"]
    kept = await client.delete("/v1/voices/tara")
    assert kept.status_code == 409 and "checkpoint voice" in kept.json()["error"]["message"]


async def test_with_api_keys_only_a_key_with_the_voices_permission_makes_or_deletes_voices(snac_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("speaker:speaker-key-0001\nadmin:admin-key-00001::voices\n")
    voices_dir = tmp_path / "voices"
    async with serving(snac_server, voices_dir=str(voices_dir), api_keys_file=str(keys)) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=60) as c:
        speaker, admin = ({"Authorization": f"Bearer {k}"} for k in ("speaker-key-0001", "admin-key-00001"))
        refused = await c.post("/v1/voices", headers=speaker, **form())
        assert refused.status_code == 403 and "may not create or delete voices" in refused.json()["error"]["message"]
        assert (await c.post("/v1/voices", **form())).status_code == 401
        assert (await c.post("/v1/voices", headers=admin, **form())).status_code == 201
        assert (await c.delete("/v1/voices/ava", headers=speaker)).status_code == 403
        assert (await c.post("/v1/audio/speech", headers=speaker, json=body("Hi.", voice="ava"))).status_code == 200
        assert (await c.delete("/v1/voices/ava", headers=admin)).status_code == 200


async def test_a_read_only_voices_directory_serves_its_voices_and_refuses_to_change_them(snac_server, tmp_path,
                                                                                       monkeypatch):
    """The chart's llm.voices.readOnly mounts the claim read-only. Root (these tests) may write anywhere, so the
    read-only mount is stood in for by os.access answering as it does on one (EROFS)."""
    (tmp_path / "ava").mkdir()
    (tmp_path / "ava" / "clone.json").write_text(json.dumps({"transcript": "Hi.", "frames": [[1, 2, 3, 4, 5, 6, 7]]}))
    monkeypatch.setattr("llm_server.clones.os.access", lambda path, mode: False)
    async with serving(snac_server, voices_dir=str(tmp_path)) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=60) as c:
        await served.runtime.refresh_voices()
        assert (await c.post("/v1/audio/speech", json=body("Hi.", voice="ava"))).status_code == 200
        for refused in (await c.post("/v1/voices", **form("bob")), await c.delete("/v1/voices/ava")):
            assert refused.status_code == 501 and "read-only" in refused.json()["error"]["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ava"]
