"""The codec at the loop's two ends: a reference voice encoded into codes (and codes checked to be
one), codes decoded into a waveform, and the frames of context each side a window needs for a
chunked decode to equal one pass (:func:`codec_context_frames`, measured with
:mod:`~higgs_pack.runtime.loop.chunking` for bundles that did not record it).
"""

from __future__ import annotations

import numpy as np

from higgs_pack.errors import InputError, Problem
from higgs_pack.runtime.loop.chunking import NotLocalError, measure_codec_context
from higgs_pack.runtime.loop.decode import check_finite
from higgs_pack.runtime.loop.pipeline import Pipeline


def decode_codes(pipeline: Pipeline, codes: np.ndarray) -> np.ndarray:
    """Codec-decode codes to a waveform.

    Args:
        codes: int64 [frames T, N], values 0..1023.

    Returns:
        float32 [T * hop_length] samples at ``sample_rate`` Hz (empty if T == 0).
    """
    if codes.shape[0] == 0:
        return np.zeros(0, dtype=np.float32)
    out = pipeline.audio_tokenizer.run({"audio_codes": codes.T[None].astype(np.int64)})["waveform"]
    return check_finite("audio_tokenizer", out, pipeline).reshape(-1).astype(np.float32)


def encode_reference(pipeline: Pipeline, samples: np.ndarray) -> np.ndarray:
    """Codec-encode a reference voice.

    Args:
        samples: float32 [samples] mono at the codec's sample rate, length a
            multiple of ``hop_length`` (see :func:`higgs_pack.runtime.audio.prepare_reference`).

    Returns:
        int64 [frames, N] codes.
    """
    if pipeline.audio_encoder is None:
        raise InputError.of(Problem.said("this bundle has no audio_encoder, so it cannot clone a voice"))
    out = pipeline.audio_encoder.run({"waveform": samples.reshape(1, 1, -1).astype(np.float32)})
    return out["audio_codes"][0].T.astype(np.int64)


def check_voice_codes(pipeline: Pipeline, codes: np.ndarray) -> None:
    """Refuse codes that are not a voice this bundle's codec encoded: int [frames >= 1, N]
    with values in ``0 .. codebook_size - 1``.

    Raises:
        InputError: the shape, dtype or a value, each named, with what is allowed.
    """
    c = pipeline.constants
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[0] < 1 or codes.shape[1] != c.num_codebooks:
        raise InputError.of(Problem.said(f"voice codes must be [frames >= 1, {c.num_codebooks}] (one column per codebook), got "
                         f"shape {list(codes.shape)}; prepare the voice with this bundle (tts.prepare_voice)"))
    if not np.issubdtype(codes.dtype, np.integer):
        raise InputError.of(Problem.said(f"voice codes must be integers, got {codes.dtype}; prepare the voice with tts.prepare_voice"))
    low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= c.codebook_size:
        raise InputError.of(Problem.said(f"voice codes must lie in 0..{c.codebook_size - 1}, got {low}..{high}; prepare the "
                         "voice with this bundle's codec (tts.prepare_voice)"))


def codec_context_frames(pipeline: Pipeline) -> int:
    """Frames of codes each side of a window for chunked codec decoding to equal one pass.

    The bundle's recorded value (``Pipeline.codec_context_frames``); for bundles built
    before it was recorded (and the oracle) it is measured once on the pipeline's own
    codec decoder with :func:`higgs_pack.runtime.loop.chunking.measure_codec_context` and
    kept on the pipeline.  Streaming (:mod:`~higgs_pack.runtime.loop.streaming`) and the join
    of text chunks (:func:`~higgs_pack.runtime.loop.synthesis.join_results`) read it.

    Raises:
        InputError: the codec mixes the whole sequence (no chunked decode can match).
    """
    if pipeline.codec_context_frames is None:
        c = pipeline.constants

        def run(codes: np.ndarray) -> np.ndarray:
            return pipeline.audio_tokenizer.run({"audio_codes": codes})["waveform"]

        try:
            pipeline.codec_context_frames = measure_codec_context(run, c.num_codebooks, c.codebook_size,
                                                                  atol=CONTEXT_ATOL)
        except NotLocalError as exc:
            raise InputError.of(Problem.said(f"this bundle's codec cannot be decoded in chunks ({exc}); use synthesize on "
                             "a text short enough for one chunk, not streaming")) from exc
    return pipeline.codec_context_frames


#: Output changes below this (float32 samples in [-1, 1]) do not count when measuring an
#: exported codec's reach: kernels may round differently across a tile.
CONTEXT_ATOL = 1e-6
