"""Reference-audio preparation and wav writing on real audio from shared/cases."""

import io

import numpy as np
import pytest
import soundfile as sf

from higgs_pack.errors import InputError
from higgs_pack.runtime.audio import load_audio, prepare_reference, write_wav

SR, HOP = 24000, 960


def test_case_clip_is_resampled_padded_to_whole_frames(cases_dir):
    samples, rate = load_audio(cases_dir / "ref_en_16k.wav")
    assert rate == 16000
    assert 6.5 < len(samples) / rate < 7.5
    out = prepare_reference(samples, rate, SR, HOP)
    assert out.dtype == np.float32 and len(out) % HOP == 0
    assert abs(len(out) - len(samples) * 1.5) < HOP + 10


def test_stereo_48k_is_downmixed(tmp_path):
    t = np.arange(48000 * 2) / 48000
    left = 0.5 * np.sin(2 * np.pi * 220 * t)
    sf.write(tmp_path / "st.wav", np.stack([left, -left * 0 + left], axis=1), 48000)
    samples, rate = load_audio(tmp_path / "st.wav")
    assert samples.ndim == 1 and rate == 48000
    out = prepare_reference(samples, rate, SR, HOP)
    assert len(out) == 2 * SR


def test_short_clip_is_padded_to_one_second():
    out = prepare_reference(0.3 * np.ones(int(0.6 * SR), np.float32), SR, SR, HOP)
    assert len(out) == SR


@pytest.mark.parametrize(("samples", "message"), [
    (np.ones(1000, np.float32) * 0.3, "needs at least 0.5 s"),
    (np.zeros(SR * 2, np.float32), "is silent"),
    (np.full(SR * 2, np.nan, np.float32), "NaN"),
    (np.ones(SR * 61, np.float32) * 0.1, "at most 60 s"),
])
def test_unusable_reference_clips_are_refused(samples, message):
    with pytest.raises(InputError, match=message):
        prepare_reference(samples, SR, SR, HOP)


def test_missing_corrupt_and_non_audio_files(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_audio(tmp_path / "nope.wav")
    (tmp_path / "text.wav").write_text("this is not audio")
    with pytest.raises(InputError, match="not a readable audio file"):
        load_audio(tmp_path / "text.wav")
    good = tmp_path / "good.wav"
    sf.write(good, np.zeros(48000, np.float32) + 0.1, 24000)
    (tmp_path / "cut.wav").write_bytes(good.read_bytes()[:30])
    with pytest.raises(InputError):
        load_audio(tmp_path / "cut.wav")


def test_loud_audio_is_scaled_not_clipped(tmp_path):
    x = np.array([0.0, 1.8, -1.2, 0.5], np.float32)
    w = write_wav(tmp_path / "a.wav", x, SR)
    assert w.scaled and w.peak == pytest.approx(1.8)
    back, rate = sf.read(tmp_path / "a.wav", dtype="float32")
    assert rate == SR and np.abs(back).max() <= 1.0
    assert back[1] > 0.99 and back[2] < -0.6  # scaled, sign and order kept (no wrap)
    w = write_wav(tmp_path / "f.wav", x, SR, subtype="FLOAT")
    assert not w.scaled and sf.read(tmp_path / "f.wav", dtype="float32")[0][1] == pytest.approx(1.8)
    assert sf.info(tmp_path / "a.wav").subtype == "PCM_16"


def test_a_stream_is_written_in_pipe_sized_pieces(tmp_path):
    """A pipe whose reader left cuts one large write short without an error Python reports;
    pieces of at most the pipe's capacity, each flushed, make the next write raise."""
    import io

    from higgs_pack.runtime.audio import PIPE_PIECE_BYTES, AudioSink

    sizes = []

    class Recording(io.BytesIO):
        def write(self, data):
            sizes.append(len(data))
            return super().write(data)

    out = Recording()
    sink = AudioSink(out, SR, subtype="PCM_16", container="raw")
    samples = np.sin(np.arange(3 * SR) / 10).astype(np.float32) * 0.5  # 144,000 bytes of 16-bit audio
    sink.write(samples)
    assert max(sizes) <= PIPE_PIECE_BYTES and len(sizes) == 3
    assert sink.samples_written == len(samples) and len(out.getvalue()) == 2 * len(samples)

    class Closed(io.BytesIO):
        def write(self, data):
            if self.tell() >= PIPE_PIECE_BYTES:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(data)

    sink = AudioSink(Closed(), SR, subtype="PCM_16", container="raw")
    with pytest.raises(BrokenPipeError):
        sink.write(samples)
    assert sink.samples_written == PIPE_PIECE_BYTES // 2  # what reached the pipe before it closed


def test_a_small_file_of_hours_is_refused_from_its_header_without_decoding(tmp_path):
    """1.1 MB of FLAC holding hours of audio decoded to 4.3 GB before its length was judged."""
    import resource

    from higgs_pack.runtime.audio import MAX_REFERENCE_S, read_audio_bytes

    bomb = tmp_path / "hours.flac"
    with sf.SoundFile(bomb, "w", samplerate=8000, channels=1, format="FLAC") as f:
        block = np.full(8000 * 60, 0.25, np.float32)
        for _ in range(120):  # two hours, written a minute at a time
            f.write(block)
    assert bomb.stat().st_size < 2_000_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InputError, match=rf"is 7200\.0 s long; use a clip of at most {MAX_REFERENCE_S:.0f} s"):
        load_audio(bomb)
    with pytest.raises(InputError, match=r"is 7200\.0 s long"):
        read_audio_bytes(bomb.read_bytes())
    # Nothing near the 230 MB the decoded file would take was allocated (peak RSS, KiB on Linux).
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000


@pytest.mark.parametrize(("samples", "rate", "message"), [
    (np.zeros((4800, 2), np.float32), SR, r"write_wav writes mono audio, float32 \[samples\]; got an array of shape "
                                          r"\[4800, 2\]: mix the channels down"),
    (np.zeros((2, 4800), np.float32), SR, r"shape \[2, 4800\]"),
    (np.zeros(100, np.float32), 0, r"sample_rate must be a whole number of Hz > 0, got 0"),
])
def test_write_wav_refuses_what_it_would_write_wrong(tmp_path, samples, rate, message):
    with pytest.raises(InputError, match=message):
        write_wav(tmp_path / "x.wav", samples, rate)
    assert not (tmp_path / "x.wav").exists()
    assert sf.info(write_wav(tmp_path / "m.wav", np.zeros((4800, 1), np.float32), SR).path).frames == 4800


def test_the_piece_writers_refuse_several_channels(tmp_path):
    """WavFileWriter and AudioSink took a [n, 2] array as 2n mono samples (a new user's finding):
    they refuse it as write_wav does, and [n, 1] stays mono."""
    from higgs_pack.runtime.audio import AudioSink, WavFileWriter

    with WavFileWriter(tmp_path / "w.wav", SR) as writer:
        with pytest.raises(InputError, match=r"WavFileWriter writes mono audio.*shape \[10, 2\]"):
            writer.write(np.zeros((10, 2), np.float32))
        writer.write(np.zeros((10, 1), np.float32))
        writer.finish()
    assert sf.info(tmp_path / "w.wav").frames == 10
    sink = AudioSink(str(tmp_path / "s.wav"), SR)
    with pytest.raises(InputError, match=r"AudioSink writes mono audio"):
        sink.write(np.zeros((10, 2), np.float32))
    sink.close()


def test_leaving_a_writers_block_normally_finishes_the_file(tmp_path):
    """A ``with WavFileWriter`` block left without finish() puts the file in place (it left a
    hidden .partial- file and no output); left by an exception it leaves nothing."""
    from higgs_pack.runtime.audio import WavFileWriter

    with WavFileWriter(tmp_path / "done.wav", SR) as writer:
        writer.write(np.zeros(480, np.float32))
    assert sf.info(tmp_path / "done.wav").frames == 480
    with pytest.raises(RuntimeError), WavFileWriter(tmp_path / "failed.wav", SR) as writer:
        writer.write(np.zeros(480, np.float32))
        raise RuntimeError("generation failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.wav"]



@pytest.mark.parametrize("subtype", ["PCM_16", "FLOAT"])
def test_the_piece_writers_write_into_a_named_pipe_front_to_back(tmp_path, subtype):
    """A named pipe (or a device) as the output: it can be neither renamed over nor sought in.
    WavFileWriter keeps the audio in a temporary file and writes it with its sizes known (loud
    16-bit audio still scaled); AudioSink streams it with a header of unknown length."""
    import os
    import tempfile
    import threading

    from higgs_pack.runtime.audio import UNKNOWN_SIZE, AudioSink, WavFileWriter

    fifo = tmp_path / "out.wav"
    os.mkfifo(fifo)
    loud = np.linspace(-2.0, 2.0, 24000, dtype=np.float32)
    for make in (lambda: WavFileWriter(fifo, 24000, subtype=subtype), lambda: AudioSink(fifo, 24000, subtype=subtype)):
        got: dict = {}
        reader = threading.Thread(target=lambda got=got: got.setdefault("bytes", fifo.read_bytes()))
        reader.start()
        before = set(os.listdir(tempfile.gettempdir()))
        with make() as writer:
            writer.write(loud[:10000])
            writer.write(loud[10000:])
        reader.join(30)
        data, rate = sf.read(io.BytesIO(got["bytes"]), dtype="float32")
        assert rate == 24000 and len(data) == 24000 and fifo.is_fifo()
        sizes = int.from_bytes(got["bytes"][40:44], "little")
        if isinstance(writer, WavFileWriter):
            assert sizes == len(got["bytes"]) - 44
            assert abs(data).max() <= (1.0 if subtype == "PCM_16" else 2.0) and data[-1] > 0.99
        else:
            assert sizes == UNKNOWN_SIZE
        assert set(os.listdir(tempfile.gettempdir())) - before == set()  # no temporary file left
    with WavFileWriter(os.devnull, 24000) as writer:
        writer.write(loud)
    assert writer.samples_written == 24000


def test_the_python_writers_errors_name_the_path_not_a_cli_flag(tmp_path):
    """write_wav and WavFileWriter, called from Python, name the file alone (they named the CLI's
    ``-o``, which a Python caller never gave); the CLI still names its flag."""
    from higgs_pack.runtime.audio import WavFileWriter

    samples = np.zeros(100, dtype=np.float32)
    for write in (lambda: write_wav("/proc/x.wav", samples, 24000), lambda: WavFileWriter("/proc/x.wav", 24000)):
        with pytest.raises(InputError, match=r"cannot write /proc/x.wav: ") as err:
            write()
        assert "-o" not in str(err.value)
    with pytest.raises(InputError, match=r"cannot write /proc/x.wav \(-o\): "):
        WavFileWriter("/proc/x.wav", 24000, option="-o")


def test_a_stream_holds_the_samples_a_file_holds():
    """pcm_samples (stdout, raw PCM, the server's streams) gives exactly the int16 that libsndfile
    writes into a file for the same floats: a stream and a file of one audio are the same
    samples (they were 1 apart in half of them: x * 32768 rounded, where libsndfile floors)."""
    from higgs_pack.runtime.audio import pcm_samples

    x = (np.random.default_rng(0).standard_normal(100_000) * 0.3).astype(np.float32)
    x = np.concatenate([x, np.float32([1.0, -1.0, 0.99999, -0.99999, 0.0, 1.5, -1.5])])
    out = io.BytesIO()
    sf.write(out, np.clip(x, -1, 1), 24000, subtype="PCM_16", format="WAV")
    out.seek(0)
    np.testing.assert_array_equal(pcm_samples(x), sf.read(out, dtype="int16")[0])


def test_write_wav_refuses_a_name_or_samples_it_would_write_wrong(tmp_path):
    """WAV bytes in ``x.mp3`` (players read the name), and int16 samples taken as floats (scaled
    from a peak of thousands): both were written without a word (a new user's findings)."""
    with pytest.raises(InputError, match=r"x.mp3 is written as WAV: give it a .wav name"):
        write_wav(tmp_path / "x.mp3", np.zeros(100, np.float32), 24000)
    with pytest.raises(InputError, match=r"got int16 samples: convert them first \(int16 PCM: samples / 32768\)"):
        write_wav(tmp_path / "x.wav", np.full(100, 1000, np.int16), 24000)
    assert not list(tmp_path.iterdir())
    assert write_wav(tmp_path / "X.WAV", np.zeros(100, np.float64), 24000).peak == 0.0
