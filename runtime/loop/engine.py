"""Many requests at once: a continuous-batching engine over one pipeline (:class:`Engine`).

``Engine.submit`` may be called at any time from any thread; it checks and plans the request
on the caller's thread (the reference voice is codec-encoded there) and returns an
:class:`EngineHandle`.  One background thread runs the steps:

1. admit waiting requests into free rows (lowest first), in the order they were submitted,
   while their KV fits the budget the admitted requests leave (:mod:`~higgs_pack.runtime.loop.
   kv_memory`; each counts its peak, ``positions x`` the decoder's KV bytes per position): embed
   the prompt and prefill it on the row (:meth:`BatchedDecoder.prefill`); they join between
   steps.  Admission is strictly first-in, first-out: when the oldest waiting request does not
   fit, none behind it is admitted either (a stream of small requests never starves a large
   one; it waits only for requests admitted before it to leave), and a request larger than the
   whole budget is refused at submit;
2. one step for all busy rows: the audio heads on every row's last hidden state in one run,
   then per row its own :class:`~higgs_pack.runtime.loop.frames.CodeSteps` (sampler, random
   generator seeded with the request's seed, delay-pattern ramps, stop rules), so a request's
   codes do not depend on the other rows; the rows still going feed their codes through the
   audio embedding in one run and the decoder in one run (:meth:`BatchedDecoder.step`);
3. a request whose last text chunk is done, that was cancelled, or whose row failed leaves at
   once and frees its row.  A long text planned as several chunks re-prefills its row.

The codec runs on the engine's one codec thread (:class:`~higgs_pack.runtime.loop.codec_batch.
CodecBatcher`, ``Engine.codec``), not on the engine's thread nor on the threads that read the
handles (:meth:`EngineHandle.result`, or iterating it for streamed chunks): a reader hands its
windows of codes over and waits, and windows of the same length that several readers need at
about the same time are decoded as one batched run (see that module for why).  While an engine is open,
use it rather than the pipeline's own ``synthesize`` / ``stream`` on other threads: both share
the sub-parts' per-step buffers.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import Any, Protocol

import numpy as np

from higgs_pack.manifests.errors import HiggsPackError, InputError
from higgs_pack.runtime.loop.codec_batch import CodecBatcher
from higgs_pack.runtime.loop.decode import FiniteChecks, GenerationResult, check_context
from higgs_pack.runtime.loop.frames import CodeSteps
from higgs_pack.runtime.loop.kv_memory import KVBudget, default_kv_budget
from higgs_pack.runtime.loop.pipeline import Decoder, Pipeline
from higgs_pack.runtime.loop.plan import SynthesisPlan, chunk_prompt, plan_request
from higgs_pack.runtime.loop.prefix_cache import (
    PrefixCache,
    Prompt,
    prefetch_prefix,
    prefix_layout,
    restore_prefix,
    store_prefix,
)
from higgs_pack.runtime.loop.streaming import (
    AudioChunk,
    SpeechStream,
)
from higgs_pack.runtime.loop.synthesis import SynthesisResult, join_results
from higgs_pack.runtime.request import SynthesisRequest

#: Default most positions per request of :meth:`higgs_pack.TTS.engine` (prompt + frames; 4096
#: positions hold 2.7 minutes of audio at 25 frames per second).
DEFAULT_MAX_LENGTH = 4096

#: ``join_gap_steps`` default: a running request waits about two of its steps for its next frame
#: while a prompt joins (issue 32 item 3).
DEFAULT_JOIN_GAP_STEPS = 2.0
#: ``prefill_chunk="auto"``: positions of a joining prompt's first chunk, before the costs are
#: measured, and the fewest positions of a chunk (smaller ones cost mostly call overhead).
FIRST_PREFILL_CHUNK = 16
MIN_PREFILL_CHUNK = 8
#: Weight of the newest sample in the running means of step and prefill costs.
_COST_WEIGHT = 0.2

log = logging.getLogger(__name__)


def _running_mean(mean: float | None, sample: float) -> float:
    return sample if mean is None else (1 - _COST_WEIGHT) * mean + _COST_WEIGHT * sample


class RequestCancelled(HiggsPackError):
    """The request was cancelled (:meth:`EngineHandle.cancel`) before it finished."""


class EngineClosed(HiggsPackError):
    """The engine was closed (or its thread stopped) before the request finished."""


class BatchedDecoder(Protocol):
    """A decoder holding the KV cache of up to ``max_batch`` requests, one row each.

    It may also state ``kv_bytes_per_position`` (int: KV bytes of one position of one row, or
    None when unknown) and ``kv_device`` (``"cpu"`` when the cache is host memory); without
    them the engine admits by free rows only.
    """

    max_batch: int
    max_length: int
    """Most positions one row may hold."""

    def prefill(self, row: int, inputs_embeds: np.ndarray, start: int = 0, final: bool = True) -> np.ndarray:
        """Prefill ``S`` prompt positions of ``row`` from position ``start``: float32 [1, S, H] ->
        float32 [1, S, H].  ``start=0`` starts the row over; a later chunk continues the row's
        own positions (an earlier chunk's or a cached prefix's); ``final``: the prompt's last
        chunk (the row then takes part in :meth:`step`).  One row at a time is prefilled in
        chunks; the other rows may step meanwhile."""
        ...

    def step(self, rows: np.ndarray, inputs_embeds: np.ndarray) -> np.ndarray:
        """One position for each of ``rows`` (ascending): float32 [a, 1, H] -> float32 [a, 1, H]."""
        ...

    def release(self, row: int) -> None:
        """Forget ``row``'s positions."""
        ...

    # Optional, for one forward per step (issue 39): ``packs_prefill = True`` and
    # ``step(rows, inputs_embeds, prefill=(row, chunk [1, S, H], start))`` -> ``(hidden, chunk hidden)``:
    # a joining row's prompt chunk rides in the decode rows' forward (the engine plans it, _ride).
    # Optional, for the voice prefix cache (:mod:`~higgs_pack.runtime.loop.prefix_cache`):
    # ``prefix_layout`` (str, or None: no caching), ``read_prefix(row, length)`` -> arrays and
    # ``write_prefix(row, arrays, length)`` (a prefill with ``start=length`` continues it).


class SingleRowDecoder:
    """Any backend's batch-1 :class:`~higgs_pack.runtime.loop.pipeline.Decoder` as a one-row
    :class:`BatchedDecoder` (``max_batch=1``: the engine then serves requests one at a time).

    Args:
        decoder: the pipeline's decoder.
        max_length: most positions per request (default, and at most, the decoder's own).

    Attributes:
        kv_bytes_per_position: the wrapped decoder's own figure where it states one (ONNX
            Runtime's :class:`~higgs_pack.runtime.backends.onnxruntime.runners.OrtDecoder`), else
            None: OpenVINO's stateful decoder keeps its cache inside the plugin in a precision
            of the plugin's choosing (u8 by default on x86, with per-token scales), and the
            NPU variant's static buffers are allocated whole when the bundle loads.
        kv_device: where the wrapped decoder's cache lives (``"cpu"`` unless it says otherwise).
    """

    max_batch = 1

    def __init__(self, decoder: Decoder, max_length: int | None = None):
        self._decoder = decoder
        self.max_length = decoder.max_length if max_length is None else min(max_length, decoder.max_length)
        self.kv_bytes_per_position: int | None = getattr(decoder, "kv_bytes_per_position", None)
        self.kv_device: str = getattr(decoder, "kv_device", "cpu")

    def prefill(self, row: int, inputs_embeds: np.ndarray, start: int = 0, final: bool = True) -> np.ndarray:
        if not start:
            self._decoder.reset()
        return self._decoder.forward(inputs_embeds)

    @property
    def prefix_layout(self) -> str | None:
        """The wrapped decoder's (None when it does not take part in prefix caching)."""
        return prefix_layout(self._decoder)

    def read_prefix(self, row: int, length: int) -> dict[str, np.ndarray]:
        return self._decoder.read_prefix(length)

    def write_prefix(self, row: int, arrays: dict[str, np.ndarray], length: int) -> None:
        self._decoder.write_prefix(arrays, length)

    def step(self, rows: np.ndarray, inputs_embeds: np.ndarray) -> np.ndarray:
        return self._decoder.forward(inputs_embeds)

    def release(self, row: int) -> None:
        self._decoder.reset()


class EngineHandle:
    """One submitted request: read its speech with :meth:`result`, or iterate it for
    :class:`~higgs_pack.runtime.loop.streaming.AudioChunk` as frames are generated (not both).

    Errors of this request (a bad prompt found at admission, non-finite output of its row)
    are raised here, by :meth:`result` or while iterating; other requests go on.
    """

    def __init__(self, engine: Engine, plan: SynthesisPlan, submitted: float):
        self._engine = engine
        self.plan = plan
        """The request as the loop runs it (:class:`~higgs_pack.runtime.loop.plan.SynthesisPlan`)."""
        self.submitted = submitted
        """``time.perf_counter()`` at :meth:`Engine.submit` (a stream's ``first_audio_s`` counts from it)."""
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._finished = threading.Event()
        self._read = False
        self._results: list[GenerationResult] = []
        self._callbacks: list = []
        self._callback_lock = threading.Lock()
        self.kv_reserved = 0
        """KV bytes this request holds against the engine's budget while on a row (0 before, after)."""
        self.waited_for_kv = False
        """Whether it was held back at least once because its KV did not fit (not for a row)."""
        self._first_prompt: Prompt | None = None  # text chunk 0's, embedded at submit

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        """Whether the engine is done with this request (finished, failed or cancelled)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the engine is done with this request (its codes are all drawn, or it
        failed or was cancelled); the codec has not run yet.  Returns :attr:`done`."""
        return self._finished.wait(timeout)

    def add_done_callback(self, callback) -> None:
        """Call ``callback(handle)`` once the engine is done with this request (as :meth:`wait`
        returns): on the engine's thread, or at once on this one when it is done already.
        Keep it short and do not read the speech in it (the engine's thread would wait for the
        codec thread); an exception it raises is logged and ignored."""
        with self._callback_lock:
            if not self._finished.is_set():
                self._callbacks.append(callback)
                return
        self._call(callback)

    def _call(self, callback) -> None:
        try:
            callback(self)
        except Exception:  # a caller's bug must not stop the engine
            log.exception("an engine handle's done callback failed")

    def _set_finished(self) -> None:
        with self._callback_lock:
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._call(callback)

    def cancel(self) -> None:
        """Stop this request: it leaves the batch (or the queue) before the engine's next step
        and frees its row; reading it then raises :class:`RequestCancelled`, also when the engine
        had already drawn all its codes.  Its windows waiting for the codec thread are dropped
        unrun (a run under way finishes).  Idempotent."""
        self._cancelled.set()
        self._engine._wake()
        self._engine.codec.withdraw(self, RequestCancelled("the request was cancelled while its audio was being "
                                                           "decoded"))

    def result(self, timeout: float | None = None) -> SynthesisResult:
        """Wait for all codes, codec-decode them (on the engine's codec thread, batched with other
        readers' windows of the same length) and join the text chunks.

        Args:
            timeout: most seconds to wait for each engine event (None: no limit).

        Returns:
            The :class:`~higgs_pack.runtime.loop.synthesis.SynthesisResult` that
            ``synthesize`` gives for the same arguments (same codes for the same seed).

        Raises:
            RequestCancelled, EngineClosed, InputError, NumericalError: as the request ended.
            TimeoutError: no event within ``timeout``.
        """
        self._claim()
        for index, _ in enumerate(self.plan.chunks):
            steps = self._chunk_steps(index, timeout)
            while True:
                try:
                    next(steps)
                except StopIteration:
                    break
        return join_results(self._engine.pipeline, self._results, self._decode, self.plan)

    def __iter__(self) -> Iterator[AudioChunk]:
        """Streamed chunks, as :func:`higgs_pack.runtime.loop.streaming.stream` gives them: a
        :class:`~higgs_pack.runtime.loop.streaming.SpeechStream` (its ``results`` fill as text
        chunks end; its windows are decoded on the engine's codec thread)."""
        self._claim()
        codec = self._engine.codec
        stream = SpeechStream(self._engine.pipeline, self.plan, None, self.submitted,
                              steps=lambda index, _text, _cap: self._chunk_steps(index, None),
                              decode=lambda codes: self._decode([codes])[0], reading=codec.stream,
                              codec_step=self._codec_step)
        return stream

    def _raise_if_cancelled(self) -> None:
        """A cancelled request reads as cancelled even when the engine had drawn all its codes
        (its events and windows are still there): cancel() is the reader's last word."""
        if self._cancelled.is_set():
            raise RequestCancelled("the request was cancelled")

    def _decode(self, windows: list[np.ndarray]) -> list[np.ndarray]:
        self._raise_if_cancelled()
        return self._engine.codec.decode_many(windows, self)

    def _codec_step(self, codes: np.ndarray, start: int, end: int, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._raise_if_cancelled()
        return self._engine.codec.step(codes, start, end, state, self)

    def _claim(self) -> None:
        if self._read:
            raise InputError("this request's speech was already read (result() or iteration, once)")
        self._read = True

    def _chunk_steps(self, index: int, timeout: float | None) -> Generator[np.ndarray, None, GenerationResult]:
        """The codes of text chunk ``index`` as the engine sends them (generate_steps' yields)."""
        while True:
            self._raise_if_cancelled()
            try:
                kind, at, value = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no frame of this request within {timeout} s") from None
            if kind == "error":
                raise value
            if at != index:
                raise RuntimeError(f"engine event for text chunk {at} while reading chunk {index}")
            if kind == "end":
                self._results.append(value)
                return value
            yield value

    # engine side
    def _send(self, kind: str, index: int, value: Any) -> None:
        self._events.put((kind, index, value))

    def _fail(self, exc: BaseException) -> None:
        self._events.put(("error", -1, exc))
        self._set_finished()


@dataclass
class _Row:
    """A request on a row of the batch (engine thread only)."""

    handle: EngineHandle
    row: int
    chunk: int = 0
    rules: CodeSteps | None = None
    checks: FiniteChecks | None = None
    last: np.ndarray | None = None  # float32 [1, 1, H]
    prompt_length: int = 0
    started: float = 0.0
    first_frame_s: float = math.nan
    decoder_s: float = 0.0
    prompt: Prompt | None = None
    """The current text chunk's prompt while it is prefilled (None once the row steps)."""
    filled: int = 0
    """Positions of ``prompt`` prefilled (a cached voice prefix's included)."""
    restored: int = 0
    """Positions of ``prompt`` restored from the voice prefix cache."""
    prefill_s: float = 0.0
    """Seconds spent prefilling ``prompt`` (its restore included)."""
    looked_up: bool = False
    store_key: str | None = None
    """The prefix cache key to keep this prompt's voice prefix under once it is prefilled."""
    last_frame_at: float = 0.0
    waited_for_join: bool = False
    """A prefill chunk of another row ran since this row's last frame."""
    results: list[GenerationResult] = field(default_factory=list)
    """Its finished text chunks (their codes are the next chunk's rolling context)."""


@dataclass
class EngineStats:
    """What the engine's thread did (read them while it runs for rough figures).

    Attributes:
        steps: batched decode steps run.
        frames: rows advanced, summed over the steps (one frame per row per step).
        step_seconds: seconds inside those steps (heads, sampling, embedding, decoder).
        prefill_seconds: seconds prefilling prompts.
        max_rows: most rows busy in one step.
        kv_waits: requests held back at least once because their KV did not fit the budget
            left (a row was free).
        max_kv_bytes_in_use: most KV bytes reserved by admitted requests at once.
        prefill_positions: prompt positions prefilled (a cached voice prefix's not counted).
        prefill_chunks: prefill runs (a prompt prefilled in chunks counts each).
        prefill_chunk_positions: the chunk size last chosen for a joining prompt (0: none yet).
        prefix_hits, prefix_misses: this engine's voice prefix cache lookups served / not served
            (the cache's own ``stats`` count every user of it).
        join_max_frame_gap_ms: longest time between two frames of a running request while
            another request's prompt was prefilled in between (ms; 0.0: no such join yet).
    """

    steps: int = 0
    frames: int = 0
    step_seconds: float = 0.0
    prefill_seconds: float = 0.0
    max_rows: int = 0
    kv_waits: int = 0
    max_kv_bytes_in_use: int = 0
    prefill_positions: int = 0
    prefill_chunks: int = 0
    prefill_chunk_positions: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    join_max_frame_gap_ms: float = 0.0

    @property
    def prefill_positions_per_s(self) -> float:
        """Prompt positions prefilled per second of prefill (nan before any)."""
        return self.prefill_positions / self.prefill_seconds if self.prefill_seconds > 0 else math.nan

    @property
    def engine_step_ms(self) -> float:
        """Mean milliseconds of one batched decode step (nan before any)."""
        return 1000 * self.step_seconds / self.steps if self.steps else math.nan


class Engine:
    """Serves many requests with one decoder step for all busy rows (see the module docstring).

    Use :meth:`higgs_pack.TTS.engine` to make one; close it (or use ``with``) to stop its thread.

    Args:
        pipeline: the loaded bundle's pipeline (its tokenizer, sub-parts and constants).
        decoder: the :class:`BatchedDecoder` (its ``max_length`` bounds each request's
            prompt + frames; long texts are planned in chunks that fit it).
        max_kv_bytes: most bytes of KV cache the admitted requests may reach together (int
            >= 1); None (default): :func:`~higgs_pack.runtime.loop.kv_memory.default_kv_budget`,
            half the memory available now, at most all rows full, when the cache is host memory
            (a cache in GPU memory gets no default limit).  Ignored when the decoder does not
            state its KV bytes per position (then admission is by free rows only).
        prefill_chunk: how a prompt joining rows that are decoding is prefilled: ``"auto"``
            (default) in chunks sized at run time from the measured costs of a step and of a
            prefilled position, so a running request waits about ``join_gap_steps`` of its own
            steps for its next frame; a whole number >= 2: chunks of that many positions; 0:
            whole prompts (each running request waits for all of it).  On a decoder that packs
            prefill (``packs_prefill``: OpenVINO's paged one) each chunk rides in the running rows'
            step, one forward for both.  A prompt with no row decoding beside it is prefilled whole.  Chunks never leave a last chunk of one
            position (merged into the one before).
        join_gap_steps: ``"auto"``'s target, in steps of the running rows (> 1; default
            :data:`DEFAULT_JOIN_GAP_STEPS`): each chunk costs about ``join_gap_steps - 1`` steps.
            A larger target brings the joining request's first frame closer to its prefill
            alone (it waits one step per chunk: about ``1 + 1 / (join_gap_steps - 1)`` times its
            prefill alone), a smaller one keeps the running streams smoother.

    Attributes:
        max_batch: rows decoded together.
        stats: :class:`EngineStats`.
        prefix_cache: the pipeline's :class:`~higgs_pack.runtime.loop.prefix_cache.PrefixCache`
            (voice prefixes' KV, shared with ``synthesize`` / ``stream``), or None.
        codec: the :class:`~higgs_pack.runtime.loop.codec_batch.CodecBatcher` that decodes every
            handle's audio (its ``stats``: runs, windows per run, seconds).

    Raises:
        InputError: ``max_kv_bytes`` is not a whole number >= 1, a bad ``prefill_chunk`` or
            ``join_gap_steps``.
    """

    def __init__(self, pipeline: Pipeline, decoder: BatchedDecoder, *, max_kv_bytes: int | None = None,
                 prefill_chunk: int | str = "auto", join_gap_steps: float = DEFAULT_JOIN_GAP_STEPS):
        if prefill_chunk != "auto" and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, Integral)
                                        or prefill_chunk < 0 or prefill_chunk == 1):
            raise InputError(f"prefill_chunk must be 'auto', 0 (whole prompts) or a whole number of positions >= 2, "
                             f"got {prefill_chunk!r}")
        if isinstance(join_gap_steps, bool) or not isinstance(join_gap_steps, (int, float)) \
                or not join_gap_steps > 1 or not math.isfinite(join_gap_steps):
            raise InputError(f"join_gap_steps must be a number of steps > 1, got {join_gap_steps!r}")
        self.prefill_chunk = prefill_chunk
        self.join_gap_steps = float(join_gap_steps)
        if max_kv_bytes is not None and (isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, Integral)
                                         or max_kv_bytes < 1):
            raise InputError(f"max_kv_bytes must be a whole number of bytes >= 1 (or None: from the free memory), "
                             f"got {max_kv_bytes!r}")
        per_position = getattr(decoder, "kv_bytes_per_position", None)
        if per_position is None and max_kv_bytes is not None:
            log.warning("max_kv_bytes=%d ignored: this decoder does not state its KV bytes per position "
                        "(requests are admitted by free rows only)", max_kv_bytes)
        if max_kv_bytes is None and getattr(decoder, "kv_device", "cpu") == "cpu":
            max_kv_bytes = default_kv_budget(per_position, decoder.max_batch, decoder.max_length)
        self.kv = KVBudget(per_position, None if per_position is None else max_kv_bytes,
                           block_size=getattr(decoder, "block_size", None), block_bytes=getattr(decoder, "block_bytes", None))
        if self.kv.limited and self.kv.block_bytes and hasattr(decoder, "max_blocks"):
            decoder.max_blocks = -(-self.kv.budget_bytes // self.kv.block_bytes)  # its pool never grows past it
        self.pipeline = replace(pipeline, decoder=decoder)  # plans chunks for this decoder's length
        self.decoder = decoder
        self.max_batch = decoder.max_batch
        self.stats = EngineStats()
        self.prefix_cache: PrefixCache | None = self.pipeline.prefix_cache
        self._prefix_layout = prefix_layout(decoder)
        self._prefilling: list[_Row] = []  # rows whose prompt is being prefilled, oldest first
        self._riding: tuple[_Row, int, int] | None = None  # (row, start, end) of the next step's chunk
        self._forward_cost: float | None = None  # running mean: seconds of a decoder step alone
        self._step_cost: float | None = None  # running means: seconds of a step, of a prefilled position
        self._position_cost: float | None = None
        self._cond = threading.Condition()
        self._waiting: list[EngineHandle] = []
        self._rows: dict[int, _Row] = {}
        self._closing = False
        self._crashed: BaseException | None = None
        self.codec = CodecBatcher(self.pipeline)
        self._thread = threading.Thread(target=self._serve, name="higgs-pack-engine", daemon=True)
        self._thread.start()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread after its current step; unfinished requests get :class:`EngineClosed`.
        The codec thread stops after its current run; finished requests stay readable (their
        windows are then decoded on the reading thread); voice prefixes still being persisted
        are written (each at most ``timeout`` seconds)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.codec.close(timeout)
        if self.prefix_cache is not None:  # voice prefixes being persisted are written before it returns
            self.prefix_cache.flush(timeout)

    @property
    def alive(self) -> bool:
        """Whether the engine takes requests: its thread runs, it did not fail, it is not closed."""
        return self._thread.is_alive() and self._crashed is None and not self._closing

    @property
    def busy_rows(self) -> int:
        """Rows holding a request now."""
        return len(self._rows)

    @property
    def kv_bytes_per_position(self) -> int | None:
        """KV bytes of one position of one row, as the decoder binds them (None: it cannot say)."""
        return self.kv.bytes_per_position

    @property
    def kv_budget_bytes(self) -> int | None:
        """Most KV bytes the admitted requests may reach together (None: no limit)."""
        return self.kv.budget_bytes

    @property
    def kv_bytes_in_use(self) -> int:
        """KV bytes reserved now by the admitted requests (each its peak until it leaves)."""
        return self.kv.in_use_bytes

    @property
    def kv_blocks_in_use(self) -> int | None:
        """KV blocks some row names now in a paged decoder's pool (a shared one once); None
        for a decoder without blocks."""
        pool = getattr(self.decoder, "pool", None)
        return None if pool is None else pool.in_use

    @property
    def prefix_blocks_shared(self) -> int | None:
        """Voice prefix blocks that several rows name now (paged decoder; None without blocks)."""
        return getattr(self.decoder, "shared_prefix_blocks", None)

    @property
    def crashed(self) -> BaseException | None:
        """The error that stopped the engine's thread (a bug or a broken runtime), else None."""
        return self._crashed

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        with self._cond:
            return len(self._waiting)

    def submit(self, text: str | SynthesisRequest | SynthesisPlan, **keywords: Any) -> EngineHandle:
        """Queue a request (any thread, any time); it joins the batch when a row is free.

        Args:
            text: what to say, or a ready :class:`~higgs_pack.runtime.request.SynthesisRequest`
                or a plan made for this engine's pipeline (a dialogue's,
                :func:`~higgs_pack.runtime.loop.dialogue.plan_dialogue`), then no keywords.
            keywords: those of :meth:`SynthesisRequest.create
                <higgs_pack.runtime.request.SynthesisRequest.create>`, as
                :meth:`higgs_pack.runtime.api.TTS.synthesize` and ``TTS.stream`` take them
                (``seed``, ``temperature``, ``top_k``, ``top_p``, ``max_frames``, ``ref_audio``
                with ``ref_text``, the stream schedule used when the handle is iterated).

        Returns:
            An :class:`EngineHandle`.

        Raises:
            EngineClosed: the engine is closed.
            InputError: a bad request (every bad field named), an unusable reference clip, a
                special token in the text, a sentence too long, or a request whose KV cache is
                larger than the engine's whole KV budget (both sizes named; here, at once).
        """
        handle = self._prepare(text, keywords)
        with self._cond:
            self._check_open()
            self._waiting.append(handle)
            self._cond.notify_all()
        return handle

    def submit_together(self, requests: Sequence[dict[str, Any]]) -> list[EngineHandle]:
        """Queue several requests at once: each is prepared (planned, its first prompt embedded)
        on the caller's thread, then all join the waiting queue under one lock, so the engine's
        thread admits them in one turn where rows are free (:meth:`submit` one by one lets the
        first start stepping alone while the next is still being planned).

        Args:
            requests: per request, the keywords of :meth:`submit` with ``text`` among them.

        Returns:
            One :class:`EngineHandle` per request, in order.

        Raises:
            EngineClosed, InputError: as :meth:`submit`; a bad request queues none of them.
        """
        handles = []
        for index, keywords in enumerate(requests):
            keywords = dict(keywords)
            if "text" not in keywords:
                raise InputError(f"submit_together: request {index} has no 'text'; give each request its text")
            handles.append(self._prepare(keywords.pop("text"), keywords))
        with self._cond:
            self._check_open()
            self._waiting.extend(handles)
            self._cond.notify_all()
        return handles

    def _prepare(self, text: str | SynthesisRequest | SynthesisPlan, keywords: dict[str, Any]) -> EngineHandle:
        """A handle for :meth:`submit`'s arguments, not queued yet (errors as :meth:`submit`)."""
        submitted = time.perf_counter()
        self._check_open()
        if isinstance(text, SynthesisPlan):
            if keywords:
                raise InputError(f"a plan carries its own options; got {', '.join(sorted(keywords))} beside it")
            plan = text
        else:
            plan = plan_request(self.pipeline, SynthesisRequest.of(text, keywords))
        self.kv.check_request(plan.positions)
        handle = EngineHandle(self, plan, submitted)
        # The first text chunk's prompt is embedded here, on the caller's thread (a voice's codes
        # through audio_embed take milliseconds to tens of them), not between the running rows' steps.
        handle._first_prompt = chunk_prompt(self.pipeline, plan, 0, [])
        # Its voice's persisted prefix is read from disk here too (a full-size file is about 63 MB).
        prefetch_prefix(self.prefix_cache, handle._first_prompt, self._prefix_layout)
        return handle

    def _check_open(self) -> None:
        if self._crashed is not None:
            raise EngineClosed(f"the engine's thread stopped on an error ({self._crashed!r}); make a new engine")
        if self._closing:
            raise EngineClosed("the engine is closed; make a new one with tts.engine()")

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # the engine's thread
    def _serve(self) -> None:
        """Admit, step, repeat, until closed; a failure outside any one request stops the engine."""
        try:
            while True:
                admitted = self._next_admissions()
                if admitted is None:
                    break
                for handle, row in admitted:
                    self._admit(handle, row)
                self._drop_cancelled()
                self._prefill_turn()
                if any(s.prompt is None for s in self._rows.values()):
                    self._step()
                self._riding = None  # a chunk no step took (its rows all ended): planned again next turn
        except BaseException as exc:  # a bug or a broken runtime: every request hears of it
            self._crashed = exc
            self._fail_all(exc)
            raise
        self._fail_all(EngineClosed("the engine was closed before this request finished"))

    def _next_admissions(self) -> list[tuple[EngineHandle, int]] | None:
        """Wait until there is work; pop waiting requests, oldest first, into the free rows
        (lowest first) while each one's KV fits what is left of the budget (the first that
        does not fit stops the admissions: first in, first out).  None when closing."""
        with self._cond:
            while True:
                for handle in [h for h in self._waiting if h.cancelled]:
                    self._waiting.remove(handle)
                    handle._fail(RequestCancelled("the request was cancelled before it started"))
                if self._closing:
                    return None
                if self._rows or self._waiting:
                    break
                self._cond.wait()
            free = [r for r in range(self.max_batch) if r not in self._rows]
            admitted = []
            for handle, row in zip(self._waiting, free, strict=False):
                if not self.kv.fits(handle.plan.positions):
                    if not handle.waited_for_kv:
                        handle.waited_for_kv = True
                        self.stats.kv_waits += 1
                    break
                handle.kv_reserved = self.kv.reserve(handle.plan.positions)
                admitted.append((handle, row))
            self.stats.max_kv_bytes_in_use = max(self.stats.max_kv_bytes_in_use, self.kv.in_use_bytes)
            del self._waiting[: len(admitted)]
            return admitted

    def _admit(self, handle: EngineHandle, row: int) -> None:
        state = _Row(handle, row, started=time.perf_counter())
        self._rows[row] = state
        self._start_chunk(state)

    def _start_chunk(self, state: _Row) -> None:
        """Embed the prompt of the row's current text chunk and queue it for prefill
        (:meth:`_prefill_turn`); a bad prompt fails this request alone."""
        req, c = state.handle.plan, self.pipeline.constants
        _, cap = req.chunks[state.chunk]
        t0 = time.perf_counter()
        try:
            prompt, state.handle._first_prompt = state.handle._first_prompt, None
            if state.chunk or prompt is None:
                prompt = chunk_prompt(self.pipeline, req, state.chunk, state.results)
            state.rules = CodeSteps(c, req.options, cap)
            check_context(prompt.length, state.rules.max_steps, self.decoder.max_length)
        except Exception as exc:  # this request's prompt: it fails alone
            self._leave(state, exc)
            return
        state.prompt, state.filled, state.looked_up, state.store_key = prompt, 0, False, None
        state.restored, state.prefill_s = 0, 0.0
        state.prompt_length = prompt.length
        state.first_frame_s = math.nan
        state.decoder_s = time.perf_counter() - t0
        self._prefilling.append(state)

    def _prefill_turn(self) -> None:
        """Prefill between steps: with no row decoding (or ``prefill_chunk=0``) every queued
        prompt whole; else one chunk of the oldest queued prompt (:meth:`_chunk_size`)."""
        if not self._prefilling:
            return
        decoding = [s for s in self._rows.values() if s.prompt is None]
        for other in decoding:
            other.waited_for_join = True
        if not decoding or self.prefill_chunk == 0:
            for state in list(self._prefilling):
                self._fill(state)
            return
        if getattr(self.decoder, "packs_prefill", False):
            self._ride(self._prefilling[0])
        else:
            self._fill(self._prefilling[0], chunked=True)

    def _chunk_size(self, remaining: int) -> int:
        """Positions of the next chunk of a prompt joining decoding rows (``remaining`` left):
        ``prefill_chunk``, or for ``"auto"`` what costs ``join_gap_steps - 1`` steps at the
        measured means (:data:`FIRST_PREFILL_CHUNK` before both are measured), at least
        :data:`MIN_PREFILL_CHUNK`; a rest shorter than that minimum (2 for a fixed size) joins
        the chunk, so no chunk of one position ends a prompt (it takes another kernel path)."""
        if self.prefill_chunk != "auto":
            n, least = int(self.prefill_chunk), 2
        elif self._step_cost is None or self._position_cost is None:
            n, least = FIRST_PREFILL_CHUNK, MIN_PREFILL_CHUNK
        else:
            n = int((self.join_gap_steps - 1) * self._step_cost / max(self._position_cost, 1e-9))
            n, least = max(n, MIN_PREFILL_CHUNK), MIN_PREFILL_CHUNK
        if remaining - n < least:
            n = remaining
        self.stats.prefill_chunk_positions = n
        return n

    def _fill(self, state: _Row, chunked: bool = False) -> None:
        """Prefill the rest of the row's prompt, or its next chunk (:meth:`_chunk_size`), from its cached
        voice prefix first when the cache holds it; on a miss the prefix is prefilled as a part
        of its own and kept (as :func:`~higgs_pack.runtime.loop.prefix_cache.cached_prefill`
        does, so the engine's codes equal ``synthesize``'s); once the prompt is done the row
        steps.  A failure fails this request alone."""
        prompt, row = state.prompt, state.row
        t0 = time.perf_counter()
        n, hidden = 0, None
        try:
            self._restore(state)
            budget = self._chunk_size(prompt.length - state.filled) if chunked else prompt.length - state.filled
            while budget > 0 and state.filled < prompt.length:
                start, end = self._part(state, budget)
                hidden = self.decoder.prefill(row, prompt.embeds[:, start:end], start=start,
                                              final=end == prompt.length)
                self._part_done(state, end)
                budget, n = budget - (end - start), n + end - start
        except Exception as exc:  # this request's prefill: it fails alone
            self._prefilling.remove(state)
            self._leave(state, exc)
            return
        self._filled(state, n, time.perf_counter() - t0, hidden)

    def _restore(self, state: _Row) -> None:
        """Look the row's voice prefix up once and restore it into the row on a hit."""
        if state.looked_up:
            return
        state.looked_up = True
        state.filled, state.store_key = restore_prefix(
            self.prefix_cache, state.prompt, self._prefix_layout,
            lambda arrays, length: self.decoder.write_prefix(state.row, arrays, length))
        state.restored = state.filled
        if state.filled:
            self.stats.prefix_hits += 1
        elif state.store_key is not None:
            self.stats.prefix_misses += 1

    @staticmethod
    def _part(state: _Row, budget: int) -> tuple[int, int]:
        """The next positions ``(start, end)`` of the row's prompt to prefill, at most ``budget``;
        a voice prefix still to be kept is a part of its own."""
        start = state.filled
        end = min(start + budget, state.prompt.length)
        if state.store_key is not None:
            end = min(end, state.prompt.prefix_length)
        return start, end

    def _part_done(self, state: _Row, end: int) -> None:
        """The row's prompt is prefilled up to ``end``: keep its voice prefix once it holds it."""
        state.filled = end
        prompt = state.prompt
        if state.store_key is not None and end == prompt.prefix_length:
            store_prefix(self.prefix_cache, prompt, self._prefix_layout, state.store_key,
                         self.decoder.read_prefix(state.row, prompt.prefix_length), background=True)
            state.store_key = None

    def _filled(self, state: _Row, n: int, dt: float, hidden: np.ndarray | None) -> None:
        """Count ``n`` positions prefilled in ``dt`` s; once the prompt is done the row steps
        from ``hidden``'s last position."""
        prompt = state.prompt
        self.stats.prefill_seconds += dt
        self.stats.prefill_positions += n
        self.stats.prefill_chunks += 1
        self._position_cost = _running_mean(self._position_cost, dt / max(n, 1))
        state.decoder_s += dt
        state.prefill_s += dt
        if state.filled < prompt.length:
            return
        c = self.pipeline.constants
        self._prefilling.remove(state)
        state.prompt = None
        state.checks = FiniteChecks(self.pipeline, {"hidden": (1, 1, c.hidden_size),
                                                     "logits": (c.num_codebooks, c.audio_vocab_size)})
        state.last = np.array(hidden[:, -1:], dtype=np.float32)
        state.last_frame_at, state.waited_for_join = 0.0, False

    def _ride(self, state: _Row) -> None:
        """Plan the row's next prompt chunk to ride in the next step's decoder forward (a decoder
        with ``packs_prefill``: prefill and decode share one forward, issue 39)."""
        try:
            self._restore(state)
        except Exception as exc:  # this request's restore: it fails alone
            self._prefilling.remove(state)
            self._leave(state, exc)
            return
        if state.filled < state.prompt.length:
            self._riding = (state, *self._part(state, self._chunk_size(state.prompt.length - state.filled)))
        else:  # the cached prefix was the whole prompt but its last position: never here (prefix < prompt)
            self._fill(state, chunked=True)

    def _drop_cancelled(self) -> None:
        for state in [s for s in self._rows.values() if s.handle.cancelled]:
            self._leave(state, RequestCancelled("the request was cancelled"))

    def _leave(self, state: _Row, error: BaseException | None = None) -> None:
        """Free the row; tell the handle why it ended when it did not finish (once)."""
        if self._rows.get(state.row) is not state:
            return
        del self._rows[state.row]
        if state in self._prefilling:
            self._prefilling.remove(state)
        self.decoder.release(state.row)
        self.kv.release(state.handle.kv_reserved)
        state.handle.kv_reserved = 0
        if error is not None:
            state.handle._fail(error)
        else:
            state.handle._set_finished()

    def _fail_all(self, exc: BaseException) -> None:
        for state in list(self._rows.values()):
            self._leave(state, exc)
        with self._cond:
            waiting, self._waiting = self._waiting, []
        for handle in waiting:
            handle._fail(exc)

    def _step(self) -> None:
        """One frame for every busy row: heads in one run, sampling per row, then the rows
        still going through the audio embedding and the decoder in one run each."""
        t0 = time.perf_counter()
        c = self.pipeline.constants
        states = [s for s in (self._rows[r] for r in sorted(self._rows)) if s.prompt is None and self._hidden_ok(s)]
        if not states:
            return
        try:
            last = np.concatenate([s.last for s in states])
            logits = self.pipeline.audio_heads.run({"hidden_states": last})["audio_logits"]
        except Exception as exc:  # the batch's run failed: every row in it fails
            for state in states:
                self._leave(state, exc)
            return
        rode = self._riding is not None
        going = []
        for i, state in enumerate(states):
            codes = self._draw(state, logits[i, -1].reshape(c.num_codebooks, c.audio_vocab_size))
            if codes is not None:
                going.append((state, codes))
        if going:
            self._feed_back(going)
        self.stats.steps += 1
        self.stats.frames += len(states)
        self.stats.max_rows = max(self.stats.max_rows, len(states))
        dt = time.perf_counter() - t0
        self.stats.step_seconds += dt
        if not rode:  # a step's own cost, without a prompt chunk riding in its forward
            self._step_cost = _running_mean(self._step_cost, dt)

    def _hidden_ok(self, state: _Row) -> bool:
        try:
            state.checks.hidden(state.last, state.rules.steps)
        except HiggsPackError as exc:
            self._leave(state, exc)
            return False
        return True

    def _draw(self, state: _Row, logits: np.ndarray) -> np.ndarray | None:
        """Sample the row's next codes and send them; None when the row does not go on
        (its chunk ended, or its logits were not finite)."""
        try:
            state.checks.finite("audio_heads", logits, "logits")
        except HiggsPackError as exc:
            self._leave(state, exc)
            return None
        rules = state.rules
        codes = rules.draw(logits)  # a row of rules' buffer, never overwritten: safe to hand over
        now = time.perf_counter()
        if rules.steps == 1:
            state.first_frame_s = now - state.started
        elif state.waited_for_join:
            gap_ms = 1000 * (now - state.last_frame_at)
            self.stats.join_max_frame_gap_ms = max(self.stats.join_max_frame_gap_ms, gap_ms)
        state.last_frame_at, state.waited_for_join = now, False
        state.handle._send("codes", state.chunk, codes)
        if not rules.done:
            return codes
        self._end_chunk(state)
        return None

    def _end_chunk(self, state: _Row) -> None:
        """Send the finished chunk's result; prefill the next text chunk, or leave."""
        rules = state.rules
        delayed = rules.delayed
        result = GenerationResult(delayed=delayed, codes=rules.codes(delayed), stop_reason=rules.stop_reason,
                                  prompt_length=state.prompt_length, first_frame_s=state.first_frame_s,
                                  seconds=time.perf_counter() - state.started, decoder_seconds=state.decoder_s,
                                  prefilled=state.prompt_length - state.restored, prefill_s=state.prefill_s)
        state.handle._send("end", state.chunk, result)
        state.results.append(result)
        if state.chunk + 1 < len(state.handle.plan.chunks) and not state.handle.cancelled:
            state.chunk += 1
            state.started = time.perf_counter()
            self._start_chunk(state)
        else:
            self._leave(state)

    def _feed_back(self, going: list[tuple[_Row, np.ndarray]]) -> None:
        """The going rows' codes -> audio embedding (one run) -> decoder step (one run, with the
        riding prompt chunk when one is planned: :meth:`_ride`)."""
        states = [s for s, _ in going]
        riding, self._riding = self._riding, None
        if riding is not None and self._rows.get(riding[0].row) is not riding[0]:
            riding = None  # it left meanwhile
        try:
            codes = np.stack([codes for _, codes in going])[:, None, :]
            embeds = self.pipeline.audio_embed.run({"codes": codes})["audio_embeds"]
            ok = []
            for i, state in enumerate(states):
                try:
                    state.checks.finite("audio_embed", embeds[i:i + 1], None)
                    ok.append(i)
                except HiggsPackError as exc:
                    self._leave(state, exc)
            if not ok and riding is None:
                return
            states = [states[i] for i in ok]
            rows = np.array([s.row for s in states], dtype=np.int64)
            t0 = time.perf_counter()
            if riding is None:
                hidden = self.decoder.step(rows, embeds[ok])
            else:
                chunk, start, end = riding
                hidden, chunk_hidden = self.decoder.step(
                    rows, embeds[ok], prefill=(chunk.row, chunk.prompt.embeds[:, start:end], start))
            dt = time.perf_counter() - t0
        except Exception as exc:  # the batch's run failed: every row in it fails
            for state in states + ([riding[0]] if riding else []):
                self._leave(state, exc)
            return
        for i, state in enumerate(states):
            np.copyto(state.last, hidden[i:i + 1])
            state.decoder_s += dt
        if riding is None:
            self._forward_cost = _running_mean(self._forward_cost, dt)
        else:
            self._rode(riding, chunk_hidden, max(dt - (self._forward_cost or 0.0), 0.0))

    def _rode(self, riding: tuple[_Row, int, int], hidden: np.ndarray, dt: float) -> None:
        """The riding chunk's bookkeeping after its forward (``dt``: its share of the time)."""
        state, start, end = riding
        try:
            self._part_done(state, end)
        except Exception as exc:  # keeping its prefix failed: it fails alone
            self._prefilling.remove(state)
            self._leave(state, exc)
            return
        self._filled(state, end - start, dt, hidden)
