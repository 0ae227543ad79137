"""Word timings (runtime/loop/words.py): words cut from text, a span shared out by characters, what
a listener heard when playback stopped; a dialogue turn's words within each of its chunks."""

from __future__ import annotations

import itertools

import pytest

from higgs_pack.runtime.loop.words import (
    Word,
    heard_words,
    proportional_bounds,
    split_words,
    word_timings,
)


def test_split_words_spaced_and_unspaced_scripts():
    assert split_words("  Hello, there -- friend!\n") == ["Hello,", "there", "--", "friend!"]
    assert split_words("你好，世界。OK") == ["你", "好，", "世", "界。", "OK"]
    assert split_words("こんにちは") == list("こんにちは")
    assert split_words("안녕 하세요") == ["안녕", "하세요"]  # Korean is written with spaces
    assert split_words(" \t\n") == []


def test_proportional_bounds_cover_the_span_exactly():
    assert proportional_bounds([1, 3], 2.0, 4.0) == [2.0, 3.0, 6.0]
    assert proportional_bounds([0, 0], 0, 10) == [0, 5, 10]  # a zero counts as one
    bounds = proportional_bounds([7, 3, 11, 1], 0.1, 0.7)
    assert bounds[0] == 0.1 and bounds[-1] == 0.1 + 0.7 and bounds == sorted(bounds)


def test_word_timings_share_the_span_by_characters():
    words = word_timings("I am here.", 1.0, 1.8)  # 1 + 2 + 5 characters over 0.8 s
    assert [w.text for w in words] == ["I", "am", "here."]
    assert [(round(w.start, 6), round(w.end, 6)) for w in words] == [(1.0, 1.1), (1.1, 1.3), (1.3, 1.8)]
    assert not any(w.exact for w in words)
    assert word_timings("Alone.", 0.0, 0.4) == (Word("Alone.", 0.0, 0.4, True),)
    assert word_timings("", 0.0, 1.0) == ()
    empty = word_timings("No frames here.", 2.0, 2.0)  # a chunk that made no frame: every word at its end
    assert all(w.start == w.end == 2.0 for w in empty)


def test_heard_words_are_the_words_ended_by_the_cut():
    words = word_timings("one two three four", 0.0, 1.5)  # 3 3 5 4 characters: ends 0.3, 0.6, 1.1, 1.5
    assert [w.text for w in heard_words(words, 0.0)] == []
    assert [w.text for w in heard_words(words, 0.61)] == ["one", "two"]
    assert [w.text for w in heard_words(words, 1.09)] == ["one", "two", "three"]  # 20 ms of tolerance
    assert [w.text for w in heard_words(words, 1.0)] == ["one", "two"]  # three was cut in its middle
    assert heard_words(words, 9.0) == list(words)


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    from higgs_pack.exporters.pytorch.reference import reference_pipeline

    return reference_pipeline(tiny_ckpt)


def test_a_dialogue_turn_of_two_chunks_has_each_chunks_words_in_its_own_span(oracle):
    """The PyTorch reference of the tiny checkpoint: a turn of 260 words is two text chunks; its
    segment is the whole turn (exact), its words are each chunk's words within that chunk's frames."""
    from higgs_pack.runtime.loop.dialogue import DialogueRequest
    from higgs_pack.runtime.loop.synthesis import run_plan

    long_turn = " ".join(f"word{i}" for i in range(259)) + " end."
    turns = [("ANN", "Good morning."), ("BEN", long_turn)]
    plan = DialogueRequest.create(turns, {}, seed=3, max_frames=10).plan(oracle)
    assert [t for t in plan.cast.turns] == [0, 1, 1]
    result = run_plan(oracle, plan)
    ann, ben = result.segments
    assert [w.text for w in ann.words] == ["Good", "morning."] and [w.text for w in ben.words] == long_turn.split()
    seam = (len(result.chunks[0].codes) + len(result.chunks[1].codes)) / 25  # where BEN's second chunk starts
    first_part = [w for w in ben.words if w.end <= seam]
    assert first_part and first_part[-1].end == seam and len(first_part) + 1 < len(ben.words)
    assert ben.words[0].start == ben.start and ben.words[-1].end == ben.end
    assert all(a.end == b.start for a, b in itertools.pairwise(ben.words))
    assert result.words == [*ann.words, *ben.words]


def test_words_prefix_keeps_the_text_as_written():
    from higgs_pack.runtime.loop.words import words_prefix

    assert words_prefix("  Hello,  dear friend! ", 2) == "Hello,  dear"
    assert words_prefix("你好，世界。", 2) == "你好，"
    assert words_prefix("Two words", 0) == "" and words_prefix("Two words", 9) == "Two words"
    assert words_prefix("   ", 1) == ""
