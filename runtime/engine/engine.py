"""Many requests at once: a continuous-batching engine over one pipeline (:class:`Engine`).

``Engine.submit`` may be called at any time from any thread; it checks and plans the request
on the caller's thread (the reference voice is codec-encoded there) and returns an
:class:`~higgs_pack.runtime.engine.handle.EngineHandle`.  One background thread runs the steps:

1. admit waiting requests into free rows (lowest first), in the order they were submitted,
   while their KV fits the budget the admitted requests leave (:mod:`~higgs_pack.runtime.loop.
   kv_memory`; each counts its peak, ``positions x`` the decoder's KV bytes per position): embed
   the prompt and prefill it on the row (:meth:`~higgs_pack.runtime.engine.decoders.BatchedDecoder.prefill`); they join between
   steps.  Admission is strictly first-in, first-out: when the oldest waiting request does not
   fit, none behind it is admitted either (a stream of small requests never starves a large
   one; it waits only for requests admitted before it to leave), and a request larger than the
   whole budget is refused at submit;
2. one step for all busy rows: the audio heads on every row's last hidden state in one run,
   then per row its own :class:`~higgs_pack.runtime.loop.frames.CodeSteps` (sampler, random
   generator seeded with the request's seed, delay-pattern ramps, stop rules), so a request's
   codes do not depend on the other rows; the rows still going feed their codes through the
   audio embedding in one run and the decoder in one run (:meth:`~higgs_pack.runtime.engine.decoders.BatchedDecoder.step`);
3. a request whose last text chunk is done, that was cancelled, or whose row failed leaves at
   once and frees its row.  A long text planned as several chunks re-prefills its row.

The codec runs on the engine's one codec thread (:class:`~higgs_pack.runtime.engine.codec_batch.
CodecBatcher`, ``Engine.codec``), not on the engine's thread nor on the threads that read the
handles (:meth:`~higgs_pack.runtime.engine.handle.EngineHandle.result`, or iterating it for streamed chunks): a reader hands its
windows of codes over and waits, and windows of the same length that several readers need at
about the same time are decoded as one batched run (see that module for why).  While an engine is open,
use it rather than the pipeline's own ``synthesize`` / ``stream`` on other threads: both share
the sub-parts' per-step buffers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from numbers import Integral
from typing import Any

from higgs_pack.errors import InputError, Problem
from higgs_pack.runtime.engine.codec_batch import CodecBatcher
from higgs_pack.runtime.engine.decoders import BatchedDecoder
from higgs_pack.runtime.engine.handle import EngineClosed, EngineHandle, RequestCancelled
from higgs_pack.runtime.engine.joins import MIN_PREFILL_CHUNK, PromptJoins
from higgs_pack.runtime.engine.kv_memory import KVBudget, default_kv_budget
from higgs_pack.runtime.engine.state import EngineStats, Row
from higgs_pack.runtime.engine.steps import BatchSteps
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.plan import SynthesisPlan, chunk_prompt, plan_request
from higgs_pack.runtime.loop.prefix_cache import PrefixCache, prefetch_prefix, prefix_layout
from higgs_pack.runtime.request import SynthesisRequest

#: Default most positions per request of :meth:`higgs_pack.TTS.engine` (prompt + frames; 4096
#: positions hold 2.7 minutes of audio at 25 frames per second).
DEFAULT_MAX_LENGTH = 4096
#: ``join_gap_steps`` default where a joining prompt's chunk is a forward of its own between the
#: running rows' steps: they wait about two of their steps for their next frame (issue 32 item 3;
#: a chunk's fixed part, every weight read once, is near a step at full size on 2 vCPUs).
DEFAULT_JOIN_GAP_STEPS = 2.0
#: ``join_gap_steps`` default where the chunk rides in the running rows' step (``packs_prefill``:
#: OpenVINO's paged engine), issue 39's goal.  At full size (Intel Xeon, 2 vCPUs, OpenVINO 2026.4.1;
#: docs/benchmarks/runs/paged-vs-stateful-full-xeon-quiet-2026-12-06.json, -warm-2026-12-07.json)
#: the running rows waited 1.2-2.6 of their steps at a voice join at batch 4 and 8, and the voice
#: joiner's first audio was 0.41-0.91x the spliced stateful engine's.
PACKED_JOIN_GAP_STEPS = 1.5
#: A stream's first audio waits on one codec step: the frames of its first chunk and the lookahead
#: not fed yet (all of them, 11 frames, with ``first_chunk_frames`` 1 and no earlier feed: about 80 ms
#: alone at the bench preset, 140 ms at full size, on 2 vCPUs; up to
#: :data:`~higgs_pack.runtime.loop.stateful_codec.FEED_FRAMES` fed as they come); run beside the
#: engine's steps it shared the cores with them and its listener waited longer.  So while it runs the engine holds its steps
#: (:meth:`Engine._hold_for_first_audio`), once per stream and at most :data:`MAX_HOLD_S`, when
#: every other decoding row has at least ``HOLD_LEAD_S`` of audio in hand (made ahead of real time
#: since its first frame, its delay ramp and the codec's lookahead not counted): a hold cannot
#: make such a row's listener wait.  Measured (issue 41; bench preset cpu int4, Intel Xeon, 2
#: vCPUs, one stream): first audio 241-251 ms with the steps running beside it, 178-187 ms held.
HOLD_LEAD_S = 1.0
MAX_HOLD_S = 0.5

log = logging.getLogger(__name__)


class Engine(BatchSteps, PromptJoins):
    """Serves many requests with one decoder step for all busy rows (see the module docstring).

    Use :meth:`higgs_pack.TTS.engine` to make one; close it (or use ``with``) to stop its thread.

    This class takes requests, admits them and runs the thread's turns; its thread's other parts
    are the classes it inherits: the batch stepping (:class:`~higgs_pack.runtime.engine.steps.
    BatchSteps`) and the prompts joining the rows (:class:`~higgs_pack.runtime.engine.joins.
    PromptJoins`).

    Args:
        pipeline: the loaded bundle's pipeline (its tokenizer, sub-parts and constants).
        decoder: the :class:`~higgs_pack.runtime.engine.decoders.BatchedDecoder` (its ``max_length`` bounds each request's
            prompt + frames; long texts are planned in chunks that fit it).
        max_kv_bytes: most bytes of KV cache the admitted requests may reach together (int
            >= 1); None (default): :func:`~higgs_pack.runtime.engine.kv_memory.default_kv_budget`,
            half the memory available now, at most all rows full, when the cache is host memory
            (a cache in GPU memory gets no default limit).  Ignored when the decoder does not
            state its KV bytes per position (then admission is by free rows only).
        prefill_chunk: how a prompt joining rows that are decoding is prefilled: ``"auto"``
            (default) in chunks sized at run time from the measured cost of a step and the
            positions per second the chunks so far have taken (:mod:`~higgs_pack.runtime.engine.joins`
            says why), so a running request waits about ``join_gap_steps`` of its own steps for
            its next frame; a whole number >= 2: chunks of that many positions; 0:
            whole prompts (each running request waits for all of it).  On a decoder that packs
            prefill (``packs_prefill``: OpenVINO's paged one) each chunk rides in the running rows'
            step, one forward for both.  A prompt with no row decoding beside it is prefilled whole.  Chunks never leave a last chunk of one
            position (merged into the one before).
        join_gap_steps: ``"auto"``'s target, in steps of the running rows (> 1; None, the
            default: :data:`PACKED_JOIN_GAP_STEPS` on a decoder that packs prefill, else
            :data:`DEFAULT_JOIN_GAP_STEPS`): each chunk costs about ``join_gap_steps - 1`` steps.
            A larger target brings the joining request's first frame closer to its prefill
            alone (it waits one step per chunk: about ``1 + 1 / (join_gap_steps - 1)`` times its
            prefill alone), a smaller one keeps the running streams smoother.

    Attributes:
        max_batch: rows decoded together.
        stats: :class:`~higgs_pack.runtime.engine.state.EngineStats`.
        prefix_cache: the pipeline's :class:`~higgs_pack.runtime.loop.prefix_cache.PrefixCache`
            (voice prefixes' KV, shared with ``synthesize`` / ``stream``), or None.
        codec: the :class:`~higgs_pack.runtime.engine.codec_batch.CodecBatcher` that decodes every
            handle's audio (its ``stats``: runs, windows per run, seconds).

    Raises:
        InputError: ``max_kv_bytes`` is not a whole number >= 1, a bad ``prefill_chunk`` or
            ``join_gap_steps``.
    """

    def __init__(self, pipeline: Pipeline, decoder: BatchedDecoder, *, max_kv_bytes: int | None = None,
                 prefill_chunk: int | str = "auto", join_gap_steps: float | None = None):
        if prefill_chunk != "auto" and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, Integral)
                                        or prefill_chunk < 0 or prefill_chunk == 1):
            raise InputError.of(Problem.said(f"prefill_chunk must be 'auto', 0 (whole prompts) or a whole number of positions >= 2, "
                             f"got {prefill_chunk!r}"))
        if join_gap_steps is None:
            join_gap_steps = PACKED_JOIN_GAP_STEPS if getattr(decoder, "packs_prefill", False) else DEFAULT_JOIN_GAP_STEPS
        if isinstance(join_gap_steps, bool) or not isinstance(join_gap_steps, (int, float)) \
                or not join_gap_steps > 1 or not math.isfinite(join_gap_steps):
            raise InputError.of(Problem.said(f"join_gap_steps must be a number of steps > 1, got {join_gap_steps!r}"))
        self.prefill_chunk = prefill_chunk
        self.join_gap_steps = float(join_gap_steps)
        if max_kv_bytes is not None and (isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, Integral)
                                         or max_kv_bytes < 1):
            raise InputError.of(Problem.said(f"max_kv_bytes must be a whole number of bytes >= 1 (or None: from the free memory), "
                             f"got {max_kv_bytes!r}"))
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
        self._prefilling: list[Row] = []  # rows whose prompt is being prefilled, oldest first
        self._riding: tuple[Row, int, int] | None = None  # (row, start, end) of the next step's chunk
        self._forward_cost: float | None = None  # running mean: seconds of a decoder step alone
        self._step_cost: float | None = None  # running means: seconds of a step, positions per second of a chunk
        self._chunk_rate: float | None = None
        self._chunk_last, self._chunk_carry = MIN_PREFILL_CHUNK, 0.0  # the last chunk measured; a size's fraction
        self._cond = threading.Condition()
        self._waiting: list[EngineHandle] = []
        self._rows: dict[int, Row] = {}
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
        """Stop the thread after its current step; unfinished requests get :class:`~higgs_pack.runtime.engine.handle.EngineClosed`.
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
            An :class:`~higgs_pack.runtime.engine.handle.EngineHandle`.

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
            One :class:`~higgs_pack.runtime.engine.handle.EngineHandle` per request, in order.

        Raises:
            EngineClosed, InputError: as :meth:`submit`; a bad request queues none of them.
        """
        handles = []
        for index, keywords in enumerate(requests):
            keywords = dict(keywords)
            if "text" not in keywords:
                raise InputError.of(Problem.said(f"submit_together: request {index} has no 'text'; give each request its text"))
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
                raise InputError.of(Problem.said(f"a plan carries its own options; got {', '.join(sorted(keywords))} beside it"))
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
                self._hold_for_first_audio()
                self._prefill_turn()
                if any(s.prompt is None for s in self._rows.values()):
                    self._step()
                self._riding = None  # a chunk no step took (its rows all ended): planned again next turn
        except BaseException as exc:  # a bug or a broken runtime: every request hears of it
            self._crashed = exc
            self._fail_all(exc)
            raise
        self._fail_all(EngineClosed("the engine was closed before this request finished"))

    def _hold_for_first_audio(self) -> None:
        """Hold the steps while a stream's first codec step runs (:data:`HOLD_LEAD_S` says why),
        once per stream and at most :data:`MAX_HOLD_S`, if every other decoding row has
        :data:`HOLD_LEAD_S` of audio in hand; rows still prefilling do not count (a hold delays
        their prefill by the codec step that would otherwise have slowed it)."""
        owners = self.codec.first_steps()
        if not owners:
            return
        waiting = [s for s in self._rows.values() if any(s.handle is o for o in owners)]
        if not waiting or all(s.held_for_first_audio for s in waiting):
            return
        c, spec = self.pipeline.constants, self.pipeline.stream_codec
        frame_s = c.hop_length / c.sample_rate
        unheard = c.num_codebooks - 1 + (spec.lookahead_frames if spec is not None else 0)  # steps before audio
        now = time.perf_counter()
        for state in self._rows.values():
            if any(state is w for w in waiting) or state.prompt is not None:
                continue
            if state.audio_from is None or (state.frames_out - unheard) * frame_s - (now - state.audio_from) < HOLD_LEAD_S:
                return
        for state in waiting:
            state.held_for_first_audio = True
        t0 = time.perf_counter()
        self.codec.wait_first_steps(MAX_HOLD_S)
        self.stats.first_audio_holds += 1
        self.stats.first_audio_hold_seconds += time.perf_counter() - t0

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

    def _fail_all(self, exc: BaseException) -> None:
        for state in list(self._rows.values()):
            self._leave(state, exc)
        with self._cond:
            waiting, self._waiting = self._waiting, []
        for handle in waiting:
            handle._fail(exc)
