"""The server's parts that need no bundle: the voice store on a shared folder, the speech
body's checks, the response formats and the config's limits (fast tier)."""

from __future__ import annotations

import base64
import dataclasses
import io
import struct
import sys

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi", reason="the [serve] extra (FastAPI) is not installed")

from higgs_pack.errors import InputError
from higgs_pack.runtime.request import CONTEXT_FRAMES, PreparedVoice
from higgs_pack.serve.config import ServeConfig
from higgs_pack.serve.errors import ApiError
from higgs_pack.serve.formats import FORMATS, StreamEncoder, encode_whole
from higgs_pack.serve.speech import parse_speech
from higgs_pack.serve.voices import VoiceStore, name_problem


def _voice(name: str, frames: int = 30, seed: int = 0) -> PreparedVoice:
    codes = np.random.default_rng(seed).integers(0, 1024, (frames, 8))
    return PreparedVoice(codes, f"transcript of {name}", name)


def test_servers_sharing_a_voices_folder_see_each_others_voices(tmp_path):
    a, b = VoiceStore(tmp_path, "c0dec"), VoiceStore(tmp_path, "c0dec")
    a.add(_voice("anna"))
    found = b.get("anna")
    assert found is not None and found.transcript == "transcript of anna"
    np.testing.assert_array_equal(found.codes, a.get("anna").codes)
    assert b.names() == ["anna"]
    a.add(_voice("anna", frames=12, seed=1))  # replaced: the other server reads the new file
    assert b.get("anna").codes.shape == (12, 8)
    assert a.delete("anna") and not (tmp_path / "anna.safetensors").exists()
    assert b.get("anna") is None and b.names() == []
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left


def test_the_voice_store_skips_what_it_cannot_use(tmp_path, caplog):
    VoiceStore(tmp_path, "c0dec").add(_voice("kept"))
    VoiceStore(tmp_path, "other-codec").add(_voice("foreign"))
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    store = VoiceStore(tmp_path, "c0dec")
    assert store.names() == ["kept"]
    assert "another codec" in caplog.text and "not a usable voice" in caplog.text
    memory = VoiceStore(None)
    memory.add(_voice("m"))
    assert memory.names() == ["m"] and not list(tmp_path.glob("m.*"))
    with pytest.raises(ValueError, match="not allowed"):
        memory.add(_voice("../escape"))


def test_a_damaged_voice_file_is_warned_about_once_per_version(tmp_path, caplog):
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    store = VoiceStore(tmp_path, "c0dec")
    for _ in range(3):
        assert store.get("broken") is None and store.names() == []
    assert caplog.text.count("not a usable voice") == 1, caplog.text
    broken.write_bytes(b"still not a safetensors file")  # changed (size): said again, once
    for _ in range(3):
        assert store.get("broken") is None and store.names() == []
    assert caplog.text.count("not a usable voice") == 2, caplog.text
    VoiceStore(tmp_path / "x", "c0dec").add(_voice("broken"))  # repaired: a good file of that name is served
    (tmp_path / "x" / "broken.safetensors").replace(broken)
    assert store.get("broken") is not None and store.names() == ["broken"]
    broken.unlink()
    assert store.get("broken") is None and store.names() == []


@pytest.mark.parametrize(("name", "ok"), [("narrator", True), ("a.b-c_1", True), ("x" * 64, True), ("x" * 65, False),
                                          ("../x", False), ("a/b", False), ("a\\b", False), (".hidden", False),
                                          ("", False), ("default", False), ("a..b", False), (None, False)])
def test_voice_names(name, ok):
    assert (name_problem(name) is None) == ok


class _Voices:
    def __init__(self, **voices):
        self.voices = voices

    def get(self, name):
        return self.voices.get(name)

    def names(self):
        return sorted(self.voices)


MODELS = ("higgs-audio-v3-tiny-cpu-int4", "higgs-audio-v3-tiny")


def _parse(config=None, voices=None, **body):
    return parse_speech({"model": MODELS[1], "input": "Hello.", **body}, models=MODELS,
                        voices=voices or _Voices(), config=config or ServeConfig())


def test_a_speech_body_becomes_one_request():
    job = _parse(seed=3, temperature=0.5, top_k=20, top_p=0.9, max_new_tokens=50, initial_chunk_frames=5,
                 response_format="pcm", stream_format="sse")
    r = job.request
    assert (r.text, r.seed, r.temperature, r.top_k, r.top_p, r.max_frames) == ("Hello.", 3, 0.5, 20, 0.9, 50)
    assert r.schedule.first_chunk_frames == 5 and job.stream_format == "sse" and job.response_format == "pcm"
    assert _parse(stream=True).stream_format == "audio" and _parse().stream_format is None
    voice = _voice("anna")
    job = _parse(voices=_Voices(anna=voice), voice={"id": "anna"})
    assert job.request.voice is voice and job.voice == "anna"


def test_context_frames_is_a_field_of_the_speech_and_dialogue_bodies():
    """context_frames (most frames of each context chunk kept) reaches the request from both
    bodies (and so a live session's session.config, parsed as a speech body), and a bad one is
    refused naming the body's field."""
    from higgs_pack.serve.speech import parse_dialogue

    assert _parse(context_frames=50).request.context_frames == 50 and _parse().request.context_frames == CONTEXT_FRAMES
    turns = {"model": MODELS[1], "turns": [{"speaker": "ANN", "input": "Hi."}], "context_frames": 30}
    dialogue = parse_dialogue(turns, models=MODELS, voices=_Voices(), config=ServeConfig())
    assert dialogue.request.options.context_frames == 30
    for bad in (0, 2.5, "9"):
        with pytest.raises(ApiError, match="context_frames must be") as err:
            _parse(context_frames=bad)
        assert err.value.status == 400 and err.value.param == "context_frames"
        with pytest.raises(ApiError, match="context_frames must be") as err:
            parse_dialogue({**turns, "context_frames": bad}, models=MODELS, voices=_Voices(), config=ServeConfig())
        assert err.value.param == "context_frames"


def test_ref_audio_is_decoded_and_bounded(tmp_path):
    wave = (0.3 * np.sin(np.arange(16000) / 8)).astype(np.float32)
    data = io.BytesIO()
    sf.write(data, wave, 16000, format="WAV")
    clip = base64.b64encode(data.getvalue()).decode()
    job = _parse(ref_audio="data:audio/wav;base64," + clip, ref_text="words")
    samples, rate = job.request.voice.audio
    assert rate == 16000 and samples.shape == (16000,)
    with pytest.raises(ApiError, match=r"at most 0\.5 s \(--max-ref-seconds\)") as err:
        _parse(ServeConfig(max_ref_seconds=0.5), ref_audio=clip, ref_text="words")
    assert err.value.status == 400 and err.value.param == "ref_audio"
    # a clip past the reader's own 60 s is refused with the server's limit too, not a second one
    two_minutes = io.BytesIO()
    sf.write(two_minutes, np.zeros(16000 * 120, np.float32), 16000, format="WAV")
    with pytest.raises(ApiError, match=r"is 120\.0 s long; use a clip of at most 30 s \(--max-ref-seconds\)"):
        _parse(ServeConfig(max_ref_seconds=30), ref_audio=base64.b64encode(two_minutes.getvalue()).decode(),
               ref_text="words")
    with pytest.raises(ApiError, match="--max-upload-mb") as err:
        _parse(ServeConfig(max_upload_bytes=2048), ref_audio=clip, ref_text="words")
    assert err.value.status == 413
    with pytest.raises(ApiError, match="reads no local files unless started with --allow-local-media"):
        _parse(ref_audio=str(tmp_path / "clip.wav"), ref_text="words")
    (tmp_path / "clip.wav").write_bytes(data.getvalue())
    allowed = ServeConfig(allow_local_media=tmp_path)
    assert _parse(allowed, ref_audio="file://" + str(tmp_path / "clip.wav"), ref_text="w").request.voice is not None
    assert _parse(allowed, ref_audio="clip.wav", ref_text="w").request.voice is not None  # relative to the folder
    with pytest.raises(ApiError, match="is outside the allowed folder"):
        _parse(allowed, ref_audio=str(tmp_path / ".." / "elsewhere.wav"), ref_text="w")
    with pytest.raises(ApiError, match="is outside the allowed folder"):
        _parse(allowed, ref_audio="../elsewhere.wav", ref_text="w")
    with pytest.raises(ApiError, match="is not a file in the allowed folder"):
        _parse(allowed, ref_audio="missing.wav", ref_text="w")
    with pytest.raises(ApiError, match=r"not a readable audio file \(Format not recognised"):
        _parse(ref_audio=base64.b64encode(b"plain text, not audio").decode(), ref_text="w")
    with pytest.raises(ApiError, match="got an empty string"):
        _parse(ref_audio="", ref_text="w")
    with pytest.raises(ApiError, match=r"unknown field 'xxxxxxxx") as err:
        _parse(**{"x" * 10_000: 1})
    assert len(err.value.message) < 1000  # a huge input is not echoed back


def test_whole_files_hold_the_samples_the_stream_carries():
    samples = np.linspace(-1.2, 1.2, 4800, dtype=np.float32)  # beyond full scale at both ends: clipped
    pcm = encode_whole(samples, 24000, "pcm")
    wav = encode_whole(samples, 24000, "wav")
    encoder = StreamEncoder("wav", 24000)
    streamed = encoder.start() + encoder.chunk(samples[:1000]) + encoder.chunk(samples[1000:])
    assert streamed[44:] == pcm and struct.unpack("<I", streamed[40:44])[0] == 0xFFFFFFFF
    read, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000 and read.tobytes() == pcm
    assert np.frombuffer(pcm, "<i2").min() == -32768 and np.frombuffer(pcm, "<i2").max() == 32767
    assert StreamEncoder("pcm", 24000).start() == b""
    assert list(FORMATS) == ["mp3", "opus", "aac", "flac", "wav", "pcm"]  # OpenAI's six, in its order


def test_config_limits_are_checked(tmp_path):
    with pytest.raises(InputError, match="max_queue must be a whole number >= 0"):
        ServeConfig(max_queue=-1)
    with pytest.raises(InputError, match=r"max_ref_seconds must be a number >= 0\.5, got 0"):
        ServeConfig(max_ref_seconds=0)
    with pytest.raises(InputError, match="api_key is blank"):
        ServeConfig(api_key=" ")
    with pytest.raises(InputError, match="is not a folder"):
        ServeConfig(allow_local_media=tmp_path / "missing")


def test_a_requests_problems_are_said_in_the_servers_terms():
    """The runtime's problems carry their fields; the server names them as its body does, with
    no CLI flag or Python keyword, every problem at once, the first field as param."""
    from higgs_pack.errors import Problem
    from higgs_pack.runtime.request import SynthesisRequest
    from higgs_pack.serve.errors import from_input_error

    with pytest.raises(InputError) as caught:
        SynthesisRequest.create("Hi.", top_p=2, max_frames=0, first_chunk_frames=0)
    assert "set it with max_frames=" in str(caught.value)  # the Python API's terms (the CLI says the flag)
    answer = from_input_error(caught.value)
    assert answer.status == 400 and answer.param == "initial_chunk_frames"
    assert answer.message.startswith("3 problems with the request:")
    assert "initial_chunk_frames must be >= 1" in answer.message and "top_p must be in (0, 1], got 2" in answer.message
    assert "max_new_tokens must be >= 1 (frames, 25 per second), got 0" in answer.message
    assert "--" not in answer.message and "set it with" not in answer.message and "max_frames" not in answer.message
    budget = InputError(problems=[Problem("max_frames", None, message="too much KV: lower {name}")])
    assert (from_input_error(budget).message, from_input_error(budget).param) == \
        ("too much KV: lower max_new_tokens", "max_new_tokens")
    plain = from_input_error(InputError("a {plain} message"), param="input")
    assert (plain.message, plain.param) == ("a {plain} message", "input")


def _clip_b64(seconds: float = 1.0) -> str:
    wave = (0.3 * np.sin(np.arange(int(16000 * seconds)) / 8)).astype(np.float32)
    data = io.BytesIO()
    sf.write(data, wave, 16000, format="WAV")
    return base64.b64encode(data.getvalue()).decode()


#: (body fields, param, words): every text field of the speech body goes through the one text check.
UNSPEAKABLE = [
    ({"input": "\ud800"}, "input", "input is not valid Unicode: character 1 is a lone surrogate (U+D800"),
    ({"input": "ok \udcff"}, "input", "character 4 is a lone surrogate (U+DCFF"),
    ({"input": "\u0000"}, "input", "input holds a control character"),
    ({"input": "\x01\x02 \t"}, "input", "holds a control character at character 1 (U+0001)"),
    ({"input": "   "}, "input", "input is only whitespace: there is nothing to speak"),
    ({"input": 5}, "input", "input must be text (a string), got a number (5)"),
    ({"voice": "\ud800"}, "voice", "voice is not valid Unicode"),
    ({"voice": {"id": "\x00"}}, "voice", "voice holds a control character"),
    ({"ref_audio": "CLIP", "ref_text": "\x00\x1f"}, "ref_text", "ref_text holds a control character"),
    ({"ref_audio": "CLIP", "ref_text": "\ud83d"}, "ref_text", "ref_text is not valid Unicode"),
    ({"ref_audio": "CLIP", "ref_text": ""}, "ref_text", "ref_text is empty"),
    ({"references": [{"audio": "CLIP", "text": "\udfff"}]}, "references[0].text", "references[0].text is not valid Unicode"),
    ({"references": [{"audio": "CLIP", "text": "\t"}]}, "references[0].text", "references[0].text is only whitespace"),
]


@pytest.mark.parametrize(("fields", "param", "words"), UNSPEAKABLE, ids=[str(i) for i in range(len(UNSPEAKABLE))])
def test_every_text_field_goes_through_the_one_text_check(fields, param, words):
    clip = _clip_b64()
    fields = {k: ([{**v[0], "audio": clip}] if k == "references" else clip if v == "CLIP" else v)
              for k, v in fields.items()}
    with pytest.raises(ApiError) as err:
        _parse(**fields)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message
    assert err.value.code == "invalid_value"
    assert "--text" not in err.value.message  # the server's terms, not the CLI's


@pytest.mark.parametrize(("model", "got"), [("", "''"), ("  ", "'  '"), (5, "a number (5)"), ([], "a list")])
def test_an_empty_or_non_text_model_is_a_bad_field_not_an_unknown_model(model, got):
    """``"model": ""`` is a 400 naming the field (it was a 404 'not served here', as a real name)."""
    with pytest.raises(ApiError) as err:
        _parse(model=model)
    assert err.value.status == 400 and err.value.param == "model" and err.value.code == "invalid_value"
    assert f"got {got}" in err.value.message and MODELS[0] in err.value.message, err.value.message
    with pytest.raises(ApiError) as err:
        _parse(model="gpt-4o-mini-tts")
    assert err.value.status == 404 and err.value.code == "model_not_found"


def test_a_whole_number_written_as_a_float_is_that_number():
    """JSON has one kind of number: ``"seed": 7.0`` (as some encoders write 7) is seed 7, where
    1.5 is still refused (it was a 400 'must be a whole number')."""
    r = _parse(seed=7.0, top_k=20.0, max_new_tokens=50.0, initial_chunk_frames=5.0).request
    assert (r.seed, r.top_k, r.max_frames, r.schedule.first_chunk_frames) == (7, 20, 50, 5)
    assert all(type(v) is int for v in (r.seed, r.top_k, r.max_frames, r.schedule.first_chunk_frames))
    with pytest.raises(ApiError, match="seed must be a whole number"):
        _parse(seed=1.5)


def test_text_with_some_words_and_controls_passes_the_check():
    assert _parse(input="Hello.\n\tAgain.").request.text == "Hello.\n\tAgain."
    with pytest.raises(ApiError, match="input is required") as err:
        _parse(input=None)
    assert err.value.code == "missing_field"


@pytest.mark.parametrize(("fields", "words"), [
    ({"stream": True, "stream_format": "sse"}, 'stream true and stream_format "sse" disagree: stream true means '
                                                'stream_format "audio"'),
    ({"stream": False, "stream_format": "sse"}, 'stream false and stream_format "sse" disagree: stream false means '
                                                 "the whole file at once"),
    ({"stream": False, "stream_format": "audio"}, 'stream false and stream_format "audio" disagree'),
])
def test_stream_and_stream_format_that_disagree_are_refused(fields, words):
    with pytest.raises(ApiError) as err:
        _parse(response_format="pcm", **fields)
    assert err.value.status == 400 and err.value.param == "stream" and err.value.code == "conflicting_fields"
    assert words in err.value.message and "send only stream_format" in err.value.message


def test_stream_and_stream_format_that_agree_or_are_null_are_taken():
    assert _parse(stream=True, stream_format="audio").stream_format == "audio"
    assert _parse(stream=True).stream_format == "audio"
    assert _parse(stream=False).stream_format is None
    assert _parse(stream=None, stream_format="sse").stream_format == "sse"
    assert _parse(stream_format=None).stream_format is None
    assert _parse(response_format=None, voice=None, speed=None).response_format == "mp3"  # OpenAI's default


def test_an_unknown_field_gets_a_close_match():
    with pytest.raises(ApiError) as err:
        _parse(sede=3)
    assert err.value.param == "sede" and err.value.code == "unknown_field"
    assert err.value.message.startswith("unknown field 'sede' (did you mean 'seed'?); known: ")
    with pytest.raises(ApiError, match=r"unknown field 'tempreature' \(did you mean 'temperature'\?\).* "
                                       r"Also unknown: 'zzz'\.$"):
        _parse(tempreature=0.5, zzz=1)


@pytest.mark.parametrize(("body", "words"), [
    ([1], "the body must be a JSON object, got a list"),
    ({"voice": 5}, "got a number (5)"),
    ({"voice": [1]}, "got a list"),
    ({"stream": "yes"}, "stream must be true or false, got 'yes'"),
    ({"stream": 1}, "got a number (1)"),
    ({"response_format": 3}, "response_format a number (3) is not supported"),
    ({"speed": "fast"}, "speed must be a number from 0.25 to 4.0 (1.0: as generated; 2.0: twice as fast, the "
                        "same pitch), got 'fast'"),
    ({"speed": True}, "speed must be a number from 0.25 to 4.0 (1.0: as generated; 2.0: twice as fast, the "
                      "same pitch), got a boolean (true)"),
    ({"speed": 0.1}, "got a number (0.1)"),
    ({"speed": 5}, "got a number (5)"),
    ({"references": 3}, "got a number (3)"),
    ({"references": [3]}, "got a list holding a number (3)"),
    ({"references": [{}, {}]}, "got a list of 2"),
    ({"ref_audio": 5, "ref_text": "hi"}, "ref_audio must be a base64 string or a data: URI, got a number (5)"),
    ({"ref_audio": {"a": 1}, "ref_text": "hi"}, "got an object"),
    ({"max_new_tokens": "5"}, "max_new_tokens must be a whole number, got '5'"),
    ({"initial_chunk_frames": 2.5}, "initial_chunk_frames must be a whole number, got 2.5"),
    ({"seed": True}, "seed must be a whole number, got true"),
])
def test_messages_name_json_types_not_python_ones(body, words):
    with pytest.raises(ApiError) as err:
        if isinstance(body, list):
            parse_speech(body, models=MODELS, voices=_Voices(), config=ServeConfig())
        else:
            _parse(**body)
    message = err.value.message
    assert words in message, message
    for python in ("NoneType", "(int)", "(str)", "(float)", "(list)", "(dict)", "(bool)", " None", "True", "False"):
        assert python not in message, message


def test_voices_dir_needs_its_parent_folder(tmp_path):
    missing = tmp_path / "missing" / "voices"
    with pytest.raises(InputError, match=f"--voices-dir {missing}: folder {missing.parent} does not exist; create it "
                                         "first"):
        ServeConfig(voices_dir=missing)
    assert not missing.parent.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is not a folder"):
        ServeConfig(voices_dir=tmp_path / "file")
    config = ServeConfig(voices_dir=tmp_path / "voices")  # the last folder alone is created, by the store
    assert not (tmp_path / "voices").exists()
    VoiceStore(config.voices_dir, "c0dec")
    assert (tmp_path / "voices").is_dir()
    with pytest.raises(FileNotFoundError):
        VoiceStore(missing, "c0dec")
    assert not missing.parent.exists()


def test_serve_refuses_a_voices_dir_whose_parent_is_missing_before_anything(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "nonexistent" / "x"
    done = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(tmp_path / "bundle"),
                           "--voices-dir", str(missing), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"folder {missing.parent} does not exist; create it first" in done.stderr
    assert "Traceback" not in done.stderr and "serving http" not in done.stderr
    assert not missing.parent.exists()


def test_every_serve_option_has_a_help_line():
    import click

    from higgs_pack.serve.cli import serve

    options = [p for p in serve.params if isinstance(p, click.Option)]
    assert len(options) >= 15
    assert [o.name for o in options if not (o.help or "").strip()] == []
    text = serve.get_help(click.Context(serve, info_name="serve"))
    for flag in ("--max-input-chars", "--max-ref-seconds"):
        line = text.split(flag, 1)[1].split("\n  --", 1)[0]
        assert "[default:" in line and len(line.split("[default:")[0].split()) > 4, line


def test_the_api_docs_describe_each_body_field_the_server_takes():
    from higgs_pack.serve.schema import SpeechBody, VoiceUpload
    from higgs_pack.serve.speech import FIELDS

    assert set(SpeechBody.model_fields) == set(FIELDS)
    assert all(f.description for f in SpeechBody.model_fields.values())
    assert set(VoiceUpload.model_fields) == {"audio", "transcript", "name"}
    assert VoiceUpload.model_json_schema()["properties"]["audio"]["format"] == "binary"


def test_a_ref_audio_that_looks_like_a_path_is_judged_as_one(tmp_path):
    """A value that is absolute and not base64, or names something under --allow-local-media,
    is a path (outside the folder, not a file), never "not valid base64"."""
    (tmp_path / "sub").mkdir()
    allowed = ServeConfig(allow_local_media=tmp_path)
    for value, words in (("/etc/passwd", "is outside the allowed folder"), ("/dev/zero", "is outside the allowed folder"),
                         ("sub", "is not a file in the allowed folder"),
                         (str(tmp_path / "sub"), "is not a file in the allowed folder")):
        with pytest.raises(ApiError, match=words) as err:
            _parse(allowed, ref_audio=value, ref_text="w")
        assert err.value.param == "ref_audio" and "base64" not in err.value.message
    with pytest.raises(ApiError, match="reads no local files unless started with --allow-local-media"):
        _parse(ref_audio="/etc/passwd", ref_text="w")
    with pytest.raises(ApiError, match="not valid base64"):  # short base64-looking text is still base64
        _parse(allowed, ref_audio="%%%", ref_text="w")


def test_a_blank_model_name_is_refused(tmp_path):
    import subprocess
    import sys

    with pytest.raises(InputError, match="--model-name is blank"):
        ServeConfig(model_names=("extra", " "))
    done = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(tmp_path / "bundle"),
                           "--model-name", "", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--model-name is blank" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "serving http" not in done.stderr


def test_an_address_the_server_cannot_listen_on_exits_2(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(tmp_path / "bundle"),
                           "--host", "not.a.host.invalid", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "cannot listen on not.a.host.invalid:0" in done.stderr and "Traceback" not in done.stderr


def test_a_body_with_several_bad_fields_names_them_all():
    """max_new_tokens is checked with the other fields by the request, not alone first (a new
    user's finding: only it was named, as param, of five bad fields)."""
    with pytest.raises(ApiError) as err:
        _parse(seed=-1, temperature="hot", top_p=2, top_k=-1, max_new_tokens=0)
    message = err.value.message
    assert message.startswith("5 problems with the request:") and err.value.param == "seed", message
    for field in ("seed", "temperature", "top_k", "top_p", "max_new_tokens"):
        assert f"- {field} must be" in message, (field, message)



def test_the_origin_check_lets_the_allowed_pages_through():
    """``--allow-origin``: the origins named (or every one with ``*``) may call the server from a
    browser; a malformed one is refused when the server is configured."""
    import asyncio

    from higgs_pack.serve.app import _SameOrigin

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def status(allow, origin, method="POST", host="127.0.0.1:8000"):
        sent = []

        async def send(message):
            sent.append(message)

        headers = [(b"host", host.encode()), *([(b"origin", origin.encode())] if origin else [])]
        scope = {"type": "http", "method": method, "path": "/v1/audio/speech", "headers": headers}
        asyncio.run(_SameOrigin(ok, allow)(scope, None, send))
        return sent[0]["status"]

    assert status((), "http://localhost:3000") == 403
    assert status(("http://localhost:3000",), "http://localhost:3000") == 200
    assert status(("http://localhost:3000",), "http://LOCALHOST:3000") == 200
    assert status(("http://localhost:3000",), "http://localhost:3001") == 403
    assert status(("*",), "https://anywhere.example") == 200
    assert status((), "http://127.0.0.1:8000") == 200  # the server's own page
    assert status((), "null") == 403  # a sandboxed frame or a file:// page
    assert status((), "http://localhost:3000", method="GET") == 200
    assert status((), None) == 200
    for bad in ("localhost:3000", "http://localhost:3000/", "http://localhost:3000/app", "ftp://x", ""):
        with pytest.raises(InputError, match="--allow-origin"):
            ServeConfig(allow_origins=(bad,))
    assert ServeConfig(allow_origins=("*", "https://app.example:8443")).allow_origins[1] == "https://app.example:8443"


def test_the_prefix_key_is_made_once_with_mode_0600_outside_the_voices_folder(tmp_path, monkeypatch):
    """Issue 37 item 4: the secret that signs persisted prefixes."""
    import stat

    from higgs_pack.serve.voices import default_prefix_key_file, load_prefix_key

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = default_prefix_key_file()
    assert path == tmp_path / "state" / "higgs-pack" / "voice-prefix.key"
    key = load_prefix_key(path, tmp_path / "voices")
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_prefix_key(path, tmp_path / "voices") == key  # kept: a restart signs with the same key
    with pytest.raises(InputError, match="is inside --voices-dir"):
        load_prefix_key(tmp_path / "voices" / "k.key", tmp_path / "voices")
    (tmp_path / "bad.key").write_text("not a key")
    with pytest.raises(InputError, match="does not hold a key"):
        load_prefix_key(tmp_path / "bad.key", None)


def test_each_server_setting_is_declared_once_and_every_door_has_it(monkeypatch, tmp_path):
    """Issue 38 item 2: ``higgs-pack serve``'s options, their environment variables and Ray Serve's
    ``build_app`` arguments are made from ServeConfig's one declaration of each setting: a field
    there is at every door with its default and its least value, and each door gives the same config."""
    import dataclasses

    from click.testing import CliRunner

    from higgs_pack.serve.cli import ENV_PREFIX, serve
    from higgs_pack.serve.config import settings
    from higgs_pack.serve.ray_app import ARGS, parse_args
    from higgs_pack.serve.server import SpeechServer

    options = {p.opts[0]: p for p in serve.params if p.opts[0].startswith("--")}
    defaults = ServeConfig()
    for name, setting in settings().items():
        option = options[setting.flag]
        key = setting.name if setting.unit != 1 else name
        assert key in ARGS and setting.flag in ARGS[key][1]
        default = getattr(defaults, name)
        if default not in (None, ()):
            assert option.default == default / setting.unit if setting.unit != 1 else option.default == default
        if setting.minimum is not None:
            assert option.type.min == setting.minimum
    assert set(settings()) == {f.name for f in dataclasses.fields(ServeConfig)}
    # one config three ways: the command line, the environment, Ray's arguments
    given = {"--max-batch": "2", "--max-queue": "3", "--max-kv-mb": "64", "--max-upload-mb": "2",
             "--model-name": "a", "--allow-origin": "http://localhost:3000", "--voices-dir": str(tmp_path / "v")}
    captured = []

    def opened(cls, source, config, device=None):  # the config the command made, then stop before loading
        captured.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(SpeechServer, "open", classmethod(opened))
    argv = [x for flag, value in given.items() for x in (flag, value)]
    assert CliRunner().invoke(serve, ["bundle", "--port", "0", *argv]).exit_code == 0
    env = {f"{ENV_PREFIX}_{flag[2:].replace('-', '_').upper()}": value for flag, value in given.items()}
    assert CliRunner().invoke(serve, ["bundle", "--port", "0"], env=env).exit_code == 0
    monkeypatch.undo()
    _, from_ray, _ = parse_args({"source": "bundle", "max_batch": 2, "max_queue": 3, "max_kv_mb": 64, "max_upload_mb": 2,
                                 "model_names": "a", "allow_origins": "http://localhost:3000",
                                 "voices_dir": str(tmp_path / "v")})
    assert len(captured) == 2 and captured[0] == captured[1] == from_ray
    assert from_ray.max_kv_bytes == 64 * 2**20 and from_ray.model_names == ("a",)



def test_a_serve_variable_that_sets_no_option_is_refused_naming_it(monkeypatch):
    """``HIGGS_PACK_SERVE_OPENVINO_ENGINE`` (read until the paged engine became OpenVINO's only one)
    or a typo such as ``HIGGS_PACK_SERVE_MAX_BACTH``: refused before anything loads, naming it and
    the variables serve reads; the command-line option is gone and click says so; the engine is
    made with the budget alone."""
    from click.testing import CliRunner

    from higgs_pack.serve.cli import serve
    from higgs_pack.serve.server import SpeechServer, _make_engine

    opened = []
    monkeypatch.setattr(SpeechServer, "open", classmethod(lambda cls, *a, **k: opened.append(a) or sys.exit(0)))
    for name in ("HIGGS_PACK_SERVE_OPENVINO_ENGINE", "HIGGS_PACK_SERVE_MAX_BACTH"):
        run = CliRunner().invoke(serve, ["bundle", "--port", "0"], env={name: "4"})
        assert run.exit_code == 2 and f"{name} is set in the environment but sets no option" in run.output, run.output
        assert "HIGGS_PACK_SERVE_MAX_BATCH" in run.output and "HIGGS_PACK_SERVE_OPENVINO_ENGINE," not in run.output
    assert not opened
    run = CliRunner().invoke(serve, ["bundle", "--port", "0"], env={"HIGGS_PACK_SERVE_MAX_BATCH": "2"})
    assert run.exit_code == 0 and len(opened) == 1, run.output
    run = CliRunner().invoke(serve, ["bundle", "--port", "0", "--openvino-engine", "paged"])
    assert run.exit_code == 2 and "No such option '--openvino-engine'" in run.output, run.output
    assert "openvino_engine" not in {f.name for f in dataclasses.fields(ServeConfig)}
    from higgs_pack.serve.ray_app import parse_args

    with pytest.raises(InputError, match=r"unknown build_app argument\(s\) 'openvino_engine'"):
        parse_args({"source": "bundle", "openvino_engine": "paged"})

    calls = []

    class FakeTTS:
        def engine(self, max_batch, **keywords):
            calls.append((max_batch, keywords))
            return "engine"

    assert _make_engine(FakeTTS(), None, 2**20) == ("engine", "")
    assert calls == [(4, {"max_kv_bytes": 2**20})]


@pytest.mark.parametrize(("fields", "param"), [
    ({"voice": "anna", "ref_audio": "UklGRg==", "ref_text": "Her words."}, "voice"),
    ({"references": [{"audio": "UklGRg==", "text": "a"}], "ref_audio": "UklGRg==", "ref_text": "b"}, "references"),
])
def test_two_ways_of_giving_the_voice_at_once_are_conflicting_fields(fields, param):
    with pytest.raises(ApiError) as err:
        _parse(**fields)
    assert err.value.status == 400 and err.value.param == param and err.value.code == "conflicting_fields", err.value
    assert "not both" in err.value.message


def test_a_prepared_voice_beside_ref_audio_is_conflicting_fields_in_python(tmp_path):
    from higgs_pack.runtime.request import SynthesisRequest

    clip = tmp_path / "clip.wav"
    sf.write(clip, np.zeros(24000, dtype=np.float32), 24000)
    with pytest.raises(InputError, match="not both") as err:
        SynthesisRequest.create("Hi.", voice=_voice("anna"), ref_audio=clip, ref_text="Her words.")
    assert err.value.code == "conflicting_fields"
    with pytest.raises(InputError, match="max_chunk_frames must be >= first_chunk_frames") as err:
        SynthesisRequest.create("Hi.", first_chunk_frames=20, max_chunk_frames=10)
    assert err.value.code == "conflicting_fields"


class _FakeEngine:
    """What the server reads of an engine, without a bundle: ``pool`` stands for a paged decoder's
    block pool (None: a decoder without blocks)."""

    def __init__(self, max_batch, pool=None):
        from types import SimpleNamespace

        from higgs_pack.runtime.engine.codec_batch import CodecStats
        from higgs_pack.runtime.engine.state import EngineStats

        self.max_batch, self.prefix_cache, self.crashed = max_batch, None, None
        self.kv_blocks_in_use = None if pool is None else 0
        self.prefix_blocks_shared = None if pool is None else 0
        self.waiting = self.busy_rows = self.kv_bytes_in_use = 0
        self.kv_bytes_per_position, self.kv_budget_bytes = 176, None
        self.stats = EngineStats()  # the engine's own counters, all 0
        self.codec = SimpleNamespace(stats=CodecStats())  # the codec thread's counters, all 0

    def close(self, timeout=None):
        pass


class _FakeTTS:
    """A loaded bundle as the server sees it: ``backend`` names its backend; ``refuse`` is an
    InputError ``engine`` raises (as ``TTS.engine`` refuses a batch its decoder cannot run)."""

    def __init__(self, backend="openvino", refuse=None):
        from types import SimpleNamespace

        self.info = SimpleNamespace(bundle="tiny-ov", model="higgs-audio-v3-tiny", target=backend, precision="int4",
                                    backend=backend, device="CPU", sample_rate=24000)
        self.bundle = SimpleNamespace(manifest={})
        self.refuse, self.calls = refuse, []

    def engine(self, max_batch, *, max_kv_bytes=None):
        self.calls.append(max_batch)
        if self.refuse is not None and max_batch > 1:
            raise self.refuse
        paged = self.info.backend == "openvino" and max_batch > 1
        return _FakeEngine(max_batch, pool=object() if paged else None)

    def close(self):
        pass


@pytest.mark.parametrize(("backend", "config", "engine", "batching"), [
    ("openvino", {}, "paged", "continuous batching"),
    ("openvino", {"max_batch": 1}, None, "one request at a time"),
    ("onnxruntime", {}, None, "continuous batching"),
    ("onnxruntime", {"max_batch": 1}, None, "one request at a time"),
])
def test_ready_and_the_startup_line_say_which_engine_serves(caplog, backend, config, engine, batching):
    from higgs_pack.serve.server import SpeechServer

    with caplog.at_level("INFO", logger="higgs_pack.serve.server"):
        server = SpeechServer(_FakeTTS(backend), ServeConfig(**config))
    described = server.describe()
    assert described.get("openvino_engine") == engine and described["batching"].startswith(batching), described
    summary = server.engine_summary()
    assert summary.startswith(f"max_batch {server.engine.max_batch}")
    if engine is None:
        assert "openvino_engine" not in summary and "openvino_engine" not in caplog.text
    else:
        assert f"openvino_engine {engine}" in summary and f"openvino_engine {engine}" in caplog.text
    # the paged pool's gauges only where there is a block pool
    metrics = server.metrics.render().decode()
    pooled = engine == "paged"
    assert ("higgs_pack_kv_blocks_in_use" in metrics) is pooled
    assert ("higgs_pack_kv_prefix_blocks_shared" in metrics) is pooled
    assert "higgs_pack_kv_bytes" in metrics


def test_a_bundle_that_cannot_batch_is_served_one_request_at_a_time_and_says_why(caplog):
    from higgs_pack.errors import Problem
    from higgs_pack.serve.server import SpeechServer

    cannot = _FakeTTS("openvino", refuse=InputError.of(Problem.said("this decoder cannot batch requests")))
    with caplog.at_level("INFO"):
        server = SpeechServer(cannot, ServeConfig())
    assert cannot.calls == [4, 1] and server.engine.max_batch == 1
    assert "serving one request at a time: this decoder cannot batch" in caplog.text
    assert server.describe()["batching"] == "one request at a time: this decoder cannot batch requests"
    assert "openvino_engine" not in server.describe()
    with pytest.raises(InputError, match="cannot batch"):  # asked for by name: refused, not served at one row
        SpeechServer(_FakeTTS("openvino", refuse=cannot.refuse), ServeConfig(max_batch=2))


def test_a_setting_refused_names_its_environment_variable_when_it_came_from_there(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from higgs_pack.errors import Problem
    from higgs_pack.runtime.cli import main
    from higgs_pack.serve.server import SpeechServer

    def opened(cls, source, config, device=None):
        raise InputError.of(Problem.said(f"max_kv_bytes={config.max_kv_bytes} is less than one request of this "
                                         "bundle needs (--max-kv-mb)", field="max_kv_bytes"))

    monkeypatch.setattr(SpeechServer, "open", classmethod(opened))
    run = CliRunner().invoke(main, ["serve", "bundle", "--port", "0"], env={"HIGGS_PACK_SERVE_MAX_KV_MB": "1"})
    assert run.exit_code == 2 and "--max-kv-mb" in run.output, run.output
    assert "HIGGS_PACK_SERVE_MAX_KV_MB" in run.output, run.output
    run = CliRunner().invoke(main, ["serve", "bundle", "--port", "0", "--max-kv-mb", "1"])
    assert run.exit_code == 2 and "--max-kv-mb" in run.output and "HIGGS_PACK_" not in run.output, run.output
    run = CliRunner().invoke(main, ["serve", "bundle", "--port", "0"],
                             env={"HIGGS_PACK_SERVE_VOICES_DIR": str(tmp_path / "no" / "voices")})
    assert run.exit_code == 2 and "HIGGS_PACK_SERVE_VOICES_DIR" in run.output, run.output


def test_first_commit_words_is_described_as_the_count_that_triggers_the_first_commit():
    from higgs_pack.serve.schema import SessionFields

    description = SessionFields.model_fields["first_commit_words"].description
    assert "once that many have arrived" in description and "most words" not in description
