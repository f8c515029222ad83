"""Streaming WAV headers and SSE events parse with standard readers."""

import base64
import io
import json
import wave

import numpy as np

from llm_server.audio_format import sse_delta, sse_done, streaming_wav_header


def test_streaming_wav_reads_as_24khz_mono_16bit_to_the_end():
    pcm = (np.sin(np.arange(4096) / 10) * 10000).astype("<i2").tobytes()
    header = streaming_wav_header()
    assert len(header) == 44
    with wave.open(io.BytesIO(header + pcm)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.readframes(10**9) == pcm


def test_sse_events_carry_base64_pcm_and_usage():
    delta = sse_delta(b"\x01\x02\x03\x04")
    assert delta.startswith(b"data: ") and delta.endswith(b"\n\n")
    event = json.loads(delta[6:])
    assert event["type"] == "speech.audio.delta" and base64.b64decode(event["audio"]) == b"\x01\x02\x03\x04"
    done = json.loads(sse_done(5, 70)[6:])
    assert done == {"type": "speech.audio.done", "usage": {"input_tokens": 5, "output_tokens": 70, "total_tokens": 75}}
