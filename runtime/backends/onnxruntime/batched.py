"""The ONNX Runtime decoder for several requests at once (:class:`BatchedOrtDecoder`).

One KV buffer per layer and key/value, [max_batch, kv_heads, max_length, head_dim], bound
with IOBinding as both ``past_key_values.*`` and ``present.*`` (GroupQueryAttention shares
them: MODEL.md "Batching and KV-cache facts").  A request owns one row.  Its prompt is
prefilled at batch 1 on that row: ``buffer[row:row+1]`` is contiguous, so it binds without a
copy.  Then all rows decode one position per step together, each at its own length (a
right-padded ``attention_mask``: row ``b`` has ``length_b + 1`` ones; the graph derives each
row's ``seqlens_k`` from it and writes the new K/V at that row's offset).  ORT refuses a
multi-token chunk with past at batch > 1, which is why prefill is per row.

Every KV binding is a pointer into a buffer (``buffer + row x row_bytes``) with the buffer's
device, so host and device memory take the same path.  On the CUDA execution provider (a
cuda bundle's GroupQueryAttention decoder) the buffers are ``OrtValue``s in the GPU's memory,
allocated whole when the decoder is made (``max_batch x max_length x``
:attr:`~BatchedOrtDecoder.kv_bytes_per_position` bytes: 4.5 GiB for 8 rows of 4,096
positions of the 4B model's float16 cache) and never copied to the host; ``inputs_embeds``,
``attention_mask`` and ``hidden_states`` stay host buffers that ONNX Runtime copies per step
(a few KB).  Device memory is not zeroed: a row is read only up to its own length, which
its prefill and steps wrote.  ``device_buffers=True`` makes the same ``OrtValue`` buffers in
host memory on the CPU provider, so the device path's allocation and binding are tested on
machines without a GPU.

KV memory on the host: each buffer is a private anonymous mapping (pages are committed as positions
are written), and :meth:`BatchedOrtDecoder.release` gives a row's pages back to the
kernel (``madvise(MADV_DONTNEED)``; they read back as zeros), so the memory held follows
the requests on the rows, not the longest request a row ever held.  Where Python's
``mmap`` has no private anonymous mappings or no ``madvise`` (Windows), the buffers are
``np.zeros`` and a released row keeps its pages until a later request overwrites them.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

from higgs_pack.errors import InputError, Problem, SignatureMismatch
from higgs_pack.runtime.backends.onnxruntime.distributions import import_ort
from higgs_pack.runtime.backends.onnxruntime.failures import _raise_unsupported, out_of_memory
from higgs_pack.runtime.backends.onnxruntime.runners import (
    _bind_host,
    kv_cache_dtype,
    provider_device_id,
    shared_kv_device,
)
from higgs_pack.runtime.backends.onnxruntime.sessions import ORT_TYPES
from higgs_pack.runtime.engine.kv_memory import mib
from higgs_pack.runtime.loop.pipeline import check_decoder_room


class BatchedOrtDecoder:
    """The ModelBuilder GroupQueryAttention decoder serving up to ``max_batch`` requests.

    Rows that hold no request but lie below the highest busy row ("holes") ride along in a
    step with one position each (their KV row is scratch); a step runs rows ``0..k-1`` where
    ``k - 1`` is the highest row asked for, so callers should fill the lowest free row.

    The KV buffers hold ``max_batch * max_length`` positions of :attr:`kv_bytes_per_position`
    bytes at most; the OS commits their pages as positions are written, and a released row's
    pages are given back (module docstring).

    Args:
        session: the decoder's ``InferenceSession`` on the CPU execution provider (it may be
            the one the batch-1 :class:`~higgs_pack.runtime.backends.onnxruntime.runners.OrtDecoder`
            uses: this class has its own bindings and buffers).
        max_batch: rows (requests decoded together), >= 1.
        max_length: most positions one row may hold (prompt + frames).
        kv_heads, head_dim: cache shape (the graph's own fixed sizes of its
            ``past_key_values.*`` inputs win where it declares them).
        device_buffers: hold the KV buffers as ``OrtValue``s on the provider's device (default:
            on a GPU provider); True on the CPU provider runs that path on host memory.

    Attributes:
        kv: ``past_key_values.*`` name -> its host buffer [max_batch, kv_heads, max_length,
            head_dim] of the dtype the graph declares (float32 in fp32 and int4 bundles;
            float16 in cuda ones; int8/uint8 for a quantized KV cache); empty when the buffers
            are ``OrtValue``s (:attr:`kv_values`; read a row with :meth:`kv_row`).
        kv_values: ``past_key_values.*`` name -> its ``OrtValue`` buffer of that shape (empty
            for host buffers).
        kv_bytes_per_position: bytes one position of one row takes over all those buffers:
            ``num_layers x 2 x kv_heads x head_dim x itemsize`` (int; fp32 at full size
            294,912 = 288 KiB, the tiny model 512).
        kv_device: where the buffers live: ``"cpu"`` (host memory) or ``"cuda"`` (the GPU's).
        lengths: int64 [max_batch] positions each row holds.

    Raises:
        SignatureMismatch: the graph takes ``position_ids`` or has no ``inputs_embeds`` (not a
            ModelBuilder GroupQueryAttention graph), a dynamic hidden size, a KV cache dtype or
            layout the runtime does not read (see
            :func:`~higgs_pack.runtime.backends.onnxruntime.runners.kv_cache_dtype`), or a
            ``present.*`` output whose dtype differs from its ``past_key_values.*`` input
            (they share one buffer).
        InputError: the session's provider keeps no shared KV buffers (DirectML), or a bad size.
        MemoryError: the device has no room for the KV buffers (the message gives their size).
    """

    def __init__(self, session, *, max_batch: int, max_length: int, kv_heads: int, head_dim: int,
                 device_buffers: bool | None = None):
        provider = (session.get_providers() or ["CPUExecutionProvider"])[0]
        device = shared_kv_device(provider)
        if device is None:
            raise InputError.of(
                Problem.said(f"the batched decoder binds one KV buffer per layer as past and present, which {provider} "
                             "does not share; use max_batch=1 there, or a cpu or cuda bundle", code="unsupported_value"))
        if max_batch < 1 or max_length < 2:
            raise InputError.of(Problem.said(f"max_batch must be >= 1 and max_length >= 2, got {max_batch} and {max_length}"))
        inputs = {i.name: i for i in session.get_inputs()}
        hidden = inputs.get("inputs_embeds")
        if hidden is None or "position_ids" in inputs or not isinstance(hidden.shape[-1], int):
            raise SignatureMismatch(
                "llm_decoder: batching needs a GroupQueryAttention graph with inputs_embeds of a fixed "
                f"width and no position_ids (inputs: {sorted(inputs)}); rebuild the bundle with "
                "`higgs-pack build --target cpu`")
        self.session = session
        self.max_batch, self.max_length = max_batch, max_length
        self.hidden_size = hidden.shape[-1]
        self._embed_type = ORT_TYPES[hidden.type]
        outputs = {o.name: o for o in session.get_outputs()}
        self._hidden_type = ORT_TYPES[outputs["hidden_states"].type]
        self._past = sorted(n for n in inputs if n.startswith("past_key_values."))
        self._present = [n.replace("past_key_values.", "present.") for n in self._past]
        kv_type = kv_cache_dtype(session, head_dim)  # int8 for a quantized KV cache, as the graph declares
        self.kv_device = device
        self._device_id = provider_device_id(session, provider)
        self._on_values = device != "cpu" if device_buffers is None else bool(device_buffers)
        self._kv_type = np.dtype(kv_type)
        self.kv: dict[str, np.ndarray] = {}
        self.kv_values: dict[str, object] = {}
        self._kv_maps: dict[str, mmap.mmap] = {}
        self._kv_shape: dict[str, tuple[int, int, int, int]] = {}
        self._kv_ptr: dict[str, int] = {}
        for past, present in zip(self._past, self._present, strict=True):
            declared = inputs[past].shape
            if present in outputs and outputs[present].type != inputs[past].type:
                raise SignatureMismatch(
                    f"llm_decoder: {present} is {outputs[present].type} but {past} is {inputs[past].type}; "
                    "both are bound to one KV buffer, so they must agree: rebuild the bundle")
            fixed = len(declared) == 4
            heads = declared[1] if fixed and isinstance(declared[1], int) else kv_heads
            width = declared[3] if fixed and isinstance(declared[3], int) else head_dim
            self._kv_shape[past] = (max_batch, heads, max_length, width)
        self.kv_bytes_per_position = sum(h * w * self._kv_type.itemsize for _, h, _, w in self._kv_shape.values())
        total = self.kv_bytes_per_position * max_batch * max_length
        for past, shape in self._kv_shape.items():
            if self._on_values:
                self._kv_ptr[past] = self._device_buffer(past, shape, total)
            else:
                self.kv[past] = self._kv_buffer(past, shape, kv_type)
                self._kv_ptr[past] = self.kv[past].ctypes.data
        self.lengths = np.zeros(max_batch, dtype=np.int64)
        self._embeds = np.zeros((max_batch, 1, self.hidden_size), dtype=self._embed_type)
        self._hidden = np.zeros((max_batch, 1, self.hidden_size), dtype=self._hidden_type)
        self._mask = np.zeros(max_batch * max_length, dtype=np.int64)
        self._positions = np.arange(max_length, dtype=np.int64)
        self._binding = session.io_binding()
        self._bound_rows = 0

    def _kv_buffer(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A zero buffer whose rows' pages :meth:`release` can give back (module docstring)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        private = getattr(mmap, "MAP_PRIVATE", None)
        anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
        if private is None or anonymous is None or not hasattr(mmap.mmap, "madvise") or nbytes == 0:
            return np.zeros(shape, dtype=dtype)
        mapping = mmap.mmap(-1, nbytes, flags=private | anonymous)
        self._kv_maps[name] = mapping
        return np.frombuffer(mapping, dtype=dtype).reshape(shape)

    def _device_buffer(self, name: str, shape: tuple[int, ...], total: int) -> int:
        """Allocate ``name``'s buffer as an ``OrtValue`` on :attr:`kv_device`; its address."""
        ort = import_ort()
        try:
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self._kv_type.type, self.kv_device,
                                                              self._device_id)
        except Exception as exc:  # onnxruntime's own error types
            if out_of_memory(exc):
                raise MemoryError(
                    f"out of {self.kv_device} memory for the batched KV cache: {self.max_batch} rows x "
                    f"{self.max_length} positions x {self.kv_bytes_per_position} B = {mib(total)} in all; "
                    f"lower max_batch or max_length ({exc})") from exc
            raise
        self.kv_values[name] = value
        return int(value.data_ptr())

    def kv_row(self, name: str, row: int) -> np.ndarray:
        """A host copy of row ``row`` of buffer ``name`` ([kv_heads, max_length, head_dim], the
        cache dtype), wherever the buffer lives (a device buffer is copied out whole: for tests
        and checks, not for the decode path)."""
        if name in self.kv:
            return self.kv[name][row].copy()
        return self.kv_values[name].numpy()[row]

    def _bind_kv(self, binding, first: int, count: int) -> None:
        """Bind rows ``first .. first+count-1`` of every KV buffer as its ``past_key_values.*``
        input and ``present.*`` output (a pointer into the buffer: the rows are contiguous)."""
        for past, present in zip(self._past, self._present, strict=True):
            _, heads, length, width = self._kv_shape[past]
            row_bytes = heads * length * width * self._kv_type.itemsize
            pointer = self._kv_ptr[past] + first * row_bytes
            shape = [count, heads, length, width]
            binding.bind_input(past, self.kv_device, self._device_id, self._kv_type, shape, pointer)
            binding.bind_output(present, self.kv_device, self._device_id, self._kv_type, shape, pointer)

    def release(self, row: int) -> None:
        """Forget row ``row``'s positions and give its KV pages back to the OS (each host buffer's
        whole pages inside the row; the row reads as zeros until the next prefill writes it).
        A device buffer keeps its memory (it was allocated whole)."""
        self.lengths[row] = 0
        page = mmap.PAGESIZE
        for name, mapping in self._kv_maps.items():
            row_bytes = self.kv[name][0].nbytes
            start = -(-row * row_bytes // page) * page
            end = (row + 1) * row_bytes // page * page
            if end > start:
                mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    @property
    def positions_held(self) -> int:
        """Positions the busy rows hold now (times :attr:`kv_bytes_per_position`: KV bytes written)."""
        return int(self.lengths.sum())

    @property
    def prefix_layout(self) -> str | None:
        """The KV layout of voice-prefix entries, the batch-1
        :class:`~higgs_pack.runtime.backends.onnxruntime.runners.OrtDecoder`'s too (one cache
        shares them); None for ``OrtValue`` buffers (their copy in is not written)."""
        return None if self._on_values else f"onnxruntime:past_key_values:{self._kv_type.name}"

    def read_prefix(self, row: int, length: int) -> dict[str, np.ndarray]:
        """A copy of row ``row``'s first ``length`` positions: ``past_key_values.*`` -> [kv_heads,
        length, head_dim] in the cache dtype."""
        if length > self.lengths[row]:
            raise ValueError(f"row {row} holds {int(self.lengths[row])} positions, not {length}")
        if self._on_values:
            return {n: self.kv_row(n, row)[:, :length].copy() for n in self._past}
        # the positions alone (kv_row copies the whole row first: 4096 positions, 1.2 GB for the
        # 36 layers at full size, which took a join 441 ms where these 60 MB take about 40)
        return {n: self.kv[n][row, :, :length].copy() for n in self._past}

    def write_prefix(self, row: int, arrays: dict[str, np.ndarray], length: int) -> None:
        """Start row ``row`` over holding ``arrays`` (:meth:`read_prefix`'s) as its first
        ``length`` positions; a :meth:`prefill` with ``start=length`` continues it.

        Raises:
            KeyError, ValueError: names or shapes other than this decoder's (nothing changed).
            InputError: ``length`` exceeds ``max_length``, or the buffers are OrtValues.
        """
        from higgs_pack.runtime.loop.prefix_cache import check_prefix_arrays

        if self._on_values:
            raise InputError.of(Problem.said("this batched decoder's KV buffers are OrtValues: a cached prefix is not copied in"))
        check_prefix_arrays(arrays, self._past, length)
        check_decoder_room(length, self.max_length)
        for n in self._past:
            self.kv[n][row, :, :length] = arrays[n]
        self.lengths[row] = length

    def prefill(self, row: int, inputs_embeds: np.ndarray, start: int = 0, final: bool = True) -> np.ndarray:
        """Prefill ``S`` prompt positions of row ``row`` from position ``start``, at batch 1 on a
        view of that row's buffers: ``start=0`` starts the row over; a later chunk continues
        the row's own positions (``start`` = the positions it holds: an earlier chunk's, or a
        cached prefix's, :meth:`write_prefix`), so a prompt may be prefilled in chunks between
        steps of the other rows.  On the CPU provider with a float32 cache a prompt prefilled in
        chunks of two or more positions gives bit-identical KV and hidden states (measured on
        the tiny fp32 bundle).

        Args:
            row: 0 <= row < max_batch.
            inputs_embeds: float32 [1, S, H].
            start: positions the row holds already (0: start over).
            final: unused here (the row joins the steps once prefilled; OpenVINO's batched
                decoder splices it in at its final chunk).

        Returns:
            float32 [1, S, H] hidden states (a new array).

        Raises:
            InputError: ``start + S`` exceeds ``max_length``, or ``start`` is not 0 or the
                positions the row holds.
        """
        s = inputs_embeds.shape[1]
        if start and start != self.lengths[row]:
            raise InputError.of(Problem.said(f"row {row} holds {int(self.lengths[row])} positions: a prefill continuing it starts "
                                             f"there, not at {start}"))
        check_decoder_room(start + s, self.max_length)
        self.lengths[row] = start
        binding = self.session.io_binding()
        embeds = np.ascontiguousarray(inputs_embeds, dtype=self._embed_type)
        hidden = np.zeros((1, s, self.hidden_size), dtype=self._hidden_type)
        mask = np.ones((1, start + s), dtype=np.int64)
        _bind_host(binding, "inputs_embeds", embeds)
        _bind_host(binding, "attention_mask", mask)
        _bind_host(binding, "hidden_states", hidden, output=True)
        self._bind_kv(binding, row, 1)  # the row itself (contiguous), no copy
        self._run(binding)
        self.lengths[row] = start + s
        return hidden.astype(np.float32)

    def step(self, rows: np.ndarray, inputs_embeds: np.ndarray) -> np.ndarray:
        """One position for each of ``rows``, all in one run.

        Args:
            rows: int [a] distinct busy rows (each prefilled), ascending.
            inputs_embeds: float32 [a, 1, H], row ``i`` for ``rows[i]``.

        Returns:
            float32 [a, 1, H] hidden states (a new array), in the order of ``rows``.

        Raises:
            InputError: a row would exceed ``max_length`` positions, or a row was not prefilled.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if (self.lengths[rows] < 1).any():
            raise InputError.of(Problem.said(f"rows {rows[self.lengths[rows] < 1].tolist()} were not prefilled; call prefill first"))
        check_decoder_room(int(self.lengths[rows].max()) + 1, self.max_length)
        k = int(rows.max()) + 1
        self._embeds[:k] = 0
        self._embeds[rows] = inputs_embeds
        # Rows not asked ride along: a hole writes a scratch position at 0, a row whose prompt is
        # being prefilled in chunks one past its positions (its next chunk writes over it).
        lengths = self.lengths[:k].copy()
        width = int(lengths.max()) + 1  # > 1: every busy row holds at least its prompt
        mask = self._mask[: k * width].reshape(k, width)
        np.less(self._positions[None, :width], lengths[:, None] + 1, out=mask, casting="unsafe")
        if k != self._bound_rows:
            self._bind_rows(k)
        _bind_host(self._binding, "attention_mask", mask)
        self._run(self._binding)
        self.lengths[rows] += 1
        return self._hidden[rows].astype(np.float32)

    def _bind_rows(self, k: int) -> None:
        """Bind the first ``k`` rows of every buffer (contiguous views) for the decode steps."""
        _bind_host(self._binding, "inputs_embeds", self._embeds[:k])
        _bind_host(self._binding, "hidden_states", self._hidden[:k], output=True)
        self._bind_kv(self._binding, 0, k)
        self._bound_rows = k

    def _run(self, binding) -> None:
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime's own error types
            _raise_unsupported("llm_decoder", self.session, exc)
            raise
