"""Token -> frame mapping: code 0, slot order, end of speech mid-frame."""

import numpy as np
import pytest

from llm_server.engine.audio_tokens import (
    END_OF_SPEECH,
    FrameAssembler,
    InvalidAudioToken,
    code_to_token,
    slot_range,
    token_to_code,
)


def _tokens(frames):
    return [code_to_token(int(c), s) for frame in frames for s, c in enumerate(frame)]


def test_token_layout():
    assert code_to_token(0, 0) == 128266
    assert code_to_token(4095, 6) == 128266 + 4096 * 6 + 4095
    assert slot_range(3) == (128266 + 3 * 4096, 128266 + 4 * 4096)
    assert token_to_code(128266 + 4096 * 2, 2) == 0


def test_code_zero_is_kept_and_frames_stay_aligned():
    frames = np.array([[0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7], [4095, 0, 4095, 0, 4095, 0, 4095]])
    assembler = FrameAssembler()
    out = np.concatenate([assembler.feed([t]) for t in _tokens(frames)])
    assert out.tolist() == frames.tolist()
    assert assembler.frames == 3


def test_tokens_split_across_deltas_in_any_way():
    frames = np.random.default_rng(0).integers(0, 4096, size=(5, 7))
    tokens = _tokens(frames)
    assembler = FrameAssembler()
    parts = [tokens[:3], tokens[3:11], tokens[11:12], tokens[12:]]
    out = np.concatenate([assembler.feed(p) for p in parts])
    assert out.tolist() == frames.tolist()


def test_end_of_speech_mid_frame_drops_the_partial_frame():
    frames = np.array([[1, 2, 3, 4, 5, 6, 7]])
    assembler = FrameAssembler()
    out = assembler.feed(_tokens(frames) + _tokens([[9, 9, 9]])[:3] + [END_OF_SPEECH] + _tokens(frames))
    assert out.tolist() == frames.tolist()
    assert assembler.dropped_tokens == 3 and assembler.stopped


def test_a_token_in_the_wrong_slot_is_refused():
    assembler = FrameAssembler()
    with pytest.raises(InvalidAudioToken, match="slot 1"):
        assembler.feed([code_to_token(5, 0), code_to_token(5, 0)])
    with pytest.raises(InvalidAudioToken):
        FrameAssembler().feed([1000])
