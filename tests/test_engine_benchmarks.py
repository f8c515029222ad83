"""Smoke tests of the benchmarks that measure the worker's vLLM engine on this CPU (tiny checkpoint):
clone_first_audio_cpu.py (a clone voice's first audio, first request against later ones) and lora_cpu.py (what
LoRA voices cost), each given one engine started here for both (prefix caching on, LoRA on with four adapters a
batch, eager as the tests' engines are, 1 GiB of KV cache), where each used to start one or two of its own in a
subprocess: a vLLM start is most of either's cost. Their own engines are the same VllmEngine with one setting
each. Figures are only checked to be readings: performance is claimed from benchmark runs."""

from __future__ import annotations

import json

import pytest_asyncio
from processes import TINY_CACHE

from benchmarks import clone_first_audio_cpu, lora_cpu
from llm_server.config import LlmServerConfig
from llm_server.engine.model_source import resolve_model
from llm_server.engine.vllm import VllmEngine


@pytest_asyncio.fixture(scope="module")
async def engine():
    config = LlmServerConfig(cache_dir=TINY_CACHE, device="cpu", enforce_eager=True, max_model_len=1024,
                             max_num_seqs=16, enable_prefix_caching=True, enable_lora=True,
                             max_loras=lora_cpu.VOICES, max_lora_rank=lora_cpu.RANK, cpu_kv_cache_gb=1)
    engine = VllmEngine(config, resolve_model("tiny", TINY_CACHE))
    await engine.start()
    yield engine
    await engine.shutdown()


async def test_a_clone_voice_s_first_and_later_requests_are_timed(engine, tmp_path, capsys):
    out = tmp_path / "clone.json"
    args = clone_first_audio_cpu.parse_args(["--voices", "1", "--reference-s", "2", "--prefix-caching", "on",
                                             "--enforce-eager", "--cache-dir", TINY_CACHE, "--out", str(out)])
    await clone_first_audio_cpu.run(args, engine)
    result = json.loads(out.read_text())
    [run] = result["runs"]
    assert run["prefix_caching"] and result["voices"] == 1 and result["reference_s"] == 2 and result["enforce_eager"]
    assert len(run["first_readings_ms"]) == 1 and len(run["later_readings_ms"]) == 4
    assert run["first_request_ms"] > 0 and run["later_requests_ms"] > 0
    assert run["reference_frames"] == 23 and run["prompt_tokens"] > 23 * 7  # 2 s of reference: 23 frames
    assert "prefix caching on : first frame" in capsys.readouterr().out


async def test_every_case_of_the_lora_engine_is_measured(engine, tmp_path, capsys):
    out = tmp_path / "lora.json"
    args = lora_cpu.parse_args(["--streams", "2", "--tokens", "29", "--repeats", "1", "--lora", "on",
                                "--enforce-eager", "--cache-dir", TINY_CACHE, "--out", str(out)])
    await lora_cpu.run(args, engine)
    result = json.loads(out.read_text())
    cases = {c["case"]: c for c in result["cases"]}
    assert list(cases) == ["lora on, unused", "one lora voice", "4 lora voices"]
    assert all(c["tokens_per_s"] > 0 and len(c["readings"]) == 1 for c in cases.values())
    assert all(c["engine_start_s"] is None for c in cases.values()), "the engine was given, not started"
    assert all(c["relative_to_lora_off"] is None for c in cases.values()), "no reference was run"
    assert result["streams"] == 2 and result["rank"] == 16 and result["enforce_eager"]
    assert "peft" in result["provenance"]["versions"]
    assert "4 lora voices" in capsys.readouterr().out
