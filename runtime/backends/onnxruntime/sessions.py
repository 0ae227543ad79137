"""ONNX Runtime backend: sessions on the execution provider a bundle names.

Never falls back silently: the provider asked for must be the one the session
uses (``session.get_providers()``), unless the caller passed
``allow_fallback=True``, and then the fallback is logged and recorded in the
pipeline description.  Which provider ran which node (what ``verify`` reports)
is read in :mod:`higgs_pack.runtime.backends.onnxruntime.placement`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.manifests.constants import CPU_PROVIDER, EXECUTION_PROVIDERS
from higgs_pack.manifests.errors import (
    ExecutionProviderUnavailable,
    SignatureMismatch,
    unknown_choice,
)
from higgs_pack.runtime.loop.pipeline import check_decoder_room, check_io_signature
from higgs_pack.runtime.mapped_pages import paging_out

log = logging.getLogger(__name__)

#: ONNX element type strings -> numpy dtypes.
ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def ort_distributions() -> tuple[str, ...]:
    """Distributions that all install the one ``onnxruntime`` module (one per provider row)."""
    return tuple(dict.fromkeys(row.distribution for row in EXECUTION_PROVIDERS.values()))



#: What ONNX Runtime says when a provider has no kernel for a node or for one of its
#: inputs (at session creation or run), as opposed to a wrong result or a broken file.
#: Measured with onnxruntime 1.32 on the CPU provider: "GroupQueryAttention (CPU):
#: q_norm_weight / k_norm_weight inputs are not supported ... implemented only on the
#: CUDA and WebGPU EPs" (cuda fp16/int4 ModelBuilder decoders), and "Could not find an
#: implementation for <Op>(<version>) node" for a missing kernel.
_UNSUPPORTED = re.compile(
    r"not supported|not implemented|NOT_IMPLEMENTED|Could not find an implementation|implemented only on",
    re.IGNORECASE,
)


def provider_cannot_run(exc: BaseException) -> str | None:
    """ONNX Runtime's own reason when a provider cannot execute a graph, else None.

    Only messages of the kinds in ``_UNSUPPORTED`` count; any other error (a shape
    mismatch, a damaged file) is a real failure and returns None.

    Returns:
        The first line of the message, without ONNX Runtime's status prefix.
    """
    if isinstance(exc, ExecutionProviderUnavailable) and exc.__cause__ is not None:
        exc = exc.__cause__  # already translated by a runner: classify ONNX Runtime's own error
    text = str(exc)
    if not _UNSUPPORTED.search(text):
        return None
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : [A-Z_]+ : ", "", text.strip())
    running = re.match(r"Non-zero status code returned while running (\S+) node\. Name:'([^']*)' "
                       r"Status Message: (.*)", text, re.DOTALL)
    if running:
        op, node, message = running.groups()
        text = f"{op} node {node!r}: {message.strip()}"
    return text.splitlines()[0] if text else type(exc).__name__


def _raise_unsupported(name: str, session, exc: Exception) -> None:
    """Re-raise "this provider cannot execute the graph" as an error naming sub-part and provider.

    Returns (so the caller re-raises ``exc`` unchanged) for any other error.
    """
    reason = provider_cannot_run(exc)
    if reason is None:
        return
    provider = (session.get_providers() or ["its provider"])[0]
    raise ExecutionProviderUnavailable(
        f"{name} cannot run on {provider}: {reason}. The bundle's graphs are built for one provider "
        "(`higgs-pack inspect` names it): run it there, or choose another --execution-provider "
        "(execution_provider=)"
    ) from exc


def installed_ort_distributions() -> list[str]:
    """Names of the onnxruntime distributions installed in this environment."""
    found = []
    for name in ort_distributions():
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def import_ort():
    """Import onnxruntime, refusing a broken environment.

    Raises:
        ExecutionProviderUnavailable: onnxruntime is not installed, or two of its
            distributions are (they overwrite each other's files: measured with
            onnxruntime + onnxruntime-openvino).
    """
    dists = installed_ort_distributions()
    if len(dists) > 1:
        raise ExecutionProviderUnavailable(
            f"{' and '.join(dists)} are installed together; they ship the same `onnxruntime` module "
            "and overwrite each other. Keep exactly one: pip uninstall -y "
            f"{' '.join(dists)} && pip install <the one you need>"
        )
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ExecutionProviderUnavailable(
            "onnxruntime is not installed; install the runtime for this bundle, e.g. "
            f"pip install 'higgs-pack[{CPU_PROVIDER.extra}]' (or "
            + ", ".join(f"[{row.extra}]" for row in EXECUTION_PROVIDERS.values() if not row.own_venv
                        and row is not CPU_PROVIDER) + ")"
        ) from exc
    return ort


def install_hint(row) -> str:
    """How to install the ONNX Runtime distribution of one EXECUTION_PROVIDERS row.

    A distribution that replaces onnxruntime (``own_venv``, e.g. onnxruntime-openvino:
    same ``onnxruntime`` module) gets a hint that removes the other distributions first.
    """
    if row.own_venv:
        others = [d for d in installed_ort_distributions() if d != row.distribution] or [CPU_PROVIDER.distribution]
        return (f"Install it in a venv of its own, or replace the installed one: pip uninstall -y "
                f"{' '.join(others)} && pip install '{row.requirement}' (it cannot share a venv with "
                "another onnxruntime distribution)")
    return f"Install it with pip install 'higgs-pack[{row.extra}]' ({row.requirement})"


#: Session options for running a float16 graph (a cuda/dml fp16 bundle) on the CPU provider.
#: The CPU provider has no float16 kernels for most of the decoder's ops, so it inserts Cast
#: nodes to float32 in front of them.  With graph optimizations on, constant folding turns
#: every cast weight into a float32 initializer: a second, twice-as-large copy of the model
#: held for the session's life (4B dims: 15.6 GB anonymous on top of 7.3 GB of float16).
#: With optimizations off the casts run per node, and the priority-based execution order
#: places each cast right before its consumer, so one layer's float32 weights exist at a
#: time (bench preset: peak 531 -> 321 MB, 17 -> 48 ms per decode step).  Measured on an
#: AMD EPYC, AVX2, ONNX Runtime 1.32; the default (topological) order runs every
#: initializer's cast first and keeps them all alive.
FLOAT16_ON_CPU_OPTIONS: dict[str, Any] = {
    "graph_optimization_level": "ORT_DISABLE_ALL",
    "execution_order": "PRIORITY_BASED",
}


#: Thread-pool settings every session gets unless the manifest sets them.  The decoder, heads
#: and embed sessions take turns every frame.  Workers spin between the operators of one run
#: (with spinning off, every parallel operator wakes a sleeping worker), and stop spinning
#: when the run ends, so they do not keep the cores from the next session.  Bench preset,
#: cpu int4, 100 frames, 3 interleaved rounds on an AMD EPYC with 2 vCPUs (AVX2), ONNX
#: Runtime 1.32: spinning off 125-147 frames/s (decoder step 5.7-6.8 ms); spinning that stops
#: with the run 165-204 (4.1-5.0 ms); spinning that continues after the run 108-131.  Full
#: size (4B), cpu int4, 40 frames, 3 interleaved rounds: 11.6-11.8 -> 12.3-12.4 frames/s
#: (decoder step 85.3-85.5 -> 79.4-79.9 ms), streamed 11.2 -> 12.0-12.1.
THREAD_POOL_DEFAULTS: dict[str, str] = {
    "session.intra_op.allow_spinning": "1",
    "session.force_spinning_stop": "1",
}


def session_options_for(ep: str, options: dict[str, Any]):
    """Build ``SessionOptions`` for a provider.

    The provider row's ``session_rules`` (DirectML: memory patterns off, sequential
    execution) are forced over whatever the manifest says.

    Args:
        ep: bundle EP name.
        options: manifest ``session_options`` (``intra_op_num_threads``, ``graph_optimization_level``,
            ``execution_order``, ``log_severity_level``, ``session.*`` config entries; enums by
            member name).  :data:`THREAD_POOL_DEFAULTS` fill the config entries it leaves out.
    """
    ort = import_ort()
    so = ort.SessionOptions()
    for key, value in options.items():
        if key == "graph_optimization_level":
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, value)
        elif key == "execution_order":
            so.execution_order = getattr(ort.ExecutionOrder, value)
        elif key.startswith("session."):
            so.add_session_config_entry(key, str(value))
        else:
            setattr(so, key, value)
    for key, value in THREAD_POOL_DEFAULTS.items():
        if key not in options:
            so.add_session_config_entry(key, value)
    row = EXECUTION_PROVIDERS.get(ep)
    for key, value in (row.session_rules if row is not None else {}).items():
        setattr(so, key, getattr(ort.ExecutionMode, value) if key == "execution_mode" else value)
    return so


#: Session option that keeps the CPU provider from copying weights into packed buffers:
#: float MatMuls then read their weights in place from the memory-mapped external data
#: (512 MB of fp32 MatMul weights: 549 MB anonymous after load with prepacking, 25 MB
#: without; measured here, ONNX Runtime 1.32).
NO_PREPACKING = {"session.disable_prepacking": "1"}


def create_session(path: Path, ep: str, *, provider_options: dict[str, Any] | None = None,
                   session_options: dict[str, Any] | None = None,
                   allow_fallback: bool = False, float16_weights: bool = False,
                   prepacking: bool = True) -> tuple[Any, str]:
    """Create an InferenceSession on ``ep`` and prove it took the session.

    Args:
        path: the ``.onnx`` file (external data beside it).
        ep: bundle EP name: ``cpu``, ``cuda``, ``dml`` or ``openvino``.
        provider_options: options for that provider.
        session_options: see :func:`session_options_for`.
        allow_fallback: permit running on the CPU provider when ``ep`` is not
            available; the returned description then says so.
        float16_weights: the graph stores float16 weights (an fp16 bundle); when the
            session lands on the CPU provider, asked for or fallen back to, it gets
            :data:`FLOAT16_ON_CPU_OPTIONS` over ``session_options``.
        prepacking: False adds :data:`NO_PREPACKING`: weights stay in the mapped file
            (for :class:`OrtDecoder`'s ``page_out_weights``).

    Returns:
        ``(session, description)``, e.g. ``("…", "CUDAExecutionProvider")`` or
        ``"CPUExecutionProvider (fallback from CUDAExecutionProvider)"``.

    Raises:
        ExecutionProviderUnavailable: unknown EP, provider not installed, or the
            session silently landed on another provider.
    """
    ort = import_ort()
    if ep not in EXECUTION_PROVIDERS:
        raise ExecutionProviderUnavailable(
            unknown_choice("execution provider", ep, EXECUTION_PROVIDERS, "--execution-provider / execution_provider=")
        )
    row = EXECUTION_PROVIDERS[ep]
    available = ort.get_available_providers()
    wanted = row.ort_provider
    providers: list[Any] = [(wanted, provider_options or {})]
    note = wanted
    if wanted not in available:
        if not allow_fallback or row is CPU_PROVIDER:
            raise ExecutionProviderUnavailable(
                f"{wanted} was asked for but is not available here (installed providers: "
                f"{', '.join(available)}; distributions: {', '.join(installed_ort_distributions()) or 'none'}). "
                f"{install_hint(row)}, or run on the CPU explicitly with --execution-provider {CPU_PROVIDER.name} "
                f"(execution_provider={CPU_PROVIDER.name!r})"
            )
        cpu = CPU_PROVIDER.ort_provider
        log.warning("%s is not available; falling back to %s as asked", wanted, cpu)
        providers = [cpu]
        wanted = cpu
        note = f"{cpu} (fallback from {row.ort_provider})"
    elif row is not CPU_PROVIDER:
        providers.append(CPU_PROVIDER.ort_provider)
    options = dict(session_options or {})
    if float16_weights and wanted == CPU_PROVIDER.ort_provider:
        options.update(FLOAT16_ON_CPU_OPTIONS)
    if not prepacking:
        options.update(NO_PREPACKING)
    so = session_options_for(ep, options)
    session = ort.InferenceSession(str(path), sess_options=so, providers=providers)
    used = session.get_providers()
    if not used or used[0] != wanted:
        raise ExecutionProviderUnavailable(
            f"{path.name}: asked for {wanted} but ONNX Runtime created the session on "
            f"{', '.join(used)} (its library failed to load?). Installed providers: {', '.join(available)}"
        )
    return session, note


def check_signature(session, subpart: str, spec: dict[str, Any]) -> None:
    """Compare a session's inputs/outputs with the manifest's I/O signature.

    Names, element types and ranks must match (symbolic dims may differ in name).

    Raises:
        SignatureMismatch: naming the sub-part, the tensor and both signatures.
    """
    def sig(items):
        return {i.name: (str(np.dtype(ORT_TYPES.get(i.type, np.void))), len(i.shape)) for i in items}

    check_io_signature(subpart, "graph", sig(session.get_inputs()), sig(session.get_outputs()), spec)


def _bind_host(binding, name: str, array: np.ndarray, output: bool = False) -> None:
    """Bind a contiguous host array as an IOBinding input or output (ONNX Runtime reads or
    writes that memory in place; the array must outlive the binding)."""
    shape = list(array.shape)
    if output:
        binding.bind_output(name, "cpu", 0, array.dtype, shape, array.ctypes.data)
    else:
        binding.bind_input(name, "cpu", 0, array.dtype, shape, array.ctypes.data)


class OrtSubPart:
    """A stateless sub-part on an ONNX Runtime session.

    Floating inputs are cast to the dtype the graph declares (fp16 graphs take
    float16); floating outputs come back as float32.

    Per-step shapes (``step_inputs``: the heads' ``hidden_states`` [1, 1, H] and the
    embed's ``codes`` [1, 1, 8], run once per frame) run through an IOBinding with
    preallocated host buffers: the inputs are copied into bound buffers, ONNX Runtime
    writes the outputs into bound buffers, and :meth:`run` returns views of them, so a
    step allocates no arrays.  The buffers are made on the first call with those shapes
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
        self._binding = None
        self._in_buffers: dict[str, np.ndarray] = {}
        self._out_buffers: list[np.ndarray] = []
        self._step_out: dict[str, np.ndarray] = {}

    @property
    def bound(self) -> bool:
        """Whether per-step calls now run through the preallocated IOBinding."""
        return self._binding is not None

    def _is_step(self, feeds: dict[str, np.ndarray]) -> bool:
        steps = self._step_inputs
        return steps is not None and len(feeds) == len(steps) and \
            all(k in steps and np.shape(v) == steps[k] for k, v in feeds.items())

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once; see :mod:`higgs_pack.runtime.loop.pipeline` for names and shapes.

        Returns:
            Output name -> float32 / integer array.  For the per-step shapes, once
            bound: views of this runner's buffers, valid until its next per-step call
            (the caller may modify them; copy what must outlive that call).  Otherwise
            new arrays the caller owns.
        """
        step = self._is_step(feeds)
        if step and self._binding is not None:
            return self._run_bound(feeds)
        cast = {k: np.ascontiguousarray(v, dtype=self._in_types[k]) for k, v in feeds.items()}
        try:
            outs = self.session.run(self._outputs, cast)
        except Exception as exc:  # onnxruntime's own error types
            _raise_unsupported(self.name, self.session, exc)
            raise
        if step:
            self._bind_step(outs)
        return {
            k: (v.astype(np.float32, copy=False) if np.issubdtype(v.dtype, np.floating) else v)
            for k, v in zip(self._outputs, outs, strict=True)
        }

    def _bind_step(self, outs: list[np.ndarray]) -> None:
        """Allocate and bind the per-step buffers, shaped like one plain run's outputs."""
        binding = self.session.io_binding()
        for name, shape in self._step_inputs.items():
            self._in_buffers[name] = np.zeros(shape, dtype=self._in_types[name])
            _bind_host(binding, name, self._in_buffers[name])
        for name, value in zip(self._outputs, outs, strict=True):
            buffer = np.zeros(value.shape, dtype=value.dtype)
            self._out_buffers.append(buffer)
            _bind_host(binding, name, buffer, output=True)
            # fp16 graphs: one more preallocated buffer holds the float32 the loop reads.
            widen = np.issubdtype(value.dtype, np.floating) and value.dtype != np.float32
            self._step_out[name] = np.zeros(value.shape, np.float32) if widen else buffer
        self._binding = binding

    def _run_bound(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, value in feeds.items():
            np.copyto(self._in_buffers[name], value, casting="same_kind")
        try:
            self.session.run_with_iobinding(self._binding)
        except Exception as exc:  # onnxruntime's own error types
            _raise_unsupported(self.name, self.session, exc)
            raise
        for buffer, out in zip(self._out_buffers, self._step_out.values(), strict=True):
            if out is not buffer:
                np.copyto(out, buffer)
        return dict(self._step_out)


def shared_kv_device(ort_provider: str) -> str | None:
    """Where the decoder's shared KV buffers live on this ONNX Runtime provider (its row's
    ``iobinding_device``, e.g. ``cuda``), or None when its attention does not share bound
    past/present buffers (the cache is then copied each step)."""
    row = next((r for r in EXECUTION_PROVIDERS.values() if r.ort_provider == ort_provider), None)
    return row.iobinding_device if row else None

#: First KV buffer length of the shared-buffer decoder (positions); it doubles when a request
#: needs more (one copy of the used part), up to the decoder's ``max_length``.
INITIAL_KV_CAPACITY = 512


class OrtDecoder:
    """The ModelBuilder decoder (``exclude_embeds``, ``exclude_lm_head``) with its KV cache.

    Graph I/O (MODEL.md, measured): inputs ``inputs_embeds`` [1,S,H],
    ``attention_mask`` int64 [1, past+S], ``past_key_values.{i}.key|value``
    [1, kv_heads, past, head_dim] (+ ``position_ids`` [1,S] for dml); outputs
    ``hidden_states`` and ``present.{i}.key|value``.

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
      fp32 cuda, see ``exporters/modelbuilder.py`` NO_PACKED_ATTENTION): present
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
            :func:`~higgs_pack.runtime.mapped_pages.paging_out` (``keep_page_cache=True``)
            on each, so the weights' pages leave the process's resident set as soon as a
            step has read them and come back from the page cache next step.  The
            full-size fp32 decoder (14.5 GB) then runs in a few hundred MB of resident
            memory, at the price of a minor fault per page each step.
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
        self._kv_type = ORT_TYPES[inputs[self._past[0]].type] if self._past else np.float32
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
        options = session.get_provider_options().get(provider, {}) if hasattr(session, "get_provider_options") else {}
        self._device_id = int(options.get("device_id", 0))
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
