"""Issue 41 items 3 and 4 on the live route: ``audio.done`` carries each sentence's word timings,
and a barge-in (``input.cancel`` with ``played_ms``) is answered with the text heard, which alone
stays as the rolling context.  A real ``higgs-pack serve`` of the tiny cpu int4 bundle on
127.0.0.1, driven by the ``websockets`` client."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from conftest import slow_fixture
from live_server import LiveServer
from test_serve_live import (
    BY_SENTENCE,
    HOP,
    LONG,
    PAUSE,
    RATE,
    Heard,
    _check_sentences,
    _read,
    _session,
)

websockets = pytest.importorskip("websockets", reason="the websockets client is a dev dependency")


@slow_fixture(scope="module")
def server(cpu_int4_bundle):
    with LiveServer(cpu_int4_bundle, "--max-batch", "2", "--max-queue", "4") as live:
        live.ws = live.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        yield live


def test_audio_done_carries_each_words_estimated_times(server):
    texts = ["Hello there, this is a test.", "And another one here!"]
    heard = asyncio.run(_session(server.ws, [" ".join(texts)], {"seed": 3, **BY_SENTENCE}))
    _check_sentences(heard, texts)
    for text, done in zip(texts, heard.of("audio.done"), strict=True):
        words = done["words"]
        assert [w["text"] for w in words] == text.split()
        assert words[0]["start"] == done["start"] and words[-1]["end"] == pytest.approx(done["end"], abs=1e-3)
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(words))
        assert not any(w["exact"] for w in words)


async def _speak_then_cancel(url: str, text: str, cancel: dict | None, after: str) -> Heard:
    """Speak ``text`` (sentence 0) whole, then (with ``cancel``) barge in with it, then ``after``."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", "seed": 4}))
        await ws.send(json.dumps({"type": "input.text", "text": text + " "}))
        heard = await _read(ws, Heard(), "audio.done")
        if cancel is not None:
            await ws.send(json.dumps({"type": "input.cancel", **cancel}))
            await _read(ws, heard, "audio.cancelled")
        await ws.send(json.dumps({"type": "input.text", "text": after}))
        await ws.send(json.dumps({"type": "input.done"}))
        await _read(ws, heard)
        return await _read(ws, heard, None, 10)


def test_a_barge_in_answers_what_was_heard_and_only_that_stays_as_context(server):
    """Sentence 0 spoken whole, the client played it up to just after its third word: the answer
    names those words; the next sentence's prompt holds the heard frames and words as its voice (no
    voice was set, so the first sentence is the voice), so it prefills fewer positions than after
    the whole sentence, by at least the frames not heard."""
    text = "Alpha bravo charlie delta echo foxtrot golf hotel."
    whole = asyncio.run(_speak_then_cancel(server.ws, text, None, "Whole context here."))
    done = whole.of("audio.done")[0]
    third = done["words"][2]["end"] - done["start"]  # seconds into sentence 0's speech (it has no pause)
    cut = asyncio.run(_speak_then_cancel(server.ws, text, {"played_ms": third * 1000 + 1, "sentence_index": 0},
                                         "Whole context here."))
    assert cut.of("audio.done")[0]["words"] == done["words"]  # same seed, same sentence 0
    cancelled = cut.of("audio.cancelled")
    assert cancelled == [{"type": "audio.cancelled", "sentence_index": 0, "end": done["end"],
                          "played_ms": pytest.approx(third * 1000 + 1), "heard_text": "Alpha bravo charlie",
                          "heard_words": 3, "words": done["words"][:3]}]  # the heard words, timed as audio.done's
    after_whole, after_cut = whole.of("audio.done")[1], cut.of("audio.done")[1]
    assert after_cut["sentence_index"] == 1
    not_heard = done["frames"] - round(third * RATE / HOP)
    assert not_heard > 0 and after_whole["prefilled"] - after_cut["prefilled"] >= not_heard


def test_a_barge_in_mid_sentence_estimates_the_words_heard(server):
    """Cut off while still being generated (its length unknown), the words heard are estimated at
    the session's speaking rate: a prefix of the sentence; the session goes on."""
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            await ws.send(json.dumps({"type": "session.config", "max_new_tokens": 2000, "seed": 2, **BY_SENTENCE}))
            await ws.send(json.dumps({"type": "input.text", "text": LONG + " Dropped."}))
            heard = await _read(ws, Heard(), "audio.start")
            while not heard.audio.get(0):
                message = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(message, bytes):
                    heard.audio.setdefault(0, bytearray()).extend(message)
            await ws.send(json.dumps({"type": "input.cancel", "played_ms": 2500}))
            await _read(ws, heard, "audio.cancelled")
            await ws.send(json.dumps({"type": "input.text", "text": "After the cancel."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10)

    heard = asyncio.run(run())
    (cancelled,) = heard.of("audio.cancelled")
    assert cancelled["sentence_index"] == 0 and cancelled["played_ms"] == 2500
    assert 1 <= cancelled["heard_words"] < len(LONG.split())
    assert LONG.startswith(cancelled["heard_text"]) and len(cancelled["heard_text"].split()) == cancelled["heard_words"]
    # the heard words' estimated times in the session's audio: back to back, the last ended by the point played
    words = cancelled["words"]
    assert [w["text"] for w in words] == cancelled["heard_text"].split() and not any(w["exact"] for w in words)
    assert words[0]["start"] == 0.0 and all(a["end"] == b["start"] for a, b in itertools.pairwise(words))
    assert words[-1]["end"] <= 2.5 + 0.02
    assert [e["sentence_text"] for e in heard.of("audio.start")] == [LONG, "After the cancel."]
    assert heard.of("session.done")[0]["total_sentences"] == 2


async def _speak(url: str, texts: list[str], config: dict, cancel_at: float | None = None) -> Heard:
    """Speak ``texts`` (one input.text each); with ``cancel_at`` (a fraction), once sentence 0's
    ``audio.done`` came, barge in with ``played_ms`` at that fraction of its audio, as received."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", **BY_SENTENCE, **config}))
        for text in texts:
            await ws.send(json.dumps({"type": "input.text", "text": text + " "}))
        if cancel_at is not None:
            heard = await _read(ws, Heard(), "audio.done")
            played_ms = len(heard.audio[0]) / 2 / RATE * 1000 * cancel_at
            await ws.send(json.dumps({"type": "input.cancel", "played_ms": played_ms, "sentence_index": 0}))
            await _read(ws, heard, "audio.cancelled")
        else:
            heard = Heard()
        await ws.send(json.dumps({"type": "input.done"}))
        await _read(ws, heard)
        return await _read(ws, heard, None, 10)


@pytest.mark.parametrize("speed", [2.0, 0.5])
def test_speed_stretches_each_sentences_audio_and_its_word_timings(server, speed):
    """speed on a live session: each sentence's audio (its pause too) is round(n / speed) samples of
    the n generated at speed 1 with the same seed (the same frames), and its span and word timings
    are the speed-1 ones divided by speed, in the session's (stretched) audio."""
    texts = ["Hello there, this is a test.", "And another one here!"]
    plain = asyncio.run(_speak(server.ws, texts, {"seed": 3}))
    fast = asyncio.run(_speak(server.ws, texts, {"seed": 3, "speed": speed}))
    for heard in (plain, fast):
        assert [e["sentence_text"] for e in heard.of("audio.start")] == texts and heard.close_code == 1000
    for index, (one, done) in enumerate(zip(plain.of("audio.done"), fast.of("audio.done"), strict=True)):
        assert done["frames"] == one["frames"]
        pause = round(PAUSE / speed) if index else 0
        assert len(fast.audio[index]) == 2 * (pause + round(one["frames"] * HOP / speed))
        assert len(plain.audio[index]) == 2 * ((PAUSE if index else 0) + one["frames"] * HOP)
        assert done["end"] - done["start"] == pytest.approx((one["end"] - one["start"]) / speed, abs=1e-3)
        assert [w["text"] for w in done["words"]] == [w["text"] for w in one["words"]]
        for w, w1 in zip(done["words"], one["words"], strict=True):
            assert w["start"] - done["start"] == pytest.approx((w1["start"] - one["start"]) / speed, abs=1e-4)
            assert w["end"] - done["start"] == pytest.approx((w1["end"] - one["start"]) / speed, abs=1e-4)
    assert fast.of("audio.done")[1]["start"] == pytest.approx(len(fast.audio[0]) / 2 / RATE + PAUSE / speed / RATE,
                                                               abs=1e-3)


def test_a_barge_in_at_speed_maps_played_ms_back_to_the_words_heard(server):
    """At speed 2 the client plays stretched audio: played_ms at half of sentence 0's audio is half
    of its words' (stretched) time, so the words heard are those ended by then, not half as many."""
    text = "Alpha bravo charlie delta echo foxtrot golf hotel india juliet."
    heard = asyncio.run(_speak(server.ws, [text, "Next one here."], {"seed": 4, "speed": 2.0}, cancel_at=0.5))
    done = heard.of("audio.done")[0]
    (cancelled,) = heard.of("audio.cancelled")
    half = len(heard.audio[0]) / 2 / RATE / 2  # seconds of the stretched audio played
    assert cancelled["played_ms"] == pytest.approx(half * 1000)
    # heard: a word whose end (generated time: stretched x 2) is within half a frame of the point played
    expected = [w["text"] for w in done["words"] if (w["end"] - done["start"]) * 2 <= half * 2 + 0.02]
    assert 3 <= len(expected) < len(text.split())
    assert cancelled["heard_words"] == len(expected)
    assert cancelled["heard_text"] == " ".join(expected)
    assert cancelled["words"] == done["words"][:len(expected)]  # in the stretched audio, as audio.done's
    assert heard.of("session.done")[0]["total_sentences"] >= 1


BAD_CANCELS = [
    ({"played_ms": -1}, "played_ms"),
    ({"played_ms": "500"}, "played_ms"),
    ({"played_ms": True}, "played_ms"),
    ({"sentence_index": 0}, "sentence_index"),
    ({"played_ms": 10, "sentence_index": 7}, "sentence_index"),
    ({"played_ms": 10, "heard": 1}, "heard"),
]


def test_a_bad_barge_in_is_an_error_naming_the_field_and_cancels_nothing(server):
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            for cancel, _ in BAD_CANCELS:
                await ws.send(json.dumps({"type": "input.cancel", **cancel}))
            heard = Heard()
            for _ in BAD_CANCELS:
                await _read(ws, heard, "error")
            await ws.send(json.dumps({"type": "input.cancel", "played_ms": 0}))  # nothing played yet: heard nothing
            await _read(ws, heard, "audio.cancelled")
            await ws.send(json.dumps({"type": "input.text", "text": "Still here."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10)

    heard = asyncio.run(run())
    assert [(e["param"], e["status"]) for e in heard.of("error")] == [(p, 400) for _, p in BAD_CANCELS]
    assert "sentence_index 7 is not a sentence whose audio was sent" in heard.of("error")[4]["message"]
    assert heard.of("audio.cancelled") == [{"type": "audio.cancelled", "sentence_index": None, "end": 0.0,
                                            "played_ms": 0, "heard_text": "", "heard_words": 0, "words": []}]
    _check_sentences(heard, ["Still here."])
    assert len(heard.audio[0]) == 2 * heard.of("audio.done")[0]["frames"] * HOP


def test_clause_granularity_and_a_first_commit_speak_sooner_and_lose_no_word(server):
    """split_granularity clause with first_commit_words 3: the first words alone, then clauses
    of three words or more, then sentences; every word spoken once, in order."""
    text = "Right, so here is the plan for today, step by step, and then a rest. Fine"
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    heard = asyncio.run(_session(server.ws, pieces, {"seed": 3, "split_granularity": "clause",
                                                     "first_commit_words": 3}))
    parts = ["Right, so here", "is the plan for today,", "step by step,", "and then a rest.", "Fine"]
    _check_sentences(heard, parts)
    assert [w["text"] for d in heard.of("audio.done") for w in d["words"]] == text.split()


def test_by_default_a_responses_first_three_words_and_its_clauses_are_spoken_alone(server):
    """The default commit rule (clause, first_commit_words 3), with no commit field in the config:
    the first three words alone, then clauses of three words or more, then sentences."""
    text = "Right, so here is the plan for today, step by step, and then a rest. Fine"
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    heard = asyncio.run(_session(server.ws, pieces, {"seed": 3}))
    _check_sentences(heard, ["Right, so here", "is the plan for today,", "step by step,", "and then a rest.", "Fine"])


def test_the_first_commit_never_cuts_a_sentence_that_arrived_whole(server):
    """The first words are cut alone only while no end has arrived after them: a sentence sent in
    one message is one part (it was "One two three four" + "five.", a one-word part, with 4)."""
    heard = asyncio.run(_session(server.ws, ["One two three four five. Six seven."], {"seed": 3}))
    _check_sentences(heard, ["One two three four five.", "Six seven."])
    heard = asyncio.run(_session(server.ws, ["Hello", " there, this is", " streamed. And a", " second sentence."],
                                 {"seed": 3}))  # docs/serving/live.md's example
    # "this" is whole once " is" came: the first three words alone, the sentence's rest at its end
    _check_sentences(heard, ["Hello there, this", "is streamed.", "And a second sentence."])


def test_the_first_commit_counts_chinese_words_as_word_timings_do(server):
    """Each ideograph is a word (as in audio.done's words): sent a character at a time, the first
    three are spoken alone (nothing was spoken before input.done)."""
    text = "你好世界今天天气很好我们去公园散步吧然后回家"
    heard = asyncio.run(_session(server.ws, list(text), {"seed": 3}))
    _check_sentences(heard, ["你好世", text[3:]])
    assert [w["text"] for w in heard.of("audio.done")[0]["words"]] == list("你好世")


def test_a_second_response_after_a_flush_starts_with_its_first_words_alone(server):
    """One session, two responses as an agent's turns (each ended by input.flush, as the plugins end
    a turn): the second response's first three words are committed as soon as they are whole, before
    any flush, as the first response's were (the rule is a response's, not only the session's first)."""
    async def run() -> tuple[Heard, dict]:
        async with websockets.connect(server.ws) as ws:
            await ws.send(json.dumps({"type": "session.config", "seed": 3}))
            for word in ("One", " two", " three", " four", " five", " six."):
                await ws.send(json.dumps({"type": "input.text", "text": word}))
            await ws.send(json.dumps({"type": "input.flush"}))
            heard = await _read(ws, Heard(), "audio.done")
            heard = await _read(ws, heard, "audio.done")  # the first response spoken
            for word in ("Seven", " eight", " nine", " ten", " eleven"):
                await ws.send(json.dumps({"type": "input.text", "text": word}))
            await _read(ws, heard, "audio.start", timeout=30)  # no flush yet: the first words' own part
            second = heard.of("audio.start")[-1]
            await ws.send(json.dumps({"type": "input.flush"}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10), second

    heard, second = asyncio.run(run())
    assert second["sentence_index"] == 2 and second["sentence_text"] == "Seven eight nine"
    _check_sentences(heard, ["One two three", "four five six.", "Seven eight nine", "ten eleven"])


@pytest.mark.parametrize(("config", "param"), [({"split_granularity": "word"}, "split_granularity"),
                                               ({"first_commit_words": -2}, "first_commit_words"),
                                               ({"first_commit_words": 2.5, "seed": -1}, "first_commit_words")])
def test_a_bad_commit_rule_is_refused_with_the_config(server, config, param):
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            await ws.send(json.dumps({"type": "session.config", **config}))
            return await _read(ws, Heard(), "error")

    (error,) = asyncio.run(run()).of("error")
    assert error["param"] == param and param in error["message"] and error["status"] == 400


def test_null_commit_fields_are_the_defaults_and_messages_show_json_values(server):
    """As in the HTTP body, a field sent as null counts as left out (split_granularity and
    first_commit_words were refused while speed null was the default); values are said in JSON's
    words (true, null), never Python's (True, None)."""
    text = "Right, so here is the plan for today, step by step, and then a rest. Fine"
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    heard = asyncio.run(_session(server.ws, pieces, {"seed": 3, "split_granularity": None, "first_commit_words": None,
                                                     "speed": None}))
    assert not heard.of("error"), heard.of("error")
    _check_sentences(heard, ["Right, so here", "is the plan for today,", "step by step,", "and then a rest.", "Fine"])

    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            heard = Heard()
            for message in ({"type": "input.text", "text": None}, {"type": "input.text", "text": True},
                            {"type": "session.config", "first_commit_words": True},
                            {"type": "session.config", "split_granularity": False},
                            {"type": "input.cancel", "played_ms": True}, {"type": True}):
                await ws.send(json.dumps(message))
                await _read(ws, heard, "error")
            return heard

    errors = asyncio.run(run()).of("error")
    assert [e["param"] for e in errors] == ["text", "text", "first_commit_words", "split_granularity", "played_ms",
                                            "type"]
    for error in errors:
        assert "True" not in error["message"] and "False" not in error["message"], error
    assert "null" in errors[0]["message"] and "got a boolean (true)" in errors[1]["message"], errors[:2]
    assert "got a boolean (true)" in errors[2]["message"] and "got a boolean (false)" in errors[3]["message"]


def test_the_client_side_maps_a_players_position_to_the_sentence_and_its_played_ms():
    """protocol.Reader (the plugins' client side): sentence starts in the session's audio, what a
    player at a position has played of which sentence, and the input.cancel that says so."""
    from higgs_pack.serve.integrations.protocol import Reader, cancel_message

    reader = Reader()
    assert reader.played(1.0) is None and reader.played_now() is None
    assert json.loads(cancel_message(None)) == {"type": "input.cancel"}
    reader.read(json.dumps({"type": "audio.start", "sentence_index": 0, "sentence_text": "Hi there."}))
    reader.read(bytes(2 * RATE))  # 1 s of sentence 0
    done = reader.read(json.dumps({"type": "audio.done", "sentence_index": 0, "start": 0.0, "end": 1.0,
                                   "words": [{"text": "Hi", "start": 0.0, "end": 0.3, "exact": False},
                                             {"text": "there.", "start": 0.3, "end": 1.0, "exact": False}]}))
    assert done.words == (("Hi", 0.0, 0.3), ("there.", 0.3, 1.0))
    reader.read(json.dumps({"type": "audio.start", "sentence_index": 1, "sentence_text": "More."}))
    reader.read(bytes(2 * RATE // 2))  # 0.5 s of sentence 1 (its pause and speech)
    assert reader.played(0.4) == (0, pytest.approx(400))
    assert reader.played(1.3) == (1, pytest.approx(300))
    assert reader.played(9.0) == (1, pytest.approx(500))  # no further than the audio read
    assert reader.played_now() is not None  # the clock started at the first audio
    assert json.loads(cancel_message((1, 300.04))) == {"type": "input.cancel", "sentence_index": 1, "played_ms": 300.0}
    reader.cancelling()
    cancelled = reader.read(json.dumps({"type": "audio.cancelled", "sentence_index": 1, "end": 1.5,
                                        "heard_text": "More", "heard_words": 1, "played_ms": 300,
                                        "words": [{"text": "More", "start": 1.2, "end": 1.28, "exact": False}]}))
    assert (cancelled.kind, cancelled.heard, reader.received) == ("cancelled", "More", 1.5)
    assert cancelled.words == (("More", 1.2, 1.28),)


def test_the_client_side_estimates_a_sentence_still_being_generated_as_the_server_would():
    """protocol.Reader.estimated_words (the LiveKit plugin gives LiveKit these words while a sentence
    plays before its audio.done): the open sentence's words timed as barge_in.estimated_words times
    the words heard of a sentence cut there, at the session's rate, or over the audio made so far."""
    from types import SimpleNamespace

    from higgs_pack.runtime.loop.synthesis import SENTENCE_PAUSE_S
    from higgs_pack.runtime.loop.words import Word
    from higgs_pack.serve.barge_in import PLAYED_KEPT, Played, estimated_words
    from higgs_pack.serve.integrations import protocol

    assert (protocol.SENTENCE_PAUSE_S, protocol.RATE_KEPT) == (SENTENCE_PAUSE_S, PLAYED_KEPT)
    reader = protocol.Reader()
    assert reader.estimated_words() == () and reader.played_position() is None
    reader.read(json.dumps({"type": "audio.start", "sentence_index": 0, "sentence_text": "Hi there."}))
    # before any finished sentence: the default rate, 12.5 characters a second (8 characters: 0.64 s)
    assert reader.estimated_words() == (("Hi", 0.0, pytest.approx(0.16)), ("there.", pytest.approx(0.16), 0.64))
    reader.read(bytes(2 * RATE))  # 1 s of sentence 0
    assert reader.estimated_words()[-1][2] == pytest.approx(1.0)  # over the audio made, which is longer
    reader.read(json.dumps({"type": "audio.done", "sentence_index": 0, "start": 0.0, "end": 1.0,
                            "words": [{"text": "Hi", "start": 0.0, "end": 0.25, "exact": False},
                                      {"text": "there.", "start": 0.25, "end": 1.0, "exact": False}]}))
    assert reader.open is None and reader.estimated_words() == ()
    text = "One two three four."
    reader.read(json.dumps({"type": "audio.start", "sentence_index": 1, "sentence_text": text}))
    reader.read(bytes(2 * RATE // 2))  # 0.5 s: its pause and 0.3 s of speech
    client = reader.estimated_words()
    record = Played(1, text, RATE, SimpleNamespace(pushed=[0] * round(0.3 / 0.04)), 100, speech=round(1.2 * RATE))
    done = Played(0, "Hi there.", 0, None, 100, speech=0, words=(Word("Hi", 0.0, 0.25), Word("there.", 0.25, 1.0)))
    server = estimated_words(record, [done, record], 0.04)  # seconds from the sentence's speech
    assert [w[0] for w in client] == [w.text for w in server] == text.split()
    for (_, start, end), word in zip(client, server, strict=True):  # 8 characters a second: 16 take 2 s
        assert (start, end) == (pytest.approx(1.2 + word.start), pytest.approx(1.2 + word.end))
    assert client[-1][2] == pytest.approx(1.2 + 2.0)
