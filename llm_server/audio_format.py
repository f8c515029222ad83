"""Speech bytes for HTTP clients: streaming WAV, raw PCM, and OpenAI-style SSE events.

Everything is 24 kHz, mono, 16-bit little-endian. The WAV header goes out before the
length is known, so its size fields hold 0xFFFFFFFF ("unknown, read to the end"), the
convention streaming players and decoders (ffmpeg, sox, Python's wave) accept.
"""

from __future__ import annotations

import base64
import json
import struct

SAMPLE_RATE = 24_000
CHANNELS = 1
SAMPLE_BYTES = 2
FORMATS = ("wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
_UNKNOWN_SIZE = 0xFFFFFFFF


def streaming_wav_header() -> bytes:
    """A 44-byte RIFF/WAVE header whose sizes say 'until the end of the stream'."""
    byte_rate = SAMPLE_RATE * CHANNELS * SAMPLE_BYTES
    return (
        b"RIFF" + struct.pack("<I", _UNKNOWN_SIZE) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, CHANNELS, SAMPLE_RATE, byte_rate, CHANNELS * SAMPLE_BYTES, 8 * SAMPLE_BYTES)
        + b"data" + struct.pack("<I", _UNKNOWN_SIZE)
    )


def sse_delta(pcm: bytes) -> bytes:
    """One `speech.audio.delta` event carrying base64 PCM, as OpenAI streams it."""
    event = {"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()}
    return f"data: {json.dumps(event)}\n\n".encode()


def sse_done(input_tokens: int, output_tokens: int) -> bytes:
    """The closing `speech.audio.done` event with token usage."""
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}
    return f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n".encode()
