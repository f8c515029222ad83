"""A fix for vLLM's CPU LoRA kernels, applied in the engine's process (probe.py imports this).

vLLM marks a batch's tokens that use no adapter with LoRA index -1. Its Triton kernels (GPUs) skip those
tokens; the PyTorch ops its CPU backend uses (vllm/lora/ops/torch_ops/lora_ops.py, 0.32) index the stacked
adapter weights with it, and -1 is the last slot: once every one of max_loras slots holds an adapter, a
base-voice stream batched beside LoRA voices is spoken through the last adapter (tests/test_vllm_engine.py:
the mixed batch). Fixed upstream by vllm-project/vllm#48421 (open when this was written); until the pinned
vLLM has it, the expand ops here leave the rows of no-LoRA tokens as they found them, which is what the GPU
kernels do. With the fix in vLLM, this changes nothing.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

_EXPANDS = ("bgmv_expand", "bgmv_expand_slice")  # the ops that add an adapter's output into the layer's


def skip_no_lora_rows(expand):
    """`expand` (output rows += adapter[index] @ input) leaving the rows whose index is -1 untouched."""

    @functools.wraps(expand)
    def expand_with_base_rows_kept(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs):
        base = lora_indices_tensor < 0
        if base.shape[0] != output_tensor.shape[0] or not bool(base.any()):
            return expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs)
        kept = output_tensor[base].clone()
        expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs)
        output_tensor[base] = kept

    expand_with_base_rows_kept.keeps_base_rows = True
    return expand_with_base_rows_kept


def apply() -> None:
    """Wrap the CPU backend's expand ops where they are called: the CPU punica wrapper calls them for decode
    steps, and the prefill (sgmv) ops call them from their own module."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        for name in _EXPANDS:
            op = getattr(module, name)
            if not getattr(op, "keeps_base_rows", False):
                setattr(module, name, skip_no_lora_rows(op))
    log.debug("vLLM's CPU LoRA expand ops keep the rows of tokens without an adapter (vllm-project/vllm#48421)")
