"""vLLM's general plugin (pyproject.toml's vllm.general_plugins entry point, run in every vLLM process): our model
classes registered by name, so that their modules, which import vLLM's model layers, load only where a model asks
for them (importing those layers under a platform other than the one running reads its kernels, e.g. the chart
tests' Hopper stand-in)."""

from __future__ import annotations

AUDIO_HEAD = "OrpheusAudioHeadForCausalLM"  # engine/audio_head.py's class, as hf_overrides asks for it


def register() -> None:
    from vllm import ModelRegistry

    if AUDIO_HEAD not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(AUDIO_HEAD, f"{__package__}.audio_head:OrpheusAudioHeadForCausalLM")
