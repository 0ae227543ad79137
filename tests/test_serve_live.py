"""Issue 31 item 2: the ``/v1/audio/speech/stream`` WebSocket on a live ``higgs-pack serve``
(a real subprocess on 127.0.0.1 serving the real tiny cpu int4 bundle), driven by the
``websockets`` client as a voice agent drives it: text in pieces, cancel, flush, bad messages,
concurrent sessions, a client that leaves mid-sentence, the API key.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
from live_server import LiveServer

from higgs_pack.errors import clipped

websockets = pytest.importorskip("websockets", reason="the websockets client is a dev dependency")

RATE = 24000
HOP = 960  # samples per frame
PAUSE = int(0.2 * RATE)  # SENTENCE_PAUSE_S
#: A sentence that runs long: the tiny model speaks to its frame cap.
LONG = "This sentence is long enough to be stopped while it is still being spoken out loud."
#: The commit rule of the tests of sentence mechanics: whole sentences (the default commits a
#: response's first words alone and cuts at clause ends too: docs/serving/live.md).
BY_SENTENCE = {"split_granularity": "sentence", "first_commit_words": 0}


@dataclass
class Heard:
    """What a session received: the JSON events in order, and per sentence its audio bytes."""

    events: list[dict] = field(default_factory=list)
    audio: dict[int, bytearray] = field(default_factory=dict)
    order: list = field(default_factory=list)  # events and ("audio", index, bytes) as they came
    close_code: int | None = None

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


@pytest.fixture(scope="module")
def server(cpu_int4_bundle):
    with LiveServer(cpu_int4_bundle, "--max-input-chars", "6000", "--max-batch", "4", "--max-queue", "8") as live:
        live.ws = live.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        yield live


async def _read(ws, heard: Heard, until: str | None = "session.done", timeout: float = 120) -> Heard:
    """Read messages into ``heard`` until an event of type ``until`` (None: until the close); audio
    belongs to the last ``audio.start`` read, in this call or an earlier one."""
    starts = heard.of("audio.start")
    current = starts[-1]["sentence_index"] if starts else None
    deadline = time.monotonic() + timeout
    while True:
        try:
            message = await asyncio.wait_for(ws.recv(), deadline - time.monotonic())
        except websockets.ConnectionClosed as closed:
            heard.close_code = closed.rcvd.code if closed.rcvd else None
            return heard
        if isinstance(message, bytes):
            heard.audio.setdefault(current, bytearray()).extend(message)
            heard.order.append(("audio", current, len(message)))
            continue
        event = json.loads(message)
        heard.events.append(event)
        heard.order.append(event)
        if event["type"] == "audio.start":
            current = event["sentence_index"]
        if event["type"] == until:
            return heard


async def _session(url: str, pieces: list[str], config: dict | None = None, **connect) -> Heard:
    async with websockets.connect(url, **connect) as ws:
        if config is not None:
            await ws.send(json.dumps({"type": "session.config", **config}))
        for piece in pieces:
            await ws.send(json.dumps({"type": "input.text", "text": piece}))
        await ws.send(json.dumps({"type": "input.done"}))
        heard = await _read(ws, Heard())
        return await _read(ws, heard, None, timeout=10)


def _check_sentences(heard: Heard, texts: list[str], fmt: str = "pcm") -> None:
    """Each sentence: audio.start, its audio, audio.done whose start/end match the bytes sent."""
    starts, dones = heard.of("audio.start"), heard.of("audio.done")
    assert [e["sentence_text"] for e in starts] == texts
    assert [e["sentence_index"] for e in starts] == list(range(len(texts)))
    assert [e["sentence_index"] for e in dones] == list(range(len(texts)))
    assert heard.of("session.done") == [{"type": "session.done", "total_sentences": len(texts)}]
    assert heard.close_code == 1000
    at = 0.0
    for start, done in zip(starts, dones, strict=True):
        index = start["sentence_index"]
        assert start["format"] == fmt and start["sample_rate"] == RATE
        data = bytes(heard.audio[index])
        if fmt == "wav":
            assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
            data = data[44:]
        pause = PAUSE if index else 0
        assert len(data) == 2 * (pause + done["frames"] * HOP), (index, len(data), done)
        assert done["start"] == pytest.approx(at + pause / RATE, abs=1e-3)
        assert done["end"] == pytest.approx(done["start"] + done["frames"] * HOP / RATE, abs=1e-3)
        assert done["first_audio_s"] > 0
        at = done["end"]


def test_a_number_cut_across_pieces_is_not_a_sentence_end(server):
    """The session cuts with runtime/loop/sentences.py (its own tests: tests/test_sentences.py):
    ``3.`` at the end of a piece waits for the next, a title's ``.`` ends nothing."""
    pieces = ["It costs 3.", "5 dollars. Dr.", " Smith said so", "。Fine"]
    heard = asyncio.run(_session(server.ws, pieces, {"seed": 3}))
    _check_sentences(heard, ["It costs 3.5 dollars.", "Dr. Smith said so。", "Fine"])


def test_text_in_pieces_is_spoken_sentence_by_sentence(server):
    pieces = ["Hello there", ", this is", " a test. And", " another one here!", " Trailing bit"]
    heard = asyncio.run(_session(server.ws, pieces, {"seed": 3, **BY_SENTENCE}))
    _check_sentences(heard, ["Hello there, this is a test.", "And another one here!", "Trailing bit"])
    # the events of a sentence come in order: its start, its audio, its done, then the next start
    kinds = [o["type"] if isinstance(o, dict) else "audio" for o in heard.order]
    assert kinds[0] == "audio.start" and kinds[-1] == "session.done"
    for i, kind in enumerate(kinds[:-1]):
        if kind == "audio.start":
            assert kinds[i + 1] == "audio" and "audio.done" not in kinds[i + 1:i + 2]


def test_the_first_audio_is_one_frame_made_once_the_codec_lookahead_and_one_frame_exist(server):
    """Issue 41 goal 2: a live session's first audio message is the codec's first call's, made once
    the stateful codec's lookahead and one frame have been generated: one frame of audio (the HTTP
    route's first piece is initial_chunk_frames, 10 frames, which waited 9 frames more); a
    session.config's initial_chunk_frames still chooses it, and the spoken codes are the same."""
    async def first_audio(config: dict) -> tuple[int, Heard]:
        heard = await _session(server.ws, ["One two three four five six seven."], {"seed": 5, **BY_SENTENCE, **config})
        return next(size for kind, *rest in (o for o in heard.order if isinstance(o, tuple))
                    for index, size in [rest] if index == 0), heard

    size, heard = asyncio.run(first_audio({}))
    assert size == 2 * HOP  # 16-bit PCM: one frame's 960 samples
    asked, again = asyncio.run(first_audio({"initial_chunk_frames": 10}))
    assert asked == 2 * 10 * HOP
    assert heard.of("audio.done")[0]["frames"] == again.of("audio.done")[0]["frames"]
    one, ten = (np.frombuffer(bytes(h.audio[0]), np.int16).astype(np.int32) for h in (heard, again))
    assert one.shape == ten.shape and np.abs(one - ten).max() <= 2  # the same codes; the codec's calls differ


def test_wav_sessions_open_each_sentence_with_a_header(server):
    heard = asyncio.run(_session(server.ws, ["First one. Second one."], {"response_format": "wav", "seed": 1}))
    _check_sentences(heard, ["First one.", "Second one."], fmt="wav")


def test_sentences_carry_the_rolling_context(server):
    """With context (the default) the second sentence's prompt holds the first sentence's text and
    codes, so its audio differs from the same sentence spoken on its own (context_chunks 0); the
    first sentence, same seed, is the same either way."""
    text = ["The first sentence sets the voice. The second one follows it."]
    with_context = asyncio.run(_session(server.ws, text, {"seed": 5}))
    alone = asyncio.run(_session(server.ws, text, {"seed": 5, "context_chunks": 0}))
    again = asyncio.run(_session(server.ws, text, {"seed": 5}))
    assert bytes(with_context.audio[0]) == bytes(alone.audio[0])
    assert bytes(with_context.audio[1]) != bytes(alone.audio[1])
    assert bytes(with_context.audio[1]) == bytes(again.audio[1])  # a seeded session repeats


def test_later_sentences_restore_the_voice_from_the_prefix_cache(server, cases_dir):
    """A sentence's request carries the voice and the previous sentences apart (the long text's
    layout, SynthesisRequest.context), so its prompt opens with the voice alone: with a named
    voice the first sentence computes the voice's prefix (a miss) and the second and third
    restore it (two hits) while still hearing the sentence before.  With no voice the first
    sentence's speech is the voice of the rest: the second computes it, the third restores it.
    Once cached, a later session's every sentence restores it (context_frames cutting the context)."""
    transcript = (cases_dir / "ref_en_16k.txt").read_text().strip()
    made = httpx.post(server.url + "/v1/audio/voices", timeout=60, data={"name": "live-prefix", "transcript": transcript},
                      files={"audio": ("ref.wav", (cases_dir / "ref_en_16k.wav").read_bytes(), "audio/wav")})
    assert made.status_code == 201, made.text
    texts = ["The first sentence sets the scene.", "The second one follows it.", "And a third one ends it."]

    def counts() -> tuple[float, float]:
        return server.metric("higgs_pack_prefix_cache_hits_total"), server.metric("higgs_pack_prefix_cache_misses_total")

    for config, (hits, misses) in (({"voice": "live-prefix", "seed": 4}, (2, 1)), ({"seed": 4}, (1, 1)),
                                   ({"voice": "live-prefix", "seed": 4, "context_frames": 5}, (3, 0))):
        before = counts()
        heard = asyncio.run(_session(server.ws, [" ".join(texts)], {**config, **BY_SENTENCE}))
        _check_sentences(heard, texts)
        assert all(done["frames"] > 0 and done["prefill_s"] > 0 and done["prefilled"] > 0
                   for done in heard.of("audio.done"))
        after = counts()
        assert (after[0] - before[0], after[1] - before[1]) == (hits, misses), config


def test_flush_speaks_text_with_no_sentence_end(server):
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:  # no first commit: the flush alone cuts
            await ws.send(json.dumps({"type": "session.config", "first_commit_words": 0}))
            await ws.send(json.dumps({"type": "input.text", "text": "No sentence end here"}))
            await ws.send(json.dumps({"type": "input.flush"}))
            heard = await _read(ws, Heard(), "audio.done")
            assert heard.of("audio.start")[0]["sentence_text"] == "No sentence end here"
            await ws.send(json.dumps({"type": "input.text", "text": "Then more."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10)

    heard = asyncio.run(run())
    _check_sentences(heard, ["No sentence end here", "Then more."])


def test_cancel_stops_the_sentence_drops_buffered_text_and_the_session_goes_on(server):
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            await ws.send(json.dumps({"type": "session.config", "max_new_tokens": 2000, "seed": 2, **BY_SENTENCE}))
            await ws.send(json.dumps({"type": "input.text", "text": LONG + " Buffered but never spoken. And a rest"}))
            heard = Heard()
            while not heard.audio.get(0):  # the first audio of sentence 0
                message = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(message, bytes):
                    heard.audio.setdefault(0, bytearray()).extend(message)
                else:
                    heard.events.append(json.loads(message))
            await ws.send(json.dumps({"type": "input.cancel"}))
            await _read(ws, heard, "audio.cancelled")
            await ws.send(json.dumps({"type": "input.text", "text": "After the cancel."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            await _read(ws, heard, None, 10)
            return heard

    heard = asyncio.run(run())
    # sentence 0's audio that came between its first piece and audio.cancelled (_read began with no
    # audio.start, so it filed those pieces under None; several arrive before the cancel on a loaded machine)
    heard.audio[0] += heard.audio.pop(None, bytearray())
    cancelled = heard.of("audio.cancelled")
    assert len(cancelled) == 1 and cancelled[0]["sentence_index"] == 0
    assert cancelled[0]["end"] == pytest.approx(len(heard.audio[0]) / 2 / RATE, abs=1e-3)
    # sentence 0 stopped well before its 2000-frame cap (80 s); no audio.done for it
    assert len(heard.audio[0]) < 2 * 2000 * HOP // 4
    assert [e["sentence_index"] for e in heard.of("audio.done")] == [1]
    # the buffered sentences were dropped: the next one spoken is the text sent after the cancel
    assert [e["sentence_text"] for e in heard.of("audio.start")] == [LONG, "After the cancel."]
    assert heard.of("session.done") == [{"type": "session.done", "total_sentences": 2}]
    assert heard.close_code == 1000


def test_cancel_with_nothing_spoken_answers_and_keeps_the_session(server):
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            await ws.send(json.dumps({"type": "input.text", "text": "Not finished"}))
            await ws.send(json.dumps({"type": "input.cancel"}))
            heard = await _read(ws, Heard(), "audio.cancelled")
            await ws.send(json.dumps({"type": "input.text", "text": "Spoken."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10)

    heard = asyncio.run(run())
    assert heard.of("audio.cancelled") == [{"type": "audio.cancelled", "sentence_index": None, "end": 0.0}]
    _check_sentences(heard, ["Spoken."])


BAD = [
    ("not json at all", "type", "invalid_json"),
    (b"\x00\x01", "type", "invalid_message"),
    ([1, 2], "type", "invalid_message"),
    ({"type": "input.bogus"}, "type", "unknown_type"),
    ({"type": "input.text"}, "text", "missing_field"),
    ({"type": "input.text", "text": 5}, "text", "invalid_value"),
    ({"type": "input.text", "text": "x", "voice": "y"}, "voice", "unknown_field"),
    ({"type": "input.flush", "now": True}, "now", "unknown_field"),
    ({"type": "input.text", "text": "x" * 6001}, "text", "input_too_long"),
]


def test_bad_messages_get_an_error_naming_the_field_and_the_session_goes_on(server):
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            for message, _, _ in BAD:
                await ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
            heard = Heard()
            for _ in BAD:
                await _read(ws, heard, "error")
            await ws.send(json.dumps({"type": "input.text", "text": "Still here."}))
            await ws.send(json.dumps({"type": "session.config", "seed": 1}))  # too late: text came first
            await _read(ws, heard, "error")
            await ws.send(json.dumps({"type": "input.done"}))
            await ws.send(json.dumps({"type": "input.text", "text": "after done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10)

    heard = asyncio.run(run())
    errors = heard.of("error")
    assert [(e["param"], e["code"]) for e in errors[:len(BAD)]] == [(p, c) for _, p, c in BAD]
    assert all(e["message"] and e["status"] == 400 for e in errors)
    assert "--max-input-chars" in errors[len(BAD) - 1]["message"]
    assert errors[len(BAD)]["code"] == "config_too_late"
    assert (errors[-1]["param"], errors[-1]["code"]) == ("type", "session_ended")
    _check_sentences(heard, ["Still here."])


@pytest.mark.parametrize(("config", "param", "code"), [
    ({"response_format": "flac"}, "response_format", "unsupported_value"),
    ({"speed": 5}, "speed", "invalid_value"),
    ({"speed": "fast"}, "speed", "invalid_value"),
    ({"voice": "nobody"}, "voice", "unknown_voice"),
    ({"sede": 1}, "sede", "unknown_field"),
    ({"input": "hello"}, "input", "unknown_field"),
    ({"temperature": -1}, "temperature", "invalid_value"),
    ({"context_frames": 0}, "context_frames", "invalid_value"),
    ({"model": "gpt-4o-mini-tts"}, "model", "model_not_found"),
    ({"max_new_tokens": 50000}, "max_new_tokens", "invalid_value"),  # past the bundle's context: HTTP's 400 too
])
def test_a_bad_config_is_refused_by_the_http_routes_checks_and_the_session_goes_on(server, config, param, code):
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            await ws.send(json.dumps({"type": "session.config", **config}))
            heard = await _read(ws, Heard(), "error")
            await ws.send(json.dumps({"type": "session.config", "seed": 4}))  # a good one is still taken
            await ws.send(json.dumps({"type": "input.text", "text": "Good after bad."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10)

    heard = asyncio.run(run())
    error = heard.of("error")[0]
    assert (error["param"], error["code"]) == (param, code), error
    if code == "unknown_field" and param == "sede":
        assert "did you mean 'seed'" in error["message"]
    if param == "max_new_tokens":
        assert "max_new_tokens is at most" in error["message"] and "for this bundle" in error["message"], error
        assert ".." not in error["message"], error
    _check_sentences(heard, ["Good after bad."])


def test_an_unknown_config_field_lists_the_fields_a_session_config_takes(server):
    """The fields listed are a session.config's (derived from the declarations: schema.config_fields),
    not the HTTP body's: the live-only commit fields in, the body's text and answer-shape fields out;
    one full stop between the message and what is said of every refused config."""
    from higgs_pack.serve.schema import config_fields

    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            heard = Heard()
            for config in ({"bogus": 1}, {"segments": True}):
                await ws.send(json.dumps({"type": "session.config", **config}))
                await _read(ws, heard, "error")
            return heard

    unknown, segments = asyncio.run(run()).of("error")
    assert (unknown["param"], unknown["code"]) == ("bogus", "unknown_field"), unknown
    listed = unknown["message"].split("known: ", 1)[1].split(".", 1)[0]
    assert listed.split(", ") == sorted(config_fields()), unknown
    assert {"split_granularity", "first_commit_words"} <= set(listed.split(", "))
    for name in ("input", "stream", "stream_format", "segments"):
        assert name not in listed.split(", "), unknown
    assert ".." not in unknown["message"], unknown
    assert (segments["param"], segments["code"]) == ("segments", "unknown_field"), segments
    assert "audio.done" in segments["message"], segments


def test_a_field_given_twice_in_a_message_is_refused_as_the_http_route_refuses_it(server):
    """Which of two values counts is ambiguous: refused (HTTP's 400 duplicate_field), never the last
    one taken; a session.config with a field twice is refused whole (text waits for a good one)."""
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            heard = Heard()
            await ws.send('{"type": "input.text", "text": "dup", "text": "Spoken twice."}')
            await _read(ws, heard, "error")
            await ws.send('{"type": "session.config", "speed": 2.0, "speed": 9}')
            await _read(ws, heard, "error")
            await ws.send(json.dumps({"type": "input.text", "text": "Not in defaults."}))
            await _read(ws, heard, "error")
            await ws.send(json.dumps({"type": "session.config", "seed": 2}))
            await ws.send(json.dumps({"type": "input.text", "text": "Good."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10)

    heard = asyncio.run(run())
    text, config, waiting = heard.of("error")
    assert (text["param"], text["code"], text["status"]) == ("text", "duplicate_field", 400), text
    assert "gives 'text' twice" in text["message"], text
    assert (config["param"], config["code"]) == ("speed", "duplicate_field"), config
    assert "refused whole" in config["message"], config
    assert (waiting["param"], waiting["code"]) == ("session.config", "config_refused"), waiting
    _check_sentences(heard, ["Good."])


def test_a_config_with_several_bad_fields_names_each_and_text_waits_for_a_good_one(server):
    """A refused session.config names every bad field and leaves no setting taken; text sent
    before a valid config is refused (never spoken in default settings), then a corrected config
    and the text are spoken (H-newuser 4)."""
    async def run() -> Heard:
        async with websockets.connect(server.ws) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "alloy", "temperature": -1,
                                      "response_format": "mp3", "max_new_tokens": 5}))
            heard = await _read(ws, Heard(), "error")
            await ws.send(json.dumps({"type": "input.text", "text": "Not in defaults."}))
            await _read(ws, heard, "error")
            await ws.send(json.dumps({"type": "session.config", "max_new_tokens": 5}))
            await ws.send(json.dumps({"type": "input.text", "text": "Good after bad."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await _read(ws, heard)
            return await _read(ws, heard, None, 10)

    heard = asyncio.run(run())
    config, text = heard.of("error")
    assert (config["param"], config["code"], config["status"]) == ("voice", "invalid_config", 400), config
    for name in ("voice", "temperature", "response_format"):
        assert f"\n  - {name} " in config["message"], config
    assert config["message"].startswith("3 problems with the request:\n"), config  # the HTTP route's shape
    assert "none of its settings were taken" in config["message"]
    assert (text["param"], text["code"]) == ("session.config", "config_refused"), text
    _check_sentences(heard, ["Good after bad."])
    assert heard.of("audio.done")[0]["frames"] <= 5  # the corrected config's max_new_tokens


def test_eight_sessions_at_once_lose_and_reorder_no_audio(server):
    """8 sessions share the engine (4 rows): each gets all its sentences, in order, each sentence's
    audio whole (its frames' samples and the pause, contiguous in the session's timeline), and
    no session gets another's audio.  (Not byte-equal to a run alone: the int4 MatMulNBits
    kernels round differently with the batch's size, and the tiny model's flat logits turn that
    into other samples; test_engine checks equality on fp32.)"""
    texts = [[f"Session {s} says sentence one. ", f"Then sentence two of session {s}. ", "And a third."]
             for s in range(8)]

    async def together() -> list[Heard]:
        return await asyncio.gather(*(_session(server.ws, t, {"seed": 10 + s, **BY_SENTENCE}) for s, t in enumerate(texts)))

    heard = asyncio.run(together())
    for s, one in enumerate(heard):
        _check_sentences(one, [p.strip() for p in texts[s]])
    firsts = {bytes(one.audio[0]) for one in heard}
    assert len(firsts) == len(heard)


def test_a_client_that_leaves_mid_sentence_frees_its_engine_row(server):
    async def run() -> None:
        ws = await websockets.connect(server.ws)
        await ws.send(json.dumps({"type": "session.config", "max_new_tokens": 3000}))
        await ws.send(json.dumps({"type": "input.text", "text": LONG + " "}))
        while not isinstance(await asyncio.wait_for(ws.recv(), 60), bytes):
            pass
        assert server.metric("higgs_pack_active_batch") == 1
        ws.transport.abort()  # no close handshake: the connection just drops

    before = server.metric("higgs_pack_requests_total", 'route="/v1/audio/speech/stream",status="499"')
    asyncio.run(run())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (server.metric("higgs_pack_active_batch")
                                           or server.metric("higgs_pack_in_flight")):
        time.sleep(0.1)
    assert server.metric("higgs_pack_active_batch") == 0 and server.metric("higgs_pack_in_flight") == 0
    after = server.metric("higgs_pack_requests_total", 'route="/v1/audio/speech/stream",status="499"')
    assert after == before + 1
    # 3000 frames are 2 minutes of audio: the engine stopped long before
    frames = server.metric("higgs_pack_engine_frames_total")
    time.sleep(0.5)
    assert server.metric("higgs_pack_engine_frames_total") == frames


def test_metrics_count_sessions_and_their_audio(server):
    labels = 'route="/v1/audio/speech/stream",status="101"'
    before, seconds = server.metric("higgs_pack_requests_total", labels), server.metric("higgs_pack_audio_seconds_total")
    heard = asyncio.run(_session(server.ws, ["Counted once."], {"seed": 8}))
    assert server.metric("higgs_pack_requests_total", labels) == before + 1
    spoken = heard.of("audio.done")[0]["frames"] * HOP / RATE
    assert server.metric("higgs_pack_audio_seconds_total") == pytest.approx(seconds + spoken, abs=1e-3)


def test_api_key_and_the_session_limit_apply(cpu_int4_bundle):
    with LiveServer(cpu_int4_bundle, "--max-batch", "1", "--max-queue", "1",
                    env={"HIGGS_PACK_API_KEY": "s3cret"}) as live:
        url = live.url.replace("http://", "ws://") + "/v1/audio/speech/stream"

        async def refused(**connect) -> Heard:
            async with websockets.connect(url, **connect) as ws:
                return await _read(ws, Heard(), None, 10)

        for connect in ({}, {"additional_headers": {"Authorization": "Bearer wrong"}}):
            heard = asyncio.run(refused(**connect))
            assert heard.of("error")[0]["code"] == "invalid_api_key" and heard.close_code == 1008
        keyed = {"additional_headers": {"Authorization": "Bearer s3cret"}}
        _check_sentences(asyncio.run(_session(url, ["With the key."], {"seed": 1}, **keyed)), ["With the key."])
        _check_sentences(asyncio.run(_session(url + "?api_key=s3cret", ["From a browser."], {"seed": 1})),
                         ["From a browser."])

        async def full() -> Heard:
            # two sessions hold the server's two places (1 row + 1 queued); a third is refused
            async with websockets.connect(url, **keyed), websockets.connect(url, **keyed):
                await asyncio.sleep(0.3)
                return await refused(**keyed)

        heard = asyncio.run(full())
        error = heard.of("error")[0]
        assert error["code"] == "queue_full" and error["status"] == 429 and heard.close_code == 1013


def test_a_client_that_does_not_read_holds_the_session_back(server):
    """Back-pressure: a client that stops reading (a small receive buffer, websockets' own queue of
    one message) stops the session: the codec decodes no more of its audio and the engine gets
    no next sentence, while the socket's buffers and the session's bounded queue are full; once it
    reads again, every sentence comes whole."""
    long = "This one sentence goes on and on, " * 24 + "until it ends. "  # about 50 s of audio each

    async def run() -> tuple[list[float], Heard]:
        host, port = server.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.connect((host, int(port)))
        async with websockets.connect(server.ws, sock=sock, max_queue=1) as ws:
            await ws.send(json.dumps({"type": "session.config", "seed": 6, **BY_SENTENCE}))
            await ws.send(json.dumps({"type": "input.text", "text": long * 6}))
            await ws.send(json.dumps({"type": "input.done"}))
            readings = [server.metric("higgs_pack_codec_frames_total")]
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and (len(readings) < 4 or len(set(readings[-4:])) > 1):
                await asyncio.sleep(0.5)  # not reading: until the codec's count stands still for 1.5 s
                readings.append(server.metric("higgs_pack_codec_frames_total"))
            heard = await _read(ws, Heard(), timeout=300)
            return readings, await _read(ws, heard, None, 10)

    before = server.metric("higgs_pack_codec_frames_total")
    readings, heard = asyncio.run(run())
    stalled = readings[-1] - before
    total = server.metric("higgs_pack_codec_frames_total") - before
    assert len(set(readings[-4:])) == 1, readings
    assert 0 < stalled < 0.6 * total, (stalled, total)  # it stopped with most of the session still to come
    _check_sentences(heard, [long.strip()] * 6)


def test_the_load_tester_runs_live_sessions_with_text_at_30_tokens_per_s(server, cases_dir):
    """``python -m bench.serving.load --live-sessions 8``: 8 sessions at once, each text sent in
    pieces of about 4 characters at 30 per second; the record says, per sentence, how long after
    its last piece its first audio came, the playback gaps, and finds no lost or reordered audio."""
    from bench.serving.checks import case_texts
    from bench.serving.live import pieces, run_live

    texts = case_texts(cases_dir)
    assert all("".join(pieces(t)) == t for t in texts)
    record = run_live(server.url, texts, 8, 30.0, 120)
    assert record["problems"] == [] and record["sessions"] == 8 and record["tokens_per_s"] == 30.0
    sentences = [s for r in record["session_records"] for s in r["sentences"]]
    assert len(sentences) == record["sentences"] >= 8
    assert record["first_audio_after_text_s"]["n"] == record["first_audio_after_ready_s"]["n"] == len(sentences)
    # ready: its last piece sent and the sentence before it done, so never sooner than the last piece
    assert all(0 < s["first_audio_after_ready_s"] <= s["first_audio_after_text_s"] for s in sentences)
    assert all(s["first_speech_at_s"] >= s["first_audio_at_s"] > s["last_text_s"] > 0 for s in sentences)
    # the text of a sentence takes (its characters / 4) / 30 s to arrive: a session lasts at least that
    longest = max(len(pieces(t)) for t in texts[:8]) / 30.0
    assert record["seconds"] >= longest
    assert record["gaps"] == len([g for r in record["session_records"] for g in r["gaps_s"]])
    assert json.dumps(record)  # it goes into the load test's JSON as it is


def test_a_page_of_another_origin_may_not_speak_through_the_server(server):
    """A browser names the page's origin: a request that spends or changes something, and the live
    WebSocket (which CORS does not cover), from a page that is not this server's own is refused;
    a client with no Origin (this one, curl, openai) and the server's own pages are not."""
    own = server.url
    body = {"model": "nobody", "input": "Hi."}
    evil = httpx.post(server.url + "/v1/audio/speech", json=body, headers={"Origin": "https://evil.example"}, timeout=30)
    assert evil.status_code == 403, evil.text
    error = evil.json()["error"]
    assert error["code"] == "cross_origin" and error["type"] == "permission_error" and "--allow-origin" in error["message"]
    for headers in ({"Origin": own}, {}):  # read: the model is unknown
        read = httpx.post(server.url + "/v1/audio/speech", json=body, headers=headers, timeout=30)
        assert read.status_code == 404, (headers, read.text)
    assert httpx.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"}, timeout=30).status_code == 200

    async def run() -> None:
        from websockets.exceptions import InvalidStatus

        with pytest.raises(InvalidStatus) as refused:
            async with websockets.connect(server.ws, origin="https://evil.example"):
                pass
        assert refused.value.response.status_code == 403
        assert json.loads(refused.value.response.body)["error"]["code"] == "cross_origin"
        with pytest.raises(InvalidStatus) as unknown:  # a path with no WebSocket: 404, not Starlette's 403
            async with websockets.connect(server.ws + "z"):
                pass
        assert unknown.value.response.status_code == 404
        assert "the live speech WebSocket is /v1/audio/speech/stream" in json.loads(unknown.value.response.body)[
            "error"]["message"]
        async with websockets.connect(server.ws, origin=own) as ws:  # the demo page's own origin
            await ws.send(json.dumps({"type": "session.config", "seed": 1}))

    asyncio.run(run())


def test_a_plain_get_of_the_live_route_says_it_is_a_websocket(server):
    """The route exists: a plain GET (a browser's address bar, curl) is a 426 naming the upgrade,
    not a 404 'no route'."""
    plain = httpx.get(server.ws.replace("ws://", "http://"), timeout=30)
    assert plain.status_code == 426 and plain.headers["upgrade"] == "websocket", plain.text
    assert plain.json()["error"]["code"] == "upgrade_required" and "is a WebSocket" in plain.json()["error"]["message"]


def test_a_later_sentence_the_planner_refuses_is_its_own_error_and_the_session_goes_on(server):
    """Issue 37 item 5: the second sentence's context is planned by the planner, whose InputError ended
    the whole session (only ApiError was caught); now that sentence gets an error event and the next
    one is spoken."""
    endless = "x" * 3000  # one word of 375 tokens: more positions than the tiny decoder's 4096, nowhere to cut
    heard = asyncio.run(_session(server.ws, ["Hello there. ", endless + ". ", "Goodbye now."],
                                 {"seed": 1}))  # the frame cap from each text: the long word's does not fit
    errors = heard.of("error")
    assert len(errors) == 1 and errors[0]["param"] == "text"
    assert errors[0]["sentence_text"] == clipped(endless + "."), "the sentence echoed clipped, with its length"
    assert errors[0]["sentence_text"].endswith("(3001 characters)")
    assert "positions" in errors[0]["message"]
    assert [e["sentence_text"] for e in heard.of("audio.start")] == ["Hello there.", "Goodbye now."]
    assert heard.of("session.done") and heard.close_code == 1000


def test_a_special_token_in_the_text_is_said_of_text_this_doors_field(server):
    """The HTTP route's field is input; a session's text comes in input.text's text, and the error
    says so in its message as well as its param (it said "input contains ...")."""
    heard = asyncio.run(_session(server.ws, ["Say <|endoftext|> now. Fine."], {"seed": 1, **BY_SENTENCE}))
    (error,) = heard.of("error")
    assert (error["param"], error["sentence_text"]) == ("text", "Say <|endoftext|> now."), error
    assert error["message"].startswith("text contains the tokenizer's special token"), error
    assert "input" not in error["message"], error
    assert [e["sentence_text"] for e in heard.of("audio.start")] == ["Fine."]
