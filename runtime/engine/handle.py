"""One submitted request as its caller holds it (:class:`EngineHandle`): its speech read whole or
streamed as frames are generated, waited for, cancelled; and the two ways a request ends
without its speech (:class:`RequestCancelled`, :class:`EngineClosed`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Generator, Iterator
from typing import Any, Protocol

import numpy as np

from higgs_pack.errors import HiggsPackError, InputError, Problem
from higgs_pack.runtime.engine.codec_batch import CodecBatcher
from higgs_pack.runtime.loop.decode import GenerationResult
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.plan import SynthesisPlan
from higgs_pack.runtime.loop.prefix_cache import Prompt
from higgs_pack.runtime.loop.streaming import AudioChunk, SpeechStream
from higgs_pack.runtime.loop.synthesis import SynthesisResult, join_results

log = logging.getLogger(__name__)


class RequestCancelled(HiggsPackError):
    """The request was cancelled (:meth:`EngineHandle.cancel`) before it finished."""


class EngineClosed(HiggsPackError):
    """The engine was closed (or its thread stopped) before the request finished."""


class Owner(Protocol):
    """What a handle uses of its :class:`~higgs_pack.runtime.engine.engine.Engine` (that module
    imports this one): the pipeline, the codec thread, and the wake-up of the engine's thread."""

    pipeline: Pipeline
    codec: CodecBatcher

    def _wake(self) -> None: ...


class EngineHandle:
    """One submitted request: read its speech with :meth:`result`, or iterate it for
    :class:`~higgs_pack.runtime.loop.streaming.AudioChunk` as frames are generated (not both).

    Errors of this request (a bad prompt found at admission, non-finite output of its row)
    are raised here, by :meth:`result` or while iterating; other requests go on.
    """

    def __init__(self, engine: Owner, plan: SynthesisPlan, submitted: float):
        self._engine = engine
        self.plan = plan
        """The request as the loop runs it (:class:`~higgs_pack.runtime.loop.plan.SynthesisPlan`)."""
        self.submitted = submitted
        """``time.perf_counter()`` at :meth:`~higgs_pack.runtime.engine.engine.Engine.submit` (a stream's ``first_audio_s`` counts from it)."""
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

    def _codec_step(self, codes: np.ndarray, start: int, end: int, state: np.ndarray, first_audio: bool = False,
                    ) -> tuple[np.ndarray, np.ndarray]:
        self._raise_if_cancelled()
        return self._engine.codec.step(codes, start, end, state, self, first_audio=first_audio)

    def _claim(self) -> None:
        if self._read:
            raise InputError.of(Problem.said("this request's speech was already read (result() or iteration, once)"))
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
