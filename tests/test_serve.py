"""Issue 20: ``higgs-pack serve`` as its users drive it: a live server on 127.0.0.1 (a real
subprocess, stopped by its process id), the official ``openai`` client, curl and plain HTTP.

Every server here serves the real tiny cpu int4 bundle on the continuous-batching engine.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import signal
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import write_voice_clip
from live_server import LiveServer

openai = pytest.importorskip("openai", reason="the official openai client is a dev dependency")

MODEL = "higgs-audio-v3-tiny"
TEXT = "Hello there, this is a test of the speech server."
#: Many sentences: each is generated as its own text chunk, so a request runs for seconds.
LONG_TEXT = " ".join(f"This is sentence number {i} of a long text to speak." for i in range(1, 18))  # 900 characters


@pytest.fixture(scope="module")
def clip(cases_dir):
    """The real reference voice: (bytes of the 6.9 s 16 kHz wav, its transcript)."""
    return (cases_dir / "ref_en_16k.wav").read_bytes(), (cases_dir / "ref_en_16k.txt").read_text().strip()


@pytest.fixture(scope="module")
def server(cpu_int4_bundle, tmp_path_factory, cases_dir):
    """One server for the module: voices kept in a folder, local media allowed from the cases
    folder, small limits to test (1000 characters, 8 s references, 1 MiB uploads)."""
    voices = tmp_path_factory.mktemp("voices")
    with LiveServer(cpu_int4_bundle, "--voices-dir", str(voices), "--allow-local-media", str(cases_dir),
                    "--max-input-chars", "1000", "--max-ref-seconds", "8", "--max-upload-mb", "1") as live:
        live.voices_dir = voices
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _speech(server, timeout=120, **body):
    return httpx.post(server.url + "/v1/audio/speech", json={"model": MODEL, **body}, timeout=timeout)


def _wav(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples, rate


def test_openai_client_whole_and_streamed_speech_agree(client, tmp_path):
    whole = client.audio.speech.create(model=MODEL, voice="default", input=TEXT, response_format="wav",
                                       extra_body={"seed": 5, "max_new_tokens": 80})
    samples, rate = _wav(whole.content)
    assert rate == 24000 and samples.ndim == 1 and samples.size >= 960 * 8
    assert float(np.abs(samples).max()) > 0.0
    out = tmp_path / "streamed.wav"
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input=TEXT, response_format="wav", stream_format="audio",
            extra_body={"seed": 5, "max_new_tokens": 80}) as response:
        assert response.headers["content-type"] == "audio/wav"
        assert response.headers["x-sample-rate"] == "24000"
        pieces = list(response.iter_bytes())
    out.write_bytes(b"".join(pieces))
    assert len(pieces) > 1, "the stream came in one piece"
    header = pieces[0][:44] if len(pieces[0]) >= 44 else b"".join(pieces)[:44]
    assert header[4:8] == b"\xff\xff\xff\xff" and header[40:44] == b"\xff\xff\xff\xff"  # one open-length header
    streamed, rate = sf.read(out, dtype="float32")  # a playable file: libsndfile reads it to its end
    assert rate == 24000 and streamed.shape == samples.shape
    assert float(np.abs(streamed - samples).max()) <= 2 / 32768  # the same codes; codec windows round alike


def test_the_docs_serving_example_writes_a_playable_file(server, tmp_path):
    """The first Python example of the serving page (docs/serving/index.md), run as a reader pastes
    it, against this server (its address in place of the page's)."""
    import subprocess
    import sys

    from test_api import doc_text, python_blocks

    block = python_blocks(doc_text("docs/serving/index.md"))[0]
    assert "http://127.0.0.1:8000/v1" in block
    script = block.replace("http://127.0.0.1:8000", server.url)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    samples, rate = sf.read(tmp_path / "hello.wav", dtype="float32")
    assert rate == 24000 and samples.size >= 960 * 8


def test_curl_streams_pcm_and_formats_are_what_they_say(server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": MODEL, "input": TEXT, "seed": 2, "max_new_tokens": 60, "response_format": "pcm",
                       "stream_format": "audio"})
    done = subprocess.run(["curl", "-sS", "-N", "--max-time", "60", "-D", "-", "-H", "Content-Type: application/json",
                           "-d", body, server.url + "/v1/audio/speech"], capture_output=True, timeout=90)
    head, _, pcm = done.stdout.partition(b"\r\n\r\n")
    assert done.returncode == 0 and b"200" in head.split(b"\r\n")[0], done.stderr
    assert b"transfer-encoding: chunked" in head.lower()
    whole = _speech(server, input=TEXT, seed=2, max_new_tokens=60, response_format="pcm")
    assert whole.headers["content-type"] == "audio/pcm"
    assert len(pcm) == len(whole.content) and len(pcm) % 2 == 0
    a = np.frombuffer(pcm, "<i2").astype(int)
    b = np.frombuffer(whole.content, "<i2").astype(int)
    assert np.abs(a - b).max() <= 2
    wav = _wav(_speech(server, input=TEXT, seed=2, max_new_tokens=60, response_format="wav").content)[0]
    np.testing.assert_array_equal(np.round(wav * 32768).astype(int), b)  # wav holds the pcm samples
    flac = _speech(server, input=TEXT, seed=2, max_new_tokens=60, response_format="flac")
    assert flac.headers["content-type"] == "audio/flac" and flac.content[:4] == b"fLaC"
    np.testing.assert_array_equal(np.round(_wav(flac.content)[0] * 32768).astype(int), b)
    for fmt, magic, kind in (("mp3", b"ID3", "audio/mpeg"), ("opus", b"OggS", "audio/ogg"), ("aac", b"\xff\xf1", "audio/aac")):
        answer = _speech(server, input=TEXT, seed=2, max_new_tokens=60, response_format=fmt)
        assert answer.status_code == 200, answer.text
        assert answer.content.startswith(magic) and answer.headers["content-type"] == kind
        if fmt != "aac":  # libsndfile reads mp3 and Ogg Opus too (tests/test_serve_formats.py decodes all with FFmpeg)
            decoded, rate = _wav(answer.content)
            assert rate in (24000, 48000) and decoded.size > 0


def test_sse_deltas_join_to_the_audio_stream(server):
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=60,
                      json={"model": MODEL, "input": TEXT, "seed": 4, "max_new_tokens": 60, "stream_format": "sse",
                            "response_format": "pcm"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta", "speech.segment"}
    assert events[-1]["type"] == "speech.audio.done" and events[-2]["type"] == "speech.segment"
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    streamed = _speech(server, input=TEXT, seed=4, max_new_tokens=60, response_format="pcm", stream_format="audio")
    assert audio == streamed.content
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == len(audio) // 2 // 960  # frames: 960 samples each
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_segments_come_as_sse_events_and_in_a_whole_json_answer(server):
    """Timings from frame counts: a speech.segment event once a sentence's audio is all sent, and
    with segments: true a whole answer that is JSON (the file base64 and the same segments)."""
    text = "The first sentence is here. A second one follows! And the third?"
    body = {"model": MODEL, "input": text, "seed": 4, "max_new_tokens": 20, "response_format": "pcm"}
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=60,
                      json={**body, "stream_format": "sse"}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    sent, timed = 0, []
    for event in events:
        if event["type"] == "speech.audio.delta":
            sent += len(base64.b64decode(event["audio"]))
        elif event["type"] == "speech.segment":
            assert event["end"] <= sent / 2 / 24000 + 1e-6  # its audio was sent before it
            timed.append({k: v for k, v in event.items() if k != "type"})
    assert [t["text"] for t in timed] == ["The first sentence is here.", "A second one follows!", "And the third?"]
    assert timed[-1]["end"] == pytest.approx(sent / 2 / 24000)
    for t in timed:  # each sentence's words, estimated within it, back to back (issue 41 item 3)
        assert [w["text"] for w in t["words"]] == t["text"].split() and not any(w["exact"] for w in t["words"])
        assert t["words"][0]["start"] == t["start"] and t["words"][-1]["end"] == pytest.approx(t["end"], abs=1e-6)
    whole = httpx.post(server.url + "/v1/audio/speech", json={**body, "segments": True}, timeout=60)
    assert whole.status_code == 200 and whole.headers["content-type"] == "application/json"
    answer = whole.json()
    assert answer["segments"] == timed and answer["response_format"] == "pcm" and answer["sample_rate"] == 24000
    assert base64.b64decode(answer["audio"]) == _speech(server, **body).content
    bad = _speech(server, input=text, segments=True, stream_format="audio", response_format="pcm")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "segments", bad.text
    assert _speech(server, input=text, segments="yes").json()["error"]["param"] == "segments"


def test_cloning_through_extra_body_and_a_stored_voice_agree(server, client, clip, cases_dir):
    audio, transcript = clip
    cloned = client.audio.speech.create(model=MODEL, voice="default", input=TEXT, response_format="pcm",
                                        extra_body={"ref_audio": base64.b64encode(audio).decode(), "ref_text": transcript,
                                                    "seed": 9, "max_new_tokens": 60})
    zero_shot = _speech(server, input=TEXT, response_format="pcm", seed=9, max_new_tokens=60).content
    assert cloned.content != zero_shot  # the reference changed the prompt
    data_uri = "data:audio/wav;base64," + base64.b64encode(audio).decode()
    assert _speech(server, input=TEXT, response_format="pcm", seed=9, max_new_tokens=60, ref_audio=data_uri,
                   ref_text=transcript).content == cloned.content
    local = _speech(server, input=TEXT, response_format="pcm", seed=9, max_new_tokens=60,
                    ref_audio=str(cases_dir / "ref_en_16k.wav"), ref_text=transcript)
    assert local.content == cloned.content  # a path under --allow-local-media
    boson = _speech(server, input=TEXT, response_format="pcm", seed=9, max_new_tokens=60,
                    references=[{"audio": base64.b64encode(audio).decode(), "text": transcript}])
    assert boson.content == cloned.content

    made = httpx.post(server.url + "/v1/audio/voices", timeout=60, files={"audio": ("ref.wav", audio, "audio/wav")},
                      data={"name": "narrator", "transcript": transcript})
    assert made.status_code == 201, made.text
    assert made.json()["name"] == "narrator" and made.json()["frames"] > 0
    assert (server.voices_dir / "narrator.safetensors").is_file()
    listed = [v["name"] for v in httpx.get(server.url + "/v1/audio/voices").json()["voices"]]
    assert listed == ["default", "narrator"]
    by_name = client.audio.speech.create(model=MODEL, voice="narrator", input=TEXT, response_format="pcm",
                                         extra_body={"seed": 9, "max_new_tokens": 60})
    assert by_name.content == cloned.content
    as_object = _speech(server, input=TEXT, voice={"id": "narrator"}, response_format="pcm", seed=9, max_new_tokens=60)
    assert as_object.content == cloned.content
    assert httpx.delete(server.url + "/v1/audio/voices/narrator").json() == {"name": "narrator", "deleted": True}
    assert not (server.voices_dir / "narrator.safetensors").exists()
    gone = _speech(server, input=TEXT, voice="narrator")
    assert gone.status_code == 400 and gone.json()["error"]["code"] == "unknown_voice"
    assert httpx.delete(server.url + "/v1/audio/voices/narrator").status_code == 404


#: (body fields, status, param (or the params it may be), words the message must hold)
BAD_BODIES = [
    ({"model": "tts-1"}, 404, "model", "serves higgs-audio-v3-tiny-cpu-int4, higgs-audio-v3-tiny"),
    ({"input": ""}, 400, "input", "input is empty: there is nothing to speak"),
    ({"input": "\x00"}, 400, "input", "input holds a control character"),
    ({"input": "x" * 1001}, 400, "input", "1001 characters; the limit is 1000"),
    ({"references_": []}, 400, "references_", "unknown field 'references_' (did you mean 'references'?)"),
    ({"sede": 1}, 400, "sede", "unknown field 'sede' (did you mean 'seed'?)"),
    ({"response_format": "ogg"}, 400, "response_format", "use one of mp3, opus, aac, flac, wav, pcm"),
    ({"stream_format": "chunks"}, 400, "stream_format", "\"audio\""),
    ({"stream": True, "stream_format": "sse"}, 400, "stream", 'stream true and stream_format "sse" disagree'),
    ({"stream": False, "stream_format": "sse"}, 400, "stream", 'stream false and stream_format "sse" disagree'),
    ({"speed": 0.1}, 400, "speed", "speed must be a number from 0.25 to 4.0"),
    ({"speed": 5}, 400, "speed", "speed must be a number from 0.25 to 4.0"),
    ({"speed": "fast"}, 400, "speed", "got 'fast'"),
    ({"instructions": "whisper"}, 400, "instructions", "inline controls"),
    ({"voice": "alloy"}, 400, "voice", "use one of default"),
    ({"seed": -1, "top_k": 1.5}, 400, ("seed", "top_k"), "2 problems"),  # param: the first one listed
    ({"max_new_tokens": 0}, 400, "max_new_tokens", ">= 1"),
    ({"max_new_tokens": 10**9}, 400, "max_new_tokens", "max_new_tokens is at most 4085 for this bundle (163 s"),
    ({"voice": None, "seed": "x"}, 400, "seed", "seed must be a whole number"),
    ({"ref_audio": "https://example.com/a.wav", "ref_text": "hi"}, 400, "ref_audio", "does not fetch URLs"),
    ({"ref_audio": "/etc/passwd.wav", "ref_text": "hi"}, 400, "ref_audio", "is outside the allowed folder"),
    ({"ref_audio": "missing.wav", "ref_text": "hi"}, 400, "ref_audio", "is not a file in the allowed folder"),
    ({"ref_audio": "bm90IGF1ZGlv", "ref_text": "hi"}, 400, "ref_audio", "not a readable audio file"),
    ({"ref_audio": "%%%", "ref_text": "hi"}, 400, "ref_audio", "not valid base64"),
    ({"ref_text": "hi"}, 400, "ref_text", "needs ref_audio"),
    ({"references": [{"text": "a"}, {"text": "b"}]}, 400, "references", "exactly one"),
    ({"input": "Say <|audio|> now."}, 400, "input", "prompt control token"),
]


@pytest.mark.parametrize(("fields", "status", "param", "words"), BAD_BODIES,
                         ids=[f"{next(iter(f))}-{s}" for f, s, _, _ in BAD_BODIES])
def test_bad_requests_get_openai_errors_that_name_the_field(server, fields, status, param, words):
    answer = _speech(server, **{"input": TEXT, **fields})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] in (param if isinstance(param, tuple) else (param,)) and words in error["message"], error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_openai_client_raises_the_servers_error(client):
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        client.audio.speech.create(model=MODEL, voice="default", input=TEXT, extra_body={"clone_from": "x"})
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.audio.speech.create(model="tts-1", voice="default", input=TEXT)


#: (raw JSON text of the input, words): JSON escapes a client may send that are no speakable text.
RAW_INPUTS = [
    ('"\\ud800"', "input is not valid Unicode: character 1 is a lone surrogate (U+D800"),
    ('"Hello \\udfff there"', "character 7 is a lone surrogate (U+DFFF"),
    ('"\\u0000"', "input holds a control character"),
    ('"\\u0001\\u0002"', "holds a control character at character 1 (U+0001)"),
]


@pytest.mark.parametrize(("raw", "words"), RAW_INPUTS, ids=["surrogate", "surrogate-inside", "nul", "controls"])
def test_text_that_is_not_speakable_is_a_400_naming_the_input(server, raw, words):
    body = f'{{"model": "{MODEL}", "input": {raw}, "response_format": "pcm"}}'
    answer = httpx.post(server.url + "/v1/audio/speech", content=body, timeout=60,
                        headers={"content-type": "application/json"})
    assert answer.status_code == 400, (answer.status_code, answer.content[:200])
    error = answer.json()["error"]
    assert error["param"] == "input" and error["type"] == "invalid_request_error" and words in error["message"], error
    assert "--text" not in error["message"]


def test_voice_uploads_check_their_name_and_transcript_as_text(server, clip):
    audio, transcript = clip
    for data, param, words in (({"name": "ok", "transcript": "\x00\x01"}, "transcript",
                                "transcript holds a control character"),
                               ({"name": "ok", "transcript": "   "}, "transcript", "transcript is only whitespace"),
                               ({"name": "\x01", "transcript": transcript}, "name",
                                "name holds a control character"),
                               ({"nmae": "ok", "transcript": transcript}, "nmae",
                                "unknown part 'nmae' (did you mean 'name'?)"),
                               # a transcript that fills the context is refused at upload, naming it, not
                               # on every later request as a sentence of the input (a new user's finding)
                               ({"name": "long", "transcript": " ".join(["word"] * 5000)}, "transcript",
                                "the voice takes")):
        bad = httpx.post(server.url + "/v1/audio/voices", files={"audio": ("r.wav", audio, "audio/wav")}, data=data,
                         timeout=60)
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert [v["name"] for v in httpx.get(server.url + "/v1/audio/voices").json()["voices"]] == ["default"]


def test_the_api_docs_need_no_network_and_describe_every_body(server):
    import re

    page = httpx.get(server.url + "/docs", timeout=30)
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assert "http://" not in page.text and "https://" not in page.text and "//cdn" not in page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert len(assets) == 3 and all(a.startswith("/") for a in assets), assets
    for asset in assets:
        got = httpx.get(server.url + asset, timeout=30)
        assert got.status_code == 200 and len(got.content) > 1000, asset
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert "Duplicate Operation ID" not in "".join(server.log)  # HEAD routes have their own ids
    schemas = spec["components"]["schemas"]
    speech = spec["paths"]["/v1/audio/speech"]["post"]
    assert speech["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/SpeechBody"}
    body = schemas["SpeechBody"]
    assert body["required"] == ["model", "input"] and body["additionalProperties"] is False
    assert {"seed", "stream", "stream_format", "ref_audio", "references", "max_new_tokens"} <= set(body["properties"])
    assert all(field.get("description") for field in body["properties"].values())
    from higgs_pack.runtime.options import (
        http_fields,  # the request's one declaration: true defaults and limits
    )

    for name, (_kind, declared) in http_fields().items():
        assert body["properties"][name].get("default") == declared.default, name
        assert body["properties"][name]["description"] == declared.description, name
    assert body["properties"]["context_frames"]["default"] == 250
    assert set(speech["responses"]["200"]["content"]) >= {"audio/wav", "audio/pcm", "text/event-stream"}
    assert "application/json" not in speech["responses"]["200"]["content"]  # audio, not JSON
    assert speech["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    upload = spec["paths"]["/v1/audio/voices"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert schemas[upload["$ref"].rsplit("/", 1)[1]]["required"] == ["audio", "transcript", "name"]
    for path, methods in spec["paths"].items():  # every route that takes a body says what it is
        for method, operation in methods.items():
            if method in ("post", "put", "patch"):
                assert "requestBody" in operation, (method, path)


def test_limits_name_the_limit(server, clip, tmp_path):
    long_clip = write_voice_clip(tmp_path / "long.wav", seconds=9.0)
    answer = _speech(server, input=TEXT, ref_audio=base64.b64encode(long_clip.read_bytes()).decode(), ref_text="hi")
    assert answer.status_code == 400 and "at most 8 s (--max-ref-seconds)" in answer.json()["error"]["message"]
    big = b"\0" * (1024 * 1024 + 10)
    answer = _speech(server, input=TEXT, ref_audio=base64.b64encode(big).decode(), ref_text="hi")
    assert answer.status_code == 413 and "--max-upload-mb" in answer.json()["error"]["message"]
    upload = httpx.post(server.url + "/v1/audio/voices", files={"audio": ("big.wav", big, "audio/wav")},
                        data={"name": "big", "transcript": "hi"}, timeout=60)
    assert upload.status_code == 413, upload.text
    for name, words in (("../x", "not allowed"), ("a/b", "not allowed"), ("default", "reserved"), ("x" * 65, "64")):
        bad = httpx.post(server.url + "/v1/audio/voices", files={"audio": ("r.wav", clip[0], "audio/wav")},
                         data={"name": name, "transcript": clip[1]}, timeout=60)
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], (name, bad.text)
        assert bad.json()["error"]["param"] == "name"
    short = write_voice_clip(tmp_path / "short.wav", seconds=0.2)
    bad = httpx.post(server.url + "/v1/audio/voices", files={"audio": ("s.wav", short.read_bytes(), "audio/wav")},
                     data={"name": "short", "transcript": "hi"}, timeout=60)
    assert bad.status_code == 400 and "at least 0.5 s" in bad.json()["error"]["message"]  # --ref-audio's message
    no_text = httpx.post(server.url + "/v1/audio/voices", files={"audio": ("r.wav", clip[0], "audio/wav")},
                         data={"name": "quiet"}, timeout=60)
    assert no_text.status_code == 400 and no_text.json()["error"]["param"] == "transcript"
    extra = httpx.post(server.url + "/v1/audio/voices", files={"audio": ("r.wav", clip[0], "audio/wav")},
                       data={"name": "extra", "transcript": clip[1], "lang": "en"}, timeout=60)
    assert extra.status_code == 400 and extra.json()["error"]["code"] == "unknown_field"
    as_json = httpx.post(server.url + "/v1/audio/voices", json={"name": "x"}, timeout=60)
    assert as_json.status_code == 400 and "multipart/form-data" in as_json.json()["error"]["message"]
    once = {"files": {"audio": ("r.wav", clip[0], "audio/wav")}, "data": {"name": "twice", "transcript": clip[1]}}
    assert httpx.post(server.url + "/v1/audio/voices", timeout=60, **once).status_code == 201
    again = httpx.post(server.url + "/v1/audio/voices", timeout=60, **once)
    assert again.status_code == 409 and again.json()["error"]["code"] == "voice_exists"
    cased = httpx.post(server.url + "/v1/audio/voices", timeout=60, files=once["files"],
                       data={"name": "Twice", "transcript": clip[1]})  # one file on a case-blind disk
    assert cased.status_code == 409 and "voice 'twice' exists" in cased.json()["error"]["message"], cased.text
    default = httpx.post(server.url + "/v1/audio/voices", timeout=60, files=once["files"],
                         data={"name": "Default", "transcript": clip[1]})
    assert default.status_code == 400 and "is reserved" in default.json()["error"]["message"], default.text
    assert httpx.delete(server.url + "/v1/audio/voices/twice").status_code == 200
    for data in ({"name": ["a1", "a2"], "transcript": clip[1]},
                 {"name": "b1", "transcript": clip[1], "ref_text": "other words"}):
        double = httpx.post(server.url + "/v1/audio/voices", timeout=60, files=once["files"], data=data)
        assert double.status_code == 400 and double.json()["error"]["code"] == "duplicate_field", double.text
        assert "more than once" in double.json()["error"]["message"]
    names = [v["name"] for v in httpx.get(server.url + "/v1/audio/voices", timeout=30).json()["voices"]]
    assert not {"a1", "a2", "b1", "Twice", "Default"} & set(names), names
    deep = "[" * 100_000 + "]" * 100_000
    nested = httpx.post(server.url + "/v1/audio/speech", content=f'{{"model": "{MODEL}", "input": "hi", "voice": {deep}}}',
                        headers={"content-type": "application/json"}, timeout=60)
    assert nested.status_code == 400 and nested.json()["error"]["code"] == "invalid_json"


def test_models_health_ready_metrics_and_demo_page(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["higgs-audio-v3-tiny-cpu-int4", MODEL]
    assert models["data"][0]["max_batch"] == 4 and models["data"][0]["backend"] == "onnxruntime"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json()["status"] == "ready"
    before = server.metric("higgs_pack_frames_total")
    ok = server.metric("higgs_pack_requests_total", 'route="/v1/audio/speech",status="200"')
    assert _speech(server, input=TEXT, seed=1, max_new_tokens=30, stream_format="audio").status_code == 200
    assert server.metric("higgs_pack_requests_total", 'route="/v1/audio/speech",status="200"') == ok + 1
    assert server.metric("higgs_pack_frames_total") > before
    assert server.metric("higgs_pack_time_to_first_audio_seconds_count") >= 1
    assert server.metric("higgs_pack_real_time_factor_count") >= 1
    assert server.metric("higgs_pack_in_flight") == 0 and server.metric("higgs_pack_active_batch") == 0
    assert server.metric("higgs_pack_ready") == 1 and server.metric("higgs_pack_kv_bytes") == 0
    assert server.metric("higgs_pack_kv_budget_bytes") > 0
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(server.url + "/nowhere").json()["error"]["message"].startswith("no route GET /nowhere")


def test_a_client_that_leaves_frees_its_row(server):
    """A streamed request dropped after its first bytes stops at the engine's next step: the
    frames made are far fewer than the whole request's, and nothing stays in flight."""
    frames_before = server.metric("higgs_pack_engine_frames_total")
    assert _speech(server, input=LONG_TEXT, seed=3, response_format="pcm").status_code == 200
    whole_frames = server.metric("higgs_pack_engine_frames_total") - frames_before
    assert whole_frames > 500
    frames_before = server.metric("higgs_pack_engine_frames_total")
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=60,
                      json={"model": MODEL, "input": LONG_TEXT, "seed": 3, "response_format": "pcm",
                            "stream_format": "audio"}) as response:
        next(response.iter_raw())
    deadline = time.monotonic() + 10
    while server.metric("higgs_pack_in_flight") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("higgs_pack_in_flight") == 0 and server.metric("higgs_pack_active_batch") == 0
    made = server.metric("higgs_pack_engine_frames_total") - frames_before
    assert 0 < made < whole_frames / 2, f"the dropped request went on: {made} of {whole_frames} frames"


def test_a_client_that_leaves_a_whole_file_request_cancels_it_quietly(server):
    import socket

    frames_before = server.metric("higgs_pack_engine_frames_total")
    body = json.dumps({"model": MODEL, "input": LONG_TEXT, "seed": 3, "response_format": "pcm"}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 10
        while not server.metric("higgs_pack_in_flight") and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server.metric("higgs_pack_in_flight") == 1  # admitted; now the client leaves
    deadline = time.monotonic() + 10
    while server.metric("higgs_pack_in_flight") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("higgs_pack_in_flight") == 0
    assert server.metric("higgs_pack_requests_total", 'route="/v1/audio/speech",status="499"') >= 1
    assert server.metric("higgs_pack_engine_frames_total") - frames_before < 1500
    assert "Traceback" not in "".join(server.log) and "unexpected error" not in "".join(server.log)


def test_each_stream_cancels_its_request_once_however_it_ends(cpu_int4_bundle, monkeypatch):
    """In-process app over a real engine: a finished stream cancels its request once (a no-op
    after the end), in the app's close, not again in the body's generator."""
    import asyncio

    from higgs_pack.runtime.engine.handle import EngineHandle
    from higgs_pack.serve.app import create_app
    from higgs_pack.serve.config import ServeConfig
    from higgs_pack.serve.server import SpeechServer

    cancels: list[EngineHandle] = []
    real_cancel = EngineHandle.cancel

    def counted(handle: EngineHandle) -> None:
        cancels.append(handle)
        real_cancel(handle)

    monkeypatch.setattr(EngineHandle, "cancel", counted)
    server = SpeechServer.open(cpu_int4_bundle, ServeConfig(max_batch=2))
    try:
        server.warm_up()
        app = create_app(server, warm_up=False)

        async def ask(**extra) -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
                return await http.post("/v1/audio/speech", json={"model": MODEL, "input": TEXT, "seed": 1,
                                                                 "max_new_tokens": 30, "response_format": "pcm",
                                                                 **extra})

        streamed = asyncio.run(ask(stream_format="audio"))
        assert streamed.status_code == 200 and len(streamed.content) > 0
        assert len(cancels) == 1 and cancels[0].done
        assert server.in_flight == 0
    finally:
        server.close()


def test_a_full_queue_answers_429_and_every_other_answer_is_complete(cpu_int4_bundle):
    with LiveServer(cpu_int4_bundle, "--max-batch", "1", "--max-queue", "1") as live:
        answers: list[httpx.Response] = []

        def one(seed: int) -> None:
            answers.append(_speech(live, input=LONG_TEXT[:400], seed=seed, response_format="pcm"))

        threads = [threading.Thread(target=one, args=(s,)) for s in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    codes = sorted(a.status_code for a in answers)
    assert len(answers) == 6 and codes.count(200) >= 2 and set(codes) <= {200, 429}, codes
    assert 429 in codes
    for answer in answers:
        if answer.status_code == 429:
            assert int(answer.headers["retry-after"]) >= 1
            assert answer.json()["error"]["code"] == "queue_full"
            assert "--max-batch, --max-queue" in answer.json()["error"]["message"]
        else:
            assert len(answer.content) % 2 == 0 and len(answer.content) >= 2 * 960 * 8


def test_api_key_is_required_on_v1_routes(cpu_int4_bundle):
    with LiveServer(cpu_int4_bundle, env={"HIGGS_PACK_API_KEY": "s3cret"}) as live:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            answer = httpx.get(live.url + "/v1/models", headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(live.url + "/health").status_code == 200  # probes need no key
        keyed = openai.OpenAI(base_url=live.url + "/v1", api_key="s3cret", max_retries=0)
        assert keyed.models.list().data[0].id == "higgs-audio-v3-tiny-cpu-int4"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_sigterm_finishes_the_request_in_flight_then_exits(cpu_int4_bundle):
    live = LiveServer(cpu_int4_bundle, "--grace-seconds", "60")
    try:
        whole = _speech(live, input=LONG_TEXT, seed=6, response_format="pcm").content
        got: list[bytes] = []
        with httpx.stream("POST", live.url + "/v1/audio/speech", timeout=120,
                          json={"model": MODEL, "input": LONG_TEXT, "seed": 6, "response_format": "pcm",
                                "stream_format": "audio"}) as response:
            pieces = response.iter_raw()
            got.append(next(pieces))
            live.signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no new connections while stopping
                httpx.get(live.url + "/health", timeout=5)
            got.extend(pieces)
        assert len(b"".join(got)) == len(whole)  # the request in flight finished, complete
        # uvicorn ends a graceful stop by re-raising the signal, as a process stopped by it does
        assert live.process.wait(60) == -signal.SIGTERM
        assert "Application shutdown complete" in "".join(live.log) and "Traceback" not in "".join(live.log)
    finally:
        live.stop()


def test_sigterm_past_the_grace_period_cuts_off_with_one_line_naming_the_request(cpu_int4_bundle):
    live = LiveServer(cpu_int4_bundle, "--grace-seconds", "1")
    try:
        with httpx.stream("POST", live.url + "/v1/audio/speech", timeout=120,
                          json={"model": MODEL, "input": LONG_TEXT * 3, "seed": 6, "response_format": "pcm",
                                "stream_format": "audio", "max_new_tokens": 4000}) as response:
            pieces = response.iter_raw()
            next(pieces)
            live.signal(signal.SIGTERM)
            with pytest.raises(httpx.HTTPError):  # cut off: the stream ends short, not cleanly
                for _ in pieces:
                    pass
        assert live.process.wait(60) == -signal.SIGTERM
        log = "".join(live.log)
        cut = [line for line in live.log if "grace period of 1 s over" in line]
        assert len(cut) == 1 and "cutting off 1 request(s)" in cut[0] and "POST /v1/audio/speech from 127.0.0.1:" in cut[0]
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
        assert "Application shutdown complete" in log
    finally:
        live.stop()


def test_ctrl_c_past_the_grace_period_answers_503_ends_streams_and_exits_130(cpu_int4_bundle):
    """Issue 29 item 3 and 6: a whole-file request cut off at shutdown gets a 503 in OpenAI's shape
    (not uvicorn's 21-byte plain-text 500), an SSE stream ends with a speech.audio.error event, and
    after Ctrl-C the process exits 130 without click's "Aborted!"."""
    live = LiveServer(cpu_int4_bundle, "--grace-seconds", "1")
    got: dict[str, object] = {}
    body = {"model": MODEL, "input": LONG_TEXT * 3, "seed": 6, "response_format": "pcm", "max_new_tokens": 4000}

    def whole() -> None:
        got["whole"] = httpx.post(live.url + "/v1/audio/speech", json=body, timeout=120)

    def sse() -> None:
        with httpx.stream("POST", live.url + "/v1/audio/speech", json={**body, "stream_format": "sse"},
                          timeout=120) as response:
            got["events"] = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]

    try:
        threads = [threading.Thread(target=whole), threading.Thread(target=sse)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while live.metric("higgs_pack_in_flight") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.metric("higgs_pack_in_flight") == 2
        live.signal(signal.SIGINT)
        for thread in threads:
            thread.join(90)
        assert live.process.wait(60) == 130
        answer = got["whole"]
        assert answer.status_code == 503 and answer.headers["content-type"] == "application/json", answer.content
        error = answer.json()["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_unavailable"
        assert error["message"].startswith("the server is shutting down") and "--grace-seconds" in error["message"]
        events = got["events"]
        assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "speech.audio.error", events[-1]
        assert events[-1]["error"]["code"] == "shutting_down"
        log = "".join(live.log)
        assert "Aborted!" not in log and "Traceback" not in log and "Exception in ASGI application" not in log, log
        assert "cutting off 2 request(s)" in log and "Application shutdown complete" in log
    finally:
        live.stop()


def test_serve_refuses_bad_sources_and_a_port_in_use(tmp_path, cpu_int4_bundle):
    import socket
    import sys

    missing = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(tmp_path / "nope"),
                              "--port", "0"], capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "nope" in missing.stderr and "Traceback" not in missing.stderr
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        busy = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(cpu_int4_bundle),
                               "--port", str(taken.getsockname()[1])], capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert busy.returncode == 2 and "is in use; choose another with --port" in busy.stderr


def test_an_openvino_bundle_is_served_batched(ov_int4_bundle):
    """The OpenVINO bundle on the CPU device batches (its default 4 rows): several clients at
    once are served together (the sub-parts' infer requests take turns between the readers)."""
    with LiveServer(ov_int4_bundle) as live:
        ready = httpx.get(live.url + "/ready").json()
        assert ready["backend"] == "openvino" and ready["max_batch"] == 4
        # the paged decoder's u8 blocks (issue 39): 2 layers x (key 2 heads x (32 + 8) x 16 + value
        # 2 x 32 x (16 + 8)) bytes per 32 positions = 176 a position
        assert ready["batching"] == "continuous batching" and ready["kv_bytes_per_position"] == 176
        assert ready["openvino_engine"] == "paged"  # the default engine, said
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda s=s: answers.append(_speech(
            live, input=TEXT, seed=s, max_new_tokens=40, response_format="pcm",
            **({"stream_format": "audio"} if s % 2 else {})))) for s in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(a.status_code for a in answers) == [200] * 4
        alone = {s: _speech(live, input=TEXT, seed=s, max_new_tokens=40, response_format="pcm").content
                 for s in range(4)}
        assert sorted(len(a.content) for a in answers) == sorted(len(v) for v in alone.values())
        assert live.metric("higgs_pack_kv_blocks_in_use") == 0  # every request has left its blocks
        metrics = httpx.get(live.url + "/metrics").text
        assert "higgs_pack_kv_prefix_blocks_shared" in metrics and "higgs_pack_engine_step_mean_seconds" in metrics
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        with client.audio.speech.with_streaming_response.create(model=MODEL, voice="default", input=TEXT,
                                                                 response_format="wav", stream_format="audio") as response:
            data = b"".join(response.iter_bytes())
        samples, rate = _wav(data)
        assert rate == 24000 and samples.size > 0


def _silent_or_short_clips():
    out = []
    for samples in (np.zeros(16000, np.float32), (0.3 * np.sin(np.arange(1600) / 8)).astype(np.float32)):
        data = io.BytesIO()
        sf.write(data, samples, 16000, format="WAV")
        out.append(data.getvalue())
    return out


def test_a_bad_clip_names_the_field_it_came_in(server):
    """A silent or too short clip is a 400 naming ref_audio in a speech body, audio in a voice
    upload (in the upload's words); a special token in an upload's transcript names transcript."""
    silent, short = _silent_or_short_clips()
    for clip, words in ((silent, "is silent"), (short, "s long")):
        answer = _speech(server, input=TEXT, ref_audio=base64.b64encode(clip).decode(), ref_text="Hello there.")
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "ref_audio" and words in error["message"], error
    bad = httpx.post(server.url + "/v1/audio/voices", files={"audio": ("r.wav", silent, "audio/wav")},
                     data={"name": "quiet", "transcript": "Hello there."}, timeout=60)
    error = bad.json()["error"]
    assert bad.status_code == 400 and error["param"] == "audio", error
    assert error["message"].startswith("audio is silent") and "ref_audio" not in error["message"], error


def test_a_special_token_in_an_uploads_transcript_names_the_transcript(server, clip):
    audio, _ = clip
    bad = httpx.post(server.url + "/v1/audio/voices", files={"audio": ("r.wav", audio, "audio/wav")},
                     data={"name": "tokens", "transcript": "<|endoftext|>"}, timeout=60)
    error = bad.json()["error"]
    assert bad.status_code == 400 and error["param"] == "transcript" and "endoftext" in error["message"], error


def test_a_client_that_leaves_while_sending_its_body_is_a_quiet_499(server):
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    for route, kind in (("/v1/audio/speech", "application/json"),
                        ("/v1/audio/voices", "multipart/form-data; boundary=xyz")):
        label = f'route="{route}",status="499"'
        before = server.metric("higgs_pack_requests_total", label)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            body = (b'{"model": "' + MODEL.encode() + b'", "input": "' if "json" in kind else
                    b'--xyz\r\nContent-Disposition: form-data; name="audio"; filename="r.wav"\r\n\r\nRIFF')
            sock.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\nContent-Length: 500\r\n\r\n"
                         .encode() + body)
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while server.metric("higgs_pack_requests_total", label) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.metric("higgs_pack_requests_total", label) == before + 1, route
    log = "".join(server.log)
    assert "Traceback" not in log and "unexpected error" not in log and "ClientDisconnect" not in log


def test_http_rough_edges_get_clear_openai_errors(server, clip):
    url = server.url
    wrong = httpx.get(url + "/v1/audio/speech", timeout=30)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST", wrong.headers
    error = wrong.json()["error"]
    assert "GET is not allowed on /v1/audio/speech: it answers POST" in error["message"], error
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    put = httpx.put(url + "/v1/audio/voices", timeout=30)  # two routes on the path: both named
    assert put.status_code == 405 and put.headers["allow"] == "GET, POST", put.headers
    assert "it answers GET and POST" in put.json()["error"]["message"]
    head = httpx.head(url + "/health", timeout=30)
    assert head.status_code == 200 and head.content == b""
    gz = httpx.post(url + "/v1/audio/speech", content=b"\x1f\x8b...", timeout=30,
                    headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert gz.status_code == 415, gz.text
    error = gz.json()["error"]
    assert error["param"] == "Content-Encoding" and "Content-Encoding 'gzip' is not supported" in error["message"]
    body = json.dumps({"model": "nobody", "input": "Hi."}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded"):  # what any web page may POST unasked
        plain = httpx.post(url + "/v1/audio/speech", content=body, headers={"content-type": kind}, timeout=30)
        assert plain.status_code == 415, plain.text
        error = plain.json()["error"]
        assert error["code"] == "unsupported_media_type" and "send the body as application/json" in error["message"]
    for kind in ("application/json; charset=utf-8", "application/merge+json", None):  # read: the model is unknown
        headers = {} if kind is None else {"content-type": kind}
        read = httpx.post(url + "/v1/audio/speech", content=body, headers=headers, timeout=30)
        assert read.status_code == 404 and read.json()["error"]["code"] == "model_not_found", (kind, read.text)
    audio, transcript = clip
    two = httpx.post(url + "/v1/audio/voices", files=[("audio", ("a.wav", audio, "audio/wav")),
                                                      ("audio", ("b.wav", audio, "audio/wav"))],
                     data={"name": "two", "transcript": transcript}, timeout=60)
    error = two.json()["error"]
    assert two.status_code == 400 and "Too many files" in error["message"], error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_body" and error["param"] == "audio"
    builtin = httpx.delete(url + "/v1/audio/voices/default", timeout=30)
    error = builtin.json()["error"]
    assert builtin.status_code == 400 and "built-in voice: it cannot be deleted" in error["message"], error
    huge = httpx.delete(url + "/v1/audio/voices/" + "v" * 5000, timeout=30)
    assert huge.status_code == 404 and len(huge.json()["error"]["message"]) < 300, huge.text[:300]
    twice = httpx.post(url + "/v1/audio/speech", timeout=30, headers={"content-type": "application/json"},
                       content=f'{{"model": "{MODEL}", "input": "a", "input": "b"}}')
    error = twice.json()["error"]
    assert twice.status_code == 400 and error["param"] == "input" and "gives 'input' twice" in error["message"]
    assert error["code"] == "duplicate_field"
