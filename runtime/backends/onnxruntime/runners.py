"""ONNX Runtime runners: a stateless sub-part (:class:`OrtSubPart`) and the decoder with
its KV cache in buffers shared between steps (:class:`OrtDecoder`), bound with IOBinding."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.errors import (
    SignatureMismatch,
)
from higgs_pack.manifests.providers import EXECUTION_PROVIDERS
from higgs_pack.runtime.backends.onnxruntime.distributions import import_ort
from higgs_pack.runtime.backends.onnxruntime.failures import _raise_unsupported
from higgs_pack.runtime.backends.onnxruntime.sessions import ORT_TYPES
from higgs_pack.runtime.loop.pipeline import check_decoder_room
from higgs_pack.runtime.machine.mapped_pages import paging_out

log = logging.getLogger(__name__)




def _bind_host(binding, name: str, array: np.ndarray, output: bool = False) -> None:
    """Bind a contiguous host array as an IOBinding input or output (ONNX Runtime reads or
    writes that memory in place; the array must outlive the binding)."""
    shape = list(array.shape)
    if output:
        binding.bind_output(name, "cpu", 0, array.dtype, shape, array.ctypes.data)
    else:
        binding.bind_input(name, "cpu", 0, array.dtype, shape, array.ctypes.data)


#: Most rows (batch size) of a per-step call that :class:`OrtSubPart` runs on bound buffers.
MAX_BOUND_ROWS = 64


class OrtSubPart:
    """A stateless sub-part on an ONNX Runtime session.

    Floating inputs are cast to the dtype the graph declares (fp16 graphs take
    float16); floating outputs come back as float32.

    Per-step shapes (``step_inputs``: the heads' ``hidden_states`` [1, 1, H] and the
    embed's ``codes`` [1, 1, 8], run once per frame) run through an IOBinding with
    preallocated host buffers: the inputs are copied into bound buffers, ONNX Runtime
    writes the outputs into bound buffers, and :meth:`run` returns views of them, so a
    step allocates no arrays.  The same holds for those shapes with another leading
    (batch) size, up to :data:`MAX_BOUND_ROWS` rows (the batched engine's steps): one set
    of buffers per batch size.  The buffers are made on the first call with those shapes
    (a plain run, which gives the output shapes and dtypes).  Any other shape (a prompt,
    a reference clip) is a plain run whose outputs the caller owns.  Binding is used on
    the providers whose rows name an ``iobinding_device`` (cpu, cuda: the host buffers
    are copied to the device by ONNX Runtime); elsewhere every call is a plain run.

    Args:
        session: the ``InferenceSession``.
        name: sub-part name (for messages).
        step_inputs: input name -> shape of the per-step call (all inputs of the graph),
            or None for no binding (see :func:`higgs_pack.runtime.loop.pipeline.step_input_shapes`).
    """

    def __init__(self, session, name: str, step_inputs: dict[str, tuple[int, ...]] | None = None):
        self.session = session
        self.name = name
        self._in_types = {i.name: ORT_TYPES[i.type] for i in session.get_inputs()}
        self._outputs = [o.name for o in session.get_outputs()]
        provider = (session.get_providers() or ["CPUExecutionProvider"])[0]
        usable = step_inputs is not None and set(step_inputs) == set(self._in_types) and \
            shared_kv_device(provider) is not None
        self._step_inputs = {k: tuple(v) for k, v in step_inputs.items()} if usable else None
        # batch size -> (binding, input buffers, output buffers, float32 outputs returned)
        self._bound: dict[int, tuple[Any, dict[str, np.ndarray], list[np.ndarray], dict[str, np.ndarray]]] = {}

    @property
    def bound(self) -> bool:
        """Whether per-step calls now run through the preallocated IOBinding."""
        return bool(self._bound)

    def _step_rows(self, feeds: dict[str, np.ndarray]) -> int | None:
        """The batch size when ``feeds`` have the per-step shapes but for their leading size
        (the same for all, at most :data:`MAX_BOUND_ROWS`); None otherwise."""
        steps = self._step_inputs
        if steps is None or len(feeds) != len(steps):
            return None
        rows = {np.shape(v)[0] if np.ndim(v) else -1 for v in feeds.values()}
        if len(rows) != 1 or not 1 <= (n := rows.pop()) <= MAX_BOUND_ROWS:
            return None
        same = all(k in steps and np.shape(v)[1:] == steps[k][1:] for k, v in feeds.items())
        return n if same else None

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once; see :mod:`higgs_pack.runtime.loop.pipeline` for names and shapes.

        Returns:
            Output name -> float32 / integer array.  For the per-step shapes, once
            bound: views of this runner's buffers, valid until its next per-step call
            (the caller may modify them; copy what must outlive that call).  Otherwise
            new arrays the caller owns.
        """
        rows = self._step_rows(feeds)
        if rows in self._bound:
            return self._run_bound(rows, feeds)
        cast = {k: np.ascontiguousarray(v, dtype=self._in_types[k]) for k, v in feeds.items()}
        try:
            outs = self.session.run(self._outputs, cast)
        except Exception as exc:  # onnxruntime's own error types
            _raise_unsupported(self.name, self.session, exc)
            raise
        if rows is not None:
            self._bind_step(rows, outs)
        return {
            k: (v.astype(np.float32, copy=False) if np.issubdtype(v.dtype, np.floating) else v)
            for k, v in zip(self._outputs, outs, strict=True)
        }

    def _bind_step(self, rows: int, outs: list[np.ndarray]) -> None:
        """Allocate and bind the per-step buffers for ``rows`` rows, shaped like one plain run's outputs."""
        binding = self.session.io_binding()
        in_buffers: dict[str, np.ndarray] = {}
        out_buffers: list[np.ndarray] = []
        step_out: dict[str, np.ndarray] = {}
        for name, shape in self._step_inputs.items():
            in_buffers[name] = np.zeros((rows, *shape[1:]), dtype=self._in_types[name])
            _bind_host(binding, name, in_buffers[name])
        for name, value in zip(self._outputs, outs, strict=True):
            buffer = np.zeros(value.shape, dtype=value.dtype)
            out_buffers.append(buffer)
            _bind_host(binding, name, buffer, output=True)
            # fp16 graphs: one more preallocated buffer holds the float32 the loop reads.
            widen = np.issubdtype(value.dtype, np.floating) and value.dtype != np.float32
            step_out[name] = np.zeros(value.shape, np.float32) if widen else buffer
        self._bound[rows] = (binding, in_buffers, out_buffers, step_out)

    def _run_bound(self, rows: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        binding, in_buffers, out_buffers, step_out = self._bound[rows]
        for name, value in feeds.items():
            np.copyto(in_buffers[name], value, casting="same_kind")
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime's own error types
            _raise_unsupported(self.name, self.session, exc)
            raise
        for buffer, out in zip(out_buffers, step_out.values(), strict=True):
            if out is not buffer:
                np.copyto(out, buffer)
        return dict(step_out)


def shared_kv_device(ort_provider: str) -> str | None:
    """Where the decoder's shared KV buffers live on this ONNX Runtime provider (its row's
    ``iobinding_device``, e.g. ``cuda``), or None when its attention does not share bound
    past/present buffers (the cache is then copied each step)."""
    row = next((r for r in EXECUTION_PROVIDERS.values() if r.ort_provider == ort_provider), None)
    return row.sessions.iobinding_device if row else None

def provider_device_id(session, ort_provider: str) -> int:
    """The device index a session's provider runs on (its ``device_id`` provider option; 0
    where the provider has none, as the CPU provider)."""
    options = session.get_provider_options().get(ort_provider, {}) if hasattr(session, "get_provider_options") else {}
    return int(options.get("device_id", 0))


def kv_cache_dtype(session, head_dim: int) -> type:
    """The numpy dtype of a decoder session's KV cache, as its ``past_key_values.*`` inputs
    declare it: float32 (ModelBuilder's cpu graphs), float16 (cuda/dml fp16 and int4), or
    int8 for a quantized KV cache (``kv_cache_quant_scheme=int8_per_tensor|int8_per_channel``:
    ModelBuilder 0.18 builders/base.py ``make_kv_cache_init``; ONNX Runtime 1.32's CPU
    GroupQueryAttention registers ``T_CACHE`` float, float16, int8 and uint8, read from its
    kernel registry).  The decoders allocate and bind their KV buffers in this dtype.

    Args:
        session: an ``InferenceSession`` of an ``llm_decoder`` graph.
        head_dim: the model's head size (manifest ``constants.head_dim``).

    Returns:
        The dtype (``np.float32`` for a graph without KV inputs).

    Raises:
        SignatureMismatch: the KV inputs disagree on their dtype, declare one this runtime
            has no numpy type for (float8), or a last dimension other than ``head_dim``
            (ModelBuilder's packed int4 KV cache, [.., head_dim / 2] uint8, which this
            runtime does not read).
    """
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    if not past:
        return np.float32
    types = sorted({i.type for i in past})
    if len(types) != 1 or types[0] not in ORT_TYPES:
        raise SignatureMismatch(
            f"llm_decoder: the KV cache inputs are {', '.join(types)}; this runtime reads one of "
            f"{', '.join(t for t in ORT_TYPES if 'int64' not in t and 'bool' not in t)} for all of them. "
            "Rebuild the bundle with `higgs-pack build --kv-cache float` or `--kv-cache int8`")
    dims = {i.shape[-1] for i in past if isinstance(i.shape[-1], int)}
    if dims - {head_dim}:
        raise SignatureMismatch(
            f"llm_decoder: the KV cache inputs have a last dimension of {sorted(dims)}, not head_dim {head_dim} "
            f"({types[0]}: a packed int4 KV cache, which this runtime does not read). Rebuild the bundle with "
            "`higgs-pack build --kv-cache float` or `--kv-cache int8`")
    return ORT_TYPES[types[0]]


#: First KV buffer length of the shared-buffer decoder (positions); it doubles when a request
#: needs more (one copy of the used part), up to the decoder's ``max_length``.
INITIAL_KV_CAPACITY = 512


class OrtDecoder:
    """The ModelBuilder decoder (``exclude_embeds``, ``exclude_lm_head``) with its KV cache.

    Graph I/O (MODEL.md, measured): inputs ``inputs_embeds`` [1,S,H],
    ``attention_mask`` int64 [1, past+S], ``past_key_values.{i}.key|value``
    [1, kv_heads, past, head_dim] (+ ``position_ids`` [1,S] for dml); outputs
    ``hidden_states`` and ``present.{i}.key|value``.

    The KV buffers have the dtype the graph's ``past_key_values.*`` inputs declare
    (:func:`kv_cache_dtype`: float32, float16, or int8 for a quantized KV cache, whose
    per-layer scales are initializers of the graph).

    Two ways to hold the cache:

    * shared buffers (GroupQueryAttention graphs: ModelBuilder's cpu, cuda fp16/int4):
      one preallocated KV buffer per layer and key/value, [1, kv_heads, capacity,
      head_dim], bound with IOBinding as both ``past_key_values.*`` and ``present.*``.
      GroupQueryAttention sees equal pointers, writes the new rows in place and reads
      the valid length from ``attention_mask`` (a view of a preallocated row of ones);
      without the sharing it allocates and copies the whole cache every step.
      ``inputs_embeds`` and ``hidden_states`` are preallocated too. On cuda the KV
      buffers live on the device.
    * copies (MultiHeadAttention graphs with ``position_ids``: ModelBuilder's dml and
      fp32 cuda, see ``exporters/onnx/modelbuilder.py`` NO_PACKED_ATTENTION): present
      tensors [1, kv_heads, past+S, head_dim] are fed back as OrtValues.

    Args:
        session: the ``InferenceSession``.
        max_length: most positions one request may use.
        kv_heads, head_dim: cache shape.
        shared_kv: force one way (default: shared when the session runs on the CPU or CUDA
            provider and the graph takes no ``position_ids``; the KV buffers then live on
            that provider's device).
        page_out_weights: the graph's external-data files, for a session created with
            ``prepacking=False`` on the CPU provider: every :meth:`forward` runs inside
            :func:`~higgs_pack.runtime.machine.mapped_pages.paging_out` (``keep_page_cache=True``)
            on each, so the weights' pages leave the process's resident set as soon as a
            step has read them and come back from the page cache next step.  The
            full-size fp32 decoder (14.5 GB) then runs in a few hundred MB of resident
            memory, at the price of a minor fault per page each step.

    Raises:
        SignatureMismatch: no ``inputs_embeds`` input; shared buffers asked of a graph with
            ``position_ids`` or a dynamic hidden size; a KV cache dtype or layout this runtime
            does not read (:func:`kv_cache_dtype`).
    """

    def __init__(self, session, *, max_length: int, kv_heads: int, head_dim: int,
                 shared_kv: bool | None = None, page_out_weights: tuple[Path, ...] = ()):
        self.session = session
        self.page_out_weights = tuple(page_out_weights)
        self.max_length = max_length
        ort = import_ort()
        self._ort = ort
        inputs = {i.name: i for i in session.get_inputs()}
        if "inputs_embeds" not in inputs:
            raise SignatureMismatch(
                f"llm_decoder: the graph has no inputs_embeds input (inputs: {sorted(inputs)}); it was not "
                "built with exclude_embeds. Rebuild the bundle with `higgs-pack build`"
            )
        self._embed_type = ORT_TYPES[inputs["inputs_embeds"].type]
        self._hidden_size = inputs["inputs_embeds"].shape[-1]
        self._past = sorted(n for n in inputs if n.startswith("past_key_values."))
        self._present = [n.replace("past_key_values.", "present.") for n in self._past]
        self._has_position_ids = "position_ids" in inputs
        self._kv_type = kv_cache_dtype(session, head_dim)
        self._kv_heads, self._head_dim = kv_heads, head_dim
        self._outputs = ["hidden_states", *self._present]
        provider = (session.get_providers() or ["CPUExecutionProvider"])[0]
        device = shared_kv_device(provider)
        if shared_kv is None:
            shared_kv = device is not None and not self._has_position_ids
        self.shared_kv = bool(shared_kv)
        if self.shared_kv and (self._has_position_ids or not isinstance(self._hidden_size, int)):
            raise SignatureMismatch(
                "llm_decoder: shared KV buffers need a GroupQueryAttention graph without position_ids and a "
                f"fixed hidden size (inputs: {sorted(inputs)}); open it with shared_kv=False"
            )
        self._device = device or "cpu"
        self._device_id = provider_device_id(session, provider)
        if self.shared_kv:
            self._binding = session.io_binding()
            self._mask = np.ones((1, max_length), dtype=np.int64)
            outputs = {o.name: o for o in session.get_outputs()}
            self._hidden_type = ORT_TYPES[outputs["hidden_states"].type]
            self._step_buffers(1)
            self._capacity = 0
            self._kv: dict[str, Any] = {}
            self._kv_host: dict[str, np.ndarray] = {}
        self.reset()

    @property
    def kv_bytes_per_position(self) -> int:
        """KV bytes one position takes: ``num_layers x 2 x kv_heads x head_dim x`` the itemsize
        of each ``past_key_values.*`` input's declared dtype (288 KiB for the 4B model at fp32).
        The copies path (no shared buffers) briefly holds the cache twice per step."""
        inputs = {i.name: i for i in self.session.get_inputs()}
        return sum(self._kv_heads * self._head_dim * np.dtype(ORT_TYPES[inputs[n].type]).itemsize
                   for n in self._past)

    @property
    def kv_device(self) -> str:
        """Where the KV cache lives: ``"cpu"`` (host memory) or ``"cuda"`` (the GPU's)."""
        return self._device if self.shared_kv else "cpu"

    @property
    def prefix_layout(self) -> str | None:
        """The KV layout of its voice-prefix entries (:mod:`~higgs_pack.runtime.loop.prefix_cache`):
        ``onnxruntime:past_key_values:<cache dtype>``, the batched decoder's too; None for shared
        buffers on a device (their copy in is not written)."""
        if self.shared_kv and self._device != "cpu":
            return None
        return f"onnxruntime:past_key_values:{np.dtype(self._kv_type).name}"

    @property
    def prefix_refusal(self) -> str:
        """Why :attr:`prefix_layout` is None ("" when it is not)."""
        return "" if self.prefix_layout else (
            f"the KV buffers are in {self._device} memory and copying a cached prefix into them is not written")

    def read_prefix(self, length: int) -> dict[str, np.ndarray]:
        """A copy of the cache's first ``length`` positions: ``past_key_values.*`` -> [kv_heads,
        length, head_dim] in the cache dtype."""
        if length > self._length:
            raise ValueError(f"the cache holds {self._length} positions, not {length}")
        if self.shared_kv:
            return {n: self._kv_host[n][0, :, :length].copy() for n in self._past}
        return {n: self._cache[n].numpy()[0, :, :length].copy() for n in self._past}

    def write_prefix(self, arrays: dict[str, np.ndarray], length: int) -> None:
        """Start over holding ``arrays`` (:meth:`read_prefix`'s) as positions 0..length-1; the
        next :meth:`forward` continues at ``length``.

        Raises:
            KeyError, ValueError: names or shapes other than this decoder's (nothing changed).
        """
        from higgs_pack.runtime.loop.prefix_cache import check_prefix_arrays

        check_prefix_arrays(arrays, self._past, length)
        check_decoder_room(length, self.max_length)
        self.reset()
        if self.shared_kv:
            self._ensure_capacity(length)
            for n in self._past:
                self._kv_host[n][0, :, :length] = arrays[n]
        else:
            self._cache = {n: self._ort.OrtValue.ortvalue_from_numpy(
                np.ascontiguousarray(arrays[n], dtype=self._kv_type)[None]) for n in self._past}
        self._length = length

    def _step_buffers(self, s: int) -> None:
        """(Re)allocate the ``inputs_embeds`` / ``hidden_states`` buffers for ``s`` positions and
        bind them (they stay bound for every step of that length)."""
        self._embeds = np.zeros((1, s, self._hidden_size), dtype=self._embed_type)
        self._hidden = np.zeros((1, s, self._hidden_size), dtype=self._hidden_type)
        _bind_host(self._binding, "inputs_embeds", self._embeds)
        _bind_host(self._binding, "hidden_states", self._hidden, output=True)

    def reset(self) -> None:
        """Empty the KV cache (shared buffers are kept and overwritten)."""
        self._length = 0
        if not self.shared_kv:
            empty = np.zeros((1, self._kv_heads, 0, self._head_dim), dtype=self._kv_type)
            self._cache = {n: self._ort.OrtValue.ortvalue_from_numpy(empty) for n in self._past}

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """float32 [1, S, H] -> float32 [1, S, H] (a new array); grows the cache by S.

        Raises:
            InputError: the cache would exceed ``max_length`` positions.
        """
        s = inputs_embeds.shape[1]
        total = self._length + s
        check_decoder_room(total, self.max_length)
        try:
            with contextlib.ExitStack() as paged:
                for path in self.page_out_weights:
                    paged.enter_context(paging_out(path, keep_page_cache=True))
                out = self._forward_shared(inputs_embeds, s, total) if self.shared_kv else \
                    self._forward_copies(inputs_embeds, total)
        except Exception as exc:  # onnxruntime's own error types
            _raise_unsupported("llm_decoder", self.session, exc)
            raise
        self._length = total
        return out

    def _forward_copies(self, inputs_embeds: np.ndarray, total: int) -> np.ndarray:
        ov = self._ort.OrtValue.ortvalue_from_numpy
        feeds = {
            "inputs_embeds": ov(np.ascontiguousarray(inputs_embeds, dtype=self._embed_type)),
            "attention_mask": ov(np.ones((1, total), dtype=np.int64)),
            **self._cache,
        }
        if self._has_position_ids:
            feeds["position_ids"] = ov(np.arange(self._length, total, dtype=np.int64)[None])
        outs = self.session.run_with_ort_values(self._outputs, feeds)
        self._cache = dict(zip(self._past, outs[1:], strict=True))
        return outs[0].numpy().astype(np.float32)

    def _ensure_capacity(self, total: int) -> None:
        """Allocate (or double, keeping the used rows) the shared KV buffers and bind them."""
        if total <= self._capacity:
            return
        capacity = max(self._capacity, min(INITIAL_KV_CAPACITY, self.max_length))
        while capacity < total:
            capacity = min(2 * capacity, self.max_length)
        shape = (1, self._kv_heads, capacity, self._head_dim)
        for past, present in zip(self._past, self._present, strict=True):
            host = np.zeros(shape, dtype=self._kv_type)
            if self._length and past in self._kv:
                used = self._kv_host[past] if self._device == "cpu" else self._kv[past].numpy()
                host[:, :, :self._length] = used[:, :, :self._length]
            if self._device == "cpu":
                self._kv_host[past] = host  # the OrtValue below uses this memory
                value = self._ort.OrtValue.ortvalue_from_numpy(host)
            else:
                value = self._ort.OrtValue.ortvalue_from_numpy(host, self._device, self._device_id)
            self._kv[past] = value
            self._binding.bind_ortvalue_input(past, value)
            self._binding.bind_ortvalue_output(present, value)
        self._capacity = capacity

    def _forward_shared(self, inputs_embeds: np.ndarray, s: int, total: int) -> np.ndarray:
        self._ensure_capacity(total)
        if s != self._embeds.shape[1]:
            self._step_buffers(s)
        np.copyto(self._embeds, inputs_embeds, casting="same_kind")
        # Only the mask's length changes from step to step: a view of the preallocated row.
        self._binding.bind_cpu_input("attention_mask", self._mask[:, :total])
        self.session.run_with_iobinding(self._binding)
        out = self._hidden.astype(np.float32)  # a new array: callers may keep it
        if s != 1:  # back to the one-position buffers for the frames that follow
            self._step_buffers(1)
        return out
