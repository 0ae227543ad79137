"""OpenAI's six response formats streamed through PyAV, and ``speed`` by FFmpeg's atempo (fast
tier: no bundle; the server's side is in test_serve.py).  Every file is decoded back with PyAV
(FFmpeg's decoders, as a player would) or libsndfile, never trusted by its size."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import httpx
import numpy as np
import pytest

pytest.importorskip("av", reason="the [serve] extra (PyAV) is not installed")
pytest.importorskip("fastapi", reason="the [serve] extra (FastAPI) is not installed")

import av

from higgs_pack.runtime.loop.synthesis import Segment, SynthesisResult
from higgs_pack.serve.formats import FORMATS, PCM_FORMATS, StreamEncoder, encode_whole
from higgs_pack.serve.tempo import (
    TimeStretch,
    at_speed,
    atempo_factors,
    retimed,
    scale_spans,
    stretch,
)

RATE = 24000
#: Samples per codec frame at 24 kHz: MPEG-2 Layer III 576, AAC 1024, Opus 20 ms; FLAC's block
#: (FFmpeg's default at 24 kHz: 4608 / 2) is lossless and sample exact.
CODEC_FRAME = {"mp3": 576, "aac": 1024, "opus": 480, "flac": 1, "wav": 1, "pcm": 1}


def _tone(seconds: float = 2.0, hz: float = 220.0) -> np.ndarray:
    """A voice-like test input: a 220 Hz tone with two harmonics, float32 [n] at 24 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    wave = 0.4 * np.sin(2 * np.pi * hz * t) + 0.15 * np.sin(4 * np.pi * hz * t) + 0.05 * np.sin(6 * np.pi * hz * t)
    return wave.astype(np.float32)


def decoded(data: bytes, response_format: str) -> tuple[np.ndarray, int]:
    """float32 [n] mono samples and their rate, decoded by FFmpeg (pcm: read as 16-bit)."""
    if response_format == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, RATE
    with av.open(io.BytesIO(data)) as container:
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
        rate = container.streams.audio[0].sample_rate
    return (samples / 32768 if samples.dtype == np.int16 else samples).astype(np.float32), rate


def streamed(samples: np.ndarray, response_format: str, pieces: int) -> list[bytes]:
    """The bytes a stream sends for ``samples`` cut into ``pieces``: start, each chunk, finish."""
    encoder = StreamEncoder(response_format, RATE)
    return [encoder.start(), *(encoder.chunk(p) for p in np.array_split(samples, pieces)), encoder.finish()]


def dominant_hz(samples: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.argmax(spectrum) * RATE / samples.size)


@pytest.mark.parametrize("response_format", list(FORMATS))
def test_each_format_streams_to_what_the_whole_file_decodes_to(response_format):
    samples = _tone(2.0)
    whole = encode_whole(samples, RATE, response_format)
    parts = streamed(samples, response_format, 23)  # 23 pieces of about 2087 samples: not codec frames
    joined = b"".join(parts)
    assert sum(1 for p in parts[:-1] if p) > 10, "the encoder held the audio back until the end"
    whole_audio, rate = decoded(whole, response_format)
    stream_audio, stream_rate = decoded(joined, response_format)
    assert rate == stream_rate == (48000 if response_format == "opus" else RATE)  # Ogg Opus decodes at 48 kHz
    frame = CODEC_FRAME[response_format] * rate // RATE
    assert abs(stream_audio.size - whole_audio.size) <= frame
    assert whole_audio.size >= samples.size * rate // RATE  # the whole tone; lossy codecs add their delay
    assert abs(dominant_hz(whole_audio) * rate / RATE - 220) < 2
    # the same encoder: the very bytes, but for a header that a whole file fills in (a FLAC's length
    # and MD5, a WAV's sizes)
    if response_format == "wav":
        assert joined[44:] == whole[44:]
    elif response_format != "flac":
        assert joined == whole


def test_lossless_formats_hold_the_pcm_samples_and_a_whole_flac_its_length():
    import soundfile as sf

    samples = _tone(1.0)
    pcm = encode_whole(samples, RATE, "pcm")
    for fmt in ("flac", "wav"):
        for data in (encode_whole(samples, RATE, fmt), b"".join(streamed(samples, fmt, 7))):
            audio, _ = decoded(data, fmt)
            assert np.round(audio * 32768).astype("<i2").tobytes() == pcm
    info = sf.info(io.BytesIO(encode_whole(samples, RATE, "flac")))  # libsndfile needs the length in STREAMINFO
    assert info.frames == samples.size and info.samplerate == RATE


def test_streams_are_what_clients_play_while_they_arrive():
    samples = _tone(1.0)
    first = {fmt: b"".join(streamed(samples, fmt, 10)[:3]) for fmt in FORMATS}
    assert first["mp3"][:3] == b"ID3" and b"\xff\xf3" in first["mp3"]  # MPEG-2 Layer III frame sync
    assert first["opus"][:4] == b"OggS" and b"OpusHead" in first["opus"]
    assert first["aac"][:2] in (b"\xff\xf1", b"\xff\xf9")  # ADTS sync, no container to finish
    assert first["flac"][:4] == b"fLaC"
    assert first["wav"][:4] == b"RIFF" and first["wav"][4:8] == b"\xff\xff\xff\xff"
    assert {media for media in (f.media_type for f in FORMATS.values())} >= {"audio/mpeg", "audio/ogg", "audio/aac"}
    assert PCM_FORMATS == ("pcm", "wav")
    with pytest.raises(ValueError, match="response_format must be one of mp3, opus, aac, flac, wav, pcm, got 'ogg'"):
        StreamEncoder("ogg", RATE)


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 2.0, 3.0, 4.0])
def test_a_stretch_keeps_the_pitch_and_is_the_same_in_pieces(speed):
    samples = _tone(3.0)
    whole = stretch(samples, RATE, speed)
    assert whole.dtype == np.float32 and whole.size == round(samples.size / speed)
    assert abs(dominant_hz(whole) - 220) < 2, "the pitch moved"
    tempo = TimeStretch(speed, RATE)
    pieces = [tempo.push(p) for p in np.array_split(samples, 17)] + [tempo.finish()]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert sum(1 for p in pieces[:-1] if p.size) >= 12, "the stretch held the audio back until the end"
    assert tempo.samples_in == samples.size and tempo.samples_out == whole.size


def test_resampling_is_not_a_stretch():
    """A naive speed-up (dropping samples) moves the pitch by the factor: the check above would see it."""
    assert abs(dominant_hz(_tone(3.0)[::2]) - 440) < 2


def test_atempo_is_chained_within_its_blending_range():
    assert atempo_factors(4.0) == [2.0, 2.0] and atempo_factors(0.25) == [0.5, 0.5]
    assert atempo_factors(1.0) == [1.0] and atempo_factors(1.5) == [1.5]
    assert atempo_factors(0.3) == pytest.approx([0.5, 0.6]) and np.prod(atempo_factors(3.3)) == pytest.approx(3.3)
    for bad in (0.1, 5.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"speed must be from 0\.25 to 4\.0"):
            atempo_factors(bad)
    samples = _tone(0.1)
    np.testing.assert_array_equal(stretch(samples, RATE, 1.0), samples)  # speed 1: untouched


@dataclasses.dataclass(frozen=True)
class Word:
    """A word's timing as a word-timing result might carry it: any dataclass with start and end."""

    text: str
    start: float
    end: float


def test_timings_are_scaled_with_the_audio_segments_and_words_alike():
    segments = [Segment("One.", 0.0, 1.2, 0, True), Segment("Two.", 1.2, 2.0, 1, True)]
    assert scale_spans(segments, 2.0) == [Segment("One.", 0.0, 0.6, 0, True), Segment("Two.", 0.6, 1.0, 1, True)]
    assert scale_spans([Word("hi", 0.5, 1.0)], 0.5) == [Word("hi", 1.0, 2.0)]
    with pytest.raises(TypeError, match="a timed span is a dataclass with start and end, got tuple"):
        scale_spans([("hi", 0.5, 1.0)], 2.0)

    @dataclasses.dataclass
    class Timed:  # a result that carries words beside its segments
        segments: list
        words: tuple

    item = retimed(Timed(segments, (Word("a", 1.0, 2.0),)), 4.0)
    assert item.segments[1].end == 0.5 and item.words == (Word("a", 0.25, 0.5),)
    samples = _tone(2.0)
    result = SynthesisResult(samples, RATE, np.zeros((50, 8), np.int64), segments=segments)
    fast = at_speed(result, 2.0)
    assert fast.samples.size == samples.size // 2 and fast.segments[-1].end * RATE == fast.samples.size
    assert result.segments[-1].end == 2.0 and at_speed(result, 1.0) is result  # the original is left as it was
    # the runtime's own word timings (Segment.words; SynthesisResult.words is a property of them) scale too
    from higgs_pack.runtime.loop.words import word_timings

    timed = [Segment("One two.", 0.0, 1.2, 0, True, words=word_timings("One two.", 0.0, 1.2))]
    fast = at_speed(SynthesisResult(samples, RATE, np.zeros((50, 8), np.int64), segments=timed), 2.0)
    assert [(w.text, w.start, w.end) for w in fast.words] == [("One", 0.0, pytest.approx(0.6 * 3 / 7)),
                                                                ("two.", pytest.approx(0.6 * 3 / 7), 0.6)]


# The server: a live `higgs-pack serve` of the tiny cpu int4 bundle on 127.0.0.1 (tests/live_server.py).

MODEL = "higgs-audio-v3-tiny"
TEXT = "Formats are streamed as they are made. Speed keeps the pitch."


@pytest.fixture(scope="module")
def server(cpu_int4_bundle):
    from live_server import LiveServer

    with LiveServer(cpu_int4_bundle) as live:
        yield live


def _post(server, **body):
    return httpx.post(server.url + "/v1/audio/speech", json={"model": MODEL, "input": TEXT, **body}, timeout=120)


def _stream(server, **body) -> tuple[list[bytes], str]:
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=120,
                      json={"model": MODEL, "input": TEXT, "stream_format": "audio", **body}) as response:
        assert response.status_code == 200, response.read()
        return list(response.iter_bytes()), response.headers["content-type"]


def test_the_openai_client_with_its_defaults_streams_mp3(server):
    """OpenAI's clients send no response_format unless told: the server's default is OpenAI's, mp3,
    and the client streams it (with_streaming_response), playable as it arrives."""
    openai = pytest.importorskip("openai", reason="the official openai client is a dev dependency")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"seed": 3, "max_new_tokens": 60}
    with client.audio.speech.with_streaming_response.create(model=MODEL, voice="default", input=TEXT,
                                                             stream_format="audio", extra_body=extra) as answer:
        assert answer.headers["content-type"] == "audio/mpeg"
        pieces = [piece for piece in answer.iter_bytes() if piece]
    whole = client.audio.speech.create(model=MODEL, voice="default", input=TEXT, extra_body=extra)
    assert len(pieces) > 1, "the mp3 came in one piece"
    streamed_audio, rate = decoded(b"".join(pieces), "mp3")
    whole_audio, _ = decoded(whole.content, "mp3")
    assert rate == RATE and whole.content[:3] == b"ID3"
    assert abs(streamed_audio.size - whole_audio.size) <= CODEC_FRAME["mp3"]
    assert whole_audio.size >= 960 * 10  # frames of speech, not an empty file


@pytest.mark.parametrize("response_format", list(FORMATS))
def test_every_format_streamed_decodes_to_the_whole_ones_duration(server, response_format):
    body = {"seed": 6, "max_new_tokens": 50, "response_format": response_format}
    pieces, kind = _stream(server, **body)
    whole = _post(server, **body)
    assert whole.status_code == 200 and kind == whole.headers["content-type"] == FORMATS[response_format].media_type
    streamed_audio, rate = decoded(b"".join(pieces), response_format)
    whole_audio, whole_rate = decoded(whole.content, response_format)
    assert rate == whole_rate and streamed_audio.size > 0
    assert abs(streamed_audio.size - whole_audio.size) <= CODEC_FRAME[response_format] * rate // RATE


def test_speed_changes_the_duration_and_scales_the_segments(server):
    body = {"seed": 8, "max_new_tokens": 30, "response_format": "pcm"}
    normal = _post(server, **body, segments=True).json()
    samples = len(base64_audio(normal)) // 2
    for speed in (0.5, 2.0):
        answer = _post(server, **body, segments=True, speed=speed).json()
        assert len(base64_audio(answer)) // 2 == round(samples / speed)  # exact: atempo's tail cut or padded
        assert [s["end"] for s in answer["segments"]] == pytest.approx([s["end"] / speed for s in normal["segments"]],
                                                                        abs=1e-6)
        pieces, _ = _stream(server, **body, speed=speed)
        assert len(b"".join(pieces)) == round(samples / speed) * 2  # streamed, the same length
    mp3_fast, _ = decoded(_post(server, **{**body, "response_format": "mp3"}, speed=2.0).content, "mp3")
    mp3_normal, _ = decoded(_post(server, **{**body, "response_format": "mp3"}).content, "mp3")
    delay = mp3_normal.size - samples  # LAME's delay and padding, the same in both
    assert abs((mp3_fast.size - delay) - samples / 2) <= 2 * CODEC_FRAME["mp3"]


def test_speed_in_an_sse_stream_times_each_sentence_at_speed(server):
    body = {"model": MODEL, "input": "One short sentence. And a second one.", "seed": 4, "max_new_tokens": 15,
            "response_format": "pcm", "stream_format": "sse", "speed": 0.5}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    sent, ends = 0, []
    for event in events:
        if event["type"] == "speech.audio.delta":
            sent += len(base64.b64decode(event["audio"])) // 2
        elif event["type"] == "speech.segment":
            assert event["end"] <= sent / RATE + 1e-6  # its (stretched) audio was sent before it
            ends.append(event["end"])
    assert len(ends) == 2 and ends[-1] == pytest.approx(sent / RATE, abs=1e-6)
    assert events[-1]["type"] == "speech.audio.done"


def base64_audio(answer: dict) -> bytes:
    return base64.b64decode(answer["audio"])


def test_the_docs_mp3_example_streams_a_playable_file_at_speed(server, tmp_path):
    """The serving page's second Python example (the client's default format, speed 1.25), run as a
    reader pastes it against this server (with the first example's client): an mp3 that FFmpeg decodes."""
    import subprocess
    import sys

    from test_api import doc_text, python_blocks

    block = python_blocks(doc_text("docs/serving/index.md"))[1]
    assert "speed=1.25" in block and "response_format" not in block
    script = python_blocks(doc_text("docs/serving/index.md"))[0].split("with client")[0] + block
    out = subprocess.run([sys.executable, "-c", script.replace("http://127.0.0.1:8000", server.url)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = (tmp_path / "hello.mp3").read_bytes()
    audio, rate = decoded(data, "mp3")
    assert data[:3] == b"ID3" and rate == RATE and audio.size > 960 * 5


def test_the_formats_bench_measures_every_format_and_speed(cases_dir):
    from bench.serving.formats import SPEEDS, measure, speech

    samples = speech(cases_dir / "ref_en_16k.wav", 3.0)
    assert samples.dtype == np.float32 and samples.size == 3 * RATE
    run = measure(samples, repeats=1)
    assert set(run["formats"]) == set(FORMATS) and set(run["atempo_ms_per_s"]) == {str(s) for s in SPEEDS}
    assert run["formats"]["pcm"]["kbit_per_s"] == 384.0  # 24000 * 16 bits
    assert 40 < run["formats"]["mp3"]["kbit_per_s"] < 90 and run["formats"]["flac"]["kbit_per_s"] < 384
    assert all(v["streamed_ms_per_s"] >= 0 for v in run["formats"].values()) and run["machine"]["cpu"]
    assert run["formats"]["pcm"]["first_audio_ms"] == 10.0  # the first 10 ms piece is sent as it is
    assert run["formats"]["mp3"]["first_audio_ms"] >= 24.0  # at least one 576-sample frame and LAME's lookahead


def test_a_voice_clip_in_a_format_this_server_writes_but_libsndfile_cannot_read_is_decoded_by_ffmpeg():
    """AAC (``response_format`` aac) is refused by libsndfile; the server's clip reader falls back to
    FFmpeg, bounded by --max-ref-seconds, and bytes that neither reads are refused naming both."""
    from higgs_pack.serve.config import ServeConfig
    from higgs_pack.serve.errors import ApiError
    from higgs_pack.serve.speech import reference_clip

    rate = 24000
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(3 * rate) / rate)).astype(np.float32)
    aac = encode_whole(tone, rate, "aac")
    samples, got_rate = reference_clip(base64.b64encode(aac).decode(), ServeConfig())
    assert got_rate == rate and abs(len(samples) / rate - 3.0) < 0.1
    spectrum = np.abs(np.fft.rfft(samples[rate // 2:rate // 2 + rate]))  # one second: bins of 1 Hz
    assert int(np.argmax(spectrum)) == 220 and 0.2 < float(np.abs(samples).max()) < 0.4  # the tone, its level
    with pytest.raises(ApiError) as caught:
        reference_clip(base64.b64encode(b"not audio at all" * 64).decode(), ServeConfig())
    assert "not a readable audio file" in caught.value.message and "FFmpeg could not decode it either" in \
        caught.value.message and caught.value.code == "unreadable_audio"
    long = encode_whole(np.tile(tone, 20), rate, "aac")  # 60 s: over the default limit, decoded only that far
    with pytest.raises(ApiError) as caught:
        reference_clip(base64.b64encode(long).decode(), ServeConfig())
    assert caught.value.code == "reference_too_long"
