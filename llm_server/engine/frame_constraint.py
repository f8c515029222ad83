"""Frame-constrained decoding: slot s of each frame may only be one of its 4,096 audio ids.

Generated token k belongs to slot k % 7; end of speech is allowed only at a frame boundary
(k % 7 == 0). With real weights this removes misaligned-frame artefacts; with random
weights it keeps the pipeline producing valid codes. Requests opt in through
SamplingParams.extra_args[OPT_IN], so other requests on the engine are untouched.

vLLM has two batch-level logits processor APIs: the V1 runner's (CPU, and GPU with
VLLM_USE_V2_MODEL_RUNNER=0) sees each request's running output ids; Model Runner V2's
(the GPU default) sees each row's position. Both mask through slot_mask's table, and
neither syncs with the host on a GPU. On CPU the V1 processor also samples the slot
itself (_SlotSampler), which is where that pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from .audio_tokens import AUDIO_TOKEN_BASE, CODEBOOK_SIZE, CODES_PER_FRAME, END_OF_SPEECH
from .slot_mask import UNCONSTRAINED, StagedUpload, blocked_ids, constrain

OPT_IN = "orpheus_frames"
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi: spreads (seed, position) over the generator's seed space


def wants_frames(params: SamplingParams) -> bool:
    """True for requests that opted in (either form of extra_args[OPT_IN])."""
    return bool(params.extra_args and params.extra_args.get(OPT_IN))


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of one step: a function of (request seed, token position) alone, so a
    request that vLLM preempts and re-adds draws exactly what it would have drawn."""
    return (seed * _GOLDEN + position) % 2**64


@dataclass
class _SlotSampler:
    """One request's sampling over its slot's 4,097 candidates (4,096 codes + end of speech).

    Sampling a 4,097-wide slice instead of the 156,940-id vocabulary is what makes top-p and
    repetition penalty affordable on CPU: the processor picks the token and leaves vLLM a
    one-hot row to take greedily. The slice is sampled in NumPy: torch's per-call overhead
    (sort, multinomial, a generator seeded each step) was 0.7 ms a row, a third of a tiny-model
    step (benchmarks/README.md, `engine_step_cpu.py`).
    """

    outputs: list[int]  # the request's running output ids (vLLM mutates it in place)
    temperature: float
    top_p: float
    repetition_penalty: float
    seed: int
    seen: np.ndarray  # (7 * 4096,) bool: audio ids this request already produced
    cursor: int = 0

    @classmethod
    def create(cls, params: SamplingParams, outputs: list[int]) -> _SlotSampler | None:
        spec = params.extra_args.get(OPT_IN) if params.extra_args else None
        if not isinstance(spec, dict):
            return None
        seen = np.zeros(CODES_PER_FRAME * CODEBOOK_SIZE, dtype=bool)
        return cls(outputs, float(spec["temperature"]), float(spec["top_p"]), float(spec["repetition_penalty"]),
                   int(spec.get("seed") or 0), seen)

    def choose(self, logits_row: torch.Tensor) -> int:
        """Sample this step's token id from the row's slot slice."""
        self._see_new_outputs()
        position = len(self.outputs)
        slot = position % CODES_PER_FRAME
        low = AUDIO_TOKEN_BASE + CODEBOOK_SIZE * slot
        cand = np.full(CODEBOOK_SIZE + 1, -np.inf)  # float64: the softmax and its sums without float32 drift
        cand[:CODEBOOK_SIZE] = logits_row[low : low + CODEBOOK_SIZE].float().cpu().numpy()
        if slot == 0:
            cand[CODEBOOK_SIZE] = float(logits_row[END_OF_SPEECH])
        if self.repetition_penalty != 1.0:  # the same rule as vLLM's: shrink seen tokens' logits
            seen = np.flatnonzero(self.seen[CODEBOOK_SIZE * slot : CODEBOOK_SIZE * (slot + 1)])
            said = cand[seen]
            cand[seen] = np.where(said > 0, said / self.repetition_penalty, said * self.repetition_penalty)
        if self.temperature <= 0:
            pick = int(cand.argmax())
        else:
            probs = np.exp((cand - cand.max()) / self.temperature)
            weights = _top_p(probs / probs.sum(), self.top_p)
            pick = _inverse_cdf(weights, np.random.default_rng(draw_seed(self.seed, position)).random())
        return END_OF_SPEECH if pick == CODEBOOK_SIZE else low + pick

    def _see_new_outputs(self) -> None:
        """Mark the outputs since the last step as seen; stop at a placeholder (-1) that vLLM's
        async scheduling has not filled in yet, so its token is marked once it is known."""
        for token in self.outputs[self.cursor :]:
            if token < 0:
                break
            if token - AUDIO_TOKEN_BASE < self.seen.size and token >= AUDIO_TOKEN_BASE:
                self.seen[token - AUDIO_TOKEN_BASE] = True
            self.cursor += 1


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most probable candidates whose probability reaches top_p (ties
    with the last one kept are kept too); the rest get weight 0."""
    if top_p >= 1.0:
        return probs
    descending = np.sort(probs)[::-1]
    before = np.cumsum(descending) - descending  # mass of the more probable candidates: non-decreasing
    kept = max(1, int(np.searchsorted(before, top_p, side="right")))
    return np.where(probs >= descending[kept - 1], probs, 0.0)


def _inverse_cdf(weights: np.ndarray, uniform: float) -> int:
    """The index whose cumulative weight first exceeds `uniform` (in [0, 1)) of the total."""
    cdf = np.cumsum(weights)
    return min(int(np.searchsorted(cdf, uniform * cdf[-1], side="right")), weights.size - 1)


class FrameConstraintV1(V1LogitsProcessor):
    """The constraint for vLLM's V1 model runner: mask the slot, or (on CPU) sample it.

    extra_args[OPT_IN] = True masks the row to its slot and lets vLLM sample (the GPU path: one
    staged upload of the rows' slots, one gather, one fill); a dict of {temperature, top_p,
    repetition_penalty, seed} samples the slot here (the request then runs greedy in vLLM, which
    takes the one-hot row).
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self._masked: dict[int, list[int]] = {}  # batch row -> the request's running output ids
        self._sampled: dict[int, _SlotSampler] = {}
        rows = vllm_config.scheduler_config.max_num_seqs
        self._slots = StagedUpload(rows, torch.int64, device, is_pin_memory)
        self._host_slots = np.empty(rows, dtype=np.int64)
        blocked_ids(vllm_config.model_config.get_vocab_size(), device)  # built now, not in the first step

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax, so it must run under greedy sampling too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self._masked, batch_update, lambda params, _prompt, out: out if params.extra_args and params.extra_args.get(OPT_IN) is True else None
        )
        process_dict_updates(self._sampled, batch_update, lambda params, _prompt, out: _SlotSampler.create(params, out))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._masked:
            host = self._host_slots[: logits.shape[0]]
            host.fill(UNCONSTRAINED)
            for row, out in self._masked.items():
                host[row] = len(out) % CODES_PER_FRAME
            constrain(logits, self._slots.upload(host))
        for row, sampler in self._sampled.items():
            token = sampler.choose(logits[row])
            logits[row].fill_(float("-inf"))
            logits[row, token].fill_(0.0)
        return logits


class FrameConstraintV2(V2LogitsProcessor):
    """The mask for Model Runner V2: generated count = row position + 1 - prompt length.

    Which request slots opted in is kept on the host and uploaded without blocking when it
    changed; vLLM already skips the whole stage in steps where no row opted in.
    """

    def __init__(self, vllm_config, req_states: LogitsProcRequestState) -> None:
        self._req_states = req_states
        device = torch.device(req_states.device)
        self._opted_host = np.zeros(req_states.max_num_reqs, dtype=np.int64)
        self._opted = StagedUpload(req_states.max_num_reqs, torch.int64, device, pin_memory=device.type == "cuda")
        self._opted_device = self._opted.upload(self._opted_host)
        self._changed = False
        blocked_ids(req_states.vocab_size, device)  # built now, not in the first step

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        on = wants_frames(sampling_params)  # slots are recycled: always overwrite
        self._changed |= bool(self._opted_host[req_idx]) != on
        self._opted_host[req_idx] = on
        return on

    def apply_staged_writes(self) -> None:
        if self._changed:  # a non-blocking copy; admissions never wait for the GPU
            self._opted_device = self._opted.upload(self._opted_host)
            self._changed = False

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        rows = ctx.expanded_idx_mapping
        # prompt_len.gpu is re-pointed by vLLM at every refresh: read it here, never cache it.
        generated = ctx.pos.long() + 1 - self._req_states.prompt_len.gpu[rows].long()
        slots = torch.where(self._opted_device[rows].bool(), generated % CODES_PER_FRAME, UNCONSTRAINED)
        return constrain(logits, slots)
