"""Batch stepping, a part of the :class:`~higgs_pack.runtime.engine.engine.Engine` (step 2 and 3
of its module docstring): a request admitted onto a row and each of its text chunks started, one
frame for every busy row (the audio heads in one run, sampling per row with the row's own
:class:`~higgs_pack.runtime.loop.frames.CodeSteps`, the audio embedding and the decoder in one
run each), a finished chunk's result, a row leaving.
"""

from __future__ import annotations

import math
import time

import numpy as np

from higgs_pack.errors import HiggsPackError
from higgs_pack.runtime.engine.decoders import BatchedDecoder
from higgs_pack.runtime.engine.handle import EngineHandle, RequestCancelled
from higgs_pack.runtime.engine.kv_memory import KVBudget
from higgs_pack.runtime.engine.state import EngineStats, Row, running_mean
from higgs_pack.runtime.loop.decode import GenerationResult, check_context
from higgs_pack.runtime.loop.frames import CodeSteps
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.plan import chunk_prompt


class BatchSteps:
    """The engine's batch stepping; :class:`~higgs_pack.runtime.engine.engine.Engine` inherits it.
    Its methods run on the engine's thread and use the engine's state, declared here and made by
    the engine (the prompts joining the rows are :class:`~higgs_pack.runtime.engine.joins.PromptJoins`)."""

    pipeline: Pipeline
    decoder: BatchedDecoder
    stats: EngineStats
    kv: KVBudget
    _rows: dict[int, Row]
    _prefilling: list[Row]
    _riding: tuple[Row, int, int] | None
    _forward_cost: float | None
    _step_cost: float | None

    def _admit(self, handle: EngineHandle, row: int) -> None:
        state = Row(handle, row, started=time.perf_counter())
        self._rows[row] = state
        self._start_chunk(state)

    def _start_chunk(self, state: Row) -> None:
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

    def _drop_cancelled(self) -> None:
        for state in [s for s in self._rows.values() if s.handle.cancelled]:
            self._leave(state, RequestCancelled("the request was cancelled"))

    def _leave(self, state: Row, error: BaseException | None = None) -> None:
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
            self._step_cost = running_mean(self._step_cost, dt)

    def _hidden_ok(self, state: Row) -> bool:
        try:
            state.checks.hidden(state.last, state.rules.steps)
        except HiggsPackError as exc:
            self._leave(state, exc)
            return False
        return True

    def _draw(self, state: Row, logits: np.ndarray) -> np.ndarray | None:
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
        state.frames_out += 1
        if state.audio_from is None:
            state.audio_from = now
        state.handle._send("codes", state.chunk, codes)
        if not rules.done:
            return codes
        self._end_chunk(state)
        return None

    def _end_chunk(self, state: Row) -> None:
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

    def _feed_back(self, going: list[tuple[Row, np.ndarray]]) -> None:
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
            self._forward_cost = running_mean(self._forward_cost, dt)
        else:
            self._rode(riding, chunk_hidden, max(dt - (self._forward_cost or 0.0), 0.0))

    def _rode(self, riding: tuple[Row, int, int], hidden: np.ndarray, dt: float) -> None:
        """The riding chunk's bookkeeping after its forward (``dt``: its share of the time)."""
        state, start, end = riding
        try:
            self._part_done(state, end)
        except Exception as exc:  # keeping its prefix failed: it fails alone
            self._prefilling.remove(state)
            self._leave(state, exc)
            return
        self._chunk_learned(end - start, dt)
        self._filled(state, end - start, dt, hidden)
