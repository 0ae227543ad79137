"""Audio in and out: reference clips for voice cloning, and wav writing.

soundfile (libsndfile) reads and writes, soxr resamples.  Every problem with a
user's file becomes an :class:`~higgs_pack.errors.InputError` that names
the file and what to do.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf
import soxr

from higgs_pack.errors import InputError, Problem, literal

#: Shortest usable reference, seconds (shorter clips carry too little voice).
MIN_REFERENCE_S = 0.5
#: Longest reference accepted, seconds (it is spent as prompt positions).
MAX_REFERENCE_S = 60.0
#: Clips are padded with silence to at least this long (upstream padded to 1 s; MODEL.md).
PAD_REFERENCE_TO_S = 1.0
#: Peak below which a clip counts as silence (float samples in [-1, 1]).
SILENCE_PEAK = 1e-3


class _OwnedSoundFile(sf.SoundFile):
    """A :class:`soundfile.SoundFile` on a file object it closes with itself."""

    def __init__(self, owned: BinaryIO, *args, **kwargs):
        object.__setattr__(self, "_owned", owned)
        try:
            super().__init__(owned, *args, **kwargs)
        except BaseException:
            owned.close()
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._owned.close()


def sound_file(path: str | Path | BinaryIO, mode: str = "r", *args, **kwargs) -> sf.SoundFile:
    """``soundfile.SoundFile(path, mode, ...)`` for any path the operating system takes, or a file
    object (handed over as it is).

    soundfile encodes a path as strict UTF-8, so a Linux path holding bytes that are not UTF-8
    (Python hands them over as lone surrogates) raised a raw UnicodeEncodeError: such a path is
    opened by Python (binary, ``w+b`` to write) and the file object handed over, closed with it.
    """
    if not isinstance(path, (str, os.PathLike)):
        return sf.SoundFile(path, mode, *args, **kwargs)
    name = os.fspath(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return _OwnedSoundFile(open(name, "rb" if mode == "r" else "w+b"), mode, *args, **kwargs)
    return sf.SoundFile(name, mode, *args, **kwargs)


def clip_error(source: str, rest: str, code: str = "invalid_value") -> InputError:
    """The :class:`InputError` of an unusable reference clip, as data: a problem of the field
    ``ref_audio`` (the server names it in its own terms: ``ref_audio`` in a speech body, ``audio``
    in a voice upload).  ``source`` is what the message calls the clip: the field itself (a clip
    given as samples) is left for each front door to name; a file is named as it is.

    Args:
        source: ``"ref_audio"``, or a description such as ``"reference audio voice.wav"``.
        rest: the sentence after it (" is silent (...)...").
        code: the problem's code (``unreadable_audio`` for bytes libsndfile cannot read).
    """
    message = "{name}" + literal(rest) if source == "ref_audio" else literal(source + rest)
    return InputError(problems=[Problem("ref_audio", None, message=message, code=code)])


def require_audio_file(path: str | Path) -> Path:
    """``path`` as a :class:`~pathlib.Path`, checked to be an existing file (not read).

    Raises:
        InputError: it does not exist or is a folder (a problem of ``ref_audio``, naming the path;
            each front door says how it was given).
    """
    path = Path(path)
    if path.is_dir():
        raise clip_error(f"reference audio {path}", " is a folder; give an audio file (wav, flac, ogg)")
    if not path.is_file():
        raise clip_error(f"reference audio {path}", " does not exist; give an existing audio file")
    return path


def check_audio_file(path: str | Path) -> Path:
    """:func:`require_audio_file`, and the file's header read (not its samples): libsndfile reads it
    and its length is a reference clip's (:data:`MIN_REFERENCE_S` to :data:`MAX_REFERENCE_S`), so a
    request is refused before a bundle loads; silence is judged once the samples are read.

    Raises:
        InputError: missing, a folder, not audio libsndfile reads, or too short or long.
    """
    path = require_audio_file(path)
    source = f"reference audio {path}"
    try:
        with sound_file(path) as info:
            frames, rate = info.frames, info.samplerate
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError, OSError) as exc:
        raise _unreadable(source, exc, "") from exc
    if frames > 0 and rate > 0:
        _check_length(source, frames / rate)
    return path


def _unreadable(source: str, exc: Exception, how: str) -> InputError:
    reason = re.sub(r"^Error opening <[^>]*>: ", "", str(exc))  # not the repr of an in-memory file
    return clip_error(source, f" is not a readable audio file ({reason}); give a file libsndfile reads: wav, flac, "
                              "ogg (Vorbis or Opus) or mp3" + (f" with {how}" if how else ""), "unreadable_audio")


def _check_length(source: str, seconds: float) -> None:
    if seconds < MIN_REFERENCE_S:
        raise clip_error(source, f" is {seconds:.2f} s long; a voice reference needs at least {MIN_REFERENCE_S} s "
                                 "of speech (3-10 s works best)")
    if seconds > MAX_REFERENCE_S:
        raise clip_error(source, f" is {seconds:.1f} s long; use a clip of at most {MAX_REFERENCE_S:.0f} s")


def load_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read any libsndfile format as mono float32.

    Args:
        path: wav/flac/ogg/… file.

    Returns:
        ``(samples, sample_rate)``: float32 [samples] in [-1, 1] (channels averaged), Hz.

    Raises:
        InputError: missing, unreadable, not audio, or empty.
    """
    path = require_audio_file(path)
    return _decode(path, f"reference audio {path}", "")  # a path names itself: no flag (--ref-audio, --voice)


def read_audio_bytes(data: bytes, source: str = "reference audio", how: str = "ref_audio", *,
                     max_seconds: float = MAX_REFERENCE_S, limit: str = "") -> tuple[np.ndarray, int]:
    """:func:`load_audio` for a file's bytes (an upload, a base64 field).

    Args:
        data: the bytes of a wav/flac/ogg/mp3 file.
        source: what the bytes are, for messages.
        how: the field or flag the user gave them with, for messages.
        max_seconds: the longest clip taken (a server's own limit, at most
            :data:`MAX_REFERENCE_S`); ``limit`` says where it comes from in the message.

    Returns:
        ``(samples, sample_rate)``: float32 [samples] in [-1, 1] (channels averaged), Hz.

    Raises:
        InputError: not audio libsndfile reads, or empty.
    """
    return _decode(io.BytesIO(data), source, how, min(max_seconds, MAX_REFERENCE_S), limit)


def _decode(file: Path | BinaryIO, source: str, how: str, max_seconds: float = MAX_REFERENCE_S,
            limit: str = "") -> tuple[np.ndarray, int]:
    """Decode at most :data:`MAX_REFERENCE_S` of audio: a file whose header says it is longer is
    refused before its samples are decoded, and one that does not say is read only that far, so a
    small compressed file of hours (1.1 MB of FLAC holding 4 hours decoded to 4.3 GB before) costs
    no more than a reference clip."""
    try:
        with sound_file(file) as f:
            rate, cap = int(f.samplerate), int(max_seconds * f.samplerate) + 1
            if f.frames > cap:
                raise clip_error(source, f" is {f.frames / rate:.1f} s long; use a clip of at most "
                                         f"{max_seconds:g} s{limit} (3-10 s of speech works best)")
            data = f.read(frames=cap, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError, OSError) as exc:
        raise _unreadable(source, exc, how) from exc
    if len(data) >= cap:
        raise clip_error(source, f" is longer than {max_seconds:g} s; use a clip of at most "
                                 f"{max_seconds:g} s{limit} (3-10 s of speech works best)")
    if data.size == 0:
        raise clip_error(source, " holds no samples; give a recording of speech")
    return data.mean(axis=1).astype(np.float32), int(rate)


def prepare_reference(samples: np.ndarray, rate: int, target_rate: int, hop_length: int,
                      source: str = "reference audio") -> np.ndarray:
    """Turn a mono clip into what the codec encoder accepts.

    Resamples to ``target_rate`` (soxr, high quality), refuses clips that are too
    short, too long or silent, pads with trailing silence to at least 1 s and to
    a whole number of ``hop_length``-sample frames (the traced encoder only
    accepts whole frames; MODEL.md).

    Args:
        samples: float32 [samples] mono.
        rate: its sample rate in Hz.
        target_rate: the codec's sample rate (24000 Hz).
        hop_length: samples per codec frame (960).
        source: name used in messages.

    Returns:
        float32 [k * hop_length] at ``target_rate``.

    Raises:
        InputError: too short (< 0.5 s), too long (> 60 s), silent or non-finite.
    """
    if not np.isfinite(samples).all():
        raise clip_error(source, " contains NaN or infinite samples; re-export the file")
    _check_length(source, len(samples) / rate)
    if float(np.abs(samples).max()) < SILENCE_PEAK:
        raise clip_error(source, f" is silent (peak below {SILENCE_PEAK}); give a recording of speech")
    if rate != target_rate:
        samples = soxr.resample(samples, rate, target_rate, quality="HQ").astype(np.float32)
    length = max(len(samples), int(PAD_REFERENCE_TO_S * target_rate))
    length = -(-length // hop_length) * hop_length
    out = np.zeros(length, dtype=np.float32)
    out[: len(samples)] = samples
    return out


def cannot_write(path: str | Path, exc: OSError, option: str | None = None) -> InputError:
    """The :class:`InputError` of a file that could not be opened or written, naming the cause
    (``exc.strerror``); a full disk (``errno.ENOSPC``) is said as such.

    Args:
        path: the file.
        exc: what the operating system raised.
        option: how the caller names the path (``-o``, ``--subtitles``, a keyword); None: the path alone.
    """
    import errno

    named = f"{path} ({option})" if option else str(path)
    if exc.errno == errno.ENOSPC:
        return InputError.of(Problem.said(f"cannot write {named}: out of disk space (ENOSPC: {exc.strerror}); free "
                                          "space on that disk or write elsewhere"))
    return InputError.of(Problem.said(f"cannot write {named}: {exc.strerror or exc}; choose a writable path"))


def check_writable(path: str | Path, option: str | None = None) -> None:
    """Refuse, before anything is generated, a file that cannot be opened for writing: it is opened
    for appending (nothing written, an existing file unchanged) and a file this created is removed.

    A full disk shows only when bytes are written (:func:`write_file` says so then).

    Raises:
        InputError: as :func:`cannot_write` (``/proc/x.wav``: no such file; a read-only folder...).
    """
    path = Path(path)
    existed = path.exists() or path.is_symlink()
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise cannot_write(path, exc, option) from exc
    if not existed:
        path.unlink(missing_ok=True)


def write_file(path: str | Path, data: bytes, option: str | None = None) -> None:
    """Write ``data`` to ``path`` (replacing it) with Python's own file, whose errors carry the errno
    that libsndfile's "System error." hides.

    Raises:
        InputError: as :func:`cannot_write`.
    """
    try:
        with open(path, "wb") as file:
            file.write(data)
    except OSError as exc:
        raise cannot_write(path, exc, option) from exc



@dataclass(frozen=True)
class WavWritten:
    """What :func:`write_wav` did.

    Attributes:
        path: file written.
        peak: peak absolute sample before any scaling.
        scaled: True when the audio was scaled down to avoid clipping 16-bit PCM.
    """

    path: Path
    peak: float
    scaled: bool


#: Sample formats a stream may carry: soundfile subtype -> (numpy dtype, WAV format tag).
STREAM_SUBTYPES = {"PCM_16": ("<i2", 1), "FLOAT": ("<f4", 3)}
#: RIFF and data chunk sizes of a WAV whose length is unknown when its header is written
#: (a pipe): the largest value, which players read as "until the end of the stream".
UNKNOWN_SIZE = 0xFFFFFFFF
#: Largest piece written to a stream at once: Linux's default pipe capacity (pipe(7)).
PIPE_PIECE_BYTES = 65536


def streaming_wav_header(sample_rate: int, subtype: str = "PCM_16", samples: int | None = None) -> bytes:
    """The 44-byte header of a mono WAV written front to back, never sought in (a pipe).

    With ``samples`` None its length is unknown (RIFF/data sizes ``0xFFFFFFFF``): aplay, sox,
    ffmpeg and soundfile read such a stream to its end.

    Args:
        sample_rate: Hz.
        subtype: ``"PCM_16"`` (16-bit integer) or ``"FLOAT"`` (32-bit IEEE float).
        samples: how many samples follow, when known.
    """
    dtype, tag = STREAM_SUBTYPES[subtype]
    width = np.dtype(dtype).itemsize
    fmt = struct.pack("<HHIIHH", tag, 1, sample_rate, sample_rate * width, width, 8 * width)
    data = UNKNOWN_SIZE if samples is None else samples * width
    riff = UNKNOWN_SIZE if samples is None else 4 + 8 + len(fmt) + 8 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", data))


def pcm_samples(samples: np.ndarray, subtype: str = "PCM_16") -> np.ndarray:
    """Float samples as a stream carries them: little-endian int16 exactly as libsndfile writes a
    16-bit file (so a stream and a file of the same audio hold the same samples), or float32.

    libsndfile turns a float into a 32-bit integer (``x * 2**31``, rounded to nearest, clipped)
    and keeps its upper 16 bits (an arithmetic shift, so it floors); measured equal to
    ``soundfile.write(..., subtype="PCM_16")`` on 400,000 random samples.

    Args:
        samples: float32 [n], nominally in [-1, 1] (beyond it: clipped).
        subtype: ``"PCM_16"`` or ``"FLOAT"`` (:data:`STREAM_SUBTYPES`).

    Returns:
        ``<i2`` or ``<f4`` [n]; ``.tobytes()`` is the stream's payload.
    """
    dtype = STREAM_SUBTYPES[subtype][0]
    if subtype == "PCM_16":
        wide = np.clip(np.rint(samples.astype(np.float64) * 2147483648.0), -2147483648, 2147483647)
        return (wide.astype(np.int64) >> 16).astype(dtype)
    return samples.astype(dtype)


#: The peak 16-bit audio beyond [-1, 1] is scaled down to (a file, or whole audio to stdout).
PCM16_PEAK = 0.999
#: Samples converted or checked at once when a whole array or a temporary file is written
#: (2**20 float32 = 4 MiB): what :func:`write_wav` and :class:`WavFileWriter` hold beyond a piece.
WRITE_BLOCK_SAMPLES = 1 << 20
#: Name prefix of the hidden file a :class:`WavFileWriter` writes beside its output.
PARTIAL_WAV_PREFIX = ".partial-"


def _blocks(samples: np.ndarray) -> Iterator[np.ndarray]:
    """Views of float32 [n] ``samples`` of at most :data:`WRITE_BLOCK_SAMPLES` each (no copies)."""
    for start in range(0, len(samples), WRITE_BLOCK_SAMPLES):
        yield samples[start:start + WRITE_BLOCK_SAMPLES]


def written_in_place(path: str | Path) -> bool:
    """Whether ``path`` is an output that exists and is neither a regular file nor a folder: a
    device (``/dev/null``) or a named pipe, which can be neither renamed over nor sought in, so
    its WAV is written into it front to back, whatever its name."""
    target = Path(path)
    return target.exists() and not target.is_file() and not target.is_dir()


class WavFileWriter:
    """Writes a mono ``.wav`` file piece by piece, so that no more than one piece is held, and
    puts it in place only when it is complete.

    The audio goes to a hidden file beside the output (``.partial-<pid>-<name>``, made as any
    file is, umask applied); :meth:`finish` (or leaving a ``with`` block normally) renames it over
    the output (a reader sees the old file or the new one, never half of one) and :meth:`discard`
    (or leaving a ``with`` block by an exception, Ctrl-C included) removes it, so an interrupted or failed run leaves no file
    that looks complete.  An output that exists and is not a regular file (a device such as
    ``/dev/null``, a named pipe) can be neither renamed over nor sought in: the audio waits in a
    hidden file in the system's temporary folder and :meth:`finish` writes it into the output
    front to back, its header's sizes known.  A symbolic link keeps pointing where it did; the
    file it names is replaced.

    16-bit PCM cannot hold samples beyond [-1, 1]: such audio is scaled down to a 0.999 peak
    (``WavWritten.scaled`` says so; ``subtype="FLOAT"`` keeps it as is).  When the peak is not
    known up front (``peak=None``, audio that is still being generated) 16-bit output is first
    written as float32 to the hidden file and converted, scaled if need be, block by block by
    :meth:`finish` (:data:`WRITE_BLOCK_SAMPLES` at a time; a second hidden file, then renamed):
    the output is then the same as :func:`write_wav` of the whole audio would have written.

    Args:
        path: the output ``.wav`` (its folder must exist).
        sample_rate: Hz, a whole number > 0.
        subtype: ``"PCM_16"`` or ``"FLOAT"``.
        peak: the largest absolute sample of all the audio that will be written, when known
            (then 16-bit samples are scaled while written); None: unknown.
        option: how the caller names ``path`` in errors (``-o``); None: the path alone.

    Attributes:
        samples_written: samples written so far.
        peak: largest absolute sample written so far (before any scaling).

    Raises:
        InputError: bad subtype or sample rate, a path not named .wav (a device or a named pipe
            is taken as named), an unwritable folder, a full disk (said as such).
    """

    def __init__(self, path: str | Path, sample_rate: int, *, subtype: str = "PCM_16", peak: float | None = None,
                 option: str | None = None):
        if subtype not in STREAM_SUBTYPES:
            raise InputError.of(Problem.said(f"unknown wav format {subtype!r}; use PCM_16 (16-bit) or FLOAT", code="unknown_value"))
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
            raise InputError.of(Problem.said(f"sample_rate must be a whole number of Hz > 0, got {sample_rate!r}"))
        self.path, self.sample_rate, self.subtype, self.option = Path(path), int(sample_rate), subtype, option
        self.samples_written = 0
        self.peak = 0.0 if peak is None else float(peak)
        self._deferred = subtype == "PCM_16" and peak is None  # float32 first, converted by finish()
        self._scale = PCM16_PEAK / peak if subtype == "PCM_16" and peak is not None and peak > 1.0 else None
        target = self.path.resolve()
        self._target, self._in_place = target, written_in_place(target)
        if not self._in_place and target.suffix.lower() != ".wav":  # WAV bytes in x.mp3 would mislead players
            raise InputError.of(Problem.said(f"{self.path}{f' ({option})' if option else ''} is written as WAV: give it a .wav name"))
        if self._in_place:
            fd, name = tempfile.mkstemp(prefix=PARTIAL_WAV_PREFIX, suffix=f"-{target.name}.wav")
            os.close(fd)
            self._partial, self._deferred, self._scale = Path(name), True, None
        else:
            self._partial = target.parent / f"{PARTIAL_WAV_PREFIX}{os.getpid()}-{target.name}"
        self._file: sf.SoundFile | None = self._open(self._partial, "FLOAT" if self._deferred else subtype)

    def _open(self, where: Path, subtype: str) -> sf.SoundFile:
        try:
            return sound_file(where, "w", self.sample_rate, 1, subtype=subtype, format="WAV")
        except (sf.LibsndfileError, RuntimeError, OSError) as exc:
            if where is not self._target:
                Path(where).unlink(missing_ok=True)
            raise self._failed(where, exc) from exc

    def _failed(self, where: Path, exc: Exception) -> InputError:
        """The error of a failed open or write.  libsndfile reports any failure of the operating
        system as "System error."; appending one byte to ``where`` (the hidden file, removed
        after, or a device written in place) with Python's own file finds its errno."""
        if isinstance(exc, OSError):
            return cannot_write(self.path, exc, self.option)
        try:
            with open(where, "ab") as probe:
                probe.write(b"\0")
        except OSError as found:
            return cannot_write(self.path, found, self.option)
        return InputError.of(Problem.said(f"cannot write {self.path}{f' ({self.option})' if self.option else ''}: {exc}; "
                                          "choose a writable path"))

    def write(self, samples: np.ndarray) -> None:
        """Append float32 [n] mono samples (nominally in [-1, 1]; a [n, 1] array is taken too).

        Raises:
            InputError: several channels (:func:`mono`), non-finite samples, or a failed write
                (the hidden file is removed).
        """
        samples = mono(samples, "WavFileWriter")
        if self._file is None:
            raise InputError.of(Problem.said(f"{self.path} is already finished or discarded; open a new WavFileWriter"))
        for block in _blocks(samples):
            if not np.isfinite(block).all():
                self.discard()
                raise InputError.of(Problem.said("refusing to write audio with NaN/inf samples"))
            if block.size:
                self.peak = max(self.peak, float(np.abs(block).max()))
            try:
                self._file.write(block if self._scale is None else block * self._scale)
            except (sf.LibsndfileError, RuntimeError, OSError) as exc:
                error = self._failed(self._partial or self._target, exc)
                self.discard()
                raise error from exc
            self.samples_written += len(block)

    def finish(self) -> WavWritten:
        """Complete the file (its header's sizes), convert deferred 16-bit audio (scaled to a
        0.999 peak when it went beyond [-1, 1]) and rename it over the output.

        Raises:
            InputError: a failed write (a full disk); nothing is left behind.
        """
        if self._file is None:
            raise InputError.of(Problem.said(f"{self.path} is already finished or discarded; open a new WavFileWriter"))
        scaled = self._scale is not None
        try:
            self._file.close()
            self._file = None
            if self._deferred:
                scaled = self.subtype == "PCM_16" and self.peak > 1.0
                self._convert(PCM16_PEAK / self.peak if scaled else None)
            if self._partial is not None:
                os.replace(self._partial, self._target)
                self._partial = None
        except (sf.LibsndfileError, RuntimeError, OSError) as exc:
            error = self._failed(self._partial or self._target, exc)
            self.discard()
            raise error from exc
        except BaseException:
            self.discard()
            raise
        return WavWritten(self.path, self.peak, scaled)

    def _convert(self, scale: float | None) -> None:
        """Rewrite the float32 hidden file as 16-bit PCM, block by block (a second hidden file),
        or into a device or pipe written in place (then in its subtype, its header first)."""
        floats = self._partial
        if self._in_place:
            self._partial = None
            try:
                with sound_file(floats) as source, open(self._target, "wb") as out:
                    out.write(streaming_wav_header(self.sample_rate, self.subtype, source.frames))
                    for block in source.blocks(WRITE_BLOCK_SAMPLES, dtype="float32"):
                        out.write(pcm_samples(block if scale is None else block * scale, self.subtype).tobytes())
            finally:
                floats.unlink(missing_ok=True)
            return
        pcm = floats.with_name(floats.name + ".pcm")
        self._partial = pcm
        try:
            with sound_file(floats) as source, sound_file(pcm, "w", self.sample_rate, 1, subtype="PCM_16",
                                                              format="WAV") as out:
                for block in source.blocks(WRITE_BLOCK_SAMPLES, dtype="float32"):
                    out.write(block if scale is None else block * scale)
        finally:
            floats.unlink(missing_ok=True)

    def discard(self) -> None:
        """Stop and remove the hidden file; the output is left as it was (idempotent).  A device
        written in place keeps what was written."""
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None
        if self._partial is not None:
            self._partial.unlink(missing_ok=True)
            self._partial = None

    def __enter__(self) -> WavFileWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        """Leaving by an exception (Ctrl-C too) discards the file; leaving normally finishes it
        when :meth:`finish` was not called in the block (it left a hidden partial file behind
        and no output before: a new user's finding).

        Raises:
            InputError: as :meth:`finish`.
        """
        if kind is not None:
            self.discard()
        elif self._file is not None:
            self.finish()


def mono(samples: np.ndarray, who: str) -> np.ndarray:
    """``samples`` as float32 [n] (a view where it can be): mono audio, [n] or [n, 1] or [1, n].

    Raises:
        InputError: samples that are not floats (int16 PCM), more than one channel, or more than
            two axes (``who`` names the writer).
    """
    kind = np.asarray(samples).dtype
    if kind.kind != "f":  # int16 PCM read as floats would be scaled from a peak of thousands
        raise InputError.of(Problem.said(f"{who} writes float samples, nominally in [-1, 1]; got {kind} samples: convert them "
                                         "first (int16 PCM: samples / 32768)"))
    shape = np.shape(samples)
    if len(shape) > 2 or (len(shape) == 2 and min(shape) != 1):
        raise InputError.of(Problem.said(f"{who} writes mono audio, float32 [samples]; got an array of shape {list(shape)}: "
                                         "mix the channels down first (samples.mean(axis=1))"))
    return np.asarray(samples, dtype=np.float32).reshape(-1)


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int, *, subtype: str = "PCM_16") -> WavWritten:
    """Write mono audio without silent wrapping or clipping.

    16-bit PCM cannot hold samples beyond [-1, 1]: such audio is scaled down to a 0.999 peak
    and the result says so (``scaled``); ``subtype="FLOAT"`` keeps it as is.  Written by a
    :class:`WavFileWriter` in blocks (no whole copy of the audio is made: a scaled or converted
    block at a time) to a hidden file renamed over ``path`` when complete.

    Args:
        path: output ``.wav`` path (parent directories must exist).
        samples: float32 [samples] (mono; a [samples, 1] or [1, samples] array is taken too).
        sample_rate: Hz, a whole number > 0.
        subtype: ``"PCM_16"`` or ``"FLOAT"``.

    Raises:
        InputError: bad subtype, several channels, a bad sample rate, non-finite samples, or an
            unwritable path (a full disk said as such).
    """
    if subtype not in ("PCM_16", "FLOAT"):
        raise InputError.of(Problem.said(f"unknown wav format {subtype!r}; use PCM_16 (16-bit) or FLOAT", code="unknown_value"))
    samples = mono(samples, "write_wav")  # a view of float32 audio, not a copy
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise InputError.of(Problem.said(f"sample_rate must be a whole number of Hz > 0, got {sample_rate!r}"))
    peak = 0.0
    for block in _blocks(samples):
        if not np.isfinite(block).all():
            raise InputError.of(Problem.said("refusing to write audio with NaN/inf samples"))
        if block.size:
            peak = max(peak, float(np.abs(block).max()))
    with WavFileWriter(path, sample_rate, subtype=subtype, peak=peak) as writer:
        writer.write(samples)
        return writer.finish()


class AudioSink:
    """Writes mono float32 audio piece by piece: to a ``.wav`` file, or to a binary stream.

    A file is written with soundfile and flushed after every piece; :meth:`close`
    finalises its header (also after an interruption, so the file is a valid WAV of
    what was written).  A stream (stdout, a pipe) gets a WAV header of unknown length
    (:func:`streaming_wav_header`) then the samples, or with ``container="raw"`` the
    bare little-endian samples.  16-bit output clips samples beyond [-1, 1] (a stream
    cannot be rescaled afterwards; :attr:`clipped` counts them).

    Args:
        target: output path (``.wav``), or a binary file object.
        sample_rate: Hz.
        subtype: ``"PCM_16"`` or ``"FLOAT"``.
        container: ``"wav"`` or ``"raw"`` (streams only).

    Attributes:
        samples_written: samples written so far.
        clipped: 16-bit samples clipped so far.

    Raises:
        InputError: unknown subtype/container, raw to a path, or an unwritable path.
    """

    def __init__(self, target: str | Path | BinaryIO, sample_rate: int, *, subtype: str = "PCM_16",
                 container: str = "wav"):
        if subtype not in STREAM_SUBTYPES:
            raise InputError.of(Problem.said(f"unknown sample format {subtype!r}; use PCM_16 (16-bit) or FLOAT", code="unknown_value"))
        if container not in ("wav", "raw"):
            raise InputError.of(Problem.said(f"unknown output format {container!r}; use wav or raw (--format)", code="unknown_value"))
        self.sample_rate, self.subtype = sample_rate, subtype
        self.samples_written = self.clipped = 0
        self._dtype = STREAM_SUBTYPES[subtype][0]
        self._file: sf.SoundFile | None = None
        self._stream: BinaryIO | None = None
        self._owned: BinaryIO | None = None
        if isinstance(target, (str, Path)) and written_in_place(target):
            target = self._owned = open(target, "wb")  # noqa: SIM115 (closed by close()): a device or a named pipe, written as a stream
        if isinstance(target, (str, Path)):
            if container != "wav":
                raise InputError.of(Problem.said("raw PCM goes to stdout (-o -); a file output is a .wav"))
            try:
                self._file = sound_file(target, "w", sample_rate, 1, subtype=subtype, format="WAV")
            except (sf.LibsndfileError, RuntimeError, OSError) as exc:
                check_writable(target)  # names the cause libsndfile calls "System error."
                raise InputError.of(Problem.said(f"cannot write {target}: {exc}; choose a writable path")) from exc
        else:
            self._stream = target
            if container == "wav":
                target.write(streaming_wav_header(sample_rate, subtype))
                target.flush()

    def write(self, samples: np.ndarray) -> None:
        """Append float32 [n] samples (nominally in [-1, 1]) and flush them out.

        Raises:
            InputError: non-finite samples.
            BrokenPipeError: the reader of a stream went away.
        """
        samples = mono(samples, type(self).__name__)
        if not np.isfinite(samples).all():
            raise InputError.of(Problem.said("refusing to write audio with NaN/inf samples"))
        if self.subtype == "PCM_16":
            over = np.abs(samples) > 1.0
            if over.any():
                self.clipped += int(over.sum())
                samples = np.clip(samples, -1.0, 1.0)
        if self._file is not None:
            self._file.write(samples)
            self.samples_written = self._file.frames  # what is in the file, even if a signal stops us here
            self._file.flush()
        elif self._stream is not None:
            # In pieces of at most a pipe's capacity, each flushed: one large write that the
            # kernel cuts short when the reader leaves is reported by Python as done, with
            # no BrokenPipeError; the next piece's write raises it.
            step = PIPE_PIECE_BYTES // np.dtype(self._dtype).itemsize
            for start in range(0, len(samples), step):
                data = pcm_samples(samples[start:start + step], self.subtype)
                self._stream.write(data.tobytes())
                self._stream.flush()
                self.samples_written += len(data)

    def close(self) -> None:
        """Finalise a file's header: libsndfile sets its RIFF and data sizes to the samples
        written (idempotent; until then they say 0).  A stream is left open for its owner; a device
        or named pipe opened by path is closed."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __enter__(self) -> AudioSink:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
