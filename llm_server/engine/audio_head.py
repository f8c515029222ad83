"""An audio-only LM head for Orpheus: vLLM's Llama, with logits computed for the ids speech can use only.

After start of speech Orpheus may only emit its 28,672 audio ids and end of speech, yet Llama's head computes
all 156,940 ids every step (the 3B model ties it to its embeddings: 0.96 GB of its 6.4 GB of weights read each
step) and the frame constraint then masks the rest away. This class computes the head's rows from end of speech
to the last audio id (28,680 rows, 18 % of them: the seven special ids between are Orpheus's markers, left as
they are) and gives every other id -inf, so the sampler, the frame constraint, prefix caching and LoRA see the
logits they saw, less ids no request of ours can be given. The row block is a view of the head's weight: no
copy, and tied embeddings stay tied.

Where the head is not the plain one this reads it computes the whole head as vLLM does: with LoRA on (vLLM then
wraps its logits processor, for adapters that train lm_head, LogitsProcessorWithLoRA), a head split over
tensor-parallel ranks, a quantized head, scaled or soft-capped logits.
vLLM loads the class by name (engine/vllm_plugin.py registers it in every vLLM process); the worker asks for it
with hf_overrides (engine/vllm.py, --audio-head).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.llama import LlamaForCausalLM

from .audio_tokens import AUDIO_TOKEN_BASE, CODEBOOK_SIZE, CODES_PER_FRAME, END_OF_SPEECH

HEAD_ROWS = slice(END_OF_SPEECH, AUDIO_TOKEN_BASE + CODES_PER_FRAME * CODEBOOK_SIZE)


def audio_only_head_applies(model: LlamaForCausalLM) -> bool:
    """Whether `model`'s head is the plain one audio_logits reads: vLLM's own logits processor (not LoRA's
    wrapper), unscaled and not soft-capped, over an unquantized, unsharded weight that holds every audio row."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    processor, head = model.logits_processor, model.lm_head
    return (type(processor) is LogitsProcessor and processor.soft_cap is None and processor.scale == 1.0
            and not processor.logits_as_input and getattr(processor, "head_dtype", None) in (None, head.weight.dtype)
            and isinstance(head.quant_method, UnquantizedEmbeddingMethod) and getattr(head, "bias", None) is None
            and get_tensor_model_parallel_world_size() == 1 and head.weight.shape[0] >= HEAD_ROWS.stop)


class AudioRows:
    """The head's HEAD_ROWS as a layer of their own (a view of its weight), through vLLM's own matmul dispatch for
    an unquantized layer: on CPU it prepares oneDNN for this weight as it did for the whole head; on CUDA it is
    torch's linear, as the head's."""

    def __init__(self, head_weight: torch.Tensor) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm, dispatch_unquantized_gemm
        from vllm.platforms import current_platform

        self.weight = head_weight[HEAD_ROWS]
        if current_platform.is_cpu():
            dispatch_cpu_unquantized_gemm(self, remove_weight=False)
        self._gemm = dispatch_unquantized_gemm()

    def logits(self, hidden_states: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(tokens, vocab_size) logits: these rows applied, every other id -inf."""
        logits = hidden_states.new_full((hidden_states.shape[0], vocab_size), float("-inf"))
        logits[:, HEAD_ROWS] = self._gemm(self, hidden_states, self.weight, None)
        return logits


class OrpheusAudioHeadForCausalLM(LlamaForCausalLM):
    """Llama whose logits are its audio rows' (AudioRows) wherever audio_only_head_applies."""

    _audio_rows: AudioRows | None = None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if not audio_only_head_applies(self):
            return super().compute_logits(hidden_states)
        if self._audio_rows is None or self._audio_rows.weight.data_ptr() != self._rows_ptr():
            self._audio_rows = AudioRows(self.lm_head.weight)  # once the weights are in place (not at __init__)
        return self._audio_rows.logits(hidden_states, self.logits_processor.org_vocab_size)

    def _rows_ptr(self) -> int:
        return self.lm_head.weight[HEAD_ROWS].data_ptr()

