"""The voice registry (llm_server/voices.py): a checkpoint's own voices from its voices.json or --voices,
the aliases, and every front door resolving its voice field through it: OpenAI `voice`, Cartesia
`voice.id`, Deepgram `model` (aura-2-<voice>-<language>); unknown names refused or, for another vendor's
stock ids, spoken in the default voice unless vendor_voice_fallback is off (issue 26, item 1)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from served import (
    NOTHING_HELD,
    CharTokenizerDouble,
    ScriptedEngineDouble,
    baseline,
    body,
    cartesia,
    serving,
    settled,
    ws_url,
)
from websockets.asyncio.client import connect

from llm_server.config import LlmServerConfig
from llm_server.doors.deepgram import voice_of
from llm_server.doors.models import model_entry
from llm_server.speech.prompt import prompt_ids
from llm_server.voices import CHECKPOINT, UnknownVoice, Voice, VoiceRegistry, read_voices_file

FRENCH = ["pierre", {"name": "amelie", "language": "fr"}]


@pytest.fixture
def french_checkpoint(tmp_path):
    """A checkpoint directory whose voices.json names its own speakers (the weights are the engine double's)."""
    (tmp_path / "voices.json").write_text(json.dumps(FRENCH))
    return str(tmp_path)


def test_without_a_voices_file_the_voices_are_the_configured_ones_with_the_openai_aliases(tmp_path):
    voices = VoiceRegistry.of(LlmServerConfig(), str(tmp_path))
    assert voices.names() == ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
    assert voices.default == Voice("tara", CHECKPOINT, "en")
    assert voices.resolve("alloy").name == "tara" and voices.resolve(" Leo ").name == "leo"  # aliases; any case
    with pytest.raises(UnknownVoice, match=r"unknown voice 'thalia'; this server speaks \['tara', 'leah'"):
        voices.resolve("thalia")


def test_a_checkpoints_voices_file_replaces_the_configured_voices_and_drops_aliases_to_voices_it_lacks(french_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="llm_server.voices"):
        voices = VoiceRegistry.of(LlmServerConfig(), french_checkpoint)
    assert voices.voices == [Voice("pierre", CHECKPOINT, None), Voice("amelie", CHECKPOINT, "fr")]
    assert voices.aliases == {}  # OpenAI's names point at the English voices
    assert "aliases left out" in caplog.text and "alloy" in caplog.text
    assert voices.listing() == {"object": "list", "aliases": {}, "unavailable": [], "data": [
        {"id": "pierre", "object": "voice", "name": "pierre", "kind": "checkpoint", "language": None},
        {"id": "amelie", "object": "voice", "name": "amelie", "kind": "checkpoint", "language": "fr"}],
        "voices": [{"voice_id": "pierre", "name": "pierre", "category": "checkpoint"},  # ElevenLabs' list_voices
                   {"voice_id": "amelie", "name": "amelie", "category": "checkpoint"}]}


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not a list"),
    ('{"voices": ["a"]}', "not a list"),
    ('[{"name": "two words"}]', "not a list"),
    ('["tara:"]', "not a list"),
    ('[{"name": "a", "accent": "x"}]', "not a list"),
    ("[]", "lists no voice"),
    ('["same", "SAME"]', "repeat"),
])
def test_a_broken_voices_file_stops_the_worker_saying_what_is_wrong(tmp_path, content, problem):
    (tmp_path / "voices.json").write_text(content)
    with pytest.raises(ValueError, match=problem):
        VoiceRegistry.of(LlmServerConfig(), str(tmp_path))


def test_another_vendors_voice_gets_the_default_voice_with_a_note_unless_the_fallback_is_off():
    voices = VoiceRegistry.of(LlmServerConfig())
    assert voices.resolve_vendor("leah") == (voices.resolve("leah"), None)
    assert voices.resolve_vendor(None) == (voices.default, None)
    chosen, note = voices.resolve_vendor("a0e99841-438c-4a64-b679-ae501e7d6091")
    assert chosen.name == "tara" and "speaking as tara" in note
    strict = VoiceRegistry.of(LlmServerConfig(vendor_voice_fallback=False))
    assert strict.resolve_vendor("leah")[0].name == "leah"
    with pytest.raises(UnknownVoice, match="this server speaks"):
        strict.resolve_vendor("a0e99841-438c-4a64-b679-ae501e7d6091")


@pytest.mark.parametrize("model, voice", [("aura-2-tara-en", "tara"), ("aura-amelie-fr", "amelie"), ("aura-2-유나-ko", "유나"),
                                          ("aura-2-pierre-fr-CA", "pierre"), ("leo", "leo"), (None, None)])
def test_deepgram_model_names_ask_for_a_voice(model, voice):
    assert voice_of(model) == voice


def test_deepgram_lists_each_voice_as_the_model_name_that_asks_for_it():
    entry = model_entry(Voice("amelie", CHECKPOINT, "fr"))
    assert entry["canonical_name"] == "aura-2-amelie-fr" and entry["languages"] == ["fr"]
    assert voice_of(entry["canonical_name"]) == "amelie"
    assert entry["uuid"] == model_entry(Voice("amelie", CHECKPOINT, "fr"))["uuid"] != model_entry(Voice("pierre", CHECKPOINT))["uuid"]


def test_the_voices_file_format_reads_names_in_any_script_and_languages(tmp_path):
    path = tmp_path / "voices.json"
    path.write_text(json.dumps([*FRENCH, {"name": "유나", "language": "ko"}], ensure_ascii=False))
    assert read_voices_file(path) == [Voice("pierre", CHECKPOINT), Voice("amelie", CHECKPOINT, "fr"), Voice("유나", CHECKPOINT, "ko")]


async def test_every_door_speaks_the_checkpoints_own_voices(snac_server, french_checkpoint):
    engine = ScriptedEngineDouble(frames=3)
    async with serving(snac_server, engine, model_dir=french_checkpoint) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            listed = (await client.get("/v1/voices")).json()
            models = (await client.get("/v1/models")).json()
            openai = await client.post("/v1/audio/speech", json=body("Bonjour.", voice="amelie"))
            refused = await client.post("/v1/audio/speech", json=body("Bonjour.", voice="tara"))
            cartesia_reply = await client.post("/tts/bytes", json={
                "model_id": "sonic-3", "transcript": "Salut.", "voice": {"mode": "id", "id": "pierre"},
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}})
        async with connect(ws_url(served, "/v1/speak?model=aura-2-amelie-fr")) as ws:
            metadata = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "Speak", "text": "Merci."}))
            await ws.send(json.dumps({"type": "Flush"}))
            while isinstance(message := await ws.recv(), bytes):
                pass
    assert [v["name"] for v in listed["data"]] == ["pierre", "amelie"]
    assert {m["canonical_name"] for m in models["tts"]} == {"aura-2-pierre-en", "aura-2-amelie-fr"}
    assert openai.status_code == 200 and cartesia_reply.status_code == 200
    assert refused.status_code == 400
    assert refused.json()["error"] == {"message": refused.json()["error"]["message"], "type": "invalid_request_error",
                                       "param": "voice", "code": None}
    assert "unknown voice 'tara'" in refused.json()["error"]["message"] and "['pierre', 'amelie']" in refused.json()["error"]["message"]
    assert metadata["model_name"] == "amelie" and json.loads(message)["type"] == "Flushed"  # no Warning: a voice of its own
    tokenizer = CharTokenizerDouble()
    assert sorted(engine.prompts.values()) == sorted([prompt_ids(tokenizer, "amelie", "Bonjour."),
                                                      prompt_ids(tokenizer, "pierre", "Salut."),
                                                      prompt_ids(tokenizer, "amelie", "Merci.")])


async def test_with_the_fallback_off_another_vendors_voice_is_refused_in_each_protocol_and_nothing_is_held(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=3), vendor_voice_fallback=False) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, "/tts/websocket")) as ws:
            await ws.send(cartesia("c1", "Hello.", more=False, voice={"mode": "id", "id": "a0e99841-438c-4a64-b679-ae501e7d6091"}))
            error = json.loads(await ws.recv())
            await ws.send(cartesia("c2", "Hello.", more=False, voice={"mode": "id", "id": "leo"}))  # the socket lives on
            spoken = [json.loads(await ws.recv()) for _ in range(2)]
        async with connect(ws_url(served, "/v1/speak?model=aura-2-thalia-en")) as ws:
            deepgram_error = json.loads(await ws.recv())
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            deepgram_http = await client.post("/v1/speak?model=aura-2-thalia-en", json={"text": "Hi."})
        assert await settled(served, snac_server, quiet) == NOTHING_HELD
    assert error["type"] == "error" and error["context_id"] == "c1" and error["status_code"] == 400
    assert "unknown voice 'a0e99841-438c-4a64-b679-ae501e7d6091'" in error["error"] and "'leo'" in error["error"]
    assert spoken[0]["context_id"] == "c2" and spoken[0]["type"] == "chunk"
    assert deepgram_error["type"] == "Error" and "unknown voice 'thalia'" in deepgram_error["err_msg"]
    assert deepgram_http.status_code == 400 and "unknown voice 'thalia'" in deepgram_http.json()["error"]["message"]
