"""A prompt joining the rows that decode, a part of the :class:`~higgs_pack.runtime.engine.engine.Engine`
(step 1 of its module docstring, after admission): prefilled whole when no row decodes, else in
chunks sized from the measured costs of a step and of a prefilled position
(:meth:`PromptJoins._chunk_size`), from its voice's cached prefix when the cache holds it; on a
decoder that packs prefill each chunk rides in the decoding rows' forward (issue 39).
"""

from __future__ import annotations

import time

import numpy as np

from higgs_pack.runtime.engine.decoders import BatchedDecoder
from higgs_pack.runtime.engine.state import EngineStats, Row, running_mean
from higgs_pack.runtime.loop.decode import FiniteChecks
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.prefix_cache import PrefixCache, restore_prefix, store_prefix

#: ``prefill_chunk="auto"``: positions of a joining prompt's first chunk, before the costs are
#: measured, and the fewest positions of a chunk (smaller ones cost mostly call overhead).
FIRST_PREFILL_CHUNK = 16
MIN_PREFILL_CHUNK = 8


class PromptJoins:
    """The engine's prefill of joining prompts; :class:`~higgs_pack.runtime.engine.engine.Engine`
    inherits it.  Its methods run on the engine's thread and use the engine's state, declared here
    and made by the engine (a row leaving is :meth:`BatchSteps._leave
    <higgs_pack.runtime.engine.steps.BatchSteps._leave>`)."""

    pipeline: Pipeline
    decoder: BatchedDecoder
    stats: EngineStats
    prefix_cache: PrefixCache | None
    prefill_chunk: int | str
    join_gap_steps: float
    _prefix_layout: str | None
    _rows: dict[int, Row]
    _prefilling: list[Row]
    _riding: tuple[Row, int, int] | None
    _step_cost: float | None
    _position_cost: float | None

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

    def _fill(self, state: Row, chunked: bool = False) -> None:
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

    def _restore(self, state: Row) -> None:
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
    def _part(state: Row, budget: int) -> tuple[int, int]:
        """The next positions ``(start, end)`` of the row's prompt to prefill, at most ``budget``;
        a voice prefix still to be kept is a part of its own."""
        start = state.filled
        end = min(start + budget, state.prompt.length)
        if state.store_key is not None:
            end = min(end, state.prompt.prefix_length)
        return start, end

    def _part_done(self, state: Row, end: int) -> None:
        """The row's prompt is prefilled up to ``end``: keep its voice prefix once it holds it."""
        state.filled = end
        prompt = state.prompt
        if state.store_key is not None and end == prompt.prefix_length:
            store_prefix(self.prefix_cache, prompt, self._prefix_layout, state.store_key,
                         self.decoder.read_prefix(state.row, prompt.prefix_length), background=True)
            state.store_key = None

    def _filled(self, state: Row, n: int, dt: float, hidden: np.ndarray | None) -> None:
        """Count ``n`` positions prefilled in ``dt`` s; once the prompt is done the row steps
        from ``hidden``'s last position."""
        prompt = state.prompt
        self.stats.prefill_seconds += dt
        self.stats.prefill_positions += n
        self.stats.prefill_chunks += 1
        self._position_cost = running_mean(self._position_cost, dt / max(n, 1))
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

    def _ride(self, state: Row) -> None:
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
