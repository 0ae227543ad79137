"""Codec decoding batched across requests: one codec thread per engine (:class:`CodecBatcher`).

The engine's readers (:meth:`EngineHandle.result <higgs_pack.runtime.engine.handle.EngineHandle.result>`
and streams iterating handles) do not run the codec (``audio_tokenizer``) themselves: they hand
their windows of codes to the engine's one codec thread and wait.  That thread takes every
window waiting, groups those of the same shape (frames T, codebooks N) and decodes each group as
ONE run on int64 codes [k, N, T] -> float32 waveform [k, 1, T * hop]; row i of the output is
window i's samples.

Why one thread owned by the engine, and not the readers' threads:

* the codec is compute-bound (transposed convolutions over 960 samples per frame) and the machine
  is the decoder's too.  With B streams, B reader threads each running their own codec decode
  put up to B runs on the cores at once (each with the session's intra-op workers spinning
  between operators), beside the engine thread's decoder steps; one thread runs one codec run at
  a time, so the codec holds at most one session's worth of threads, whatever B is;
* windows due together are decoded together: the B streams of a batch that started together
  with the same schedule reach a window at the same engine step (their cores and contexts have
  the same sizes), so at steady state one run of [B, N, T] replaces B runs of [1, N, T] (per
  operator overheads and the weight reads are paid once);
* a window's reader blocks until its window is decoded, so a stream never has more than one
  window waiting, and the codec thread can tell when every open stream has one (it then runs at
  once; otherwise it waits at most :data:`GATHER_S` for one more, :data:`MAX_GATHER_S` in all).

The codec session keeps the bundle's thread settings (``session_options`` of the manifest: by
default ONNX Runtime's one intra-op worker per core, spinning only within a run,
:data:`~higgs_pack.runtime.backends.onnxruntime.sessions.THREAD_POOL_DEFAULTS`); while a codec run
and a decoder step overlap they share the cores, as they did before, but never more than one
codec run does.  The streaming codec's session (``audio_tokenizer_stream``, which runs only beside
the decoder) gets half the CPUs on the CPU provider
(:func:`~higgs_pack.runtime.backends.onnxruntime.sessions.stream_codec_thread_pool`).

What batching cannot do on a small CPU: the codec's work per frame exceeds the decoder's.  On
the bench bundles (AMD EPYC, 2 vCPUs, load 10-13) the codec takes 13-20 ms per window frame
alone or batched (rows of a batch cost about the same per frame: the convolutions are
compute-bound), and a 100-frame request streamed with the default schedule decodes 166 window
frames (21 + 42 + 62 + 41: each core with 11 frames of context per side), about 25-33 ms of codec
per frame, against a cpu int4 engine step of 10 ms at batch 1 and 5.5 ms per frame at batch 8.
Streamed throughput then stays well under the plain run's (``stream_over_plain`` 0.57-0.65 at
batch 1-8 on cpu int4, ``python -m bench --batch 1,2,4,8``) until the codec
gets cheaper per frame (fewer context frames per window, a stateful export that keeps the left
context's activations, a quantized codec) or cores of its own.

Exactness: only windows of the same length are stacked, never padded.  Padding a window with
codes would change its output: the codec's convolutions zero-pad at the input's end, and pad
codes are not zeros once embedded, so a window whose end is the real end of the input (the
last window of every stream and every ``result()``) would decode differently (the static NPU
codec has a ``valid_frames`` input for exactly this; the dynamic ones do not).  A batched
convolution computes each row on its own, so row i equals window i decoded alone within float
rounding (max abs difference 0.0 measured on the bench bundles' codec, ONNX Runtime CPU and
OpenVINO CPU; the tests allow :data:`BATCH_ATOL`).

Stream steps: with the stateful streaming codec (``audio_tokenizer_stream``; streams of bundles built
since manifest format 2) a stream hands over :meth:`CodecBatcher.step` calls instead of windows:
its next frames, their offset and end and its state row.  Steps with the same frame count share
one run, their states stacked as rows of ``codec_state`` [k, S] and split back after it (each row
is its own stream: ``exporters/pytorch/stream_codec.py``); :attr:`CodecBatcher.batch_streams`
False runs them one per run (``python -m bench.decoder.stream_codec`` measures both).  Each frame is then
decoded once, not once per window plus its context.

Fallbacks: a static-shape codec (the NPU variant: batch 1 in its IR) gets one row per run
(:attr:`CodecBatcher.batched` False, :attr:`CodecBatcher.reason` says why).  A batched run that
fails is retried one row per run, so only the windows that fail alone fail (their request gets
:class:`CodecRunError`, chained to the runtime's error); a window whose owner is cancelled
(:meth:`CodecBatcher.withdraw`) leaves the queue without a run.  Once the batcher is closed
(the engine closing), windows still waiting, and any asked for later, are decoded on the
reader's own thread, one at a time as before: a request the engine finished stays readable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from higgs_pack.errors import HiggsPackError
from higgs_pack.runtime.loop.codec import decode_codes
from higgs_pack.runtime.loop.decode import check_finite
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.stateful_codec import runner_step

#: Seconds the codec thread waits for one more window after the last one arrived (while some
#: open stream has none waiting): readers wake a little apart after the engine step that made
#: their windows due.  Small beside a codec run (tens to hundreds of ms per window on CPU).
GATHER_S = 0.005
#: Most seconds the codec thread waits for windows in all before it runs what it has.
MAX_GATHER_S = 0.02
#: Most frames (rows x T) decoded in one run: caps the activations of one batched run (each
#: frame is 960 samples through every convolution layer); one window is always taken whole.
MAX_RUN_FRAMES = 1024
#: Float tolerance the tests allow between a row of a batched run and the window decoded alone.
BATCH_ATOL = 1e-5

log = logging.getLogger(__name__)


class CodecRunError(HiggsPackError):
    """The codec (``audio_tokenizer``) failed on a request's window of codes (the runtime's
    error is chained as ``__cause__``)."""


@dataclass
class CodecStats:
    """What the codec thread did.

    Attributes:
        runs: codec runs.
        windows: windows decoded by those runs (``windows / runs``: rows per run on average).
        frames: frames decoded (context frames included).
        seconds: seconds inside the runs.
        max_run_seconds: the longest run's seconds.
        max_rows: most windows in one run.
        retried: batched runs that failed and were retried one row per run.
        withdrawn: windows dropped unrun because their request was cancelled.
    """

    runs: int = 0
    windows: int = 0
    frames: int = 0
    seconds: float = 0.0
    max_run_seconds: float = 0.0
    max_rows: int = 0
    retried: int = 0
    withdrawn: int = 0


class _Job:
    """One window: int64 codes [T, N] of one owner; ``done`` is set with samples or an error,
    or with ``alone`` (decode it on the waiting thread: the batcher closed).  A stream step
    (``stream``: ``(start_frame, end_frame, state)`` of the stateful codec) sets ``state`` too."""

    __slots__ = ("alone", "codes", "done", "error", "owner", "samples", "state", "stream")

    def __init__(self, codes: np.ndarray, owner: Any, stream: tuple[int, int, np.ndarray] | None = None):
        self.codes, self.owner, self.stream = codes, owner, stream
        self.done = threading.Event()
        self.samples: np.ndarray | None = None
        self.state: np.ndarray | None = None
        self.error: BaseException | None = None
        self.alone = False

    @property
    def key(self) -> tuple[Any, ...]:
        """Jobs of one key share a run: windows of one shape; stream steps of one frame count."""
        return (*self.codes.shape, "stream") if self.stream is not None else self.codes.shape


def batch_support(runner: Any) -> tuple[bool, str]:
    """Whether a codec runner takes more than one row per run, and why not.

    A static-shape runner (``OvStaticSubPart``: an ``in_shape`` with batch 1, the NPU variant)
    takes one row; the exported ONNX and OpenVINO IR codecs have a symbolic batch axis
    (``audio_codes`` [batch, N, frames], ``exporters/pytorch/modules.py`` ``DYNAMIC_AXES``).

    Returns:
        ``(batched, reason)``; reason is "" when batched.
    """
    shape = getattr(runner, "in_shape", None)
    if shape is not None and len(shape) and int(shape[0]) == 1:
        return False, f"the codec is compiled with static shape {list(shape)} (batch 1): one window per run"
    return True, ""


class CodecBatcher:
    """The engine's codec thread: decodes the windows its readers hand over, batched (see the
    module docstring).

    Args:
        pipeline: the bundle's pipeline (its ``audio_tokenizer`` runs here; nothing else does).
        max_run_frames: most frames (rows x T) per run (:data:`MAX_RUN_FRAMES`).
        gather_s, max_gather_s: waits for more windows (:data:`GATHER_S`, :data:`MAX_GATHER_S`).

    Attributes:
        batched: whether windows of the same shape share a run (False: one per run).
        reason: why not, when not ("").
        stats: :class:`CodecStats`.
    """

    def __init__(self, pipeline: Pipeline, *, max_run_frames: int = MAX_RUN_FRAMES, gather_s: float = GATHER_S,
                 max_gather_s: float = MAX_GATHER_S):
        self._pipeline = pipeline
        self._max_run_frames = int(max_run_frames)
        self._gather_s, self._max_gather_s = float(gather_s), float(max_gather_s)
        self.batched, self.reason = batch_support(pipeline.audio_tokenizer)
        if not self.batched:
            log.info("codec batching off: %s", self.reason)
        stream = pipeline.audio_tokenizer_stream
        #: Whether stream steps of several requests share a run (:meth:`step`); settable (the bench
        #: compares both).
        self.batch_streams = stream is not None and batch_support(stream)[0]
        self.stats = CodecStats()
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._first: dict[int, Any] = {}  # a stream's first step (its first audio) waiting or running: id(job) -> owner
        self._streams = 0
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="higgs-pack-codec", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the codec thread runs (False once closed)."""
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Windows waiting for a run."""
        with self._cond:
            return len(self._pending)

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread after its current run; windows still waiting are handed back to their
        readers, which decode them on their own threads (as every later window).  Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Count an open stream while inside (it hands over one window at a time; the codec
        thread runs at once when every open stream has one waiting)."""
        with self._cond:
            self._streams += 1
        try:
            yield
        finally:
            with self._cond:
                self._streams -= 1
                self._cond.notify_all()

    def decode(self, codes: np.ndarray, owner: Any = None) -> np.ndarray:
        """Decode one window: int64 codes [T, N] -> float32 samples [T * hop] (``decode_codes``'s
        contract).  Blocks until its run is done.

        Args:
            codes: the window's codes, frames first.
            owner: who asked (an ``EngineHandle``), for :meth:`withdraw`.

        Raises:
            CodecRunError: the codec failed on this window (run alone).
            NumericalError: its samples are not finite.
            Whatever :meth:`withdraw` gave for a cancelled owner.
        """
        return self.decode_many([codes], owner)[0]

    def decode_many(self, windows: list[np.ndarray], owner: Any = None) -> list[np.ndarray]:
        """Decode several windows of one owner (a request's text chunks) in as few runs as their
        shapes allow; :meth:`decode` for each, in order."""
        jobs = [_Job(np.asarray(codes), owner) for codes in windows]
        with self._cond:
            if self._closed:
                for job in jobs:
                    job.alone = True
                    job.done.set()
            else:
                for job in jobs:
                    if job.codes.shape[0] == 0:
                        job.samples = np.zeros(0, dtype=np.float32)
                        job.done.set()
                    else:
                        self._pending.append(job)
                self._cond.notify_all()
        out = []
        for job in jobs:
            job.done.wait()
            if job.alone:
                out.append(decode_codes(self._pipeline, job.codes))
            elif job.error is not None:
                raise job.error
            else:
                out.append(job.samples)
        return out

    def step(self, codes: np.ndarray, start: int, end: int, state: np.ndarray, owner: Any = None,
             first_audio: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """One call of a stream's stateful codec (``audio_tokenizer_stream``,
        :class:`~higgs_pack.runtime.loop.stateful_codec.Step`): int64 codes [T, N], its frame offset and
        end, float32 state [S] -> (float32 samples [T * hop], new state [S]).  Steps of several
        streams with the same T share one run (their states stacked as rows) while
        :attr:`batch_streams`; blocks until its run is done.  ``first_audio``: the stream's first
        audio waits on this step (:meth:`first_steps` lists its owner meanwhile).

        Raises:
            CodecRunError: the codec failed on this step (run alone).
            NumericalError: its samples are not finite.
        """
        job = _Job(np.asarray(codes), owner, (int(start), int(end), np.asarray(state, dtype=np.float32)))
        with self._cond:
            alone = self._closed
            if not alone:
                self._pending.append(job)
                if first_audio:  # what the stream's listener waits for
                    self._first[id(job)] = owner
                self._cond.notify_all()
        if not alone:
            try:
                job.done.wait()
            finally:
                if first_audio:
                    with self._cond:
                        self._first.pop(id(job), None)
                        self._cond.notify_all()
            if job.error is not None:
                raise job.error
            if not job.alone:
                return job.samples, job.state
        return runner_step(self._pipeline.audio_tokenizer_stream.run)(job.codes, *job.stream)

    def first_steps(self) -> list[Any]:
        """The owners of streams whose first audio's step (:meth:`step` with ``first_audio``) is
        waiting or running now."""
        with self._cond:
            return list(self._first.values())

    def wait_first_steps(self, timeout: float) -> bool:
        """Block until no stream's first step waits or runs, at most ``timeout`` seconds; whether
        none does."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._first or self._closed, timeout)

    def withdraw(self, owner: Any, error: BaseException) -> int:
        """Drop ``owner``'s windows not yet running; their readers get ``error``.  A run under
        way finishes (its other windows are unaffected).  Returns the windows dropped."""
        with self._cond:
            mine = [j for j in self._pending if j.owner is owner]
            self._pending = [j for j in self._pending if j.owner is not owner]
            self.stats.withdrawn += len(mine)
        for job in mine:
            job.error = error
            job.done.set()
        return len(mine)

    # the codec thread
    def _serve(self) -> None:
        try:
            while True:
                jobs = self._next_run()
                if jobs is None:
                    return
                try:
                    self._run(jobs)
                except BaseException as exc:  # a bug here: the windows taken must not wait forever
                    for job in jobs:
                        if not job.done.is_set():
                            job.error = CodecRunError(f"the engine's codec thread stopped on an error ({exc!r})")
                            job.error.__cause__ = exc
                            job.done.set()
                    raise
        finally:
            with self._cond:
                self._closed = True
                left, self._pending = self._pending, []
            for job in left:
                job.alone = True
                job.done.set()

    def _next_run(self) -> list[_Job] | None:
        """Wait for windows, gather those due together, take the oldest one's shape group."""
        with self._cond:
            while True:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                deadline = time.perf_counter() + self._max_gather_s
                while self.batched and self._pending and not self._closed:
                    owners = len({id(j.owner) for j in self._pending})
                    left = deadline - time.perf_counter()
                    if (self._streams and owners >= self._streams) or left <= 0:
                        break
                    seen = len(self._pending)
                    # A wake-up that is not a timeout (a stream opened or closed, a window came or
                    # was withdrawn) re-counts the open streams; only a quiet gather_s ends the wait
                    # early (a stream closing used to end it, so its neighbours ran one by one).
                    notified = self._cond.wait(min(self._gather_s, left))
                    if not notified and len(self._pending) == seen:
                        break
                if self._closed:
                    return None
                if self._pending:  # (a withdraw may have emptied it meanwhile)
                    break
            first = self._pending[0]
            if not (self.batch_streams if first.stream is not None else self.batched):
                take = [first]
            else:
                most = max(1, self._max_run_frames // first.key[0])
                take = [j for j in self._pending if j.key == first.key][:most]
            chosen = {id(j) for j in take}
            self._pending = [j for j in self._pending if id(j) not in chosen]
            return take

    def _run(self, jobs: list[_Job]) -> None:
        """One run for ``jobs`` (same shape); a failed batched run is retried one row per run."""
        t0 = time.perf_counter()
        codes = np.stack([j.codes.T for j in jobs]).astype(np.int64, copy=False)  # [k, N, T]
        streaming = jobs[0].stream is not None
        try:
            if streaming:
                out = self._pipeline.audio_tokenizer_stream.run({
                    "audio_codes": codes,
                    "start_frame": np.array([j.stream[0] for j in jobs], dtype=np.int64),
                    "end_frame": np.array([j.stream[1] for j in jobs], dtype=np.int64),
                    "codec_state": np.stack([j.stream[2] for j in jobs])})
                waveform, states = out["waveform"], out["codec_state_out"]
            else:
                waveform = self._pipeline.audio_tokenizer.run({"audio_codes": codes})["waveform"]
            if waveform.shape[0] != len(jobs):
                raise ValueError(f"the codec returned {waveform.shape[0]} rows for a batch of {len(jobs)}")
            error = None
        except Exception as exc:  # the runtime's own error types
            error = exc
        self._count(jobs, time.perf_counter() - t0)
        if error is not None and len(jobs) > 1:
            log.warning("a batched codec run of %d windows failed (%s); retrying one window per run", len(jobs), error)
            self.stats.retried += 1
            for job in jobs:
                self._run([job])
            return
        for i, job in enumerate(jobs):
            if error is not None:
                t, n = job.codes.shape
                part = "audio_tokenizer_stream" if streaming else "audio_tokenizer"
                job.error = CodecRunError(
                    f"the codec ({part} on {self._pipeline.description.get(part, 'its backend')}) "
                    f"failed on this request's window of {t} frames x {n} codebooks: {error}; codes must be int64 "
                    f"in 0..{self._pipeline.constants.codebook_size - 1}")
                job.error.__cause__ = error
            else:
                try:
                    row = check_finite("audio_tokenizer", waveform[i], self._pipeline)
                    job.samples = np.array(row.reshape(-1), dtype=np.float32)  # its own copy, not a view of the batch
                    if streaming:
                        job.state = np.array(states[i], dtype=np.float32)
                except HiggsPackError as exc:
                    job.error = exc
            job.done.set()

    def _count(self, jobs: list[_Job], seconds: float) -> None:
        s = self.stats
        s.runs += 1
        s.windows += len(jobs)
        s.frames += sum(j.codes.shape[0] for j in jobs)
        s.seconds += seconds
        s.max_run_seconds = max(s.max_run_seconds, seconds)
        s.max_rows = max(s.max_rows, len(jobs))
