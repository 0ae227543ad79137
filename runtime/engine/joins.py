"""A prompt joining the rows that decode, a part of the :class:`~higgs_pack.runtime.engine.engine.Engine`
(step 1 of its module docstring, after admission): prefilled whole when no row decodes, else in
chunks sized at run time (:meth:`PromptJoins._chunk_size`) so that each costs about
``join_gap_steps - 1`` of the running rows' steps, from its voice's cached prefix when the cache
holds it; on a decoder that packs prefill each chunk rides in the decoding rows' forward (issue 39).

Why chunks are sized by a measured rate and not by a cost per position: a batch-1 forward of a few
positions costs a fixed part (every weight read and dequantized once) plus a part per position.
At full size on a 2-vCPU AMD EPYC (ONNX Runtime, int4) a chunk of n positions cost about
100 + 15 n ms, and a decode step of one running row about 110 ms, so a chunk of 8 positions took
3.7 steps where its mean cost per position, measured on longer prefills, promised less than one
(issue 37 item 7: joins of 4.5 steps at batch 2).  The size is therefore steered by the positions
per second that chunks of the sizes actually used have taken (:meth:`PromptJoins._chunk_learned`):
``n' = rate(n) * budget`` has its fixed point where a chunk costs the budget, and approaches it
from below without overshooting when it starts small, whatever the fixed part is on this host.
"""

from __future__ import annotations

import math
import time

import numpy as np

from higgs_pack.runtime.engine.decoders import BatchedDecoder
from higgs_pack.runtime.engine.state import EngineStats, Row, running_mean
from higgs_pack.runtime.loop.decode import FiniteChecks
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.prefix_cache import PrefixCache, restore_prefix, store_prefix

#: ``prefill_chunk="auto"``: the fewest positions of a chunk, also the engine's first chunk before
#: any was measured.  One position would take the decode kernels' path, whose KV is not
#: bit-identical to a longer prefill's on the CPU provider (the engine's codes would then differ
#: from ``synthesize``'s).
MIN_PREFILL_CHUNK = 2
#: ``prefill_chunk="auto"``: a chunk is at most this many times the size of the last one measured
#: (the rate measured at one size promises more than it holds at a larger one: the fixed part).
CHUNK_GROWTH = 2.0


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
    _chunk_rate: float | None
    _chunk_last: int
    _chunk_carry: float

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
        """Positions of the next chunk of a prompt joining decoding rows (``remaining`` left in its
        part, :meth:`_part_end`):
        ``prefill_chunk``, or for ``"auto"`` what the chunks measured so far say costs
        ``join_gap_steps - 1`` of the running rows' mean step (the module docstring): the measured
        positions per second times that budget, at most :data:`CHUNK_GROWTH` times the last chunk
        measured, at least :data:`MIN_PREFILL_CHUNK` (also the engine's first chunk).  A
        fractional size is carried to the next chunk (sizes 2, 3, 2, 3 for 2.5), so the sizes
        average the target.  No chunk leaves a rest shorter than the minimum (2 for a fixed
        size; a chunk of one position takes another kernel path): the chunk is shortened to
        leave the minimum, or takes the whole rest when that is under twice the minimum."""
        if self.prefill_chunk != "auto":
            n, least = int(self.prefill_chunk), 2
        elif self._chunk_rate is None or self._step_cost is None:
            n, least = MIN_PREFILL_CHUNK, MIN_PREFILL_CHUNK
        else:
            budget = (self.join_gap_steps - 1) * self._step_cost
            want = min(self._chunk_rate * budget, CHUNK_GROWTH * self._chunk_last) + self._chunk_carry
            n = max(math.floor(want), MIN_PREFILL_CHUNK)
            self._chunk_carry = max(want - n, 0.0)  # under 1: n is want's floor, or the minimum above it
            least = MIN_PREFILL_CHUNK
        if remaining - n < least:  # no rest shorter than the minimum: shorten this chunk, or take it all
            n = remaining if n >= remaining or remaining < 2 * least else remaining - least
        self.stats.prefill_chunk_positions = n
        return n

    def _chunk_learned(self, n: int, seconds: float) -> None:
        """A chunk of ``n`` positions took ``seconds`` of decoder time (its own forward, or its
        share of the step it rode in): fold its positions per second into the rate
        :meth:`_chunk_size` steers by."""
        if n > 0 and seconds > 0:
            self._chunk_rate = running_mean(self._chunk_rate, n / seconds)
            self._chunk_last = n

    def _fill(self, state: Row, chunked: bool = False) -> None:
        """Prefill the rest of the row's prompt, or one turn of it when ``chunked``, from its cached
        voice prefix when the cache holds it; on a miss the prefix is prefilled as a part of its
        own and kept (as :func:`~higgs_pack.runtime.loop.prefix_cache.cached_prefill` does, so
        the engine's codes equal ``synthesize``'s); once the prompt is done the row steps.

        A chunked turn runs one decoder forward of :meth:`_chunk_size` positions, timed alone for
        :meth:`_chunk_learned`, or copies a voice prefix into the row (a cache hit) or out of it
        (the prefix just prefilled, to keep) instead: about 60 MB of float32 KV for a 7-second
        voice at full size, a copy that would otherwise lengthen one chunk's gap.  A failure
        fails this request alone."""
        prompt = state.prompt
        t0 = time.perf_counter()
        n, hidden = 0, None
        try:
            if not chunked:
                self._restore(state)
                while state.filled < prompt.length:
                    start, end = self._part(state, prompt.length)
                    hidden = self._prefill(state, start, end)
                    self._part_done(state, end)
                    n += end - start
            elif not self._copied_prefix(state):
                start, end = self._part(state, self._chunk_size(self._part_end(state) - state.filled))
                t1 = time.perf_counter()
                hidden = self._prefill(state, start, end)
                self._chunk_learned(end - start, time.perf_counter() - t1)
                state.filled, n = end, end - start
        except Exception as exc:  # this request's prefill: it fails alone
            self._prefilling.remove(state)
            self._leave(state, exc)
            return
        self._filled(state, n, time.perf_counter() - t0, hidden)

    def _prefill(self, state: Row, start: int, end: int) -> np.ndarray:
        """The decoder's prefill of the row's prompt positions ``start:end``: float32 [1, S, H]."""
        return self.decoder.prefill(state.row, state.prompt.embeds[:, start:end], start=start,
                                    final=end == state.prompt.length)

    def _copied_prefix(self, state: Row) -> bool:
        """A chunked turn's copy instead of a prefill: on the row's first turn its cached voice
        prefix restored into it (a hit), or, once its prefix is prefilled, that prefix kept.
        False when neither was due (the turn prefills)."""
        if not state.looked_up:
            self._restore(state)
            return state.filled > 0
        if state.store_key is not None and state.filled == state.prompt.prefix_length:
            self._keep_prefix(state)
            return True
        return False

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
        """The next positions ``(start, end)`` of the row's prompt to prefill, at most ``budget``,
        up to :meth:`_part_end`."""
        return state.filled, min(state.filled + budget, PromptJoins._part_end(state))

    @staticmethod
    def _part_end(state: Row) -> int:
        """Where the row's current part of its prompt ends: a voice prefix still to be kept is a
        part of its own, so its end; else the prompt's."""
        if state.store_key is not None and state.filled < state.prompt.prefix_length:
            return state.prompt.prefix_length
        return state.prompt.length

    def _part_done(self, state: Row, end: int) -> None:
        """The row's prompt is prefilled up to ``end``: keep its voice prefix once it holds it."""
        state.filled = end
        if state.store_key is not None and end == state.prompt.prefix_length:
            self._keep_prefix(state)

    def _keep_prefix(self, state: Row) -> None:
        """Copy the row's voice prefix out of the decoder into the prefix cache (persisted on
        the cache's writer thread)."""
        prompt = state.prompt
        store_prefix(self.prefix_cache, prompt, self._prefix_layout, state.store_key,
                     self.decoder.read_prefix(state.row, prompt.prefix_length), background=True)
        state.store_key = None

    def _filled(self, state: Row, n: int, dt: float, hidden: np.ndarray | None) -> None:
        """Count ``n`` positions prefilled in ``dt`` s; once the prompt is done the row steps
        from ``hidden``'s last position."""
        prompt = state.prompt
        self.stats.prefill_seconds += dt
        self.stats.prefill_positions += n
        self.stats.prefill_chunks += n > 0
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
            self._riding = (state, *self._part(state, self._chunk_size(self._part_end(state) - state.filled)))
        else:  # the cached prefix was the whole prompt but its last position: never here (prefix < prompt)
            self._fill(state, chunked=True)
