"""benchmarks/llm_ceiling.py's decode step on CPU, on the tiny layout its dry run uses: what it computes is what a GPU
would time (FP8 close to bf16, its padding to cuBLASLt's multiples of 16 invisible, the cache written where the
step's token sits) and it never syncs with the host, which a CUDA Graph capture would refuse."""

from __future__ import annotations

import pytest
import torch

from benchmarks.llm_ceiling import Arch, DecodeStep, Linear, Weights
from orpheus_common.sync_detector import host_syncs

TINY = Arch.tiny()
CPU = torch.device("cpu")


@pytest.mark.parametrize("out_features", [48, 2054])  # a multiple of 16, and not (the full head's 156,940 is not)
def test_fp8_linear_is_bf16_within_fp8s_precision(out_features):
    torch.manual_seed(0)
    weight = torch.randn(out_features, 128, dtype=torch.bfloat16) / 128**0.5
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    quantized = Linear(weight, fp8=True)
    b = quantized.weight.t()  # cuBLASLt's B: column-major, its dimensions multiples of 16 (unchecked on a CPU)
    assert b.stride(0) == 1 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
    exact, fp8 = Linear(weight, fp8=False)(x).float(), quantized(x).float()
    assert fp8.shape == exact.shape == (3, out_features)
    error = (fp8 - exact).norm() / exact.norm()
    assert 0 < error < 0.1, error  # e4m3 keeps 3 mantissa bits: a few per cent, not zero (it did quantize)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("head, ids", [("full", TINY.vocab), ("audio", TINY.audio_ids)])
def test_a_step_writes_the_cache_at_its_position_and_picks_from_its_head(fmt, head, ids):
    step = DecodeStep(Weights(TINY, fmt == "fp8", CPU), head, batch=3, context=8)
    tokens = step(torch.tensor([1, 2, 3]))
    assert tokens.shape == (3,) and ((0 <= tokens) & (tokens < ids)).all()
    written = [(k[:, :, 7] != 0).any() and not (k[:, :, :7] != 0).any() for k in step.k]
    assert all(written), "each layer's key for position context - 1, and nothing before it"
    assert step.cache_bytes() == 2 * TINY.layers * 3 * TINY.kv_heads * 8 * TINY.head_dim * 2


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_the_step_never_syncs_with_the_host(fmt):
    step = DecodeStep(Weights(TINY, fmt == "fp8", CPU), "full", batch=2, context=8)
    tokens = torch.tensor([4, 5])
    assert host_syncs(step, tokens) == []
