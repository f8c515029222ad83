"""The frame-slot constraint as a table, so that each step costs one gather and one fill on the device.

Row s (0..6) of the table blocks every id but slot s's 4,096 audio ids (and, for s = 0, end of
speech: speech may only end at a frame boundary); row UNCONSTRAINED blocks nothing, for the rows of
requests that did not opt in. A step looks up each row's slot and fills the blocked ids with -inf:
no per-step arange, compare or host sync, whatever the batch.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .audio_tokens import CODES_PER_FRAME, END_OF_SPEECH, slot_range

UNCONSTRAINED = CODES_PER_FRAME  # the table's last row: a request that did not opt in


@functools.lru_cache(maxsize=8)
def blocked_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    """(8, vocab) bool, True where an id is not allowed: rows 0..6 per slot, row 7 nothing blocked."""
    table = torch.ones(CODES_PER_FRAME + 1, vocab_size, dtype=torch.bool, device=device)
    for slot in range(CODES_PER_FRAME):
        first, last = slot_range(slot)
        table[slot, first:last].fill_(False)
    table[0, END_OF_SPEECH].fill_(False)
    table[UNCONSTRAINED].fill_(False)
    return table


def constrain(logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Block, in place, every id each row's slot forbids; `slots` (rows,) int64 on the logits' device."""
    return logits.masked_fill_(blocked_ids(logits.shape[-1], logits.device)[slots], float("-inf"))


class StagedUpload:
    """Per-step host values for the device, without a blocking copy.

    The values go into pinned host memory and reach the device with one non-blocking copy. Two host
    buffers take turns, because vLLM schedules a step ahead: the host may fill the next step's
    values while the copy of this step's has not run yet.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> None:
        self._host = [torch.zeros(size, dtype=dtype, pin_memory=pin_memory) for _ in range(2)]
        self._views = [h.numpy() for h in self._host]
        self._device = torch.zeros(size, dtype=dtype, device=device)
        self._turn = 0

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """`values` on the device (a view of a reused buffer, valid until the next upload)."""
        self._turn ^= 1
        n = len(values)
        self._views[self._turn][:n] = values
        return self._device[:n].copy_(self._host[self._turn][:n], non_blocking=True)
