"""The Higgs-Audio-v3 text-to-speech loop, in numpy, for every backend.

One loop serves every target and the PyTorch oracle: it only talks to a
:class:`~higgs_pack.runtime.loop.pipeline.Pipeline`.  Prompt formats, the delay
pattern and the stop rules follow MODEL.md ("Special tokens and prompts",
"Generation loop").

Streaming (the same loop, its codes decoded as they arrive) is in
:mod:`higgs_pack.runtime.loop.streaming`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from higgs_pack.manifests.errors import InputError, NumericalError, Problem, literal
from higgs_pack.runtime.loop.chunking import NotLocalError, context_window, measure_codec_context
from higgs_pack.runtime.loop.delay import (
    SamplingOptions,
    apply_delay,
    bundle_sampling,
)
from higgs_pack.runtime.loop.frames import CodeSteps
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.prefix_cache import Prompt, prefill_prompt, voice_prompt
from higgs_pack.runtime.loop.sentences import split_sentences
from higgs_pack.runtime.loop.words import Word, proportional_bounds, word_timings
from higgs_pack.runtime.request import (
    CONTEXT_CHUNKS,
    PreparedVoice,
    StreamSchedule,
    SynthesisRequest,
    Voice,
    refuse,
    text_problems,
    voice_pair_problems,
)

#: Frame cap per text token and its floor, when the caller gives no ``max_frames``.
#: 10 frames (0.4 s at 25 fps) per token is well above normal speech
#: (about 0.2-0.3 s per English BPE token), so the cap only stops runaway output.
FRAMES_PER_TEXT_TOKEN = 10.0
MIN_MAX_FRAMES = 50

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(frames_done, frame_cap)`` after every generated frame."""


@dataclass
class GenerationResult:
    """Codes generated for one prompt.

    Attributes:
        delayed: int64 [steps, N] as sampled (delay pattern applied).
        codes: int64 [frames, N] after undoing the delay, values 0..1023.
        stop_reason: ``"eoc"``, ``"repeat_guard"`` or ``"max_frames"``.
        prompt_length: prompt positions fed to the decoder.
        first_frame_s: seconds from the start until the first frame was sampled.
        seconds: seconds spent in the loop (prefill included, codec excluded).
        decoder_seconds: of which inside ``decoder.forward``.
        prefilled: prompt positions the decoder computed (``prompt_length`` less a voice prefix
            restored from the prefix cache); -1 where not recorded.
        prefill_s: seconds of the prompt's prefill (a cached prefix's restore included); NaN
            where not recorded.
    """

    delayed: np.ndarray
    codes: np.ndarray
    stop_reason: str
    prompt_length: int
    first_frame_s: float
    seconds: float
    decoder_seconds: float
    prefilled: int = -1
    prefill_s: float = math.nan


@dataclass(frozen=True)
class Segment:
    """Where one sentence (or, in a dialogue, one turn) is in the audio.

    Timings come from frame counts, not from an aligner: a text chunk's span is exact by
    construction (its first and last frame, 25 frames per second), and so is a segment that is a
    whole text chunk (a one-sentence chunk, a dialogue turn).  Sentences that share one chunk
    share one generation, whose frames say nothing of where one sentence ends: their inner
    boundaries are estimated by dividing the chunk's frames in proportion to the sentences'
    characters (whitespace not counted), to a whole frame, and marked ``exact=False``.  Its
    words' timings are estimated the same way within its span (:mod:`~higgs_pack.runtime.loop.words`).

    Attributes:
        text: the sentence (or turn) as spoken.
        start: seconds from the start of the audio to its first sample.
        end: seconds to just after its last sample (``end >= start``; equal for a chunk that
            produced no frame).
        chunk: index of the text chunk it was generated in (:attr:`SynthesisPlan.chunks`; a
            dialogue turn longer than one chunk: its first chunk).
        exact: both ends are frame-exact (the segment is a whole chunk or turn); False: one or
            both ends are the estimate above.
        speaker: the speaker of a dialogue turn; None outside a dialogue.
        words: its :class:`~higgs_pack.runtime.loop.words.Word` items, in order, within
            ``[start, end]`` (estimates: :func:`~higgs_pack.runtime.loop.words.word_timings`; a
            turn of several chunks: each chunk's words within that chunk's exact span).
    """

    text: str
    start: float
    end: float
    chunk: int
    exact: bool
    speaker: str | None = None
    words: tuple[Word, ...] = ()


@dataclass
class SynthesisResult:
    """Speech for one text.

    Attributes:
        samples: float32 [samples], mono, nominally in [-1, 1].
        sample_rate: Hz (24000 for Higgs-Audio-v3).
        codes: int64 [frames, N], all chunks joined.
        chunks: per-chunk :class:`GenerationResult` (one unless the text was split).
        segments: one :class:`Segment` per sentence (per turn in a dialogue), in order (empty
            when the result was joined without its plan).
        words: every segment's :attr:`Segment.words`, in order (estimated word timings).
        frame_cap_hit: True when some chunk stopped at its frame cap, not at EOC.
    """

    samples: np.ndarray
    sample_rate: int
    codes: np.ndarray
    chunks: list[GenerationResult] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    @property
    def words(self) -> list[Word]:
        return [word for segment in self.segments for word in segment.words]

    @property
    def frame_cap_hit(self) -> bool:
        return any(c.stop_reason == "max_frames" for c in self.chunks)

    @property
    def seconds_of_audio(self) -> float:
        return len(self.samples) / self.sample_rate


def _check_finite(name: str, array: np.ndarray, pipeline: Pipeline) -> np.ndarray:
    if not np.isfinite(array).all():
        raise NumericalError(
            f"{name} returned non-finite values (NaN/inf) on {pipeline.description.get(name, 'its backend')}; "
            "the export or the execution provider is broken for this input: run `higgs-pack verify` "
            "on the bundle, or try another --execution-provider / --device"
        )
    return array


def check_text_tokens(pipeline: Pipeline, text: str, field: str = "text") -> list[int]:
    """Tokenize ``text`` and refuse it if it holds a special token of the tokenizer.

    The prompt's control tokens (``<|tts|>``, ``<|text|>``, ``<|audio|>``, …) and every
    other added token the tokenizer marks special (``<|endoftext|>``, ``<|im_start|>``,
    reserved ids) would reach the model as those ids, not as text.  Added tokens not
    marked special (Qwen3's ``<tool_call>``) are ordinary vocabulary and pass.

    Args:
        pipeline: the backend (its tokenizer and special-token ids).
        text: text to speak, or a reference transcript.
        field: the request field ``text`` came from (``"text"``, ``"ref_text"``), for the
            :class:`~higgs_pack.manifests.errors.Problem` of the error (each front door names
            the field in its own terms).

    Returns:
        The token ids of ``text`` (no special tokens added).

    Raises:
        InputError: names the field and the special tokens found.
    """
    ids, problems = _special_tokens(pipeline, text, field)
    refuse(problems)
    return ids


def _special_tokens(pipeline: Pipeline, text: str, field: str) -> tuple[list[int], list[Problem]]:
    """``text``'s token ids and the problem of its special tokens (``[]`` when it has none)."""
    tok = pipeline.tokenizer
    prompt = set(pipeline.constants.special_tokens.values())
    special = {i for i, added in tok.get_added_tokens_decoder().items() if added.special} | prompt
    out = tok.encode(text, add_special_tokens=False).ids
    found = [i for i in dict.fromkeys(out) if i in special]
    if not found:
        return out, []
    names = ", ".join(tok.id_to_token(i) for i in found)
    if all(i in prompt for i in found):
        why = f"the prompt control token(s) {names}, which the model reserves for its prompt format"
    else:
        why = f"the tokenizer's special token(s) {names}, which would reach the model as control ids, not words"
    message = literal(f"{why}; remove them (inline controls such as <|emotion:amusement|> are read as text "
                      "unless the tokenizer has them)")
    return out, [Problem(field, None, message="{name} contains " + message)]


def build_prompt(
    pipeline: Pipeline,
    text: str,
    ref_codes: np.ndarray | None = None,
    ref_text: str | None = None,
) -> np.ndarray:
    """Embed the prompt (:func:`prompt_of`'s ``embeds``)."""
    return prompt_of(pipeline, text, ref_codes, ref_text).embeds


def prompt_of(
    pipeline: Pipeline,
    text: str,
    ref_codes: np.ndarray | None = None,
    ref_text: str | None = None,
    *,
    voice_prefix: bool = True,
    context: Sequence[tuple[np.ndarray, str]] = (),
) -> Prompt:
    """Embed the prompt (MODEL.md "Special tokens and prompts"), saying where its voice prefix ends.

    Zero-shot: ``<|tts|> <|text|> tok(text) <|audio|>``.  Voice clone:
    ``<|tts|> <|ref_text|> tok(ref_text) <|ref_audio|> [delay-patterned reference
    codes] <|text|> tok(text) <|audio|>``.  A rolling context (:func:`chunk_context`) adds one more
    ``<|ref_text|> tok(chunk text) <|ref_audio|> [its delay-patterned codes]`` pair per earlier
    chunk after the voice's and before ``<|text|>``, as Higgs' own long-form generator gives the
    reference and each buffered chunk one (text, audio) pair of its own
    (../shared/SPEECH-AT-LENGTH.md): the voice's pair stays the prompt's first positions, so its
    cached KV serves every chunk.

    Args:
        pipeline: the backend.
        text: the text to speak (already validated non-empty).
        ref_codes: int64 [frames, N] codec codes of the reference voice, or None.
        ref_text: transcript of the reference audio (required with ``ref_codes``).
        voice_prefix: whether the voice's pair is a voice of its own (so its KV may be cached,
            :mod:`~higgs_pack.runtime.loop.prefix_cache`); False: never cache it.
        context: earlier chunks' ``(codes int64 [frames >= 1, N], text)``, oldest first (needs
            ``ref_codes``: with no voice of its own a rolling context's first chunk is the voice).

    Returns:
        A :class:`~higgs_pack.runtime.loop.prefix_cache.Prompt`: float32 [1, positions, H]
        ``inputs_embeds`` and, for a voice clone, its prefix's length and digests.
    """
    sp = pipeline.constants.special_tokens

    def ids(s: str) -> list[int]:
        return check_text_tokens(pipeline, s)

    def embed_ids(seq: list[int]) -> np.ndarray:
        arr = np.asarray([seq], dtype=np.int64)
        return _check_finite("text_embed", pipeline.text_embed.run({"input_ids": arr})["inputs_embeds"], pipeline)

    c = pipeline.constants

    def embed_codes(codes: np.ndarray) -> np.ndarray:
        delayed = apply_delay(codes, c.boc, c.eoc)[None]
        return _check_finite("audio_embed", pipeline.audio_embed.run({"codes": delayed})["audio_embeds"], pipeline)

    pieces: list[np.ndarray] = []
    if ref_codes is not None:
        refuse(voice_pair_problems(ref_codes, ref_text))
        prefix_ids = [sp["tts"], sp["ref_text"], *ids(ref_text), sp["ref_audio"]]
        prefix = np.concatenate([embed_ids(prefix_ids).astype(np.float32),
                                 embed_codes(ref_codes).astype(np.float32)], axis=1)
        pieces = [prefix]
        for codes, words in context:
            pieces += [embed_ids([sp["ref_text"], *ids(words), sp["ref_audio"]]), embed_codes(codes)]
        pieces.append(embed_ids([sp["text"], *ids(text), sp["audio"]]))
        embeds = np.concatenate([p.astype(np.float32, copy=False) for p in pieces], axis=1)
        if voice_prefix:
            return voice_prompt(embeds, prefix_ids, prefix, ref_codes, ref_text)
        return Prompt(embeds)
    if context:
        raise ValueError("a rolling context needs a voice (ref_codes) before it")
    pieces.append(embed_ids([sp["tts"], sp["text"], *ids(text), sp["audio"]]))
    return Prompt(np.concatenate([p.astype(np.float32) for p in pieces], axis=1))


def check_context(prompt_len: int, max_steps: int, max_length: int) -> None:
    """Refuse a chunk whose prompt positions plus audio steps exceed ``max_length``.

    Raises:
        InputError: naming the three numbers and what to shorten.
    """
    if prompt_len + max_steps > max_length:
        raise InputError(
            f"prompt of {prompt_len} positions + up to {max_steps} audio steps exceeds the "
            f"decoder's context of {max_length} positions; shorten the text "
            "or the reference audio, or lower --max-frames"
        )


def generate_codes(
    pipeline: Pipeline,
    prompt_embeds: np.ndarray | Prompt,
    options: SamplingOptions,
    max_frames: int,
    progress: ProgressCallback | None = None,
) -> GenerationResult:
    """Run the decoder loop to its end (:func:`generate_steps`) and return its result.

    Args and raises: as :func:`generate_steps`.
    """
    steps = generate_steps(pipeline, prompt_embeds, options, max_frames, progress)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def generate_steps(
    pipeline: Pipeline,
    prompt_embeds: np.ndarray | Prompt,
    options: SamplingOptions,
    max_frames: int,
    progress: ProgressCallback | None = None,
) -> Generator[np.ndarray, None, GenerationResult]:
    """Run the decoder loop with audio feedback until EOC, the repeat guard or the cap.

    Per step (MODEL.md "Generation loop"): audio_heads on the last hidden state
    -> logits [N, 1026]; sample each codebook; during the first N steps codebooks
    above the step are forced to BOC; after codebook 0 emits EOC (or the repeat
    guard fires) codebook ``c`` is forced to EOC from ``c`` steps later and the
    loop stops when all are EOC; the N codes go through audio_embed as the next
    decoder input.

    Args:
        pipeline: the backend; its decoder is reset first.
        prompt_embeds: float32 [1, P, H], or a :class:`~higgs_pack.runtime.loop.prefix_cache.Prompt`
            (:func:`prompt_of`), whose voice prefix comes from ``pipeline.prefix_cache`` when it
            holds it (:func:`~higgs_pack.runtime.loop.prefix_cache.prefill_prompt`).
        options: sampling options (checked when they were made).
        max_frames: frame cap (steps = max_frames + N - 1 at most).
        progress: optional callback, see :data:`ProgressCallback`.

    Yields:
        int64 [N]: each step's codes as sampled (delay pattern applied), as soon as
        they are drawn (streaming reads frames from them).

    Returns:
        A :class:`GenerationResult` (the generator's return value).

    Raises:
        InputError: prompt + cap exceed the decoder's context length.
        NumericalError: a sub-part returned NaN/inf or an all-zero hidden state.
    """
    # Over 80 lines with its docstring on purpose: the body is the per-frame hot loop, kept in one
    # frame so a step makes no call beyond the sub-parts and the sampler.
    c = pipeline.constants
    n, vocab, h = c.num_codebooks, c.audio_vocab_size, c.hidden_size
    prompt = prompt_embeds if isinstance(prompt_embeds, Prompt) else Prompt(prompt_embeds)
    prompt_len = prompt.length
    max_steps = max_frames + n - 1
    check_context(prompt_len, max_steps, pipeline.decoder.max_length)
    # Everything a step touches is made here, once per request (issue 9: no per-step
    # allocation): the code rules' sampler and codes, the sub-parts' feeds and the
    # finiteness flags.
    rules = CodeSteps(c, options, max_frames)
    last = np.empty((1, 1, h), dtype=np.float32)
    step_codes = np.empty((1, 1, n), dtype=np.int64)
    heads_feed, embed_feed = {"hidden_states": last}, {"codes": step_codes}
    checks = _FiniteChecks(pipeline, {"hidden": (1, 1, h), "logits": (n, vocab)})

    start = time.perf_counter()
    decoder_s = 0.0
    first_frame_s = math.nan
    t0 = time.perf_counter()
    hidden, restored = prefill_prompt(pipeline.decoder, prompt, pipeline.prefix_cache)
    prefill_s = time.perf_counter() - t0
    decoder_s += prefill_s
    for step in range(max_steps):
        np.copyto(last, hidden[:, -1:])
        checks.hidden(last, step)
        # A view of the heads' buffer (valid until their next run): read before that.
        logits = pipeline.audio_heads.run(heads_feed)["audio_logits"][0, -1].reshape(n, vocab)
        checks.finite("audio_heads", logits, "logits")
        codes = rules.draw(logits)
        if step == 0:
            first_frame_s = time.perf_counter() - start
        if progress is not None:
            progress(step + 1, max_steps)
        yield codes
        if rules.done:
            break
        np.copyto(step_codes[0, 0], codes)
        embeds = pipeline.audio_embed.run(embed_feed)["audio_embeds"]
        checks.finite("audio_embed", embeds, None)
        t0 = time.perf_counter()
        hidden = pipeline.decoder.forward(embeds)
        decoder_s += time.perf_counter() - t0
    delayed = rules.delayed
    return GenerationResult(
        delayed=delayed,
        codes=rules.codes(delayed),
        stop_reason=rules.stop_reason,
        prompt_length=prompt_len,
        first_frame_s=first_frame_s,
        seconds=time.perf_counter() - start,
        decoder_seconds=decoder_s,
        prefilled=prompt_len - restored,
        prefill_s=prefill_s,
    )


class _FiniteChecks:
    """The loop's per-step checks for NaN/inf and all-zero outputs, on flag buffers made once.

    Args:
        pipeline: for the error message.
        shapes: buffer name -> shape of the arrays checked with it.
    """

    def __init__(self, pipeline: Pipeline, shapes: dict[str, tuple[int, ...]]):
        self._pipeline = pipeline
        self._flags = {name: np.empty(shape, dtype=bool) for name, shape in shapes.items()}

    def finite(self, name: str, array: np.ndarray, buffer: str | None) -> None:
        """Raise :class:`NumericalError` naming sub-part ``name`` if ``array`` holds NaN/inf
        (``buffer``: the flags of its shape; None: an other shape, checked with a new array)."""
        flags = self._flags.get(buffer) if buffer is not None else None
        ok = np.isfinite(array, out=flags).all() if flags is not None and flags.shape == array.shape \
            else np.isfinite(array).all()
        if not ok:
            _check_finite(name, array, self._pipeline)

    def any_nonzero(self, array: np.ndarray, buffer: str) -> bool:
        """Whether ``array`` (the shape of ``buffer``) has a non-zero element."""
        return bool(np.not_equal(array, 0, out=self._flags[buffer]).any())

    def hidden(self, last: np.ndarray, step: int) -> None:
        """Check a step's last decoder hidden state (the ``"hidden"`` buffer's shape).

        Raises:
            NumericalError: NaN/inf or all zeros (naming the step and the backend).
        """
        self.finite("llm_decoder", last, "hidden")
        if not self.any_nonzero(last, "hidden"):
            raise NumericalError(
                f"llm_decoder returned an all-zero hidden state at step {step} on "
                f"{self._pipeline.description.get('llm_decoder', 'its backend')}; run `higgs-pack verify`"
            )


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
    return _check_finite("audio_tokenizer", out, pipeline).reshape(-1).astype(np.float32)


def encode_reference(pipeline: Pipeline, samples: np.ndarray) -> np.ndarray:
    """Codec-encode a reference voice.

    Args:
        samples: float32 [samples] mono at the codec's sample rate, length a
            multiple of ``hop_length`` (see :func:`higgs_pack.runtime.audio.prepare_reference`).

    Returns:
        int64 [frames, N] codes.
    """
    if pipeline.audio_encoder is None:
        raise InputError("this bundle has no audio_encoder, so it cannot clone a voice")
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
        raise InputError(f"voice codes must be [frames >= 1, {c.num_codebooks}] (one column per codebook), got "
                         f"shape {list(codes.shape)}; prepare the voice with this bundle (tts.prepare_voice)")
    if not np.issubdtype(codes.dtype, np.integer):
        raise InputError(f"voice codes must be integers, got {codes.dtype}; prepare the voice with tts.prepare_voice")
    low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= c.codebook_size:
        raise InputError(f"voice codes must lie in 0..{c.codebook_size - 1}, got {low}..{high}; prepare the "
                         "voice with this bundle's codec (tts.prepare_voice)")


def frame_cap(n_text_tokens: int, frames_per_token: float = FRAMES_PER_TEXT_TOKEN,
              minimum: int = MIN_MAX_FRAMES) -> int:
    """Default frame cap for a text of ``n_text_tokens`` BPE tokens (frames at 25 fps)."""
    return max(minimum, math.ceil(frames_per_token * n_text_tokens))


def synthesize(
    pipeline: Pipeline,
    text: str,
    *,
    ref_samples: np.ndarray | None = None,
    ref_text: str | None = None,
    options: SamplingOptions | None = None,
    max_frames: int | None = None,
    progress: ProgressCallback | None = None,
    ref_codes: np.ndarray | None = None,
) -> SynthesisResult:
    """Speak ``text`` (optionally in the voice of a reference clip).

    Text whose prompt plus frame cap does not fit the decoder's context is split
    into sentences, each spoken with the same options and joined.

    Args:
        pipeline: a loaded bundle (``higgs_pack.runtime.sources.bundle.load_pipeline``) or the oracle.
        text: what to say; inline controls like ``<|emotion:amusement|>`` pass as text.
        ref_samples: float32 [samples] mono at ``sample_rate`` Hz, a multiple of
            ``hop_length`` long (see ``audio.prepare_reference``), or None.
        ref_text: transcript of ``ref_samples``.
        options: sampling options (default: manifest defaults, else temperature 0.8, top-k 50).
        max_frames: frame cap per chunk; default derived from the text length
            (:func:`frame_cap`).
        progress: per-frame callback.
        ref_codes: int64 [frames, N] codes of a voice encoded before
            (:meth:`higgs_pack.runtime.api.TTS.prepare_voice`), instead of ``ref_samples``;
            needs ``ref_text``.

    Returns:
        A :class:`SynthesisResult` (float32 samples at 24000 Hz).

    Raises:
        InputError: empty/whitespace text, a special token of the tokenizer in the text or
            the transcript (:func:`check_text_tokens`), ``ref_samples`` without ``ref_text``
            (or the reverse), or one sentence too long.
        NumericalError: non-finite or all-zero sub-part output.
    """
    plan = plan_synthesis(pipeline, text, options=options, ref_samples=ref_samples, ref_codes=ref_codes,
                          ref_text=ref_text, max_frames=max_frames)
    return run_plan(pipeline, plan, progress)


def join_results(pipeline: Pipeline, results: list[GenerationResult],
                 decode: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None,
                 plan: SynthesisPlan | None = None) -> SynthesisResult:
    """Codec-decode the text chunks' codes as one continuous utterance: one :class:`SynthesisResult`.

    The chunks join as continuous speech, with no inserted silence: each chunk is decoded in a
    window holding :func:`codec_context_frames` frames of its neighbours' codes on each side
    (:func:`~higgs_pack.runtime.loop.chunking.context_window`), and only its own frames' samples
    are kept, so the joined samples equal one codec decode of all chunks' codes concatenated
    (within float rounding; tests/test_streaming.py holds it to 1e-4) while the codec never runs
    on more than one chunk and its context at once.  Pauses come from the speech itself (a
    sentence's end), never from the join.

    Args:
        pipeline: the backend.
        results: each text chunk's :class:`GenerationResult`, in order.
        decode: optional; decodes all windows (int64 codes [T, N] each) to their samples
            (float32 [T * hop] each) instead of :func:`decode_codes` one by one (the engine's
            batched codec thread, :class:`~higgs_pack.runtime.loop.codec_batch.CodecBatcher`).
        plan: the plan the results are of: gives the result its :attr:`SynthesisResult.segments`
            (:func:`chunk_segments`); None: no segments.

    Raises:
        InputError: the codec mixes the whole sequence (:func:`codec_context_frames`).
        NumericalError: the codec returned NaN/inf.
    """
    codes = np.concatenate([r.codes for r in results], axis=0) if results else np.zeros((0, 0), np.int64)
    hop = pipeline.constants.hop_length
    ends = np.cumsum([len(r.codes) for r in results]).tolist()
    spans = [(end - len(r.codes), end) for r, end in zip(results, ends, strict=True) if len(r.codes)]
    if len(spans) > 1:
        context = codec_context_frames(pipeline)
        windows = [context_window(start, end, len(codes), context) for start, end in spans]
    else:
        windows = spans
    pieces = [codes[start:end] for start, end in windows]
    decoded = [decode_codes(pipeline, piece) for piece in pieces] if decode is None else decode(pieces)
    kept = [samples[(start - w_start) * hop:(end - w_start) * hop]
            for samples, (start, end), (w_start, _) in zip(decoded, spans, windows, strict=True)]
    samples = np.concatenate(kept).astype(np.float32, copy=False) if kept else np.zeros(0, np.float32)
    segments: list[Segment] = []
    if plan is not None:
        for index in range(len(results)):
            segments += chunk_segments(plan, index, ends, hop, pipeline.constants.sample_rate)
    return SynthesisResult(samples, pipeline.constants.sample_rate, codes, results, segments)


def chunk_segments(plan: SynthesisPlan, index: int, ends: list[int], hop: int, sample_rate: int) -> list[Segment]:
    """The :class:`Segment` items text chunk ``index`` of ``plan`` completes, once its frames are
    known: one per sentence (:func:`split_sentences` of the chunk's text), the chunk's ends exact and
    the boundaries between its sentences estimated by their characters (see :class:`Segment`); in a
    dialogue, the whole turn (exact) when ``index`` is its last chunk, else none.

    Args:
        plan: the request's plan.
        index: the text chunk.
        ends: the frame just after each text chunk ``0 .. index`` (at least) in the whole audio.
        hop: samples per frame (960).
        sample_rate: Hz (24000).
    """
    first_frame = ends[index - 1] if index else 0
    frames = ends[index] - first_frame
    seconds = hop / sample_rate  # of one frame
    if plan.cast is not None:
        turn = plan.cast.turns[index]
        if index + 1 < len(plan.chunks) and plan.cast.turns[index + 1] == turn:
            return []
        first = plan.cast.turns.index(turn)
        start = ends[first - 1] if first else 0
        words = tuple(word for j in range(first, index + 1)
                      for word in word_timings(plan.chunks[j][0], (ends[j - 1] if j else 0) * seconds, ends[j] * seconds))
        return [Segment(plan.cast.texts[turn], start * seconds, ends[index] * seconds, first,
                        True, plan.cast.names[plan.cast.speakers[index]], words)]
    sentences = split_sentences(plan.chunks[index][0]) or [plan.chunks[index][0]]
    bounds = [first_frame + round(b) for b in proportional_bounds([sum(not ch.isspace() for ch in s)
                                                                   for s in sentences], 0, frames)]
    return [Segment(sentence, bounds[i] * seconds, bounds[i + 1] * seconds, index, len(sentences) == 1,
                    words=word_timings(sentence, bounds[i] * seconds, bounds[i + 1] * seconds))
            for i, sentence in enumerate(sentences)]


def codec_context_frames(pipeline: Pipeline) -> int:
    """Frames of codes each side of a window for chunked codec decoding to equal one pass.

    The bundle's recorded value (``Pipeline.codec_context_frames``); for bundles built
    before it was recorded (and the oracle) it is measured once on the pipeline's own
    codec decoder with :func:`higgs_pack.runtime.loop.chunking.measure_codec_context` and
    kept on the pipeline.  Streaming (:mod:`~higgs_pack.runtime.loop.streaming`) and the join
    of text chunks (:func:`join_results`) read it.

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
            raise InputError(f"this bundle's codec cannot be decoded in chunks ({exc}); use synthesize on "
                             "a text short enough for one chunk, not streaming") from exc
    return pipeline.codec_context_frames


#: Output changes below this (float32 samples in [-1, 1]) do not count when measuring an
#: exported codec's reach: kernels may round differently across a tile.
CONTEXT_ATOL = 1e-6


#: Most words in one text chunk when a rolling context is kept (Higgs' ``chunk_max_word_num``, 200).
CHUNK_WORDS = 200


@dataclass(frozen=True, eq=False)
class SynthesisPlan:
    """One request resolved against one loaded bundle, once: what the loop runs.

    Made by :func:`plan_request`
    (every front door) or :func:`plan_synthesis` (pipeline-level callers); run by
    :func:`run_plan`, :func:`higgs_pack.runtime.loop.streaming.stream_plan` and the engine.

    Attributes:
        options: the sampling options (the bundle's defaults with the request's choices).
        ref_codes: int64 [frames, N] codes of the voice (its clip encoded by this bundle's
            codec, or a prepared voice's), or None for the bundle's own voice.
        ref_text: the voice's transcript, or None.
        chunks: ``(text, frame cap)`` per text chunk, in order (one unless the text does not
            fit the decoder's context).
        schedule: the chunk sizes a stream of this request yields.
        positions: most decoder positions one chunk holds (prompt, rolling context at its
            largest, and audio steps of its cap; at most ``max_length``): KV bytes are this times
            the decoder's bytes per position.
        context_chunks: previous text chunks whose text and codes follow the voice in a chunk's
            prompt (:func:`chunk_context`); 0: the voice alone.
        max_length: the decoder context the chunks were planned for (positions).
        max_prompt_length: the longest prompt the decoder takes, where it has a limit of its own
            (an NPU bundle's static prompt, ``generation.max_prompt_length``), else None.
        cast: the speakers of a dialogue, else None.
        context_frames: most frames of each context chunk kept in a prompt (its end, cut at a
            word, :func:`context_tail`); None: whole chunks.
        context: earlier speech before the first text chunk, ``(codes int64 [frames, N], text)``
            oldest first (a live session's previous sentences,
            :attr:`~higgs_pack.runtime.request.SynthesisRequest.context`): rolling context of the
            first chunks, as if they were chunks before chunk 0 (:func:`chunk_context`).
    """

    options: SamplingOptions
    ref_codes: np.ndarray | None
    ref_text: str | None
    chunks: tuple[tuple[str, int], ...]
    schedule: StreamSchedule
    positions: int
    context_chunks: int = CONTEXT_CHUNKS
    max_length: int = 0
    max_prompt_length: int | None = None
    cast: Cast | None = None
    context_frames: int | None = None
    context: tuple[tuple[np.ndarray, str], ...] = ()

    def speaker_of(self, index: int) -> int:
        """The speaker of text chunk ``index`` (an index into ``cast.names``; 0 outside a dialogue)."""
        return 0 if self.cast is None else self.cast.speakers[index]

    def voice_of(self, index: int) -> tuple[np.ndarray | None, str | None]:
        """The voice of text chunk ``index``'s speaker: ``(codes int64 [frames, N], transcript)``, or
        ``(None, None)`` when the speaker's first chunk is its voice (:func:`chunk_context`)."""
        return (self.ref_codes, self.ref_text) if self.cast is None else self.cast.voices[self.speaker_of(index)]


@dataclass(frozen=True, eq=False)
class Cast:
    """The speakers of a dialogue's :class:`SynthesisPlan` (made by
    :func:`higgs_pack.runtime.loop.dialogue.plan_dialogue`): each text chunk belongs to one turn,
    each turn to one speaker, each speaker has its own voice.

    Attributes:
        names: the speakers' names, in order of their first turn.
        voices: per speaker ``(codes int64 [frames, N], transcript)``, or ``(None, None)``: the
            speaker's first chunk becomes its voice.
        speakers: the speaker (index into ``names``) of each text chunk.
        turns: the turn (index into ``texts``) of each text chunk; a turn's chunks are consecutive.
        texts: each turn's text, as spoken.
    """

    names: tuple[str, ...]
    voices: tuple[tuple[np.ndarray | None, str | None], ...]
    speakers: tuple[int, ...]
    turns: tuple[int, ...]
    texts: tuple[str, ...]


def plan_synthesis(pipeline: Pipeline, text: str, *, options: SamplingOptions | None = None,
                   ref_samples: np.ndarray | None = None, ref_codes: np.ndarray | None = None,
                   ref_text: str | None = None, max_frames: int | None = None,
                   schedule: StreamSchedule | None = None, checked: bool = False,
                   context_chunks: int = CONTEXT_CHUNKS, context_frames: int | None = None,
                   context: Context = ()) -> SynthesisPlan:
    """Check what only the bundle can judge and plan the request: a :class:`SynthesisPlan`.

    Everything the loop can refuse is refused here, before a frame is generated or a byte
    written: the text (:func:`higgs_pack.runtime.request.text_problems`, unless ``checked``),
    its special tokens (:func:`check_text_tokens`), the voice pairing, a voice's codes against
    the codec (:func:`check_voice_codes`), a sentence too long for the context.

    Args:
        pipeline: a loaded bundle or the oracle.
        text: what to say.
        options: sampling options; None: the bundle's defaults
            (:func:`~higgs_pack.runtime.loop.delay.bundle_sampling`).
        ref_samples: float32 [samples] mono at the codec's rate, a multiple of ``hop_length``
            long (``audio.prepare_reference``): encoded here.  Or
        ref_codes: int64 [frames, N] codes encoded before (never both).
        ref_text: the voice's transcript (with either).
        max_frames: frame cap per chunk; None: from each chunk's length (:func:`frame_cap`).
        schedule: stream chunk sizes (default :class:`~higgs_pack.runtime.request.StreamSchedule`).
        checked: the text and voice pairing were checked already (a
            :class:`~higgs_pack.runtime.request.SynthesisRequest` checks them when made).
        context_frames: most frames of each context chunk kept (:attr:`SynthesisPlan.context_frames`).
        context: earlier speech after the voice, ``(codes int64 [frames, N], text)`` oldest first
            (:attr:`SynthesisPlan.context`); needs a voice.
        context_chunks: the rolling context (:func:`chunk_context`): with it (default
            :data:`CONTEXT_CHUNKS`) a long text is cut into chunks of at most
            :data:`CHUNK_WORDS` words; 0 packs each chunk up to the decoder's context and
            opens its prompt with the voice alone (the clip's, or the first chunk's).

    Raises:
        InputError: as listed above.
    """
    if ref_samples is not None and ref_codes is not None:
        raise InputError("give a voice as reference samples or as prepared codes, not both")
    if not checked:
        voice = ref_samples if ref_codes is None else ref_codes
        refuse(text_problems(text) or voice_pair_problems(voice, ref_text))
    if context and ref_samples is None and ref_codes is None:
        raise InputError("a rolling context (earlier speech) follows the voice in the prompt and needs one; "
                         "give a voice (with none, make the oldest speech the voice)")
    if ref_codes is not None:
        check_voice_codes(pipeline, ref_codes)
    for codes, words in context:
        check_voice_codes(pipeline, codes)
        check_text_tokens(pipeline, words, "context")
    options = bundle_sampling(pipeline.generation_defaults) if options is None else options
    refuse(_special_tokens(pipeline, text, "text")[1]  # both fields' problems at once
           + (_special_tokens(pipeline, ref_text, "ref_text")[1] if ref_text is not None else []))
    if ref_samples is not None:
        ref_codes = encode_reference(pipeline, ref_samples)
    chunks = tuple(plan_chunks(pipeline, text.strip(), ref_codes, ref_text, max_frames,
                               max_words=CHUNK_WORDS if context_chunks else None))
    plan = SynthesisPlan(options, ref_codes, ref_text, chunks, schedule or StreamSchedule(), 0, context_chunks,
                         pipeline.decoder.max_length, getattr(pipeline.decoder, "max_prompt_length", None),
                         context_frames=context_frames, context=tuple(context))
    return dataclasses.replace(plan, positions=_most_positions(pipeline, plan))


def plan_request(pipeline: Pipeline, request: SynthesisRequest) -> SynthesisPlan:
    """A request resolved once against a loaded bundle: the frozen :class:`SynthesisPlan` that
    ``TTS.synthesize``, ``TTS.stream`` and the engine run: the sampling options (the bundle's
    defaults with the request's choices), the voice's codes (a clip read, resampled and encoded
    here; a prepared voice's checked against the codec), the text chunks with their frame caps,
    the stream schedule.  The request's own fields were checked when it was made.

    Raises:
        InputError: the reference clip cannot be read or used, a special token of the
            tokenizer in the text or transcript, a sentence too long for the context, the
            bundle's own sampling defaults out of range.
    """
    c, voice = pipeline.constants, request.voice
    return plan_synthesis(
        pipeline, request.text, options=request.sampling_options(pipeline.generation_defaults),
        ref_samples=voice.prepared(c.sample_rate, c.hop_length) if isinstance(voice, Voice) else None,
        ref_codes=voice.codes if isinstance(voice, PreparedVoice) else None,
        ref_text=voice.transcript if voice is not None else None,
        max_frames=request.max_frames, schedule=request.schedule, checked=True,
        context_chunks=request.context_chunks, context_frames=request.context_frames,
        context=[(part.codes, part.transcript) for part in request.context])


def run_plan(pipeline: Pipeline, plan: SynthesisPlan, progress: ProgressCallback | None = None) -> SynthesisResult:
    """Generate every text chunk of ``plan`` and join them (:func:`join_results`).

    Raises:
        InputError: a prompt and cap past the decoder's context.
        NumericalError: non-finite or all-zero sub-part output.
    """
    results: list[GenerationResult] = []
    for index, (_, cap) in enumerate(plan.chunks):
        prompt = chunk_prompt(pipeline, plan, index, results)
        results.append(generate_codes(pipeline, prompt, plan.options, cap, progress))
    return join_results(pipeline, results, plan=plan)


def chunk_prompt(pipeline: Pipeline, plan: SynthesisPlan, index: int, results: list[GenerationResult]) -> Prompt:
    """Text chunk ``index``'s prompt (:func:`prompt_of`) with its voice and rolling context
    (:func:`chunk_context`).  The voice's pair opens it whatever the context, so its voice
    prefix is cached once and restored for every later chunk (the request's voice, a dialogue
    speaker's, or with none the first chunk's own speech)."""
    codes, words, context = chunk_context(pipeline, plan, index, results)
    return prompt_of(pipeline, plan.chunks[index][0], codes, words, context=context)


Context = list[tuple[np.ndarray, str]]
"""A rolling context: earlier chunks' ``(codes int64 [frames, N], text)``, oldest first."""


def chunk_context(pipeline: Pipeline, plan: SynthesisPlan, index: int,
                  results: list[GenerationResult]) -> tuple[np.ndarray | None, str | None, Context]:
    """The voice and rolling context that open text chunk ``index``'s prompt.

    The voice is the request's (a reference clip's codes and transcript; in a dialogue the
    chunk's speaker's, :meth:`SynthesisPlan.voice_of`); with none, the first chunk's own codes
    and text (whole) become the voice of every later chunk.  After it come the last
    ``plan.context_chunks`` chunks before ``index`` (text and codes, oldest first, the plan's
    earlier speech :attr:`SynthesisPlan.context` counted as chunks before chunk 0; each cut to its
    last ``plan.context_frames`` frames, :func:`context_tail`), as Higgs' own long-form
    generation keeps its ``generation_chunk_buffer_size`` chunks (../shared/SPEECH-AT-LENGTH.md);
    the oldest are left out while the prompt and the chunk's cap would not fit
    ``plan.max_length`` (or the prompt alone ``plan.max_prompt_length``), and a first-chunk voice
    that cannot fit is left out too.  The same function serves :func:`run_plan`, streaming and
    the engine, so each gives the same codes for the same seed.

    Args:
        pipeline: the backend (its tokenizer and constants).
        plan: the request's plan.
        index: the text chunk about to be generated.
        results: the :class:`GenerationResult` of chunks ``0 .. index - 1``.

    Returns:
        ``(voice codes int64 [frames, N], voice transcript, context)`` for :func:`prompt_of`, or
        ``(None, None, [])`` (zero-shot).
    """
    chosen = _context_of(plan, index)
    ref_codes, ref_text = plan.voice_of(index)
    parts = _earlier(plan, len(chosen)) + [(results[j].codes, plan.chunks[j][0]) for j in chosen]
    if ref_codes is None and parts:  # the speaker's first chunk is its voice (whole)
        (ref_codes, ref_text), parts = parts[0], parts[1:]
        if not len(ref_codes):
            return None, None, []
    parts = [context_tail(pipeline, codes, words, plan.context_frames) for codes, words in parts if len(codes)]
    if not parts and ref_codes is plan.voice_of(index)[0]:
        return ref_codes, ref_text, []
    text, cap = plan.chunks[index]
    steps = cap + pipeline.constants.num_codebooks - 1
    prompt_limit = plan.max_prompt_length or plan.max_length
    while ref_codes is not None:
        positions = chunk_positions(pipeline, text, cap, ref_codes, ref_text, parts)
        if positions <= plan.max_length and positions - steps <= prompt_limit:
            return ref_codes, ref_text, parts
        if parts:  # the oldest context goes first; a first-chunk voice (with no reference) last
            del parts[0]
        else:
            ref_codes, ref_text = plan.voice_of(index)
            if ref_codes is None:
                break
            return ref_codes, ref_text, []
    return None, None, []


def context_tail(pipeline: Pipeline, codes: np.ndarray, text: str, frames: int | None) -> tuple[np.ndarray, str]:
    """An earlier chunk's ``(codes, text)`` cut to about its last ``frames`` frames, at a word
    boundary, for a rolling context (None: whole).

    Where in the codes a word starts is estimated as :class:`Segment` estimates sentence
    boundaries: the chunk's frames divided in proportion to its words' characters (whitespace not
    counted), to a whole frame.  The kept words are the longest run ending the chunk whose
    estimated frames fit ``frames``, starting at a sentence start when one of those words does
    (a pause, where an estimate's error falls in silence); the codes kept start at the first kept
    word's estimated frame.  At least the last word is kept.

    Args:
        pipeline: unused today (kept for a tokenizer-aware cut).
        codes: int64 [F, N], the chunk's codes.
        text: the chunk's text.
        frames: most frames to keep (>= 1), or None.

    Returns:
        ``(codes int64 [<= max(frames, last word's frames), N], text)``.
    """
    del pipeline
    words = text.split()
    if frames is None or len(codes) <= frames or len(words) < 2:
        return codes, text
    weights = np.cumsum([0] + [len(w) for w in words])
    starts = [round(len(codes) * w / weights[-1]) for w in weights[:-1]]
    fits = [i for i, start in enumerate(starts) if len(codes) - start <= frames] or [len(words) - 1]
    sentence_starts = {0} | {i + 1 for i, w in enumerate(words[:-1]) if w[-1] in ".!?;:"}
    first = next((i for i in fits if i in sentence_starts), fits[0])
    return codes[starts[first]:], " ".join(words[first:])


def _context_of(plan: SynthesisPlan, index: int) -> list[int]:
    """The earlier text chunks whose text and codes follow the voice in chunk ``index``'s prompt at
    most, oldest first: when the speaker has no voice of its own, its first chunk (the voice of
    the rest, whatever ``plan.context_chunks``), then the speaker's last ``plan.context_chunks``
    chunks after it.  Only the same speaker's chunks: a dialogue's prompt format has no speaker
    tag, so another speaker's audio there would pull the voice towards that speaker."""
    speaker, (codes, _) = plan.speaker_of(index), plan.voice_of(index)
    first = None if codes is not None else (0 if plan.cast is None else plan.cast.speakers.index(speaker))
    if index == 0 or first == index:
        return []
    recent: list[int] = []
    j = index - 1
    while j >= 0 and j != first and len(recent) < plan.context_chunks:
        if plan.speaker_of(j) == speaker:
            recent.append(j)
        j -= 1
    return ([] if first is None else [first]) + recent[::-1]


def _earlier(plan: SynthesisPlan, taken: int) -> Context:
    """The plan's earlier speech (:attr:`SynthesisPlan.context`) that a chunk's prompt holds
    besides ``taken`` earlier chunks of the plan: the last ``plan.context_chunks - taken`` of it."""
    room = plan.context_chunks - taken
    return list(plan.context[-room:]) if room > 0 and plan.cast is None else []


def _most_positions(pipeline: Pipeline, plan: SynthesisPlan) -> int:
    """Most decoder positions a chunk of ``plan`` can hold: its prompt and cap, with the rolling
    context of :func:`chunk_context` at its largest (every chunk of :func:`_context_of` at its frame
    cap, and the plan's earlier speech at its length, or ``plan.context_frames`` of each, with its whole text and a token to spare for a cut), and
    never more than ``plan.max_length`` (:func:`chunk_context` drops context past it)."""
    n = pipeline.constants.num_codebooks
    most = 0
    for index, (text, cap) in enumerate(plan.chunks):
        chosen, (ref_codes, ref_text) = _context_of(plan, index), plan.voice_of(index)
        earlier = [(words, len(codes)) for codes, words in _earlier(plan, len(chosen))]
        if ref_codes is None and chosen:  # the first chunk is the voice, whole
            first, chosen = chosen[0], chosen[1:]
            ref_codes, ref_text = np.zeros((plan.chunks[first][1], n), np.int64), plan.chunks[first][0]
        extra = 0
        for words, frames in earlier + [plan.chunks[j] for j in chosen]:
            if plan.context_frames is not None and frames > plan.context_frames:  # context_tail's most
                split = words.split()
                last = frames * len(split[-1]) // sum(len(w) for w in split) + 1
                frames, extra = min(frames, max(plan.context_frames, last)), extra + 1  # + 1: a token to spare
            extra += _token_count(pipeline, words) + 2 + frames + n - 1
        most = max(most, min(plan.max_length, chunk_positions(pipeline, text, cap, ref_codes, ref_text) + extra))
    return most


#: Silence between two sentences generated as separate requests (a live session's sentences,
#: serve/live.py), seconds.  Text chunks of one request never get it: they join as continuous
#: speech (:func:`join_results`).
SENTENCE_PAUSE_S = 0.2


def _token_count(pipeline: Pipeline, text: str) -> int:
    return len(pipeline.tokenizer.encode(text, add_special_tokens=False).ids)


def _prompt_overhead(pipeline: Pipeline, ref_codes: np.ndarray | None, ref_text: str | None,
                     context: Context = ()) -> int:
    """Positions of a chunk's prompt besides its text tokens, plus the delay ramp of its frames
    (``N - 1``): ``<|tts|> <|text|> … <|audio|>`` and, with a voice and each context chunk,
    ``<|ref_text|> text <|ref_audio|>`` and its delayed codes (:func:`prompt_of`'s layout)."""
    n = pipeline.constants.num_codebooks
    fixed = 3 + n - 1
    pairs = ([] if ref_codes is None else [(ref_codes, ref_text or "")]) + list(context)
    for codes, words in pairs:
        fixed += _token_count(pipeline, words) + 2 + codes.shape[0] + n - 1
    return fixed


def voice_room_problems(pipeline: Pipeline, ref_codes: np.ndarray, ref_text: str) -> list[Problem]:
    """The problem of a voice whose prompt (transcript and clip codes) leaves no room in the
    decoder's context for even a one-word sentence and its shortest frame cap, else ``[]``:
    said of the voice, not of the text (a new user's finding: a 5,000-word transcript was
    reported as a sentence of the text to split)."""
    gen = pipeline.generation_defaults
    fixed = _prompt_overhead(pipeline, ref_codes, ref_text)
    limit = pipeline.decoder.max_length
    least = fixed + 1 + frame_cap(1, gen.get("frames_per_text_token", FRAMES_PER_TEXT_TOKEN),
                                  gen.get("min_max_frames", MIN_MAX_FRAMES))
    if least <= limit:
        return []
    return [Problem("ref_text", None, message=literal(
        f"the voice takes {fixed} positions of the decoder's context of {limit} (its transcript, "
        f"{_token_count(pipeline, ref_text)} tokens, and its clip, {ref_codes.shape[0]} frames), leaving no room "
        f"for a sentence ({least} needed for one word): use a shorter clip with its transcript"))]


def _too_long(needed: int, limit: int, sentence: str, max_frames: int | None) -> Problem:
    """The problem of one sentence whose prompt and frames do not fit the context: the frame cap's
    when the request set one (lowering it is a fix), else the text's."""
    what = (f"one sentence needs {needed} positions (its prompt and audio frames), more than the decoder's "
            f"context of {limit} (the sentence starts {sentence[:60]!r}), and has no space or comma to cut it "
            "at: split it with spaces or punctuation")
    what = literal(what)
    if max_frames is None or needed - max_frames > limit - 1:  # a frame cap of 1 would not fit it either
        return Problem("text", None, message=what)
    return Problem("max_frames", max_frames, message=what + ", or lower {name}")


def _cap_too_large(max_frames: int | None, limit: int, fixed: int, voice: bool) -> list[Problem]:
    """The problem of a frame cap that no text fits beside, else ``[]``: the largest the bundle takes
    is its decoder's context less the prompt (with the voice, when there is one) and one text token."""
    largest = limit - fixed - 1
    if max_frames is None or max_frames <= largest:
        return []
    return [Problem("max_frames", max_frames, message="{name}" + literal(
        f" is at most {largest} for this bundle{' with this voice' if voice else ''} ({largest / 25:.0f} s: its "
        f"decoder's context holds {limit} positions, the prompt takes {fixed} and the text at least one), got "
        f"{max_frames}; a longer text is spoken in several chunks, each with its own cap"))]


def chunk_positions(pipeline: Pipeline, text: str, cap: int, ref_codes: np.ndarray | None = None,
                    ref_text: str | None = None, context: Context = ()) -> int:
    """Most positions one text chunk holds in the decoder: its prompt (exactly the length
    :func:`build_prompt` gives) plus the audio steps of its frame cap (``cap + N - 1``
    with the delay pattern's ramp; :func:`check_context` bounds the same sum).

    Args:
        pipeline: the backend (its tokenizer and constants).
        text: the chunk's text.
        cap: its frame cap (frames at 25 per second).
        ref_codes: int64 [frames, N] reference codes with ``ref_text`` (its transcript), or None.
        context: a rolling context after the voice (:func:`chunk_context`).

    Returns:
        Positions (>= 1): KV bytes are this times the decoder's bytes per position.
    """
    return _token_count(pipeline, text) + _prompt_overhead(pipeline, ref_codes, ref_text, context) + cap


def _word_pieces(sentence: str, max_words: int) -> list[str]:
    """``sentence`` as it is when it holds at most ``max_words`` whitespace-separated words, else
    cut at word boundaries into pieces of ``max_words`` words (the last one shorter), joined by
    single spaces.  Linear in the sentence's length."""
    words = sentence.split()
    if len(words) <= max_words:
        return [sentence]
    return [" ".join(words[i:i + max_words]) for i in range(0, len(words), max_words)]


#: Clause marks a piece with no space in it may be cut after (CJK text has no spaces between words).
_CLAUSE_MARK = re.compile(r"[,;:\uff0c\u3001\uff1b\uff1a]")


def _halves(piece: str) -> list[str]:
    """``piece`` cut in two near its middle: at a space, else after a clause mark (``,`` ``;``
    ``:`` and the CJK ``，`` ``、`` ``；`` ``：``), else not at all (``[piece]``)."""
    words = piece.split()
    if len(words) > 1:
        return [" ".join(words[:len(words) // 2]), " ".join(words[len(words) // 2:])]
    cuts = [m.end() for m in _CLAUSE_MARK.finditer(piece) if m.end() < len(piece)]
    if not cuts:
        return [piece]
    middle = min(cuts, key=lambda cut: abs(2 * cut - len(piece)))
    return [piece[:middle], piece[middle:]]


def _cut_to_fit(pipeline: Pipeline, sentences: list[str], tokens: list[int], fits: Callable[[int], bool]) -> list[str]:
    """``sentences`` in order, each whose ``tokens`` do not ``fits`` halved (:func:`_halves`) until
    its pieces do or cannot be cut (those are refused by the caller).  A sentence of commas and
    no full stop, or a list, is cut this way; the 200-word pieces alone could still overflow a
    small context."""
    out: list[str] = []
    todo = list(zip(sentences, tokens, strict=True))[::-1]
    while todo:
        sentence, count = todo.pop()
        parts = [sentence] if fits(count) else _halves(sentence)
        if len(parts) == 1:
            out.append(sentence)
            continue
        counts = [len(e.ids) for e in pipeline.tokenizer.encode_batch(parts, add_special_tokens=False)]
        todo += list(zip(parts, counts, strict=True))[::-1]
    return out


def plan_chunks(pipeline: Pipeline, text: str, ref_codes: np.ndarray | None = None,
                ref_text: str | None = None, max_frames: int | None = None,
                max_words: int | None = None) -> list[tuple[str, int]]:
    """Split ``text`` into ``(chunk, frame cap)`` pairs whose prompt + frames fit the context.

    The whole text is one chunk when it fits (and holds at most ``max_words`` words);
    otherwise sentences are packed greedily into chunks (the reference voice, if any, is
    repeated in each prompt), each closed before it would pass the context or ``max_words``
    words (whitespace-separated; None: no word budget).  A sentence longer than the word
    budget is cut at word boundaries into pieces of ``max_words`` words, packed as sentences are
    (text without sentence ends is chunked too; without a word budget it stays whole); a piece
    that still does not fit the context is halved at a space or a clause mark until it does.

    Linear in the text: the whole text and each sentence are tokenized once (in one
    batch), a chunk's token count is the sum of its sentences' (each after the first
    counted with the space that joins it), and each chunk is tokenized once more at the
    end to make its count exact; a chunk the exact count puts past the context gives its
    last sentence to the next chunk.  (Re-tokenizing the growing chunk for every sentence
    took 78.6 s for a 313 KB text, issue 30.)

    Raises:
        InputError: ``max_frames`` past the largest cap the context takes beside the prompt (the
            largest named), or a piece with no space or clause mark to cut at does not fit.
    """
    gen = pipeline.generation_defaults
    limit = pipeline.decoder.max_length
    fpt = gen.get("frames_per_text_token", FRAMES_PER_TEXT_TOKEN)
    floor = gen.get("min_max_frames", MIN_MAX_FRAMES)
    fixed = _prompt_overhead(pipeline, ref_codes, ref_text)
    refuse(([] if ref_codes is None else voice_room_problems(pipeline, ref_codes, ref_text or ""))
           or _cap_too_large(max_frames, limit, fixed, ref_codes is not None))

    def cap_of(tokens: int) -> int:
        return max_frames if max_frames is not None else frame_cap(tokens, fpt, floor)

    def positions(tokens: int) -> int:
        return fixed + tokens + cap_of(tokens)

    whole = _token_count(pipeline, text)
    if positions(whole) <= limit and (max_words is None or len(text.split()) <= max_words):
        return [(text, cap_of(whole))]
    sentences = split_sentences(text)
    if max_words is not None:  # text without sentence ends (a list, a transcript) is chunked too
        sentences = [piece for sentence in sentences for piece in _word_pieces(sentence, max_words)]
    encoded = pipeline.tokenizer.encode_batch([*sentences, *(" " + s for s in sentences)], add_special_tokens=False)
    alone = [len(e.ids) for e in encoded[:len(sentences)]]
    joined = [len(e.ids) for e in encoded[len(sentences):]]
    if positions(1) <= limit and any(positions(tokens) > limit for tokens in alone):  # (no room for a word: refused)
        sentences = _cut_to_fit(pipeline, sentences, alone, lambda tokens: positions(tokens) <= limit)
        encoded = pipeline.tokenizer.encode_batch([*sentences, *(" " + s for s in sentences)], add_special_tokens=False)
        alone = [len(e.ids) for e in encoded[:len(sentences)]]
        joined = [len(e.ids) for e in encoded[len(sentences):]]
    for sentence, tokens in zip(sentences, alone, strict=True):
        if positions(tokens) > limit:
            refuse([_too_long(positions(tokens), limit, sentence, max_frames)])
    words = [len(sentence.split()) for sentence in sentences]
    groups: list[list[int]] = []  # sentence indices of each chunk
    tokens = count = 0
    for i in range(len(sentences)):
        if groups and positions(tokens + joined[i]) <= limit and (max_words is None or count + words[i] <= max_words):
            groups[-1].append(i)
            tokens += joined[i]
            count += words[i]
        else:
            groups.append([i])
            tokens, count = alone[i], words[i]
    chunks: list[tuple[str, int]] = []
    while groups:
        group = groups.pop(0)
        chunk = " ".join(sentences[i] for i in group)
        exact = _token_count(pipeline, chunk)
        if positions(exact) > limit and len(group) > 1:  # the sum was a token or two short
            groups.insert(0, group[:-1])
            if groups[1:] and groups[1][0] == group[-1] + 1:
                groups[1].insert(0, group[-1])
            else:
                groups.insert(1, [group[-1]])
            continue
        chunks.append((chunk, cap_of(exact)))
    return chunks
