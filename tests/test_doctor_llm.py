"""The doctor's LLM plan and its attention comparisons, without starting an engine: the main run takes the
worker's default attention (auto); FlashInfer + TRT-LLM is a comparison that runs only where FlashInfer's
precompiled kernels are installed, and otherwise says what is missing (issue 24, finding 3)."""

from __future__ import annotations

import importlib.metadata

import pytest

import llm_server.selfcheck as llm
from llm_server.config import LlmServerConfig
from processes import TINY_CACHE

FLASHINFER = "0.7.2.post1"
ALL_KERNELS = {"flashinfer-python": FLASHINFER, "flashinfer-cubin": FLASHINFER,
               "flashinfer-jit-cache": f"{FLASHINFER}+cu130"}


@pytest.fixture
def installed(monkeypatch):
    """Pretend these distributions (name -> version) are the only ones installed."""
    packages: dict[str, str] = {}

    def version(name: str) -> str:
        if name not in packages:
            raise importlib.metadata.PackageNotFoundError(name)
        return packages[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    return packages


def test_gpu_plan_runs_the_workers_default_attention(tmp_path):
    config = llm.plan("cuda", tmp_path, TINY_CACHE, quick=False).config
    defaults = LlmServerConfig()
    assert (config.attention_backend, config.trtllm_attention) == (defaults.attention_backend, defaults.trtllm_attention)
    assert (config.attention_backend, config.trtllm_attention) == ("auto", "auto")


def test_gpu_plan_compares_flashinfer_with_trtllm_on_and_off(tmp_path):
    comparisons = llm.plan("cuda", tmp_path, TINY_CACHE, quick=False).comparisons
    assert [c.settings for c in comparisons] == [
        {"attention_backend": "FLASHINFER", "trtllm_attention": "on"},
        {"attention_backend": "FLASHINFER", "trtllm_attention": "off"}]


def test_cpu_plan_has_no_attention_comparisons(tmp_path):
    assert llm.plan("cpu", tmp_path, TINY_CACHE, quick=True).comparisons == ()


def test_missing_cubin_is_named_with_its_install(installed):
    installed.update(ALL_KERNELS)
    del installed["flashinfer-cubin"]
    reason = llm.missing_kernel_packages("13.0", {})
    assert reason.startswith("flashinfer-cubin not installed")
    assert f"pip install flashinfer-cubin=={FLASHINFER}`" in reason and "vllm download-kernels" in reason
    assert "jit-cache" not in reason  # installed, at flashinfer's version


def test_all_kernel_packages_present(installed):
    installed.update(ALL_KERNELS)
    assert llm.missing_kernel_packages("13.0", {}) is None


def test_a_cubin_of_another_version_counts_as_missing(installed):
    installed.update(ALL_KERNELS, **{"flashinfer-cubin": "0.6.13"})
    assert llm.missing_kernel_packages("13.0", {}).startswith(
        f"flashinfer-cubin 0.6.13 does not match flashinfer-python {FLASHINFER}")


def test_jit_cache_is_needed_from_cuda_12_9_only(installed):
    installed.update({k: v for k, v in ALL_KERNELS.items() if k != "flashinfer-jit-cache"})
    assert llm.missing_kernel_packages("12.8", {}) is None
    reason = llm.missing_kernel_packages("12.9", {})
    assert reason.startswith("flashinfer-jit-cache not installed")
    assert f"flashinfer-jit-cache=={FLASHINFER}+cu129" in reason


def test_vllm_has_flashinfer_cubin_stands_for_the_cubin_package(installed):
    installed.update({k: v for k, v in ALL_KERNELS.items() if k != "flashinfer-cubin"})
    assert llm.missing_kernel_packages("13.0", {"VLLM_HAS_FLASHINFER_CUBIN": "1"}) is None


def test_no_flashinfer_at_all(installed):
    assert llm.missing_kernel_packages("13.0", {}).startswith("flashinfer-python is not installed")


@pytest.mark.parametrize("capability, supported", [((9, 0), True), ((10, 0), True), ((10, 3), True), ((12, 0), True),
                                                    ((8, 0), False), ((8, 9), False), (None, False)])
def test_trtllm_needs_hopper_blackwell(capability, supported):
    assert (llm.trtllm_unsupported(capability) is None) == supported


@pytest.mark.parametrize("engine, on_ok, off_ok", [
    ({"backends": ["FLASHINFER"], "trtllm_decode": "xqa"}, True, False),
    ({"backends": ["FLASHINFER"], "trtllm_decode": "none"}, False, True),  # TRT-LLM silently off
    ({"backends": ["FLASH_ATTN"], "trtllm_decode": "none"}, False, False),  # not FlashInfer at all
])
def test_kernels_as_asked(engine, on_ok, off_ok):
    on, off = llm.GPU_COMPARISONS
    assert llm.kernels_as_asked(on, engine) == on_ok and llm.kernels_as_asked(off, engine) == off_ok


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU plan whose engines are stand-ins: each run_engine call is recorded with its attention settings."""
    started: list[tuple[str, str]] = []

    async def run_engine(plan_, config, check_constraint):
        started.append((config.attention_backend, config.trtllm_attention))
        trtllm = "xqa" if config.trtllm_attention == "on" else "none"
        backends = ["FLASH_ATTN"] if config.attention_backend == "auto" else [config.attention_backend]
        result = {"engine": {"engine": "vllm", "runner": "V2", "backends": backends, "trtllm_decode": trtllm},
                  "start_s": 1.0, "step_ms": {1: 5.0}, "realtime_streams": 1.0}
        return {**result, "frame_constraint": {"ok": True}} if check_constraint else result

    monkeypatch.setattr(llm, "run_engine", run_engine)
    monkeypatch.setattr(llm, "_gpu_kernel_facts", lambda: ("13.0", (9, 0)), raising=False)
    return llm.plan("cuda", tmp_path, TINY_CACHE, quick=False), started


async def test_check_llm_skips_flashinfer_without_its_kernels(fake_gpu, installed):
    plan_, started = fake_gpu
    installed.update({k: v for k, v in ALL_KERNELS.items() if k != "flashinfer-cubin"})
    result = await llm.check_llm(plan_)
    assert started == [("auto", "auto")]  # the main run only
    assert "trtllm_attention" not in result
    assert [(c["name"], "flashinfer-cubin not installed" in c["skipped"]) for c in result["attention_comparisons"]] == [
        ("flashinfer+trtllm", True), ("flashinfer", True)]


async def test_check_llm_reports_each_comparisons_kernels_beside_its_figures(fake_gpu, installed):
    plan_, started = fake_gpu
    installed.update(ALL_KERNELS)
    result = await llm.check_llm(plan_)
    assert started == [("auto", "auto"), ("FLASHINFER", "on"), ("FLASHINFER", "off")]
    assert result["engine"]["backends"] == ["FLASH_ATTN"] and result["frame_constraint"]["ok"]
    on, off = result["attention_comparisons"]
    assert on["settings"] == {"attention_backend": "FLASHINFER", "trtllm_attention": "on"}
    assert on["engine"]["trtllm_decode"] == "xqa" and on["step_ms"] == {1: 5.0} and on["kernels_as_asked"]
    assert off["engine"]["trtllm_decode"] == "none" and off["kernels_as_asked"]
    assert "frame_constraint" not in on and "skipped" not in on


async def test_the_main_engine_is_checked_before_it_starts_as_the_comparisons_are(fake_gpu, installed, monkeypatch):
    """The main engine's FlashInfer (its attention backend, or the fused sampler turned on again) needs the same
    precompiled kernels as a comparison's; without them the doctor says so before starting it, where the engine
    would compile for minutes or fail (issue 44, finding 1)."""
    plan_, started = fake_gpu
    installed.update({k: v for k, v in ALL_KERNELS.items() if k != "flashinfer-cubin"})
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    with pytest.raises(llm.PreflightError, match="flashinfer-cubin not installed"):
        await llm.check_llm(plan_)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    flashinfer = llm.LlmPlan(**{**plan_.__dict__, "config": plan_.config.replace(attention_backend="FLASHINFER")})
    with pytest.raises(llm.PreflightError, match="flashinfer-cubin not installed"):
        await llm.check_llm(flashinfer)
    assert started == []  # no engine was started
    await llm.check_llm(plan_)  # attention auto and the sampler off: nothing of FlashInfer's is compiled
    assert started[0] == ("auto", "auto")


def test_gpu_plan_times_the_h100_profiles_engine_at_every_batch_up_to_512_and_again_in_fp8(tmp_path):
    """megapod doctor times what the deployed profiles run (megapod/cluster.py), not settings of its own."""
    from megapod.doctor import profile_engines

    engine, precisions = profile_engines()
    planned = llm.plan("cuda", tmp_path, TINY_CACHE, False, engine, precisions)
    config = planned.config
    assert (config.max_num_seqs, config.max_cudagraph_capture_size, config.async_scheduling) == (512, 1024, True)
    assert planned.batches == (1, 16, 64, 128, 256, 384, 512)
    assert (config.attention_backend, config.quantization, config.kv_cache_dtype) == ("auto", "", "auto")
    assert planned.precisions == (("fp8", {"quantization": "fp8_per_tensor", "kv_cache_dtype": "fp8"}),
                                  ("full-head", {"audio_head": False}))  # both heads' step times (issue 44)
    assert config.audio_head  # the main run: the worker's default head


async def test_each_precision_is_timed_by_an_engine_of_its_own_and_a_failed_one_leaves_the_rest(monkeypatch, tmp_path):
    started = []

    async def run_engine(plan_, config, check_constraint):
        started.append((config.quantization, config.kv_cache_dtype))
        if config.kv_cache_dtype == "fp8_e5m2":
            raise RuntimeError("no such kernel")
        return {"engine": {}, "start_s": 1.0, "step_ms": {1: 5.0}, "realtime_streams": 1.0, "admission_settles_at": 1,
                "frame_constraint": {"ok": True}}

    monkeypatch.setattr(llm, "run_engine", run_engine)
    planned = llm.plan("cpu", tmp_path, TINY_CACHE, quick=True)
    planned = llm.LlmPlan(**{**planned.__dict__, "precisions": (
        ("fp8", {"quantization": "fp8_per_tensor", "kv_cache_dtype": "fp8"}), ("e5m2", {"kv_cache_dtype": "fp8_e5m2"}))})
    result = await llm.check_llm(planned)
    assert started == [("", "auto"), ("fp8_per_tensor", "fp8"), ("", "fp8_e5m2")]
    fp8, e5m2 = result["precisions"]
    assert fp8["name"] == "fp8" and fp8["step_ms"] == {1: 5.0} and fp8["settings"]["quantization"] == "fp8_per_tensor"
    assert e5m2 == {"name": "e5m2", "settings": {"kv_cache_dtype": "fp8_e5m2"}, "failed": "RuntimeError: no such kernel"}
    assert result["step_ms"] == {1: 5.0}  # the main run's figures stand


def test_admission_is_predicted_with_the_workers_own_target_pace_and_ceiling():
    """GPU target pace 1.03: a step of 11.8 ms at most; 2 ms + 0.05 ms a stream reaches it at 196 streams."""
    curve = {b: 2.0 + 0.05 * b for b in (1, 16, 64, 128, 256, 384, 512)}
    gpu = LlmServerConfig(device="cuda", max_num_seqs=512)
    assert 194 <= llm.admission_settles_at(gpu, curve) <= 196
    assert llm.admission_settles_at(gpu.replace(max_streams=100), curve) == 100  # a ceiling holds
    assert llm.admission_settles_at(gpu, {1: 2.0, 64: 5.0}) == 64  # not predicted past the largest batch timed
    assert llm.admission_settles_at(gpu, {1: float("nan")}) is None
