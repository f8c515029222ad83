"""Loading and preparing SNAC: real checkpoint directories, weight-norm folding, dtypes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from snac import SNAC
from torch.nn.utils import parametrize

from conftest import random_frames
from orpheus_common.sync_detector import host_syncs
from snac_server.codec_model import (
    REFUSE_SNR_DB, SNAC_24KHZ_CONFIG, WARN_SNR_DB, HalfPrecisionTooNoisy, SnacDecoder, build_decoder,
    check_half_precision, load_snac,
)
from snac_server.frames import FRAME_SAMPLES, frames_to_levels

ROOT = Path(__file__).resolve().parent.parent


def _silence_noise(snac: SNAC) -> None:
    """Zero the NoiseBlocks' gains so the original's random draws cannot matter."""
    for module in snac.decoder.modules():
        if type(module).__name__ == "NoiseBlock":
            with torch.no_grad():
                module.linear.parametrizations.weight.original0.zero_()


def test_prepared_decoder_matches_the_original_snac():
    original = load_snac("random-24khz", seed=3)
    _silence_noise(original)
    prepared = SnacDecoder(load_snac("random-24khz", seed=3), 4, torch.device("cpu"), torch.float32)
    noise_blocks = [m for m in prepared.modules() if type(m).__name__ == "PositionalNoise"]
    assert len(noise_blocks) == 4, "one per decoder block"
    for block in noise_blocks:
        with torch.no_grad():
            block.linear.weight.zero_()
    assert not any(parametrize.is_parametrized(m) for m in prepared.modules()), "weight norm is folded"
    frames = random_frames(6, seed=1)
    levels = [torch.as_tensor(l[None], dtype=torch.int64) for l in frames_to_levels(torch.as_tensor(frames))]
    with torch.inference_mode():
        expected = original.decode(levels)[0, 0].numpy()
    got = prepared.decode_full(frames, seed=0)
    assert got.shape == (6 * FRAME_SAMPLES,) == expected.shape
    assert np.abs(got - expected).max() < 1e-5


def test_a_local_checkpoint_directory_loads_the_same_weights(tmp_path):
    """The real loading path: config.json + pytorch_model.bin, as published on the Hub."""
    source = load_snac("random-24khz", seed=5)
    (tmp_path / "config.json").write_text(json.dumps(SNAC_24KHZ_CONFIG))
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    from_dir = build_decoder(str(tmp_path), "cpu", "float32", 2)
    from_random = build_decoder("random-24khz", "cpu", "float32", 2)
    frames = random_frames(5, seed=2)
    assert np.abs(from_dir.decode_full(frames, 1) - SnacDecoder(source, 2, torch.device("cpu"), torch.float32).decode_full(frames, 1)).max() == 0
    assert np.abs(from_dir.decode_full(frames, 1) - from_random.decode_full(frames, 1)).max() > 1e-3


def test_a_checkpoint_of_another_snac_is_refused(tmp_path):
    config = dict(SNAC_24KHZ_CONFIG, sampling_rate=32000, vq_strides=[8, 4, 2, 1])
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(SNAC(**config).state_dict(), tmp_path / "pytorch_model.bin")
    try:
        load_snac(str(tmp_path))
    except ValueError as exc:
        assert "not a 24 kHz SNAC" in str(exc)
    else:
        raise AssertionError("a 32 kHz SNAC was accepted")


def test_the_decoder_forward_as_captured_never_syncs_or_uploads():
    """The forward a CUDA Graph captures: any host sync in it fails capture on a GPU."""
    decoder = build_decoder("random-24khz", "cpu", "float32", 2)
    frames = torch.as_tensor(random_frames(2 * 4, seed=1).reshape(2, 4, 7), dtype=torch.int64)
    seeds = torch.tensor([1, 2])
    frame0 = torch.tensor([0, 9])
    assert host_syncs(decoder, frames, seeds, frame0) == []


def test_float32_means_ieee_float32_on_gpus():
    """cuDNN's default for fp32 convolutions is TF32: loading an fp32 decoder turns that off."""
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch's default, whatever ran before
    build_decoder("random-24khz", "cpu", "float32", 1)
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


@pytest.mark.parametrize("cublas_override", [None, "1"])
def test_exact_fp32_leaves_the_legacy_tf32_flags_readable(cublas_override):
    """torch.compile's conv lowering reads torch.backends.cudnn.allow_tf32: after use_exact_fp32 it
    must read False, not raise for a mix of the legacy and new TF32 APIs. The flags are process-global
    (this process's tests set them), so a fresh interpreter checks them; TORCH_ALLOW_TF32_CUBLAS_OVERRIDE
    starts the legacy matmul precision at "high", which the new matmul setting alone would contradict."""
    flags = ["cudnn.allow_tf32", "cuda.matmul.allow_tf32", "cudnn.conv.fp32_precision", "cuda.matmul.fp32_precision"]
    script = (  # each flag's value, or the name of the error reading it raised
        "import torch\n"
        "from snac_server.codec_model import use_exact_fp32\n"
        "use_exact_fp32()\n"
        f"for flag in {flags!r}:\n"
        "    try:\n"
        "        print(eval('torch.backends.' + flag))\n"
        "    except RuntimeError as exc:\n"
        "        print(type(exc).__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"}
    if cublas_override:
        env["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = cublas_override
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert dict(zip(flags, run.stdout.split())) == dict(zip(flags, ["False", "False", "ieee", "ieee"]))


def test_a_stream_decodes_alike_alone_and_in_a_batch_within_one_s16_step():
    """The reproducibility claim (docs/api.md, the `seed` field): batch shape moves fp32 audio by less than one s16 step."""
    decoder = build_decoder("random-24khz", "cpu", "float32", 8)
    frames = np.stack([random_frames(6, seed=s) for s in range(8)])
    alone = decoder(torch.as_tensor(frames[:1]), torch.tensor([5]), torch.tensor([3]))[0].numpy()
    batch = decoder(torch.as_tensor(frames), torch.arange(5, 13), torch.full((8,), 3))[0].numpy()
    assert np.abs(alone - batch).max() < 1 / 32767


def test_bfloat16_is_measured_against_float32_and_served_with_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="snac_server.codec_model"):
        decoder = build_decoder("random-24khz", "cpu", "bfloat16", 1)
    snr = check_half_precision("random-24khz", decoder)
    assert REFUSE_SNR_DB < snr < WARN_SNR_DB, f"bf16 at {snr:.1f} dB"
    assert any(r.levelno == logging.WARNING and "dB from fp32" in r.message for r in caplog.records)


def test_a_half_precision_decoder_far_from_float32_is_refused():
    decoder = SnacDecoder(load_snac("random-24khz"), 1, torch.device("cpu"), torch.bfloat16)
    with torch.no_grad():  # weights that no longer match the fp32 reference: as broken as an overflow
        decoder.decoder.model[0].weight.mul_(3.0)
    with pytest.raises(HalfPrecisionTooNoisy, match="dB from fp32"):
        check_half_precision("random-24khz", decoder)
