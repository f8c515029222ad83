"""Text -> Orpheus prompt ids, and the token budget of a segment (segmenter.py cuts the text into segments).

The prompt is rebuilt from ids, never by tokenizing a string of special tokens:
[start of human, begin of text] + tokens("{voice}: {text}") + [end of turn, end of human,
start of AI, start of speech]. Generation ends at end of speech. A clone voice's prompt puts its reference
recording before that as a turn of its own (clone_prompt_ids).
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from ..engine.audio_tokens import (
    BEGIN_OF_TEXT,
    CODES_PER_FRAME,
    END_OF_AI,
    END_OF_HUMAN,
    END_OF_SPEECH,
    END_OF_TURN,
    START_OF_AI,
    START_OF_HUMAN,
    START_OF_SPEECH,
    code_to_token,
)

TOKENS_PER_SECOND = 82.03  # 7 tokens per 2048-sample frame at 24 kHz
# Generous bounds on speaking rate, so the budget never cuts speech short: 10 characters per
# second is slower than any Orpheus voice; pauses, tags and the opening silence get 2 s.
_CHARS_PER_SECOND = 10.0
_SLACK_SECONDS = 2.0
MIN_SPEECH_TOKENS = 8  # the fewest tokens a segment is generated with: room the prompt must leave



class PromptTooLong(ValueError):
    """A segment's prompt leaves no room for speech in the model's context: the input's fault (text that
    tokenizes densely), refused before the engine sees it."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def prompt_ids(tokenizer: Tokenizer, voice: str, text: str) -> list[int]:
    """The Orpheus prompt for one segment of speech."""
    return _turn(tokenizer, f"{voice}: {text}")


def clone_prompt_ids(tokenizer: Tokenizer, transcript: str, frames: np.ndarray, text: str) -> list[int]:
    """The zero-shot prompt of a clone voice: the reference recording as an earlier turn (its transcript asked
    for, its frames spoken), then the segment asked for in a turn of its own, in the slot layout generation
    uses. The layout of Canopy Labs' pretrained-model Colab (canopyai/Orpheus-TTS, colabs/
    Orpheus_0_1_Pretrain_Inference.ipynb): both texts with begin of text, the reference frames not
    de-duplicated. The reference turn is the same for every request of the voice: vLLM's prefix cache holds it."""
    audio = [code_to_token(int(code), slot) for frame in frames for slot, code in enumerate(frame)]
    return [*_turn(tokenizer, transcript), *audio, END_OF_SPEECH, END_OF_AI, *_turn(tokenizer, text)]


def _turn(tokenizer: Tokenizer, text: str) -> list[int]:
    """A human turn of `text` and the opening of the AI's spoken answer."""
    body = tokenizer.encode(text, add_special_tokens=False)
    return [START_OF_HUMAN, BEGIN_OF_TEXT, *body, END_OF_TURN, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]


def token_budget(text: str) -> int:
    """max_tokens for a segment: enough for its speech at a slow rate, in whole frames."""
    seconds = len(text) / _CHARS_PER_SECOND + _SLACK_SECONDS
    frames = math.ceil(seconds * TOKENS_PER_SECOND / CODES_PER_FRAME)
    return frames * CODES_PER_FRAME + 1  # +1: room for end of speech after the last frame


def check_room(ids: list[int], text: str, max_model_len: int) -> None:
    """Raise PromptTooLong when a segment's prompt leaves fewer than MIN_SPEECH_TOKENS for its speech."""
    if len(ids) + MIN_SPEECH_TOKENS > max_model_len:
        raise PromptTooLong(f"a segment of the input ({len(text)} characters) is a {len(ids)}-token prompt; this "
                            f"worker's context is {max_model_len} tokens (max_model_len)")
