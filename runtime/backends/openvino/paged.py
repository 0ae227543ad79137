"""The OpenVINO decoder on PagedAttention (:class:`OvPagedDecoder`): every row's KV in blocks of
one pool, all rows in one packed forward, no state splice (issue 39).

At load, OpenVINO's own ``SDPAToPagedAttention`` pass
(``openvino._offline_transformations.paged_attention_transformation``, what openvino.genai's
ContinuousBatchingPipeline and OpenVINO Model Server run) turns the bundle's stateful decoder
IR into one whose every attention is a ``PagedAttentionExtension``; no bundle changes.  The
model then takes (OpenVINO 2026.4, read from the transformed IR):

* ``inputs_embeds`` f32 [T, H] and ``position_ids`` i64 [T]: the packed tokens of every
  sequence of the forward, one sequence after another;
* ``past_lens`` i32 [B]: positions each sequence holds before this forward;
  ``subsequence_begins`` i32 [B + 1]: where each sequence's tokens start in the packed T;
* ``block_indices`` i32 [sum of blocks] and ``block_indices_begins`` i32 [B + 1]: the
  sequences' block tables, one after another; ``max_context_len`` i32 []: the longest
  ``past_lens + new tokens``;
* ``key_cache.N`` / ``value_cache.N`` per layer: the whole block pool [blocks, ...], which the
  forward reads and writes in place (the new tokens' K and V go to their positions' blocks);

and gives ``hidden_states`` f32 [T, 1, H].  The plugin fixes the cache tensors' element type
and per-block shape at compile from the ``KV_CACHE_PRECISION`` it compiles with (as genai's
``paged_attention_transformations.cpp`` sets them per device): on the CPU, f32 gives
key and value [blocks, kv_heads, 32, head_dim]; its default u8 gives a value block of
[kv_heads, 32, head_dim + 8] (a f32 scale and zero point per position) and a key block of
[kv_heads, 32 + 8, head_dim] (per channel).  The block size is the value cache's axis 2 on the
CPU and GPU layouts alike, so nothing here assumes the CPU: the device string picks the layout.

A voice prefix is blocks (issue 39 item 2): a prefix entry's arrays are the raw blocks of its
positions (name -> [n_blocks, ...] in the cache's own type, so a persisted prefix restores into
blocks bit for bit); every row of one voice names the same full prefix blocks, and only a
partly filled last block is copied for each row (copy on write: the row writes its next
positions there).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np
import openvino as ov

from higgs_pack.errors import (
    ExecutionProviderUnavailable,
    InputError,
    Problem,
    SignatureMismatch,
)
from higgs_pack.runtime.engine.kv_blocks import BlockPool, blocks_for
from higgs_pack.runtime.loop.pipeline import check_decoder_room

#: The inputs the paged model takes besides the caches (OpenVINO 2026.4's transformation).
PAGED_INPUTS = ("inputs_embeds", "position_ids", "past_lens", "subsequence_begins", "block_indices",
                "block_indices_begins", "max_context_len")
_CACHES = ("key_cache.", "value_cache.")


def paged_model(core: ov.Core, xml_path, num_layers: int) -> ov.Model:
    """The decoder IR at ``xml_path`` read and turned to PagedAttention.

    Raises:
        SignatureMismatch: the pass did not give one ``PagedAttentionExtension`` per layer, or the
            inputs this module feeds (the IR is not a stateful SDPA decoder it matches).
    """
    from openvino._offline_transformations import paged_attention_transformation

    model = core.read_model(str(xml_path))
    try:
        paged_attention_transformation(model)
    except RuntimeError as exc:  # e.g. "Model is supposed to be stateful"
        raise SignatureMismatch(f"{xml_path}: OpenVINO's SDPAToPagedAttention refused the decoder IR "
                                f"({str(exc).strip().splitlines()[-1]}); rebuild the bundle with "
                                "`higgs-pack build --target openvino`") from exc
    attentions = sum(op.get_type_name() == "PagedAttentionExtension" for op in model.get_ops())
    names = {p.get_any_name() for p in model.inputs}
    missing = [n for n in PAGED_INPUTS if n not in names]
    if attentions != num_layers or missing:
        raise SignatureMismatch(
            f"{xml_path}: OpenVINO's SDPAToPagedAttention gave {attentions} PagedAttentionExtension ops for "
            f"{num_layers} layers (inputs missing: {missing}); the paged engine cannot run this decoder: use "
            "engine(max_batch=1) (the CLI's --batch 1), or rebuild the bundle with `higgs-pack build --target openvino`")
    return model


#: The paged model compiled for each stateful decoder (:func:`compile_paged`), with the compile
#: properties it was compiled with; an entry goes when its decoder does.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILING = threading.Lock()


def compile_paged(decoder, num_layers: int):
    """The paged form (:func:`paged_model`) of a stateful decoder
    (:class:`~higgs_pack.runtime.backends.openvino.runners.OvStatefulDecoder`) compiled on its
    device with its compile properties (its ``KV_CACHE_PRECISION`` is the blocks' type).

    Compiled once per decoder (and compile properties): every engine of a bundle shares the one
    ``openvino.CompiledModel``, each :class:`OvPagedDecoder` with an infer request and a block
    pool of its own.  A compiled model holds the decoder's weights again (its own mapping of the
    IR's ``.bin``, which the CPU plugin reads int4 weights from in place, plus what it packs:
    about 110 MB of RSS for the 54 MB bench decoder, measured), so compiling one per engine held
    one more copy for every engine still referenced (the bench's batch worker held up to five;
    at full size about 2.5 GB each).

    Returns:
        The ``openvino.CompiledModel`` (the same object for the same decoder and properties).

    Raises:
        SignatureMismatch: as :func:`paged_model`.
        ExecutionProviderUnavailable: the device's PagedAttention refuses these properties (the
            CPU plugin's computes an f32 cache with f32 inference only: with bf16 inference it
            takes a bf16 or u8 cache), naming both.
    """
    key = (decoder.device, int(num_layers), tuple(sorted((k, str(v)) for k, v in decoder.config.items())))
    with _COMPILING:
        kept = _COMPILED.get(decoder)
        if kept is not None and kept[0] == key:
            return kept[1]
        model = paged_model(decoder.core, decoder.path, num_layers)
        try:
            compiled = decoder.core.compile_model(model, decoder.device, decoder.config)
        except RuntimeError as exc:
            kv, hint = (decoder.config.get(k, "the device's default") for k in ("KV_CACHE_PRECISION",
                                                                                "INFERENCE_PRECISION_HINT"))
            raise ExecutionProviderUnavailable(
                f"OpenVINO {decoder.device} cannot compile the paged decoder with KV_CACHE_PRECISION={kv} and "
                f"INFERENCE_PRECISION_HINT={hint} ({str(exc).strip().splitlines()[-1]}); compile the decoder with a "
                "cache type its inference precision takes (f32 with f32; bf16 or u8 with bf16)") from exc
        del model  # the compiled model keeps what it needs of it
        _COMPILED[decoder] = (key, compiled)
        return compiled


@dataclass
class _Shared:
    """A voice prefix held as blocks: the entry's ``arrays`` (kept so its id stays unique), its
    length, and its full blocks (which every row of the voice names)."""

    arrays: dict[str, np.ndarray]
    length: int
    blocks: list[int]


class OvPagedDecoder:
    """Up to ``max_batch`` rows on the PagedAttention form of the stateful decoder IR
    (module docstring); a ``BatchedDecoder`` of :mod:`higgs_pack.runtime.engine`.

    Args:
        compiled: the paged model (:func:`paged_model`) compiled for its device.
        max_batch: rows (requests decoded together), >= 1.
        max_length: most positions one row may hold.
        initial_blocks: blocks the pool is made with at the first forward (default: every row's
            first 256 positions, at most :attr:`max_blocks`); it grows by doubling when a row needs
            more.

    Attributes:
        block_size: positions per block (the device's cache layout).
        block_bytes: bytes of one block over every layer's K and V.
        kv_bytes_per_position: ``ceil(block_bytes / block_size)`` (the engine's KV budget unit).
        kv_device: ``"cpu"`` on the CPU device (host memory), else the device.
        pool: the :class:`~higgs_pack.runtime.engine.kv_blocks.BlockPool`.
        max_blocks: the most blocks its doubling grows the pool to (a row that needs more still
            gets them); the engine sets it from its KV budget, which admits requests by the
            blocks their positions need, so a running row always gets its next block.
        tables: row -> its block table (list of block ids).
        lengths: int64 [max_batch] positions each row holds (0: free).
        forwards, packed_forwards: forwards run, and those that carried a prefill chunk beside
            decoding rows.

    Raises:
        InputError: a bad size.
        SignatureMismatch: the compiled model's cache inputs have no static block shape.
    """

    packs_prefill = True
    """:meth:`step` takes a joining row's prompt chunk into the same forward."""

    def __init__(self, compiled, *, max_batch: int, max_length: int, device: str, initial_blocks: int | None = None):
        if max_batch < 1 or max_length < 2:
            raise InputError.of(Problem.said(f"max_batch must be >= 1 and max_length >= 2, got {max_batch} and {max_length}"))
        self.max_batch, self.max_length, self.device = int(max_batch), int(max_length), device
        self.kv_device = "cpu" if device.split(".")[0] == "CPU" else device
        self.compiled = compiled
        self._request = compiled.create_infer_request()
        self._output = compiled.output(0)
        self.hidden_size = self._output.get_partial_shape()[2].get_length()  # hidden_states [T, 1, H]
        self._layout: dict[str, tuple[ov.Type, list[int]]] = {}
        for port in compiled.inputs:
            name = port.get_any_name()
            if name.startswith(_CACHES):
                shape = list(port.get_partial_shape())[1:]
                if any(d.is_dynamic for d in shape):
                    raise SignatureMismatch(f"{name}: the device left the block shape {port.get_partial_shape()} "
                                            f"dynamic on {device}; the paged engine needs the device to fix it")
                self._layout[name] = (port.get_element_type(), [d.get_length() for d in shape])
        self.block_size = self._layout["value_cache.0"][1][1]
        self.block_bytes = sum(int(np.prod(s)) * t.size for t, s in self._layout.values())
        self.kv_bytes_per_position = -(-self.block_bytes // self.block_size)
        self.pool = BlockPool(self.block_size)
        self.max_blocks: int | None = None
        self._caches: dict[str, ov.Tensor] = {}
        self._initial_blocks = initial_blocks or self.max_batch * blocks_for(min(self.max_length, 256), self.block_size)
        self.tables: dict[int, list[int]] = {}
        self.lengths = np.zeros(self.max_batch, dtype=np.int64)
        self._shared: dict[int, _Shared] = {}
        self.forwards = self.packed_forwards = 0

    @property
    def cache_types(self) -> str:
        """The element types of the KV cache inputs as the device compiled them (``"u8"`` on the
        CPU by default; ``"bf16"``, ``"f32"``, or several, comma-separated)."""
        return ", ".join(sorted({kind.get_type_name() for kind, _ in self._layout.values()}))

    # the pool
    def _grow(self, blocks: int) -> None:
        """Make the pool hold at least ``blocks`` blocks (doubling), copying the cache tensors."""
        ahead = max(2 * self.pool.capacity, self._initial_blocks)
        capacity = max(int(blocks), min(ahead, self.max_blocks or ahead))
        for name, (kind, shape) in self._layout.items():
            tensor = ov.Tensor(kind, [capacity, *shape])
            old = self._caches.get(name)
            if old is not None:
                tensor.data[: old.shape[0]] = old.data
            self._caches[name] = tensor
            self._request.set_tensor(name, tensor)
        self.pool.grow(capacity)

    def _take(self, n: int) -> list[int]:
        if n > self.pool.free:
            self._grow(self.pool.in_use + n)
        return self.pool.take(n)

    def _ensure(self, row: int, positions: int) -> None:
        """Give ``row`` the blocks ``positions`` positions need."""
        table = self.tables.setdefault(row, [])
        need = blocks_for(positions, self.block_size) - len(table)
        if need > 0:
            table += self._take(need)

    @property
    def positions_held(self) -> int:
        """Positions the busy rows hold now."""
        return int(self.lengths.sum())

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of the blocks some row (or shared prefix) names: a shared block counted once."""
        return self.pool.in_use * self.block_bytes

    @property
    def shared_prefix_blocks(self) -> int:
        """Blocks of voice prefixes named by more than one row now."""
        return sum(1 for s in self._shared.values() for b in s.blocks if self.pool.refs(b) > 1)

    def release(self, row: int) -> None:
        """Forget row ``row``: its blocks lose a reference (shared prefix blocks stay while
        another row names them)."""
        self.lengths[row] = 0
        freed = set(self.pool.drop(self.tables.pop(row, [])))
        if freed:
            self._shared = {k: s for k, s in self._shared.items() if not freed.intersection(s.blocks)}

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_batch:
            raise InputError.of(Problem.said(f"row {row} is outside 0..{self.max_batch - 1}"))

    # voice prefixes as blocks
    @property
    def prefix_layout(self) -> str:
        """``openvino:paged:<device>:<block size>:<cache type and block shape of each side>``:
        the layout of its voice-prefix entries (raw blocks; never served to another layout)."""
        sides = [f"{side}{self._layout[side + '.0'][0].get_type_name()}{self._layout[side + '.0'][1]}"
                 for side in ("key_cache", "value_cache")]
        return f"openvino:paged:{self.device}:{self.block_size}:{'/'.join(sides)}"

    def read_prefix(self, row: int, length: int) -> dict[str, np.ndarray]:
        """Copies of the blocks of row ``row``'s first ``length`` positions: cache input ->
        [ceil(length / block_size), *block shape] in the cache's type.  Its full blocks are
        from then on the prefix's: a row that restores these arrays (:meth:`write_prefix`)
        names them instead of a copy while this row or another holds them.

        Raises:
            ValueError: the row holds fewer than ``length`` positions.
        """
        if length > self.lengths[row]:
            raise ValueError(f"row {row} holds {int(self.lengths[row])} positions, not {length}")
        blocks = self.tables[row][: blocks_for(length, self.block_size)]
        arrays = {name: np.array(tensor.data[blocks], copy=True) for name, tensor in self._caches.items()}
        self._shared[id(arrays)] = _Shared(arrays, length, blocks[: length // self.block_size])
        return arrays

    def write_prefix(self, row: int, arrays: dict[str, np.ndarray], length: int) -> None:
        """Start row ``row`` over holding ``arrays`` (:meth:`read_prefix`'s, or the same read
        back from a persisted entry) as its first ``length`` positions; a :meth:`prefill` with
        ``start=length`` continues it.  Full blocks of a prefix some row holds now are shared
        (one more reference, no copy); the rest are copied into new blocks, and a partly
        filled last block is always the row's own copy.

        Raises:
            KeyError, ValueError: names or shapes other than this decoder's blocks (nothing changed).
            InputError: ``length`` exceeds ``max_length``, or ``row`` is out of range.
        """
        self._check_row(row)
        check_decoder_room(length, self.max_length)
        n = blocks_for(length, self.block_size)
        if sorted(arrays) != sorted(self._layout):
            raise KeyError(f"prefix arrays {sorted(arrays)[:2]}... are not the paged cache {sorted(self._layout)[:2]}...")
        for name, a in arrays.items():
            kind, shape = self._layout[name]
            dtype = np.dtype(kind.to_dtype())  # bf16 as float16: its bits, never computed with here
            if list(a.shape) != [n, *shape] or a.dtype != dtype:
                raise ValueError(f"prefix array {name} is {a.dtype}{list(a.shape)}, not the {n} blocks of "
                                 f"{dtype}{shape} that {length} positions take")
        self.release(row)
        full = length // self.block_size
        shared = self._shared.get(id(arrays))
        if shared is not None and shared.arrays is arrays and len(shared.blocks) == full:
            self.pool.share(shared.blocks)
            table = list(shared.blocks)
        else:
            table = self._take(full)
            self._copy_in(table, arrays, 0)
            self._shared[id(arrays)] = _Shared(arrays, length, list(table))
        if n > full:
            own = self._take(1)
            self._copy_in(own, arrays, full)
            table += own
        self.tables[row] = table
        self.lengths[row] = length

    def _copy_in(self, blocks: list[int], arrays: dict[str, np.ndarray], first: int) -> None:
        for name, tensor in self._caches.items():
            tensor.data[blocks] = arrays[name][first:first + len(blocks)]

    # forwards
    def prefill(self, row: int, inputs_embeds: np.ndarray, start: int = 0, final: bool = True) -> np.ndarray:
        """Prefill ``S`` prompt positions of row ``row`` from position ``start`` in one forward
        (``final`` is not needed: a row's blocks are its own from its first chunk on).

        Args:
            row: 0 <= row < max_batch.
            inputs_embeds: float32 [1, S, H].
            start: positions the row holds (0: start the row over).

        Returns:
            float32 [1, S, H] hidden states.

        Raises:
            InputError: ``start + S`` exceeds ``max_length``, ``row`` is out of range, or ``start``
                is not 0 or the positions the row holds.
        """
        self._check_row(row)
        if start == 0:
            self.release(row)
        elif start != self.lengths[row]:
            raise InputError.of(Problem.said(f"a prefill continuing row {row} at position {start} must start where the row ends "
                                             f"({int(self.lengths[row])} positions)"))
        return self.forward([(row, inputs_embeds[0])])[0][None]

    def step(self, rows: np.ndarray, inputs_embeds: np.ndarray, prefill: tuple[int, np.ndarray, int] | None = None):
        """One position for each of ``rows``, in one forward; with ``prefill`` = ``(row,
        inputs_embeds [1, S, H], start)`` a joining row's prompt chunk rides in the same forward.

        Args:
            rows: int [a] distinct busy rows.
            inputs_embeds: float32 [a, 1, H], row ``i`` for ``rows[i]``.

        Returns:
            float32 [a, 1, H] hidden states in the order of ``rows``; with ``prefill``, a pair of
            that and the chunk's float32 [1, S, H].

        Raises:
            InputError: a row was not prefilled, would exceed ``max_length``, or the chunk's
                ``start`` is not where its row ends.
        """
        rows = [int(r) for r in rows]
        if any(self.lengths[r] < 1 for r in rows):
            raise InputError.of(Problem.said(f"rows {[r for r in rows if self.lengths[r] < 1]} were not prefilled; call prefill first"))
        parts = [(r, inputs_embeds[i]) for i, r in enumerate(rows)]
        if prefill is None:
            return np.stack(self.forward(parts))
        row, embeds, start = prefill
        self._check_row(row)
        if start == 0:
            self.release(row)
        elif start != self.lengths[row]:
            raise InputError.of(Problem.said(f"the prefill chunk of row {row} at {start} must start where the row ends "
                                             f"({int(self.lengths[row])} positions)"))
        out = self.forward([*parts, (row, embeds[0])])
        self.packed_forwards += bool(rows)
        return (np.stack(out[:-1]) if rows else np.zeros((0, 1, self.hidden_size), np.float32)), out[-1][None]

    def forward(self, parts: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """One infer over the packed tokens of ``parts`` (``(row, inputs_embeds [S, H])``, each
        continuing its row): returns float32 [S, H] per part; rows gain their positions."""
        for row, embeds in parts:
            check_decoder_room(int(self.lengths[row]) + embeds.shape[0], self.max_length)
        for row, embeds in parts:
            self._ensure(row, int(self.lengths[row]) + embeds.shape[0])
        sizes = [embeds.shape[0] for _, embeds in parts]
        past = [int(self.lengths[row]) for row, _ in parts]
        tables = [self.tables[row] for row, _ in parts]
        feeds = {
            "inputs_embeds": np.ascontiguousarray(np.concatenate([e for _, e in parts]), dtype=np.float32),
            "position_ids": np.concatenate([np.arange(p, p + s) for p, s in zip(past, sizes, strict=True)]),
            "past_lens": np.array(past, dtype=np.int32),
            "subsequence_begins": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32),
            "block_indices": np.concatenate([np.array(t, dtype=np.int32) for t in tables]),
            "block_indices_begins": np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
            "max_context_len": np.array(max(p + s for p, s in zip(past, sizes, strict=True)), dtype=np.int32),
        }
        hidden = self._request.infer(feeds)[self._output]
        self.forwards += 1
        out, at = [], 0
        for (row, _), s in zip(parts, sizes, strict=True):
            out.append(np.array(hidden[at:at + s, 0], dtype=np.float32, copy=True))
            self.lengths[row] += s
            at += s
        return out
