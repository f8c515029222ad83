"""LoRA voices (issue 26, item 2): a PEFT adapter directory in the voices directory is a voice, named by its
directory, served through vLLM's multi-LoRA; the directory is re-read while serving. The directory and HTTP tests
here use the engine double; on the real vLLM CPU engine (adapters made for the `tiny` checkpoint, a mixed batch,
vLLM's refusals, an adapter added and removed while it runs): tests/test_vllm_engine.py, whose engines they share."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import httpx
import pytest
from served import NOTHING_HELD, CharTokenizerDouble, ScriptedEngineDouble, baseline, body, serving, settled

from llm_server.config import LlmServerConfig
from llm_server.runtime import lora_enabled
from llm_server.speech.prompt import prompt_ids
from llm_server.voices import CHECKPOINT, LORA, VoiceRegistry, VoicesDirectory


def peft_dir(path, rank: int = 8, peft_type: str = "LORA", **about):
    """A directory that looks like a PEFT adapter to the registry (the engine double loads nothing)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": rank}))
    if about:
        (path / "voice.json").write_text(json.dumps(about))
    return path


# --- the directory, with the engine double ---------------------------------------------------------------

async def test_an_adapter_directory_is_a_lora_voice_named_by_it_and_listed_with_its_kind(tmp_path):
    peft_dir(tmp_path / "ava")
    peft_dir(tmp_path / "bob", speaker="tara", language="fr")
    registry, engine = VoiceRegistry.of(LlmServerConfig()), ScriptedEngineDouble()
    assert await VoicesDirectory(str(tmp_path)).refresh(registry, engine.load_adapter)
    ava, bob = registry.resolve("AVA"), registry.resolve("bob")
    assert (ava.kind, ava.prompt_name, ava.adapter.path) == (LORA, "ava", str(tmp_path / "ava"))
    assert (bob.prompt_name, bob.language) == ("tara", "fr")  # voice.json: the speaker the adapter was trained on
    assert ava.adapter.id != bob.adapter.id and ava.adapter.name != bob.adapter.name
    assert [a.path for a in engine.loaded] == [str(tmp_path / "ava"), str(tmp_path / "bob")]
    listed = {v["id"]: v["kind"] for v in registry.listing()["data"]}
    assert listed["ava"] == listed["bob"] == LORA and listed["tara"] == CHECKPOINT


async def test_what_is_not_a_usable_adapter_is_logged_and_not_offered_while_the_rest_are(tmp_path, caplog):
    peft_dir(tmp_path / "good")
    peft_dir(tmp_path / "prefix", peft_type="PREFIX_TUNING")
    peft_dir(tmp_path / "two words")
    peft_dir(tmp_path / "tara")  # the checkpoint's voice keeps its name
    peft_dir(tmp_path / "broken")
    (tmp_path / "broken" / "voice.json").write_text("{not json")
    peft_dir(tmp_path / "refused")
    (tmp_path / "empty").mkdir()  # holds no voice (yet)
    (tmp_path / ".staging").mkdir()  # a voice being written (clones.py): not looked at
    (tmp_path / "short-frames").mkdir()
    (tmp_path / "short-frames" / "clone.json").write_text(json.dumps({"transcript": "Hi.", "frames": [[1, 2, 3]]}))
    registry, engine = VoiceRegistry.of(LlmServerConfig()), ScriptedEngineDouble()
    engine.unloadable.add(str(tmp_path / "refused"))
    with caplog.at_level(logging.WARNING, logger="llm_server.voices"):
        await VoicesDirectory(str(tmp_path)).refresh(registry, engine.load_adapter)
    assert sorted(v.name for v in registry.voices if v.kind == LORA) == ["good"]
    assert [a.path for a in engine.loaded] == [str(tmp_path / "good")]
    assert registry.resolve("tara").kind == CHECKPOINT
    for said in ("peft_type 'PREFIX_TUNING'", "'two words'", "'tara' (", "checkpoint has a voice of that name",
                 "'broken'", "scripted refusal", "'short-frames'", "every frame holds 7 codes"):
        assert said in caplog.text
    assert ".staging" not in caplog.text
    # GET /v1/voices lists each with why, so an operator sees it without the worker's log (issue 44, finding 4)
    why = {v["id"]: v["reason"] for v in registry.listing()["unavailable"]}
    assert sorted(why) == ["broken", "prefix", "refused", "short-frames", "tara", "two words"]
    assert "scripted refusal" in why["refused"] and "PREFIX_TUNING" in why["prefix"]


async def test_a_voice_mended_in_place_is_offered_and_no_longer_listed_as_unavailable(tmp_path):
    registry, engine = VoiceRegistry.of(LlmServerConfig()), ScriptedEngineDouble()
    voices = VoicesDirectory(str(tmp_path))
    peft_dir(tmp_path / "ava")
    (tmp_path / "ava" / "voice.json").write_text("{not json")
    engine.unloadable.add(str(tmp_path / "bob"))
    peft_dir(tmp_path / "bob")
    await voices.refresh(registry, engine.load_adapter)
    assert [v["id"] for v in registry.listing()["unavailable"]] == ["ava", "bob"]
    (tmp_path / "ava" / "voice.json").write_text('{"speaker": "tara"}')
    engine.unloadable.clear()
    (tmp_path / "bob" / "adapter_model.safetensors").write_bytes(b"retrained")
    assert await voices.refresh(registry, engine.load_adapter)
    assert registry.resolve("ava").prompt_name == "tara" and registry.resolve("bob").kind == LORA
    assert registry.listing()["unavailable"] == []


async def test_the_directory_is_read_again_only_when_it_changes_and_a_changed_adapter_is_a_new_one(tmp_path):
    registry, engine = VoiceRegistry.of(LlmServerConfig()), ScriptedEngineDouble()
    voices = VoicesDirectory(str(tmp_path / "voices"))  # not there yet: no voices of its own
    assert await voices.refresh(registry, engine.load_adapter) and registry.get("ava") is None
    peft_dir(tmp_path / "voices" / "ava")
    assert await voices.refresh(registry, engine.load_adapter)
    first = registry.resolve("ava").adapter
    assert not await voices.refresh(registry, engine.load_adapter) and len(engine.loaded) == 1
    (tmp_path / "voices" / "ava" / "adapter_model.safetensors").write_bytes(b"new weights")
    assert await voices.refresh(registry, engine.load_adapter)
    second = registry.resolve("ava").adapter
    assert second.id != first.id and second.name != first.name and len(engine.loaded) == 2
    shutil.rmtree(tmp_path / "voices" / "ava")
    assert await voices.refresh(registry, engine.load_adapter) and registry.get("ava") is None


def test_lora_is_on_in_the_engine_only_when_an_adapter_is_there_at_start_unless_configured(tmp_path):
    assert not lora_enabled(LlmServerConfig())
    assert not lora_enabled(LlmServerConfig(voices_dir=str(tmp_path)))  # empty: LoRA would only cost
    peft_dir(tmp_path / "ava")
    assert lora_enabled(LlmServerConfig(voices_dir=str(tmp_path)))
    assert not lora_enabled(LlmServerConfig(voices_dir=str(tmp_path), enable_lora=False))
    assert lora_enabled(LlmServerConfig(enable_lora=True))


async def test_an_adapter_added_while_serving_becomes_a_voice_and_one_removed_is_refused_after_its_stream_ends(
        snac_server, tmp_path):
    voices_dir = tmp_path / "voices"
    voices_dir.mkdir()
    engine = ScriptedEngineDouble(frames=96, batch_delay_s=0.01)
    async with serving(snac_server, engine, voices_dir=str(voices_dir), voices_poll_s=0.05) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=30) as client:
        before = await baseline(served, snac_server)
        assert "ava" not in [v["id"] for v in (await client.get("/v1/voices")).json()["data"]]
        peft_dir(voices_dir / "ava", speaker="tara")
        await _until(lambda: served.runtime.voices.get("ava") is not None)
        listing = await client.get("/v1/voices")
        assert {v["id"]: v for v in listing.json()["data"]}["ava"]["kind"] == LORA
        assert listing.headers["x-loaded-voices"] == "ava"  # loaded when found: the front routes ava's requests here

        async with client.stream("POST", "/v1/audio/speech", json=body("Hi.", voice="ava")) as response:
            assert response.status_code == 200
            chunks = response.aiter_bytes()
            received = len(await anext(chunks))
            shutil.rmtree(voices_dir / "ava")  # mid-stream
            await _until(lambda: served.runtime.voices.get("ava") is None)
            received += sum([len(c) async for c in chunks])
        assert received == 96 * 2048 * 2  # every frame of the stream that began with the adapter
        (request_id, adapter), = [(r, a) for r, a in engine.adapters.items() if a is not None]
        assert adapter.path == str(voices_dir / "ava")
        assert engine.prompts[request_id] == prompt_ids(CharTokenizerDouble(), "tara", "Hi.")  # voice.json's speaker

        refused = await client.post("/v1/audio/speech", json=body("Hi.", voice="ava"))
        assert refused.status_code == 400 and "unknown voice 'ava'" in refused.json()["error"]["message"]
        assert "x-loaded-voices" not in refused.headers  # gone with its voice
        assert await settled(served, snac_server, before) == NOTHING_HELD


async def _until(condition, within_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the voices directory was not read again in time"
        await asyncio.sleep(0.02)


def test_the_cpu_expand_op_leaves_rows_without_an_adapter_as_they_were_where_vllms_own_adds_the_last_adapter():
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    from llm_server.engine.cpu_lora import skip_no_lora_rows

    torch.manual_seed(0)
    inputs, weights = torch.randn(3, 4), torch.randn(2, 1, 5, 4)  # 3 tokens of rank 4; 2 adapter slots, 5 outputs
    indices = torch.tensor([0, -1, 1])  # the middle token uses no adapter
    original = getattr(lora_ops.bgmv_expand, "__wrapped__", lora_ops.bgmv_expand)  # vLLM's own op
    start = torch.randn(3, 5)
    theirs, ours = start.clone(), start.clone()
    original(inputs, weights, theirs, indices, add_inputs=True)
    skip_no_lora_rows(original)(inputs, weights, ours, indices, add_inputs=True)
    assert torch.allclose(theirs[1], start[1] + weights[-1, 0] @ inputs[1])  # vLLM 0.32's: the last slot's adapter
    assert torch.equal(ours[1], start[1])  # no adapter, no change (what the GPU kernels do)
    assert torch.equal(ours[[0, 2]], theirs[[0, 2]])  # the adapters' rows as vLLM computes them


def test_a_max_lora_rank_vllm_does_not_take_is_refused_with_the_ones_it_does():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"max_lora_rank must be one of vLLM's \(1, 8, 16, 32"):
        LlmServerConfig(max_lora_rank=12)
