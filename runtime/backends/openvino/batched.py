"""The OpenVINO decoder for several requests at once (:class:`OvBatchedDecoder`).

optimum-intel's stateful decoder IR keeps the KV cache of every row in one state of one
length, and every infer appends the same number of positions to all rows; ``beam_idx``
(i32 [batch]) gathers the cache rows at the start of the infer (MODEL.md "Batching and
KV-cache facts").  So the rows are kept *right-aligned* in one state of ``P`` columns: a
row's real positions are its last columns, the columns before them are left padding that
``attention_mask`` zeros hide, and its ``position_ids`` are its own counter (RoPE is applied
to the keys before they are cached, so where a position sits in the state does not matter).

A joining request is prefilled alone on a second ``InferRequest`` of the same compiled
model (batch 1, a fresh state), then *spliced* into the batched state through the state API
(``query_state()``; ``state.state`` reads a float32 copy [batch, kv_heads, P, head_dim],
the plugin dequantizing its u8 cache; assigning an ``ov.Tensor`` writes it back, quantized
again).  The splice re-lays every kept row onto its real positions only (its padding and the
rows that left are dropped), so ``P`` is the longest row's length, never more.  Rows that
leave between splices are dropped by ``beam_idx`` at the next step (no copy); a busy row that
a step does not name rides along with a masked position.  A request joining an empty batch
costs no splice: the two infer requests swap roles.

Measured on the bench-size int4 bundle (OpenVINO 2026.4 CPU, u8 KV cache): rows spliced at
different lengths give bit-identical hidden states to their runs alone; a get/set round trip
of an unchanged state is usually exact but can move a later hidden state by ~1 % (relative
max; one u8 code flips when the plugin quantizes the dequantized values again); with an
f16/f32 cache it is exact.  Why this design: the alternatives (running a joining prompt
inside the batched infer with the other rows masked, a stateless decoder with explicit KV,
OpenVINO GenAI's continuous batching) are compared in ``docs/architecture.md``.
"""

from __future__ import annotations

import time

import numpy as np
import openvino as ov

from higgs_pack.errors import InputError, Problem
from higgs_pack.runtime.backends.openvino.runners import read_state, state_layout, write_state
from higgs_pack.runtime.loop.pipeline import check_decoder_room

#: Bytes the CPU plugin keeps per token and KV head beside a u8/u4 cache: one f32 scale and
#: one f32 zero point (its by-token quantization; group size 0 = the whole head).  Read from
#: the CPU plugin's by-token cache layout, not measured here: the plugin also grows its state
#: buffers ahead of the positions written, which no count from outside sees.
_QUANT_PARAM_BYTES = 8


def cache_bytes_per_position(compiled, *, num_layers: int, kv_heads: int, head_dim: int) -> tuple[int | None, str]:
    """KV bytes one position of one row takes in a compiled stateful decoder, from the
    precisions the plugin reports, and the words that say how it was counted.

    ``num_layers x kv_heads x (K + V)`` where K and V are ``head_dim x itemsize`` bytes of
    ``KEY_CACHE_PRECISION`` / ``VALUE_CACHE_PRECISION`` (falling back to
    ``KV_CACHE_PRECISION``), plus :data:`_QUANT_PARAM_BYTES` for a u8/u4 cache quantized by
    token.  At full size (36 layers, 8 KV heads, head_dim 128) a u8 cache is 36 x 8 x 2 x
    (128 + 8) = 78,336 bytes (76.5 KiB) per position; f32 is 294,912.

    Returns:
        ``(bytes, how)``, or ``(None, why)`` when the plugin does not say its precision, or
        says a grouped or by-channel quantization whose parameters are not counted here.
    """
    def prop(name):
        try:
            return compiled.get_property(name)
        except RuntimeError:
            return None

    total = 0
    words = []
    for side in ("KEY", "VALUE"):
        precision = prop(f"{side}_CACHE_PRECISION") or prop("KV_CACHE_PRECISION")
        if precision is None:
            return None, "the device does not report KV_CACHE_PRECISION"
        name = str(precision.get_type_name() if hasattr(precision, "get_type_name") else precision)
        bits = {"u8": 8, "i8": 8, "u4": 4, "i4": 4, "f16": 16, "bf16": 16, "f32": 32}.get(name)
        if bits is None:
            return None, f"the cache precision {name!r} is not one this count knows"
        group = prop(f"{side}_CACHE_GROUP_SIZE") or 0
        mode = str(prop(f"{side}_CACHE_QUANT_MODE") or "BY_TOKEN")
        quantized = bits <= 8
        if quantized and (int(group) not in (0, head_dim) or "CHANNEL" in mode.upper()):
            return None, f"{side.lower()} cache quantized {mode} in groups of {group} (parameters not counted)"
        total += head_dim * bits // 8 + (_QUANT_PARAM_BYTES if quantized else 0)
        words.append(f"{side.lower()} {name}")
    return num_layers * kv_heads * total, ", ".join(words)


def _columns(mask_row: np.ndarray) -> slice | np.ndarray:
    """The state columns of one row's real positions: a slice when they are contiguous (every
    step named the row), else their indices."""
    real = np.flatnonzero(mask_row)
    if real.size and real[-1] - real[0] + 1 == real.size:
        return slice(int(real[0]), int(real[-1]) + 1)
    return real


class OvBatchedDecoder:
    """The stateful OpenVINO decoder IR serving up to ``max_batch`` requests (module docstring).

    Args:
        decoder: the bundle's :class:`~higgs_pack.runtime.backends.openvino.runners.OvStatefulDecoder`
            (its compiled model is shared; this class makes its own two infer requests; every
            request of the model copies its inputs, see that class's ``share_inputs``).
        max_batch: rows (requests decoded together), >= 1.
        max_length: most positions one row may hold (prompt + frames).
        num_layers, kv_heads, head_dim: the cache shape, for :attr:`kv_bytes_per_position`.

    Attributes:
        kv_bytes_per_position: see :func:`cache_bytes_per_position` (None when it cannot be
            counted); a splice briefly holds one layer's K or V of all rows again as float32.
        kv_device: ``"cpu"``.
        lengths: int64 [max_batch] positions each row holds (0: free).
        columns: ``P``, the batched state's length now.
        splices: joins so far (each one get/set of every state variable, except one into an
            empty batch: the two infer requests swap roles).
        splice_seconds, last_splice_seconds: time in those splices, all and the latest (the
            benchmark's splice cost per join).

    Raises:
        InputError: a bad size, or a ``decoder`` that shares its inputs.
    """

    kv_device = "cpu"

    def __init__(self, decoder, *, max_batch: int, max_length: int, num_layers: int, kv_heads: int,
                 head_dim: int):
        if max_batch < 1 or max_length < 2:
            raise InputError.of(Problem.said(f"max_batch must be >= 1 and max_length >= 2, got {max_batch} and {max_length}"))
        if getattr(decoder, "shares_inputs", False):
            # Its input memory would stay bound to the graph this class's requests run on, and
            # their infers would write into it (OvStatefulDecoder's share_inputs says what broke).
            raise InputError.of(
                Problem.said(f"{decoder.path.name}: the batch-1 decoder was made with share_inputs=True, so the batched "
                             "decoder's infers would overwrite its input arrays; make it with share_inputs=False to batch"))
        self.max_batch, self.max_length = int(max_batch), int(max_length)
        self.compiled = decoder.compiled
        self.kv_bytes_per_position, self.kv_count = cache_bytes_per_position(
            self.compiled, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim)
        inputs = {p.get_any_name(): np.dtype(p.get_element_type().to_dtype()) for p in self.compiled.inputs}
        self._types = inputs
        self._output = self.compiled.output("hidden_states")
        self.hidden_size = self.compiled.input("inputs_embeds").get_partial_shape()[2].get_length()
        self._batched = self.compiled.create_infer_request()
        self._solo = self.compiled.create_infer_request()
        self.lengths = np.zeros(self.max_batch, dtype=np.int64)
        self.splices = 0
        self.splice_seconds = self.last_splice_seconds = 0.0
        self._pending: tuple[int, int] | None = None  # (row, positions) prefilled on the solo request, not spliced
        self._reset()

    def _reset(self) -> None:
        self._batched.reset_state()
        self._order: list[int] = []  # state batch index -> row (rows that left stay until dropped)
        self._mask = np.zeros((0, 0), dtype=np.int64)  # [len(_order), P]
        self.columns = 0

    @property
    def positions_held(self) -> int:
        """Positions the busy rows hold now."""
        return int(self.lengths.sum())

    def release(self, row: int) -> None:
        """Forget row ``row``: its state row is dropped at the next step or splice; when no
        row is busy the state is reset."""
        self.lengths[row] = 0
        if self._pending is not None and self._pending[0] == row:
            self._pending = None
        if not self.lengths.any():
            self._reset()

    @property
    def prefix_layout(self) -> str:
        """The KV layout of voice-prefix entries (:func:`~higgs_pack.runtime.backends.openvino.
        runners.state_layout`), the batch-1 stateful decoder's too (one compiled model)."""
        return state_layout(self.compiled)

    def write_prefix(self, row: int, arrays: dict[str, np.ndarray], length: int) -> None:
        """Start row ``row`` over on the solo request holding ``arrays`` (variable -> float32
        [kv_heads, length, head_dim]) as its first ``length`` positions; a :meth:`prefill` with
        ``start=length`` continues it (and splices it in at its final chunk).

        Raises:
            KeyError, ValueError: names or shapes other than the state's (nothing changed).
            InputError: ``length`` exceeds ``max_length``, or ``row`` is out of range.
        """
        self._check_row(row)
        check_decoder_room(length, self.max_length)
        write_state(self._solo, arrays, length)
        self.lengths[row] = 0
        self._pending = (row, length)

    def read_prefix(self, row: int, length: int) -> dict[str, np.ndarray]:
        """Copies of row ``row``'s first ``length`` positions (variable -> float32 [kv_heads, length,
        head_dim]): from the solo request while its prompt is prefilled there, else from its
        real columns in the batched state."""
        if self._pending is not None and self._pending[0] == row:
            if length > self._pending[1]:
                raise ValueError(f"row {row} holds {self._pending[1]} positions, not {length}")
            return read_state(self._solo, 0, slice(0, length))
        if length > self.lengths[row]:
            raise ValueError(f"row {row} holds {int(self.lengths[row])} positions, not {length}")
        index = next(i for i, r in enumerate(self._order) if r == row and self._mask[i].any())
        return read_state(self._batched, index, np.flatnonzero(self._mask[index])[:length])

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_batch:
            raise InputError.of(Problem.said(f"row {row} is outside 0..{self.max_batch - 1}"))

    def prefill(self, row: int, inputs_embeds: np.ndarray, start: int = 0, final: bool = True) -> np.ndarray:
        """Prefill ``S`` prompt positions of row ``row`` on the solo request from position
        ``start``; at the ``final`` chunk the row is spliced into the batch.  ``start=0`` starts
        the row over; a later chunk continues the one row being prefilled (``start`` = the
        positions it holds: an earlier chunk's, or a cached prefix's, :meth:`write_prefix`), so a
        prompt may be prefilled in chunks between steps of the other rows (one joining row at a
        time).  The CPU plugin computes a prompt prefilled in chunks with other kernel blocks
        than in one infer: about 2e-4 apart on the tiny int4 bundle's hidden states (its int4
        weights; 1e-7 with f32 inference and no dynamic quantization), so codes of a request
        prefilled in chunks agree with, but are not bound to equal, its codes alone.

        Args:
            row: 0 <= row < max_batch (a busy row starts over).
            inputs_embeds: float32 [1, S, H].
            start: positions the row holds already on the solo request (0: start over).
            final: the prompt's last chunk: splice the row into the batch.

        Returns:
            float32 [1, S, H] hidden states (a new array).

        Raises:
            InputError: ``start + S`` exceeds ``max_length``, ``row`` is out of range, or
                ``start`` is not 0 or the positions the row being prefilled holds.
        """
        self._check_row(row)
        s = inputs_embeds.shape[1]
        if start and self._pending != (row, start):
            raise InputError.of(Problem.said(f"a prefill continuing row {row} at position {start} must follow that row's own "
                                             f"earlier chunk or cached prefix (the solo request holds {self._pending})"))
        check_decoder_room(start + s, self.max_length)
        self.lengths[row] = 0
        if not start:
            self._solo.reset_state()
        hidden = self._infer(self._solo, inputs_embeds, np.ones((1, start + s)), np.arange(start, start + s)[None],
                             np.zeros(1))
        if final:
            self._pending = None
            self._splice(row, start + s)
            self.lengths[row] = start + s
        else:
            self._pending = (row, start + s)
        return hidden

    def _splice(self, row: int, s: int) -> None:
        """Put the solo request's state (``s`` positions) into the batched state as ``row``,
        dropping the rows that left and every row's padding."""
        t0 = time.perf_counter()
        keep = [i for i, r in enumerate(self._order) if self.lengths[r] > 0]
        lengths = [int(self.lengths[self._order[i]]) for i in keep] + [s]
        width = max(lengths)
        if keep:
            solo = {v.name: v for v in self._solo.query_state()}
            real = [_columns(self._mask[i]) for i in keep]
            for variable in self._batched.query_state():
                old = variable.state.data  # float32 [n, kv_heads, P, head_dim], the plugin's copy
                new = np.empty((len(lengths), old.shape[1], width, old.shape[3]), dtype=old.dtype)
                for j, (i, columns) in enumerate(zip(keep, real, strict=True)):
                    pad = width - lengths[j]
                    new[j, :, :pad] = 0
                    new[j, :, pad:] = old[i][:, columns]
                new[-1, :, :width - s] = 0
                new[-1, :, width - s:] = solo[variable.name].state.data[0]
                variable.state = ov.Tensor(new)
        else:  # an empty batch: the solo request's state becomes the batch's, nothing is copied
            self._batched, self._solo = self._solo, self._batched
        self._order = [self._order[i] for i in keep] + [row]
        self._mask = (np.arange(width)[None, :] >= width - np.array(lengths)[:, None]).astype(np.int64)
        self.columns = width
        self.splices += 1
        self.last_splice_seconds = time.perf_counter() - t0
        self.splice_seconds += self.last_splice_seconds

    def step(self, rows: np.ndarray, inputs_embeds: np.ndarray) -> np.ndarray:
        """One position for each of ``rows``, all in one infer (busy rows not named ride along
        with a masked position; rows that left are dropped through ``beam_idx``).

        Args:
            rows: int [a] distinct busy rows, ascending.
            inputs_embeds: float32 [a, 1, H], row ``i`` for ``rows[i]``.

        Returns:
            float32 [a, 1, H] hidden states, in the order of ``rows``.

        Raises:
            InputError: a row would exceed ``max_length`` positions, or was not prefilled.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if (self.lengths[rows] < 1).any():
            raise InputError.of(Problem.said(f"rows {rows[self.lengths[rows] < 1].tolist()} were not prefilled; call prefill first"))
        check_decoder_room(int(self.lengths[rows].max()) + 1, self.max_length)
        keep = [i for i, r in enumerate(self._order) if self.lengths[r] > 0]
        order = [self._order[i] for i in keep]
        where = {r: j for j, r in enumerate(order)}
        asked = np.zeros(len(order), dtype=bool)
        picks = [where[int(r)] for r in rows]
        asked[picks] = True
        embeds = np.zeros((len(order), 1, self.hidden_size), dtype=np.float32)
        embeds[picks] = inputs_embeds
        mask = np.concatenate([self._mask[keep], asked[:, None].astype(np.int64)], axis=1)
        positions = self.lengths[order][:, None]
        hidden = self._infer(self._batched, embeds, mask, positions, np.array(keep))
        self._order, self._mask, self.columns = order, mask, mask.shape[1]
        self.lengths[rows] += 1
        return hidden[picks]

    def _infer(self, request, embeds, mask, positions, beam) -> np.ndarray:
        feeds = {
            "inputs_embeds": np.ascontiguousarray(embeds, dtype=self._types["inputs_embeds"]),
            "attention_mask": np.ascontiguousarray(mask, dtype=self._types.get("attention_mask", np.int64)),
            "position_ids": np.ascontiguousarray(positions, dtype=self._types.get("position_ids", np.int64)),
            "beam_idx": np.ascontiguousarray(beam, dtype=self._types.get("beam_idx", np.int32)),
        }
        results = request.infer({k: v for k, v in feeds.items() if k in self._types})
        return np.array(results[self._output], dtype=np.float32, copy=True)
