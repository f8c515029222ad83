"""llm_server's SpeechSession (llm_server/speech/session.py) through its public API: admission and the slot given
back once, text in (say, push, flush, end_input), the events (each segment's Audio, then its Words, then its
SegmentEnd), the outcomes (ok, cancelled, invalid_input, error, slow_client) and what a cancel frees.

A real Runtime (Runtime.assemble) and codec client against the module's real codec server on loopback (the small
test codec); the engine and the tokenizer are test doubles (served.py). No HTTP, no vLLM: seconds."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest

from llm_server.config import LlmServerConfig
from llm_server.edge.auth import ApiKey
from llm_server.engine import EngineError
from llm_server.runtime import Runtime, codec_client_config
from llm_server.speech.codec_client import CodecClient
from llm_server.speech.prompt import prompt_ids
from llm_server.speech.session import (
    Audio,
    ClientTooSlow,
    PromptTooLong,
    Refused,
    SegmentEnd,
    SpeechSession,
    SpeechSpec,
    Words,
)
from served import CharTokenizerDouble, ScriptedEngineDouble

FRAME_SAMPLES = 2048
SAMPLE_RATE = 24000
FRAMES = 8  # per segment: enough audio to share among a segment's words, little to decode
# Each of these is a segment of its own with max_segment_chars=40 (two of them joined are longer).
SENTENCES = ["The first sentence is spoken here.", "Then a second one follows it!", "And a third ends it all?"]


@contextlib.asynccontextmanager
async def assembled(snac_server, engine: ScriptedEngineDouble | None = None, **overrides):
    """A worker's Runtime around the engine double and a codec client to `snac_server` (a fixed limit of
    `max_streams`, 8 unless said), its codec client closed after."""
    overrides.setdefault("max_streams", 8)
    overrides.setdefault("min_streams", overrides["max_streams"])
    overrides.setdefault("max_segment_chars", 40)
    config = LlmServerConfig(host="127.0.0.1", port=0, snac=snac_server.address, **overrides)
    engine = engine or ScriptedEngineDouble(frames=FRAMES)
    runtime = Runtime.assemble(config, engine, CodecClient(codec_client_config(config)), CharTokenizerDouble())
    try:
        yield runtime
    finally:
        await runtime.codec.close()


def spec(runtime: Runtime) -> SpeechSpec:
    return SpeechSpec(runtime.voices.default, seed=7)


def counted(runtime: Runtime, outcome: str) -> float:
    return runtime.metrics.registry.get_sample_value("orpheus_requests_total", {"outcome": outcome}) or 0.0


def active_streams(runtime: Runtime) -> float:
    return runtime.metrics.registry.get_sample_value("orpheus_active_streams")


async def read_all(session: SpeechSession) -> list[Audio | Words | SegmentEnd]:
    return [event async for event in session.events()]


async def codec_streams_left(snac_server) -> int:
    """The codec server's open Decode streams, once it has seen the client's cancels (a liveness bound: it
    passes at once when nothing is held)."""
    for _ in range(600):
        if snac_server.service.active == 0:
            break
        await asyncio.sleep(0.05)
    return snac_server.service.active


def by_segment(events: list) -> list[tuple[list[Audio], Words, SegmentEnd]]:
    """The events cut after each SegmentEnd: (the segment's Audio, its Words, its SegmentEnd); asserts the order
    Audio..., Words, SegmentEnd within each, and only a zero-length encoder tail after the last."""
    segments, audio, words = [], [], None
    for event in events:
        if isinstance(event, Audio):
            assert words is None, "audio between a segment's Words and its SegmentEnd"
            audio.append(event)
        elif isinstance(event, Words):
            assert words is None, "two Words for one segment"
            words = event
        else:
            assert isinstance(event, SegmentEnd) and words is not None, "a SegmentEnd without its Words first"
            segments.append((audio, words, event))
            audio, words = [], None
    assert words is None and all(a.seconds == 0.0 for a in audio), "events after the last SegmentEnd"
    return segments


# -- admission ------------------------------------------------------------------------------------------

async def test_a_session_past_the_workers_limit_is_refused_and_counted(snac_server):
    async with assembled(snac_server, max_streams=2) as runtime:
        held = [await SpeechSession.open(runtime, spec(runtime), None, f"held-{i}") for i in range(2)]
        assert runtime.admission.active == 2 and active_streams(runtime) == 2
        with pytest.raises(Refused) as refused:
            await SpeechSession.open(runtime, spec(runtime), None, "one-too-many")
        assert refused.value.by_key is False
        assert "limit of 2" in str(refused.value)
        assert counted(runtime, "refused") == 1
        assert runtime.metrics.registry.get_sample_value("megapod_worker_refusals_total", {"cause": "capacity"}) == 1
        assert runtime.admission.active == 2 and active_streams(runtime) == 2  # the refused one took nothing
        await held[0].close()
        again = await SpeechSession.open(runtime, spec(runtime), None, "after-a-close")  # the slot given back is taken
        for session in (held[1], again):
            await session.close()
        assert runtime.admission.active == 0 and active_streams(runtime) == 0


async def test_a_keys_own_cap_refuses_by_key_while_the_worker_has_room(snac_server):
    alice = ApiKey("alice", b"alice-secret-1", max_streams=1)
    async with assembled(snac_server, max_streams=4) as runtime:
        first = await SpeechSession.open(runtime, spec(runtime), alice, "alice-1")
        with pytest.raises(Refused) as refused:
            await SpeechSession.open(runtime, spec(runtime), alice, "alice-2")
        assert refused.value.by_key is True
        assert "'alice'" in str(refused.value) and "limit of 1" in str(refused.value)
        registry = runtime.metrics.registry
        assert registry.get_sample_value("orpheus_key_requests_total", {"key": "alice", "outcome": "refused_key"}) == 1
        assert registry.get_sample_value("megapod_worker_refusals_total", {"cause": "key"}) == 1
        other = await SpeechSession.open(runtime, spec(runtime), None, "anonymous")  # the worker itself has room
        assert runtime.admission.active_per_key == {"alice": 1} and runtime.admission.active == 2
        await first.close()
        assert runtime.admission.active_per_key == {}
        await other.close()


async def test_close_gives_the_slot_back_and_counts_the_outcome_exactly_once(snac_server):
    key = ApiKey("bob", b"bob-secret-12", max_streams=2)
    async with assembled(snac_server, max_streams=3) as runtime:
        sessions = [await SpeechSession.open(runtime, spec(runtime), key, f"twice-{i}") for i in range(2)]
        await sessions[0].close()
        await sessions[0].close()  # a door's cleanup and a disconnect handler both closing
        assert runtime.admission.active == 1 and runtime.admission.active_per_key == {"bob": 1}
        assert active_streams(runtime) == 1
        assert counted(runtime, "disconnected") == 1  # never read to the end: the default outcome
        key_counted = {"key": "bob", "outcome": "disconnected"}
        assert runtime.metrics.registry.get_sample_value("orpheus_key_requests_total", key_counted) == 1
        await sessions[1].close("cancelled")  # the outcome close() is given wins
        await sessions[1].close()
        assert runtime.admission.active == 0 and runtime.admission.active_per_key == {}
        assert active_streams(runtime) == 0
        assert counted(runtime, "disconnected") == 1 and counted(runtime, "cancelled") == 1


# -- text in --------------------------------------------------------------------------------------------

async def test_say_speaks_the_text_sentence_by_sentence_in_order(snac_server):
    async with assembled(snac_server) as runtime:
        engine = runtime.engine
        session = await SpeechSession.open(runtime, spec(runtime), None, "say")
        session.say("  ".join(SENTENCES))
        assert session.segments == 3 and session.pending_text == ""
        events = await read_all(session)
        segments = by_segment(events)
        assert [(end.index, end.text) for _, _, end in segments] == list(enumerate(SENTENCES))
        # One engine request per segment, each with its own sentence's prompt.
        voice = runtime.voices.default.prompt_name
        tokenizer = runtime.tokenizer
        assert engine.prompts == {f"say-{i}": prompt_ids(tokenizer, voice, text) for i, text in enumerate(SENTENCES)}
        assert session.usage == (sum(map(len, engine.prompts.values())), 3 * (FRAMES * 7 + 1))
        await session.close()


async def test_push_speaks_only_complete_segments_and_flush_and_end_input_the_rest(snac_server):
    async with assembled(snac_server) as runtime:
        engine = runtime.engine
        session = await SpeechSession.open(runtime, spec(runtime), None, "push")
        session.push("The first sentence")
        session.push(" is spoken")
        assert session.segments == 0 and session.pending_text == "The first sentence is spoken"
        await asyncio.sleep(0.2)  # time enough for a request to start, were there one
        assert engine.prompts == {}
        session.push(" here. And then")
        assert session.segments == 1 and session.pending_text == "And then"
        session.flush()  # speak what is buffered, sentence end or not
        assert session.segments == 2 and session.pending_text == ""
        session.push("A last few")
        assert session.segments == 2 and session.pending_text == "A last few"
        session.end_input()
        assert session.segments == 3 and session.pending_text == ""
        texts = [end.text for _, _, end in by_segment(await read_all(session))]
        assert texts == ["The first sentence is spoken here.", "And then", "A last few"]
        assert sorted(engine.prompts) == ["push-0", "push-1", "push-2"]
        assert session.outcome == "ok"
        await session.close()


# -- events ---------------------------------------------------------------------------------------------

async def test_each_segment_has_its_audio_then_words_timed_inside_that_audio(snac_server):
    async with assembled(snac_server) as runtime:
        session = await SpeechSession.open(runtime, spec(runtime), None, "words")
        session.say(" ".join(SENTENCES))
        segments = by_segment(await read_all(session))
        assert len(segments) == 3
        start = 0.0
        for audio, words, end in segments:
            assert audio and all(a.data for a in audio)
            seconds = sum(a.seconds for a in audio)
            assert math.isclose(seconds, FRAMES * FRAME_SAMPLES / SAMPLE_RATE)  # every sample of its frames
            assert sum(len(a.data) for a in audio) == FRAMES * FRAME_SAMPLES * 2  # s16 PCM by default
            assert words.words == end.text.split()
            assert len(words.starts) == len(words.ends) == len(words.words)
            times = [t for pair in zip(words.starts, words.ends) for t in pair]
            assert times == sorted(times)  # each word starts after the last ended, and ends after it starts
            assert all(s < e for s, e in zip(words.starts, words.ends))
            # Inside this segment's audio: from where the previous segment's ended to where its own ends.
            assert words.starts[0] == pytest.approx(start, abs=1e-3)
            assert words.ends[-1] == pytest.approx(start + seconds, abs=1e-3)
            start += seconds
        assert session.delivered_s == 0.0  # nothing was sent through send(): the client took nothing
        await session.close()


# -- outcomes -------------------------------------------------------------------------------------------

async def test_a_full_read_is_ok_and_a_later_cancel_leaves_it_so(snac_server):
    async with assembled(snac_server) as runtime:
        session = await SpeechSession.open(runtime, spec(runtime), None, "ok")
        session.say(SENTENCES[0])
        assert session.outcome == "disconnected"  # until the stream ends otherwise
        await read_all(session)
        assert session.outcome == "ok"
        session.cancel()  # a client leaving after the last byte
        await session.close()
        assert session.outcome == "ok" and counted(runtime, "ok") == 1 and counted(runtime, "cancelled") == 0


async def test_cancel_mid_stream_aborts_the_engine_request_and_releases_the_codec_stream(snac_server):
    engine = ScriptedEngineDouble(frames=100_000)  # would run for minutes: only the cancel ends it
    assert await codec_streams_left(snac_server) == 0  # what earlier tests' streams held is given back
    async with assembled(snac_server, engine) as runtime:
        session = await SpeechSession.open(runtime, spec(runtime), None, "barge-in")
        session.say(SENTENCES[0])
        events = session.events()
        first = await anext(events)
        assert isinstance(first, Audio) and first.data
        assert engine.num_unfinished() == 1 and snac_server.service.active == 1  # mid-stream
        session.cancel()
        assert session.outcome == "cancelled"
        assert session.failed(asyncio.CancelledError()) is False  # the cancel's echo: no error for the client
        assert session.outcome == "cancelled"
        await events.aclose()
        await session.close()
        assert engine.num_unfinished() == 0  # the generator was closed: the engine request is gone
        assert await codec_streams_left(snac_server) == 0
        assert runtime.admission.active == 0 and active_streams(runtime) == 0
        assert counted(runtime, "cancelled") == 1 and counted(runtime, "error") == 0


async def test_a_prompt_too_long_for_the_context_is_invalid_input_before_the_engine_sees_it(snac_server):
    async with assembled(snac_server, max_model_len=48, max_segment_chars=280) as runtime:
        session = await SpeechSession.open(runtime, spec(runtime), None, "too-long")
        session.say("This sentence is far too long for a context of forty-eight tokens.")
        with pytest.raises(PromptTooLong) as failure:
            await read_all(session)
        assert session.failed(failure.value) is True  # the client is told
        assert session.outcome == "invalid_input"
        await session.close()
        assert runtime.engine.prompts == {}
        assert counted(runtime, "invalid_input") == 1 and counted(runtime, "error") == 0
        assert await codec_streams_left(snac_server) == 0


async def test_an_engine_failure_is_an_error_the_client_hears_of(snac_server):
    engine = ScriptedEngineDouble(frames=FRAMES, fail_after_frames=2)
    engine.fail_gate.set()
    async with assembled(snac_server, engine) as runtime:
        session = await SpeechSession.open(runtime, spec(runtime), None, "fails")
        session.say(SENTENCES[0])
        with pytest.raises(EngineError) as failure:
            await read_all(session)
        assert session.failed(failure.value) is True
        assert session.outcome == "error"
        await session.close()
        assert counted(runtime, "error") == 1 and engine.num_unfinished() == 0
        assert await codec_streams_left(snac_server) == 0


async def test_a_failure_after_a_cancel_is_not_told(snac_server):
    async with assembled(snac_server) as runtime:
        session = await SpeechSession.open(runtime, spec(runtime), None, "cancel-then-fail")
        session.say(SENTENCES[0])
        session.cancel("disconnected")
        assert session.failed(PromptTooLong("an echo of the cancel")) is False
        assert session.failed(EngineError("an echo of the cancel")) is False
        assert session.outcome == "disconnected"  # the cancel's outcome, not invalid_input nor error
        await session.close()
        assert counted(runtime, "disconnected") == 1
        assert counted(runtime, "invalid_input") == 0 and counted(runtime, "error") == 0


# -- pacing ---------------------------------------------------------------------------------------------

async def test_send_counts_what_the_client_took_and_cuts_off_a_client_too_slow(snac_server):
    async with assembled(snac_server, max_client_lag_s=0.05) as runtime:
        session = await SpeechSession.open(runtime, spec(runtime), None, "slow")
        session.say(SENTENCES[0])
        taken = []

        async def at_once(data: bytes = b"x") -> None:  # a client that takes each send without waiting
            taken.append(data)

        await session.send(at_once, 0.5)
        await session.send(at_once, 0.25)
        assert session.delivered_s == pytest.approx(0.75) and len(taken) == 2

        async def stuck() -> None:  # a client that stopped reading: the send never completes
            await asyncio.sleep(60)  # far past the 0.8 s allowance (0.05 s + the 0.75 s taken)

        with pytest.raises(ClientTooSlow):
            await session.send(stuck, 0.5)
        assert session.outcome == "slow_client"
        assert session.delivered_s == pytest.approx(0.75)  # the send cut off was not taken
        session.cancel("slow_client")
        await session.close()
        assert counted(runtime, "slow_client") == 1 and runtime.engine.num_unfinished() == 0
        assert await codec_streams_left(snac_server) == 0
