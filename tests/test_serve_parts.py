"""The server's parts that need no bundle: the voice store on a shared folder, the speech
body's checks, the response formats and the config's limits (fast tier)."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi", reason="the [serve] extra (FastAPI) is not installed")

from higgs_pack.manifests.errors import InputError
from higgs_pack.runtime.request import PreparedVoice
from higgs_pack.serve.config import ServeConfig
from higgs_pack.serve.errors import ApiError
from higgs_pack.serve.formats import StreamEncoder, encode_whole, response_formats
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
    with pytest.raises(ApiError, match=r"unknown field\(s\) 'xxxxxxxx") as err:
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
    assert {"wav", "pcm", "flac"} <= set(response_formats())


def test_config_limits_are_checked(tmp_path):
    with pytest.raises(InputError, match="max_queue must be a whole number >= 0"):
        ServeConfig(max_queue=-1)
    with pytest.raises(InputError, match="max_ref_seconds must be a number of seconds > 0"):
        ServeConfig(max_ref_seconds=0)
    with pytest.raises(InputError, match="api_key is blank"):
        ServeConfig(api_key=" ")
    with pytest.raises(InputError, match="is not a folder"):
        ServeConfig(allow_local_media=tmp_path / "missing")


def test_runtime_advice_is_given_in_the_servers_terms():
    from higgs_pack.serve.server import server_terms

    assert server_terms("split it with punctuation, or lower --max-frames") == \
        "split it with punctuation, or lower max_new_tokens"
    assert "--max-kv-mb" in server_terms("or make the engine with a larger max_kv_bytes= (tts.engine(max_kv_bytes=...))")
