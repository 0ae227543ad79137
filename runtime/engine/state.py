"""The engine thread's records: a request on a row of the batch (:class:`Row`), what the thread did
(:class:`EngineStats`), and the running means of its measured costs (:func:`running_mean`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from higgs_pack.runtime.engine.handle import EngineHandle
from higgs_pack.runtime.loop.decode import FiniteChecks, GenerationResult
from higgs_pack.runtime.loop.frames import CodeSteps
from higgs_pack.runtime.loop.prefix_cache import Prompt

#: Weight of the newest sample in the running means of step and prefill costs.
COST_WEIGHT = 0.2


def running_mean(mean: float | None, sample: float) -> float:
    """``mean`` moved towards ``sample`` by :data:`COST_WEIGHT` (``sample`` itself when there is no mean yet)."""
    return sample if mean is None else (1 - COST_WEIGHT) * mean + COST_WEIGHT * sample


@dataclass
class Row:
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
    frames_out: int = 0
    """Steps that sent this request's codes, every text chunk's (its delay ramp included)."""
    audio_from: float | None = None
    """When its first codes were sent (``time.perf_counter()``)."""
    held_for_first_audio: bool = False
    """The engine held its steps once for this request's first audio."""
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
        prefill_chunks: prefill runs (a prompt prefilled in chunks counts each; a turn that only
            copied a voice prefix in or out is not one).
        prefill_chunk_positions: the chunk size last chosen for a joining prompt (0: none yet).
        prefix_hits, prefix_misses: this engine's voice prefix cache lookups served / not served
            (the cache's own ``stats`` count every user of it).
        join_max_frame_gap_ms: longest time between two frames of a running request while
            another request's prompt was prefilled in between (ms; 0.0: no such join yet).
        first_audio_holds, first_audio_hold_seconds: times the steps were held while a stream's
            first audio was in the codec, and the seconds held
            (:meth:`~higgs_pack.runtime.engine.engine.Engine._hold_for_first_audio`).
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
    first_audio_holds: int = 0
    first_audio_hold_seconds: float = 0.0

    @property
    def prefill_positions_per_s(self) -> float:
        """Prompt positions prefilled per second of prefill (nan before any)."""
        return self.prefill_positions / self.prefill_seconds if self.prefill_seconds > 0 else math.nan

    @property
    def engine_step_ms(self) -> float:
        """Mean milliseconds of one batched decode step (nan before any)."""
        return 1000 * self.step_seconds / self.steps if self.steps else math.nan
