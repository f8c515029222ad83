"""Loading and preparing SNAC: real checkpoint directories, weight-norm folding, dtypes."""

from __future__ import annotations

import json

import numpy as np
import torch
from snac import SNAC
from torch.nn.utils import parametrize

from conftest import random_frames
from snac_server.codec_model import SNAC_24KHZ_CONFIG, SnacDecoder, build_decoder, load_snac
from snac_server.frames import FRAME_SAMPLES, frames_to_levels


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
    levels = [torch.as_tensor(l[None], dtype=torch.int64) for l in frames_to_levels(frames)]
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


def test_half_precision_stays_close_to_float32():
    frames = random_frames(4, seed=4)
    ref = build_decoder("random-24khz", "cpu", "float32", 1).decode_full(frames, 2)
    bf16 = build_decoder("random-24khz", "cpu", "bfloat16", 1).decode_full(frames, 2)
    snr_db = 10 * np.log10(np.sum(ref**2) / np.sum((bf16 - ref) ** 2))
    assert bf16.dtype == np.float32
    assert snr_db > 20, f"bf16 SNR {snr_db:.1f} dB"
