"""Every format and rate a client may ask for, encoded chunk by chunk and decoded with PyAV (an
independent decoder): the same audio length as the input (MP3 and AAC add their encoder's priming),
bytes out from the first chunks on, and μ-law/A-law as telephony raw bytes."""

from __future__ import annotations

import base64
import io
import json

import av
import numpy as np
import pytest

from llm_server.speech.encoding import AudioOutput, SilenceTrim, StreamEncoder, UnsupportedOutput, first_audible, sse_delta, sse_done

CHUNKS, CHUNK = 10, 2048
SINE = (np.sin(np.arange(CHUNKS * CHUNK) * 2 * np.pi * 440 / 24000) * 12000).astype("<i2")
# Samples the encoder adds at its own rate: LAME's delay (1105) plus padding to a 576-sample frame;
# AAC's 1024 of priming plus padding to a 1024-sample frame.
PRIMING = {"mp3": 1105 + 576, "aac": 2 * 1024}


def encode(output: AudioOutput) -> tuple[bytes, list[int]]:
    """The sine, chunk by chunk: all the bytes, and how many came out after each chunk."""
    encoder = StreamEncoder(output)
    parts = [encoder.encode(SINE[i * CHUNK : (i + 1) * CHUNK].tobytes()) for i in range(CHUNKS)]
    return b"".join(parts) + encoder.finish(), [len(p) for p in parts]


def decoded_samples(data: bytes, output: AudioOutput) -> tuple[int, int]:
    """(samples, rate) as PyAV decodes the bytes."""
    raw = output.format in ("mulaw", "alaw", "pcm", "pcm_f32le")
    if output.format in ("pcm", "pcm_f32le"):
        width = 2 if output.format == "pcm" else 4
        return len(data) // width, output.sample_rate
    options = {"sample_rate": str(output.sample_rate), "ch_layout": "mono"} if raw else {}
    with av.open(io.BytesIO(data), format=output.format if raw else None, options=options) as container:
        frames = list(container.decode(audio=0))
    return sum(f.samples for f in frames), frames[0].sample_rate


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm", "pcm_f32le", "mulaw", "alaw"])
@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 44100, 48000])
def test_each_format_decodes_to_the_input_length(fmt, rate):
    output = AudioOutput(fmt, rate)
    data, sizes = encode(output)
    samples, decoded_rate = decoded_samples(data, output)
    expected = round(CHUNKS * CHUNK * decoded_rate / 24000)
    scale = decoded_rate / output.encoded_rate  # Opus decodes at 48 kHz whatever it was encoded at
    rounding = 2 * scale  # the resampler's rounding, a sample or so at the encoded rate
    assert expected - rounding <= samples <= expected + rounding + PRIMING.get(fmt, 0) * scale, (samples, expected)
    header = len(StreamEncoder(output).encode(b""))  # what a container writes before any audio
    assert sum(sizes[: CHUNKS // 2]) > header, "audio streams out as it arrives, not at the end"


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "wav"])
def test_audio_leaves_with_the_first_chunk(fmt):
    """The streaming decoder's first chunk (1387 samples) must not wait in the encoder for the next
    one, a frame of the LLM later. (AAC cannot: ffmpeg's encoder needs 2048 samples for its first packet.)"""
    headers_only, first = StreamEncoder(AudioOutput(fmt)), StreamEncoder(AudioOutput(fmt))
    header = len(headers_only.encode(b""))
    assert len(first.encode(SINE[:1387].tobytes())) > header


def test_pcm_at_24khz_is_the_codecs_bytes_untouched():
    data, _ = encode(AudioOutput("pcm", 24000))
    assert data == SINE.tobytes()


def test_opus_at_22050_is_encoded_at_48000():
    assert AudioOutput("opus", 22050).encoded_rate == 48000 and AudioOutput("opus", 16000).encoded_rate == 16000


@pytest.mark.parametrize("fmt, rate", [("ogg", 24000), ("mp3", 11025), ("pcm", 96000)])
def test_unknown_formats_and_rates_are_refused(fmt, rate):
    with pytest.raises(UnsupportedOutput):
        AudioOutput(fmt, rate)


def test_first_audible_sample_and_the_trim_threshold():
    trim = SilenceTrim(threshold_dbfs=-40.0)
    quiet_then_loud = np.concatenate([np.full(100, 50, "<i2"), np.full(10, 2000, "<i2")]).tobytes()
    assert trim.level == 327 and first_audible(quiet_then_loud, trim.level) == 100
    assert first_audible(np.zeros(10, "<i2").tobytes(), trim.level) is None


def test_sse_events_carry_base64_audio_and_usage():
    delta = sse_delta(b"\x01\x02\x03\x04")
    assert delta.startswith(b"data: ") and delta.endswith(b"\n\n")
    event = json.loads(delta[6:])
    assert event["type"] == "speech.audio.delta" and base64.b64decode(event["audio"]) == b"\x01\x02\x03\x04"
    done = json.loads(sse_done(5, 70)[6:])
    assert done == {"type": "speech.audio.done", "usage": {"input_tokens": 5, "output_tokens": 70, "total_tokens": 75}}
