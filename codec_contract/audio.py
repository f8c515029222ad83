"""Audio frames as both tiers see them, the codec's policies, and what audio frames make final.

A frame is 7 SNAC codes (one Orpheus frame of audio-code tokens) and decodes to 2048 samples at
24 kHz. The streaming decoder emits a sample once its right context has arrived: sample n is final
once the frames received cover sample n + STREAMING_DELAY_SAMPLES (2.32 frames), and the stream's
tail once it has ended. A replica resumed from RESUME_CONTEXT_FRAMES frames before a sample rebuilds
the decoder's state exactly (SNAC's receptive field is as wide on the left).
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from .api import codec_pb2

CODES_PER_FRAME = 7
CODEBOOK_SIZE = 4096
CODE_DTYPE = np.dtype("<u2")  # a code on the wire (Frames.codes): little-endian uint16
FRAME_BYTES = CODES_PER_FRAME * CODE_DTYPE.itemsize
SAMPLE_RATE = 24_000
FRAME_SAMPLES = 2048
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE
STREAMING_DELAY_SAMPLES = 4757  # SNAC 24 kHz's right context (snac_server.streaming derives and checks it)
RESUME_CONTEXT_FRAMES = 3  # ceil(4757 / 2048): frames of left context that rebuild the state
REFERENCE_WINDOW = 4  # the reference decoder's window: 1 frame before the emitted one, 2 after

POLICIES = {"streaming": codec_pb2.POLICY_STREAMING, "reference": codec_pb2.POLICY_REFERENCE}
Policy = Literal["streaming", "reference"]  # a policy's name, as settings take it
assert set(get_args(Policy)) == POLICIES.keys()
DEFAULT_POLICY = "streaming"


def final_samples(policy: int, frames: int, ended: bool) -> int:
    """How many samples of a stream are final once `frames` frames (counted from 0) have arrived."""
    if ended:
        return frames * FRAME_SAMPLES
    if policy == codec_pb2.POLICY_REFERENCE:  # frame j needs frames up to j + 2, and frame 0 needs 4
        return (frames - 2) * FRAME_SAMPLES if frames >= REFERENCE_WINDOW else 0
    return max(0, frames * FRAME_SAMPLES - STREAMING_DELAY_SAMPLES)


def pack_frames(frames) -> bytes:
    """Frames (n, 7) as Frames.codes: 14 bytes a frame. Codes must fit a uint16 (the codec checks
    0..4095 itself); a wider one is the caller's bug, refused here rather than wrapped."""
    codes = np.asarray(frames)
    if codes.size and (codes.ndim != 2 or codes.shape[1] != CODES_PER_FRAME):
        raise ValueError(f"frames of shape {codes.shape} are not (n, {CODES_PER_FRAME})")
    if codes.size and (codes.min() < 0 or codes.max() > np.iinfo(CODE_DTYPE).max):
        raise ValueError(f"codes outside 0..{np.iinfo(CODE_DTYPE).max} cannot be packed")
    return codes.astype(CODE_DTYPE, copy=False).tobytes()


def unpack_frames(codes: bytes) -> np.ndarray:
    """Frames.codes as an (n, 7) int32 array; ValueError if the bytes are not whole frames."""
    if len(codes) % FRAME_BYTES:
        raise ValueError(f"{len(codes)} bytes of codes are not whole frames of {FRAME_BYTES} bytes "
                         f"({CODES_PER_FRAME} little-endian uint16 codes)")
    return np.frombuffer(codes, dtype=CODE_DTYPE).reshape(-1, CODES_PER_FRAME).astype(np.int32)
