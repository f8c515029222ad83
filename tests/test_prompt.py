"""Sentence splitting and token budgets (prompt ids are tested with the tiny model's tokenizer)."""

from hypothesis import given
from hypothesis import strategies as st

from llm_server.prompt import TOKENS_PER_SECOND, split_sentences, token_budget


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
