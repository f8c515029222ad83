"""Sentence splitting and token budgets (prompt ids are tested with the tiny model's tokenizer)."""

from hypothesis import given
from hypothesis import strategies as st

from llm_server.speech.prompt import TOKENS_PER_SECOND, token_budget
from llm_server.speech.segmenter import TextSegmenter, split_sentences


def test_sentences_split_and_short_ones_join():
    text = "Hello there. How are you today? I'm fine! Thanks."
    assert split_sentences(text, 1000) == [text]
    assert split_sentences(text, 30) == ["Hello there.", "How are you today? I'm fine!", "Thanks."]


def test_long_sentence_splits_at_clauses_then_words():
    text = "one two three, four five six, seven eight nine ten eleven twelve"
    parts = split_sentences(text, 20)
    assert all(len(p) <= 20 for p in parts)
    assert " ".join(parts).replace(",", "") == text.replace(",", "")


@given(st.text(alphabet=st.sampled_from("ab .!?,'\n"), max_size=400), st.integers(5, 80))
def test_nothing_is_lost_and_every_segment_fits(text, max_chars):
    parts = split_sentences(text, max_chars)
    assert all(0 < len(p) <= max_chars for p in parts)
    assert "".join(parts).replace(" ", "") == "".join(text.split()).replace(" ", "")


def test_budget_covers_slow_speech_in_whole_frames():
    short, long = token_budget("Hi."), token_budget("word " * 200)
    assert (short - 1) % 7 == 0 and (long - 1) % 7 == 0
    assert long / TOKENS_PER_SECOND > 1000 / 10  # at least 10 characters per second of audio
    assert short < long


def _segments(pieces, max_chars=280):
    segmenter, out = TextSegmenter(max_chars), []
    for piece in pieces:
        out += segmenter.push(piece)
    return out, segmenter


def test_streamed_words_become_sentences_as_soon_as_each_ends():
    out, segmenter = _segments(["Hello ", "there. ", "How ", "are ", "you"])
    assert out == ["Hello there."] and segmenter.pending.strip() == "How are you"
    assert segmenter.flush() == ["How are you"] and segmenter.flush() == []


def test_whole_sentences_without_trailing_spaces_each_end_one():
    """Pipecat streams sentences to Cartesia as 'Hello there.' then 'How are you?': no space between."""
    out, _ = _segments(["Hello there.", "How are you?"])
    assert out == ["Hello there.", "How are you?"]


def test_numbers_and_tokens_do_not_end_sentences():
    out, segmenter = _segments(["It costs 3", ".", "5 dollars", " today"])
    assert out == [] and segmenter.flush() == ["It costs 3.5 dollars today"]


def test_a_long_sentence_starts_at_its_last_clause_mark():
    out, segmenter = _segments(["one two three four, five six seven eight, nine ten"], max_chars=48)
    assert out == ["one two three four, five six seven eight,"]
    assert segmenter.flush() == ["nine ten"]


@given(st.lists(st.text(alphabet=st.sampled_from("ab .!?,'"), max_size=30), max_size=20), st.integers(16, 80))
def test_streamed_text_loses_nothing_and_every_segment_fits(pieces, max_chars):
    out, segmenter = _segments(pieces, max_chars)
    out += segmenter.flush()
    assert all(0 < len(p) <= max_chars for p in out)
    assert "".join(out).replace(" ", "") == "".join("".join(pieces).split())
