"""The GPU profiles' engines at full tilt, as the chart hands their settings to the workers, are the CUDA image's
vLLM's to take (issue 25): that release's own config objects (vLLM 0.33: deploy/docker/cuda-pins.txt) are built
from the rendered settings through the worker's own engine_args(), by tests/engine_config_probe.py with the
release's Python files on the path (deploy/tools/fetch_vllm_gpu.py; `make test` fetches them into .vllm-gpu)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from llm_server.config import LlmServerConfig
from llm_server.model_source import resolve_model
from llm_server.prompt import prompt_ids
from llm_server.selfcheck import ORPHEUS_3B_CONFIG
from megapod.cluster import PROFILES
from megapod.render import HelmRender, find_helm, parse_manifests

REPO = Path(__file__).resolve().parent.parent
VLLM_GPU = REPO / ".vllm-gpu"
PROBE = Path(__file__).resolve().parent / "engine_config_probe.py"
GPU_PROFILES = ("h100", "h100-fp8")


def _pinned_vllm() -> str:
    pins = (REPO / "deploy" / "docker" / "cuda-pins.txt").read_text().splitlines()
    return next(line.split("==")[1] for line in pins if line.startswith("vllm=="))


def rendered_settings(profile: str) -> LlmServerConfig:
    """The worker's settings as its pod gets them: the profile rendered by `megapod deploy`'s helm call,
    the LLM container's ORPHEUS_* variables parsed by the worker's own loader."""
    objects = parse_manifests(HelmRender(PROFILES[profile]).run(find_helm()))
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-llm")]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "llm-server"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e and e["name"].startswith("ORPHEUS_")}
    return LlmServerConfig.from_cli([], env)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    """Each GPU profile through vLLM 0.33's configs, plus the fp8 profile with an e5m2 KV cache (refused)."""
    assert (VLLM_GPU / "vllm").is_dir(), "`make test` fetches vLLM's CUDA release into .vllm-gpu"
    model_dir = tmp_path_factory.mktemp("orpheus-3b-architecture")
    shutil.copy(ORPHEUS_3B_CONFIG, model_dir / "config.json")
    cases = {name: rendered_settings(name) for name in GPU_PROFILES}
    cases["h100-fp8-e5m2"] = cases["h100-fp8"].replace(kv_cache_dtype="fp8_e5m2")
    settings = [json.loads(c.model_dump_json()) for c in cases.values()]
    env = {**os.environ, "PYTHONPATH": f"{VLLM_GPU}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, str(PROBE), json.dumps(settings), str(model_dir)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(cases, json.loads(done.stdout.splitlines()[-1])))


@cache
def longest_prompt() -> int:
    """Tokens of the longest prompt one segment makes: the most characters a segment holds, in words, with the
    longest voice name (the tiny checkpoint carries Orpheus's tokenizer)."""
    from transformers import AutoTokenizer

    config = LlmServerConfig()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny", config.cache_dir))
    text = ("Thanks for calling, how can I help you today? " * 20)[: config.max_segment_chars]
    return max(len(prompt_ids(tokenizer, voice, text)) for voice in config.voices)


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_the_profile_is_vllm_0_33s_to_take(resolved, profile):
    got = resolved[profile]
    assert "error" not in got, got
    assert got["vllm"] == _pinned_vllm() and got["platform"] == "HopperStandIn"


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_h100_engines_run_at_full_tilt(resolved, profile):
    got = resolved[profile]
    assert got["max_num_seqs"] >= 512
    # every batch the profile may admit replays a CUDA Graph (vLLM's own default stops at 512)
    assert got["max_cudagraph_capture_size"] >= got["max_num_seqs"]
    # a new stream's whole prompt fits one step beside a full batch of decodes: chunked prefill never needs
    # to split an Orpheus prompt, and no prompt waits for the step budget
    assert got["chunked_prefill"] and got["max_num_batched_tokens"] >= got["max_num_seqs"] + longest_prompt()
    assert got["prefix_caching"]  # every request of a voice starts with the same prompt prefix
    # async scheduling stays on beside the frame constraint's logits processor: vLLM 0.33 refuses it (raises)
    # only for some speculative decoding methods and pipeline parallelism
    assert got["async_scheduling"] is True and got["scheduler"] == "AsyncScheduler"
    assert got["logits_processors"] == ["FrameConstraintV1"]
    assert got["attention_backend"].endswith("FLASHINFER") and got["trtllm_attention"] is True


def test_h100_is_bf16_and_h100_fp8_quantizes_weights_and_kv_cache_as_they_load(resolved):
    bf16, fp8 = resolved["h100"], resolved["h100-fp8"]
    assert (bf16["quantization"], bf16["kv_cache_dtype"]) == (None, "auto")
    # fp8_per_tensor: one of 0.33's online shorthands, quantizing the bf16 checkpoint's weights as they load
    assert fp8["quantization"] == "fp8_per_tensor" and fp8["quantization_known"] and fp8["quantization_online"]
    assert fp8["kv_cache_dtype"] == "fp8"  # e4m3, the format TRT-LLM attention reads


def test_an_e5m2_kv_cache_under_trtllm_attention_is_refused_before_vllm_starts(resolved):
    assert "reads fp8 KV caches as e4m3 only" in resolved["h100-fp8-e5m2"]["error"]
