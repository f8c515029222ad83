"""PEFT LoRA adapters for the `tiny` checkpoint, made here (no weights are downloaded): random, non-zero
weights, so an adapter changes what the checkpoint generates. The LoRA voice tests and the LoRA benchmark
use them; `peft` is in the test extra."""

from __future__ import annotations

from pathlib import Path

# Every linear layer of a Llama block: what Orpheus LoRA fine-tunes (Unsloth's notebook, Canopy's script) adapt.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_dir: str, out: Path, seed: int, rank: int = 8) -> Path:
    """Write a rank-`rank` LoRA adapter of the checkpoint in `base_dir` into `out` (PEFT's own format:
    adapter_config.json and adapter_model.safetensors); returns `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    # init_lora_weights=False: both A and B random (PEFT's default zeroes B, an adapter that changes nothing).
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES), init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out
