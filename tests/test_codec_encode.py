"""The codec tier's Encode RPC (a clone voice's reference recording -> frames; issue 26, item 3), against the
real in-process server: SNAC's own encoder gives the frames, in the slot layout decoding reads; hostile input is
INVALID_ARGUMENT with nothing held; a decode stream runs on while a long recording is encoded."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from codec_contract.api import codec_pb2, codec_pb2_grpc
from codec_contract.audio import CODEBOOK_SIZE, FRAME_SAMPLES, unpack_frames
from codec_contract.client import channel, decode, header_request, paced_requests
from conftest import random_frames
from processes import TEST_CODEC
from snac_server.codec_model import load_snac
from snac_server.frames import frames_to_levels, levels_to_frames


def recording(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * 24000)) * 0.1).clip(-1, 1).astype(np.float32)


def request(pcm: np.ndarray, rate: int = 24000) -> codec_pb2.EncodeRequest:
    return codec_pb2.EncodeRequest(sample_rate=rate, pcm=pcm.astype("<f4").tobytes())


async def encode(snac_server, message) -> np.ndarray:
    async with channel(snac_server.address) as ch:
        reply = await codec_pb2_grpc.SnacCodecStub(ch).Encode(message, timeout=120)
    return unpack_frames(reply.codes)


async def decoded_samples(snac_server, frames: np.ndarray, seed: int) -> int:
    async with channel(snac_server.address) as ch:
        stream = await decode(codec_pb2_grpc.SnacCodecStub(ch), paced_requests(header_request(seed), frames, 2), 120)
    return stream.audio().size


def test_frames_and_levels_are_each_others_inverse():
    frames = torch.from_numpy(random_frames(9, seed=4).astype(np.int64))
    assert torch.equal(levels_to_frames(*frames_to_levels(frames)), frames)


async def test_a_recording_becomes_the_frames_snacs_own_encoder_gives_in_decodings_slot_layout(snac_server):
    pcm = recording(1.0)  # 24,000 samples: 11.7 frames, padded to 12
    frames = await encode(snac_server, request(pcm))
    assert frames.shape == (-(-pcm.size // FRAME_SAMPLES), 7) and frames.max() < CODEBOOK_SIZE
    snac = load_snac(TEST_CODEC)  # the replica's weights (random, seeded)
    with torch.inference_mode():
        levels = [level[0] for level in snac.encode(torch.from_numpy(pcm)[None, None])]
    assert [torch.equal(a, b) for a, b in zip(frames_to_levels(torch.from_numpy(frames.astype(np.int64))), levels)] \
        == [True, True, True]
    assert np.array_equal(await encode(snac_server, request(pcm)), frames)  # the same recording, the same frames
    assert await decoded_samples(snac_server, frames, seed=1) == frames.shape[0] * FRAME_SAMPLES  # and they decode


@pytest.mark.parametrize("message, said", [
    (request(recording(0.5), rate=16000), "sample_rate 16000: Encode takes 24000 Hz"),
    (codec_pb2.EncodeRequest(sample_rate=24000), "pcm holds no samples"),
    (codec_pb2.EncodeRequest(sample_rate=24000, pcm=b"\0\0\0"), "not whole float32 samples"),
    (request(recording(30.5)), "30.5 s of audio; this replica encodes at most 30 s"),
    (request(np.array([0.0, np.nan, 0.1], np.float32)), "not finite"),
    (request(np.array([0.0, np.inf], np.float32)), "not finite"),
    (request(np.array([0.5, -1.5], np.float32)), "outside [-1, 1]"),
], ids=["rate", "empty", "partial-sample", "too-long", "nan", "inf", "loud"])
async def test_hostile_recordings_are_invalid_argument_saying_why_and_the_replica_encodes_on(snac_server, message, said):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await encode(snac_server, message)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in refused.value.details()
    assert snac_server.service.active == 0
    assert (await encode(snac_server, request(recording(0.2)))).shape == (3, 7)


async def test_a_recording_far_too_long_for_a_message_is_refused_by_grpc_itself(snac_server):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await encode(snac_server, request(recording(50.0)))  # 4.8 MB: over gRPC's 4 MiB
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_decode_stream_goes_on_while_a_long_recording_is_encoded(snac_server):
    """The encode runs on a thread of its own: the stream's audio comes back whole, and before the encode is
    done (on this 2-core machine, 20 s of audio takes the test codec seconds to encode)."""
    encoding = asyncio.create_task(encode(snac_server, request(recording(20.0))))
    await asyncio.sleep(0.05)
    assert await decoded_samples(snac_server, random_frames(8, seed=2), seed=3) == 8 * FRAME_SAMPLES
    assert not encoding.done(), "the decode waited for the encode"
    assert (await encoding).shape == (235, 7)
