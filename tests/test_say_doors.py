"""`megapod say --door` (issue 27): the same text spoken through each front door's own protocol, the audio whole
(raw PCM or a WAV file), and a door's refusal said as an error."""

from __future__ import annotations

import asyncio
import io
import wave

import pytest
from served import FRAME_BYTES, ScriptedEngineDouble, serving

from megapod.doors import DOORS
from megapod.say import say_through

FRAMES = 4


@pytest.mark.parametrize("door", DOORS)
async def test_each_door_speaks_the_whole_text_as_pcm_and_as_wav(snac_server, door):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        raw, wav = io.BytesIO(), io.BytesIO()
        said = await asyncio.to_thread(say_through, door, served.url, "Hello there.", "leo", raw, "pcm", None, None)
        await asyncio.to_thread(say_through, door, served.url, "Hello there.", "leo", wav, "wav", None, None)
    assert len(raw.getvalue()) == FRAMES * FRAME_BYTES and said.audio_s == pytest.approx(FRAMES * 2048 / 24000)
    assert said.first_audio_s > 0
    with wave.open(io.BytesIO(wav.getvalue())) as w:  # the OpenAI door's streamed WAV leaves its length open
        assert (w.getframerate(), w.getnchannels(), len(w.readframes(10**9))) == (24000, 1, FRAMES * FRAME_BYTES)


@pytest.mark.parametrize("door", DOORS)
async def test_a_voice_the_server_refuses_is_an_error_through_every_door(snac_server, door):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), vendor_voice_fallback=False) as served:
        with pytest.raises(RuntimeError, match="unknown voice 'thalia'"):
            await asyncio.to_thread(say_through, door, served.url, "Hello.", "thalia", io.BytesIO(), "pcm", None, None)


def test_a_socket_door_gives_pcm_only():
    with pytest.raises(RuntimeError, match="the deepgram door gives 24 kHz PCM: write pcm or wav, not mp3"):
        say_through("deepgram", "http://127.0.0.1:1", "Hi.", "tara", io.BytesIO(), "mp3", None, None)
