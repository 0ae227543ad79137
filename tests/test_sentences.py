"""runtime/loop/sentences.py: one sentence rule for whole texts (the long-text planner) and for
text arriving in pieces (the live route), on the cases' texts and on the inputs that used to be
cut wrongly (``3.5`` after ``3.``)."""

from __future__ import annotations

import gc
import random
import time

import pytest

from higgs_pack.runtime.loop.sentences import SentenceSplitter, split_sentences
from higgs_pack.runtime.loop.text_chunks import split_sentences as planner_split


@pytest.mark.parametrize(("text", "sentences"), [
    ("It costs 3.5 now. And", ["It costs 3.5 now.", "And"]),
    ("Pay 1,000.25 dollars, or 3.14159. Then", ["Pay 1,000.25 dollars, or 3.14159.", "Then"]),
    ("Use v1.2.3 or 2.0.1-rc.4 now. Ok", ["Use v1.2.3 or 2.0.1-rc.4 now.", "Ok"]),
    ("See https://example.com/a.b?c=d&e=f.g today. Mail ann.lee@example.co.uk! Bye",
     ["See https://example.com/a.b?c=d&e=f.g today.", "Mail ann.lee@example.co.uk!", "Bye"]),
    ("Visit example.com. Then", ["Visit example.com.", "Then"]),
    ("Dr. Smith met Mr. Jones (e.g. at home), i.e. here. Then", ["Dr. Smith met Mr. Jones (e.g. at home), i.e. here.",
                                                               "Then"]),
    ("I met Mr. X. He left.", ["I met Mr. X.", "He left."]),
    ("It was 1990. Then etc. Next", ["It was 1990.", "Then etc.", "Next"]),
    ("1. Buy milk\n2. Buy eggs. Done.", ["1. Buy milk", "2. Buy eggs.", "Done."]),
    ("One! Two? Three; four", ["One!", "Two?", "Three;", "four"]),
    ("Wait... what?! Ok…", ["Wait...", "what?!", "Ok…"]),
    ('He said "stop." Then (quietly.) Fine', ['He said "stop."', "Then (quietly.)", "Fine"]),
    ("你好。再见！好吗？", ["你好。", "再见！", "好吗？"]),
    ("他说：“好。”然后走了。", ["他说：“好。”", "然后走了。"]),
    ("你好!再见.谢谢", ["你好!", "再见.", "谢谢"]),  # ASCII punctuation in CJK text, no space after
    ("こんにちは。元気ですか？", ["こんにちは。", "元気ですか？"]),
    ("नमस्ते। आप कैसे हैं?", ["नमस्ते।", "आप कैसे हैं?"]),
    ("مرحبا؟ كيف حالك", ["مرحبا؟", "كيف حالك"]),
    ("Γεια σου. Τι κάνεις;", ["Γεια σου.", "Τι κάνεις;"]),
    ("สวัสดีครับ วันนี้อากาศดี\nขอบคุณ", ["สวัสดีครับ วันนี้อากาศดี", "ขอบคุณ"]),  # Thai: lines only
    ("a line\r\nnext\n\n\nlast", ["a line", "next", "last"]),
    ("", []),
    ("  \n\t ", []),
])
def test_sentence_ends(text, sentences):
    assert split_sentences(text) == sentences
    assert planner_split(text) == sentences  # text_chunks.py's name is this one


def test_an_end_at_the_end_of_a_piece_waits_for_what_follows():
    splitter = SentenceSplitter()
    assert splitter.feed("It costs 3.") == [] and splitter.pending == "It costs 3."  # may be 3.5
    assert splitter.feed("5 now") == []
    assert splitter.feed(". And") == ["It costs 3.5 now."]
    assert splitter.feed(" 你好。") == []  # a closing quote may still come
    assert splitter.feed("”") == []
    assert splitter.feed("再见") == ["And 你好。”"]
    assert splitter.feed("\n") == ["再见"]
    assert splitter.feed("Trailing") == [] and splitter.flush() == ["Trailing"]
    assert splitter.pending == "" and splitter.flush() == []


@pytest.mark.parametrize("name", ["text_en_basic.txt", "text_zh.txt", "mixed"])
def test_pieces_of_any_size_give_the_whole_texts_sentences(cases_dir, name):
    if name == "mixed":
        text = ("Dr. Lee paid 1,000.25 (v1.2.3) at https://x.org/a.b?c=d. “好。”再见!\n1. One… Two?! "
                "नमस्ते। Done")
    else:
        text = (cases_dir / name).read_text(encoding="utf-8")
    whole = split_sentences(text)
    assert len(whole) > 1
    assert "".join("".join(whole).split()) == "".join(text.split())  # every character, in order
    for seed in range(100):
        rng, splitter, got, at = random.Random(seed), SentenceSplitter(), [], 0
        while at < len(text):
            size = rng.randint(1, 7)
            got += splitter.feed(text[at:at + size])
            at += size
        assert got + splitter.flush() == whole, seed


def test_cases_texts_sentences(cases_dir):
    assert split_sentences((cases_dir / "text_en_basic.txt").read_text(encoding="utf-8")) == [
        "The sun rises in the east and sets in the west.",
        "This simple fact has been observed by humans for thousands of years."]
    zh = split_sentences((cases_dir / "text_zh.txt").read_text(encoding="utf-8"))
    assert len(zh) == 6 and zh[2] == "今天我们要聊的是一个你绝对不能忽视的话题\"多模态学习\"。"


def test_a_megabyte_is_split_in_linear_time(cases_dir):
    """Whole (the planner) and in 4-character pieces (the live route): 1 MB of the cases' texts,
    numbers and versions in well under a second each on the 2-core test machine (0.03-0.12 s and
    0.6 s measured); a 4x larger text takes about 4x, not 16x."""
    unit = " ".join([(cases_dir / "text_en_basic.txt").read_text(encoding="utf-8"),
                     (cases_dir / "text_zh.txt").read_text(encoding="utf-8"), "1. (2) «three»! v1.2.3 3.5 "])
    text = unit * (2**20 // len(unit.encode()) + 1)
    assert len(text.encode()) >= 2**20

    def seconds(text: str, piece: int | None) -> float:
        gc.collect()
        gc.disable()  # the collector's passes over the test process's heap are not the splitter's work
        try:
            start = time.perf_counter()
            if piece is None:
                split_sentences(text)
            else:
                splitter = SentenceSplitter()
                for at in range(0, len(text), piece):
                    splitter.feed(text[at:at + piece])
                splitter.flush()
            return time.perf_counter() - start
        finally:
            gc.enable()

    assert seconds(text, None) < 5 and seconds(text, 4) < 15
    ratio = min(seconds(text * 4, None) for _ in range(3)) / min(seconds(text, None) for _ in range(3))
    assert ratio < 10, ratio  # 4 MB over 1 MB: about 4 measured; quadratic work would be 16
    endless = "word " * 200_000  # no sentence end: one sentence, no rescans
    assert seconds(endless, None) < 5 and split_sentences(endless) == [endless.strip()]


# ------------------------------------------------ committing text that arrives in pieces (issue 41 item 2)

PROSE = "Well, I think that the weather today, all things considered, is fine. It costs 1,000 dollars: a lot. Bye"


def _commits(text: str, size: int, **options) -> list[list[str]]:
    from higgs_pack.runtime.loop.sentences import TextCommits

    commits = TextCommits(**options)
    out = [commits.feed(text[i:i + size]) for i in range(0, len(text), size)]
    return [*out, commits.flush()]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_commits_at_sentences_clauses_and_first_words_lose_nothing(size):
    from higgs_pack.runtime.loop.sentences import split_sentences

    sentence = [p for ps in _commits(PROSE, size) for p in ps]
    assert sentence == split_sentences(PROSE)
    clause = [p for ps in _commits(PROSE, size, granularity="clause") for p in ps]
    # "Well," is under MIN_CLAUSE_WORDS and joins its clause; 1,000 is no clause end
    assert clause == ["Well, I think that the weather today,", "all things considered,", "is fine.",
                      "It costs 1,000 dollars:", "a lot.", "Bye"]
    first = [p for ps in _commits(PROSE, size, granularity="clause", first_words=4) for p in ps]
    # the first four words alone when they arrive before the clause's end; all at once, the clause is one part
    assert first == (["Well, I think that", "the weather today,", *clause[1:]] if size < 1000 else clause)
    assert " ".join(first).split() == PROSE.split()
    # the first words alone are committed as soon as the fourth word is known whole (a space after it)
    if size == 1:
        pieces = _commits(PROSE, 1, first_words=4)
        assert pieces[len("Well, I think that ") - 1] == ["Well, I think that"]
        assert [p for ps in pieces for p in ps] == ["Well, I think that", "the weather today, all things considered, "
                                                    "is fine.", "It costs 1,000 dollars: a lot.", "Bye"]


def test_commits_cut_cjk_clauses_and_restart_after_a_barge_in():
    from higgs_pack.runtime.loop.sentences import TextCommits

    commits = TextCommits("clause")
    assert commits.feed("你好，我是一个测试。今天天气很好，") == ["你好，我是一个测试。", "今天天气很好，"]
    assert commits.feed("不是") == [] and commits.pending == "不是"
    commits = TextCommits("sentence", first_words=2)
    assert commits.feed("One two three") == ["One two"]
    assert commits.feed(" four five six") == [] and commits.pending.strip() == "three four five six"
    commits.restart()
    assert commits.pending == "" and commits.feed("Seven eight nine") == ["Seven eight"]


def test_a_flush_ends_a_response_and_the_next_words_are_a_responses_first():
    """An agent's turn ends with a flush (the plugins flush at each turn's end): the next turn's first
    words are cut alone as the first turn's were, not held for a clause or sentence end."""
    from higgs_pack.runtime.loop.sentences import TextCommits

    for granularity in ("clause", "sentence"):
        commits = TextCommits(granularity, first_words=4)
        assert [commits.feed(w) for w in ("One", " two", " three", " four", " five")][-1] == ["One two three four"]
        assert commits.feed(" six") == [] and commits.flush() == ["five six"]
        assert [commits.feed(w) for w in ("Seven", " eight", " nine", " ten")] == [[], [], [], []]
        assert commits.feed(" eleven") == ["Seven eight nine ten"]
        assert commits.flush() == ["eleven"]
        assert commits.feed("Whole one. Two") == ["Whole one."]  # an end that arrived is still the cut


def test_the_first_commit_never_cuts_an_end_that_has_arrived():
    """The first words are cut alone only while no clause or sentence end has arrived after them: a
    sentence that arrives whole is one part (it was "One two three four" + "five."), and a "." at
    the end of what arrived, which may be a sentence's end, holds the cut until the next piece."""
    from higgs_pack.runtime.loop.sentences import TextCommits

    for granularity in ("clause", "sentence"):
        commits = TextCommits(granularity, first_words=4)
        assert commits.feed("One two three four five. Six seven") == ["One two three four five."]
        assert commits.flush() == ["Six seven"]
        commits = TextCommits(granularity, first_words=4)  # the docs' example
        assert commits.feed("Hello") == [] and commits.feed(" there, this is") == []
        assert commits.feed(" streamed. And a") == ["Hello there, this is streamed."]
        commits = TextCommits(granularity, first_words=4)
        assert commits.feed("One two three four five.") == []  # its "." may be the sentence's end
        assert commits.feed(" Six") == ["One two three four five."]
        commits = TextCommits(granularity, first_words=4)  # word by word: the cut at four words
        assert [commits.feed(w) for w in ("One", " two", " three", " four", " five")][-1] == ["One two three four"]
        assert commits.feed(" six.") == [] and commits.feed(" Seven") == ["five six."]
    commits = TextCommits("clause", first_words=4)  # a clause end that has arrived is the cut
    assert commits.feed("One two three four five six, seven") == ["One two three four five six,"]
    commits = TextCommits("clause", first_words=4)
    assert commits.feed("One two three four five six") == ["One two three four"]


def test_the_first_commit_counts_words_as_word_timings_do():
    """Chinese and Japanese have no spaces: each ideograph or kana is a word (split_words), whole once
    the next character (not punctuation of its own) has arrived."""
    from higgs_pack.runtime.loop.sentences import TextCommits
    from higgs_pack.runtime.loop.words import split_words

    text = "你好世界今天天气很好我们去公园散步吧然后回家"
    commits = TextCommits("clause", first_words=4)
    pieces = [commits.feed(character) for character in text]
    assert pieces[4] == ["你好世界"] and not any(pieces[:4]) and split_words("你好世界") == list("你好世界")
    assert [p for ps in pieces for p in ps] + commits.flush() == ["你好世界", text[4:]]
    commits = TextCommits("sentence", first_words=2)
    assert commits.feed("こん") == [] and commits.feed("、") == [] and commits.feed("に") == ["こん、"]


@pytest.mark.parametrize("options", [{"granularity": "word"}, {"first_words": -1}])
def test_commits_refuse_a_bad_rule(options):
    from higgs_pack.runtime.loop.sentences import TextCommits

    with pytest.raises(ValueError, match="granularity is one of"):
        TextCommits(**options)
