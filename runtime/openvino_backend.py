"""OpenVINO runtime backend: sub-parts and the stateful decoder on an OpenVINO device.

Runtime code: imports numpy, openvino and higgs-pack's manifests and pipeline
only (no torch, no exporters). The device string is normalised once
(:func:`normalize_device`) and checked against ``Core.available_devices``
(:func:`check_device`); a device that is missing is an error unless the caller
passed ``allow_fallback=True``, and then the fallback to CPU is logged and
written into the runner's ``description``. After compiling, the devices OpenVINO
reports in ``EXECUTION_DEVICES`` are checked too.

Compiling from the ``.xml`` path with ``CACHE_DIR`` set lets OpenVINO import the
compiled blob on the next load instead of reading and compiling the IR again.

Static (NPU) bundles get runners with the same interface: :class:`OvStaticSubPart`
pads or chunks inputs into the static shapes the manifest declares, and
:class:`OvStaticKVDecoder` keeps the KV cache in fixed-size buffers for the
stateless decoder; a sub-part may be pinned to another device for a given bundle
device (``device_overrides``, see :func:`subpart_device`).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from higgs_pack.manifests.errors import (
    BundleError,
    ExecutionProviderUnavailable,
    InputError,
    SignatureMismatch,
    last_line,
)
from higgs_pack.runtime.chunking import chunk_windows
from higgs_pack.runtime.pipeline import check_io_signature

log = logging.getLogger(__name__)

#: Single OpenVINO devices a bundle may name (optionally with an index: ``GPU.1``).
PLAIN_DEVICES: tuple[str, ...] = ("CPU", "GPU", "NPU")

#: Virtual devices that take a list of devices after a colon (``AUTO`` alone is allowed).
META_DEVICES: tuple[str, ...] = ("AUTO", "HETERO", "MULTI")

#: Inputs the stateful decoder IR (optimum-intel, see ``exporters/openvino_decoder.py``) may declare.
DECODER_INPUTS: tuple[str, ...] = ("inputs_embeds", "attention_mask", "position_ids", "beam_idx")

#: Name of the decoder IR's output.
DECODER_OUTPUT = "hidden_states"

_PLAIN_RE = re.compile(r"^(CPU|GPU|NPU)(\.\d+)?$")
_DEVICE_FIX = "--device / device="
_ALLOWED_FORMS = "CPU, GPU, GPU.<n>, NPU, AUTO, AUTO:<devices>, HETERO:<devices>, MULTI:<devices>"


#: What OpenVINO says when an IR's weights file does not fit its XML (measured: a
#: truncated .bin gives "Incorrect weights in bin file!").
_DAMAGED_IR = re.compile(r"weights in bin file|bin file is|Incorrect weights", re.IGNORECASE)


def runtime_versions() -> dict[str, str]:
    """Versions of the runtime packages this backend uses.

    Returns:
        ``{"openvino": "2026.4.1"}`` (the distribution's version; the build string
        ``openvino.__version__`` if the distribution metadata is missing).
    """
    try:
        return {"openvino": importlib.metadata.version("openvino")}
    except importlib.metadata.PackageNotFoundError:
        return {"openvino": ov.__version__}


def normalize_device(device: str) -> str:
    """Upper-case and validate an OpenVINO device string.

    Accepted forms: ``CPU``, ``GPU``, ``GPU.<n>``, ``NPU``, ``AUTO``, and
    ``AUTO:`` / ``HETERO:`` / ``MULTI:`` followed by a comma-separated list of
    single devices (``"auto:gpu,cpu"`` -> ``"AUTO:GPU,CPU"``). Spaces are removed.

    Args:
        device: The device string from the user or the manifest.

    Returns:
        The normalised string.

    Raises:
        ExecutionProviderUnavailable: The string is not one of the accepted forms
            (the message lists them and the ``--device`` flag / ``device=`` keyword).
    """
    text = re.sub(r"\s+", "", str(device)).upper()
    base, sep, rest = text.partition(":")
    ok = False
    if not sep:
        ok = bool(_PLAIN_RE.match(text)) or text == "AUTO"
    elif base in META_DEVICES and rest:
        ok = all(_PLAIN_RE.match(part) for part in rest.split(","))
    if not ok:
        raise ExecutionProviderUnavailable(
            f"unknown OpenVINO device {device!r}; allowed forms: {_ALLOWED_FORMS}. "
            f"Set it with {_DEVICE_FIX}."
        )
    return text


def _present(name: str, available: list[str]) -> bool:
    """Whether one single device (``GPU``, ``GPU.1``) is among ``available``."""
    if name in available:
        return True
    base, _, index = name.partition(".")
    if not index:  # "GPU" while OpenVINO lists "GPU.0", "GPU.1"
        return any(a.startswith(base + ".") for a in available)
    return index == "0" and base in available  # "GPU.0" while OpenVINO lists one "GPU"


def check_device(core: ov.Core, device: str, allow_fallback: bool = False) -> tuple[str, str]:
    """Check that a device is usable here, before anything is compiled.

    A single device must be in ``core.available_devices``; ``HETERO:`` and
    ``MULTI:`` need every listed device; ``AUTO:`` needs at least one (choosing
    among them is what AUTO is asked to do); bare ``AUTO`` needs any device.

    Args:
        core: The ``openvino.Core``.
        device: The requested device (normalised here).
        allow_fallback: Run on ``CPU`` when the device is missing, with a warning,
            instead of raising.

    Returns:
        ``(device, description)``: the device to compile for and a description,
        ``"CPU"`` or ``"CPU (fallback from GPU)"``.

    Raises:
        ExecutionProviderUnavailable: The string is invalid, or the device is not
            available and ``allow_fallback`` is false (the message names the
            devices present and the ``--device`` flag / ``device=`` keyword).
    """
    available = list(core.available_devices)
    try:
        device = normalize_device(device)
    except ExecutionProviderUnavailable as exc:
        raise ExecutionProviderUnavailable(f"{exc} Devices present here: {', '.join(available) or 'none'}") from None
    base, _, rest = device.partition(":")
    if base in META_DEVICES:
        listed = rest.split(",") if rest else []
        missing = [d for d in listed if not _present(d, available)]
        ok = bool(available) and (len(missing) < len(listed) if base == "AUTO" and listed else not missing)
    else:
        missing = [device]
        ok = _present(device, available)
    if ok:
        return device, device
    if allow_fallback and "CPU" in available:
        log.warning("OpenVINO device %s is not available (present: %s); falling back to CPU as asked",
                    device, ", ".join(available))
        return "CPU", f"CPU (fallback from {device})"
    raise ExecutionProviderUnavailable(
        f"OpenVINO device {device} is not available here ({', '.join(missing)} missing); devices present: "
        f"{', '.join(available) or 'none'}. Choose one of them with {_DEVICE_FIX} (for example "
        f"--device {available[0] if available else 'CPU'}), or pass --allow-fallback (allow_fallback=True) "
        "to run on CPU"
    )


def precision_config(device: str, precision: str, *, stateful: bool = False) -> dict[str, str]:
    """Compile properties that keep an fp32 bundle in fp32 on the device.

    OpenVINO's CPU plugin computes in bf16 on CPUs with AMX/AVX512-BF16 and keeps
    the KV cache in u8 by default; its GPU plugin computes in f16. For
    ``precision == "fp32"`` this returns ``INFERENCE_PRECISION_HINT=f32`` on CPU
    and GPU, and ``KV_CACHE_PRECISION=f32`` on CPU for a stateful decoder. Other
    precisions and devices (NPU, AUTO, ...) get no override.

    Args:
        device: The (normalised) device the model is compiled for.
        precision: The sub-part's precision in the manifest.
        stateful: Whether the model is the stateful decoder.

    Returns:
        A properties dict to merge into ``compile_model``'s config.
    """
    base = device.split(".")[0]
    if precision != "fp32" or base not in ("CPU", "GPU"):
        return {}
    config = {"INFERENCE_PRECISION_HINT": "f32"}
    if stateful and base == "CPU":
        config["KV_CACHE_PRECISION"] = "f32"
    return config


#: KV cache element type the CPU plugin keeps for a stateful decoder, per bundle precision.
#: u8 (the plugin's x86 default, made explicit): a quarter of f32's bytes read per step, what
#: matters once the cache is long (full size: 0.97 of the weight-read roofline with u8, MODEL.md);
#: on the tiny model, whose cache is a few KB, f32/f16 measured faster (quantizing dominates).
KV_CACHE_PRECISION = {"int4": "u8", "int8": "u8", "fp16": "f16", "fp32": "f32"}


def decoder_compile_properties(precision: str, *, stateful: bool) -> dict[str, dict[str, str]]:
    """Compile properties recorded in the decoder's manifest options (``compile_properties``),
    per device; :func:`open_openvino_parts` applies the entry of the device it compiles for.

    * every device: ``PERFORMANCE_HINT=LATENCY``: one request at a time (speech is one
      sequential decode), all cores on it, whatever a future OpenVINO's default is;
    * CPU, stateful decoder: ``KV_CACHE_PRECISION`` from :data:`KV_CACHE_PRECISION`
      (the static npu decoder keeps its KV in buffers the runtime owns: nothing to set).

    Args:
        precision: the decoder's precision.
        stateful: whether the IR keeps its KV cache as state.
    """
    cpu = {"PERFORMANCE_HINT": "LATENCY"}
    if stateful:
        cpu["KV_CACHE_PRECISION"] = KV_CACHE_PRECISION[precision]
    return {"CPU": cpu, "GPU": {"PERFORMANCE_HINT": "LATENCY"}, "NPU": {"PERFORMANCE_HINT": "LATENCY"}}


def _numpy_dtype(port) -> np.dtype:
    return np.dtype(port.get_element_type().to_dtype())


def _output(value: np.ndarray) -> np.ndarray:
    if np.issubdtype(value.dtype, np.floating):
        return value.astype(np.float32, copy=False)
    if np.issubdtype(value.dtype, np.integer):
        return value.astype(np.int64, copy=False)
    return value


def compile_ir(core: ov.Core, xml_path: str | os.PathLike, device: str, cache_dir: str | os.PathLike | None = None,
               config: Mapping[str, Any] | None = None, *, allow_fallback: bool = False
               ) -> tuple[ov.CompiledModel, str, str]:
    """Compile an IR file for a device, with the model cache when asked.

    Args:
        core: The ``openvino.Core``.
        xml_path: The ``.xml`` file (its ``.bin`` beside it).
        device: Requested device (see :func:`normalize_device`).
        cache_dir: OpenVINO model cache directory (``CACHE_DIR``); created if needed.
        config: Extra compile properties (``INFERENCE_PRECISION_HINT``, ``NUM_STREAMS``...).
        allow_fallback: See :func:`check_device`.

    Returns:
        ``(compiled_model, device, description)``; the description names the
        device used, any fallback, and the execution devices when they differ.

    Raises:
        BundleError: The IR or its weights are missing, or the weights do not fit the IR.
        ExecutionProviderUnavailable: The device is unavailable, OpenVINO cannot
            compile for it, or it compiled onto other devices than asked.
    """
    path = Path(xml_path)
    for file in (path, path.with_suffix(".bin")):
        if not file.is_file():
            raise BundleError(f"OpenVINO file {file} is missing; the bundle is incomplete: rebuild or re-download it")
    device, description = check_device(core, device, allow_fallback)
    properties: dict[str, Any] = dict(config or {})
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        properties["CACHE_DIR"] = str(cache_dir)
    try:
        compiled = core.compile_model(str(path), device, properties)
    except RuntimeError as exc:
        if _DAMAGED_IR.search(str(exc)):
            raise BundleError(
                f"OpenVINO cannot read {path.name} with its weights {path.with_suffix('.bin').name} "
                f"({last_line(exc)}): the .bin is damaged or belongs to another IR; rebuild or re-download "
                "the bundle"
            ) from exc
        raise ExecutionProviderUnavailable(
            f"OpenVINO could not compile {path.name} for {device} with {properties}: {exc}"
        ) from exc
    try:
        used = [str(d) for d in compiled.get_property("EXECUTION_DEVICES")]
    except RuntimeError:
        used = []
    if used and device.split(":")[0] not in META_DEVICES:
        base = device.split(".")[0]
        if not all(u.split(".")[0] == base for u in used):
            raise ExecutionProviderUnavailable(
                f"{path.name}: asked for {device} but OpenVINO compiled it for {', '.join(used)}"
            )
    elif used:
        description = f"{description} (executing on {', '.join(used)})"
    return compiled, device, description


def _signature(ports) -> dict[str, tuple[str, int]]:
    return {p.get_any_name(): (_numpy_dtype(p).name, p.get_partial_shape().rank.get_length()) for p in ports}


def check_signature(runner: OvSubPart | OvStatefulDecoder, subpart: str, spec: Mapping[str, Any]) -> None:
    """Compare a compiled IR's inputs/outputs with the manifest's I/O signature.

    Names, element types (numpy names) and ranks must match; dynamic axes are not
    compared by name.

    Args:
        runner: An :class:`OvSubPart` or :class:`OvStatefulDecoder`.
        subpart: The sub-part name, for the message.
        spec: The manifest entry, with ``inputs`` and ``outputs`` lists of
            ``{"name", "dtype", "shape"}``.

    Raises:
        SignatureMismatch: Naming the sub-part and both signatures.
    """
    compiled = runner.compiled
    check_io_signature(subpart, "IR", _signature(compiled.inputs), _signature(compiled.outputs), dict(spec))


class OvSubPart:
    """A stateless sub-part compiled once on an OpenVINO device (a ``SubPartRunner``).

    Inputs are cast to the element type the IR declares; floating outputs come
    back as float32 and integer outputs as int64, copied out of the request.

    Args:
        core: The ``openvino.Core`` (shared by all sub-parts of a bundle).
        xml_path: The sub-part's ``.xml`` file.
        device: OpenVINO device, e.g. ``"CPU"``, ``"GPU"``, ``"AUTO"``.
        cache_dir: Model cache directory (``CACHE_DIR``) or ``None``.
        config: Extra compile properties (see :func:`precision_config`).
        allow_fallback: Compile for CPU when ``device`` is missing (logged, and
            said in :attr:`description`).

    Attributes:
        compiled: The ``openvino.CompiledModel``.
        device: The device compiled for.
        description: e.g. ``"CPU"`` or ``"CPU (fallback from GPU)"``.
        input_names, output_names: Tensor names, in graph order.

    Raises:
        BundleError: The IR file is missing.
        ExecutionProviderUnavailable: As :func:`compile_ir`.
    """

    def __init__(self, core: ov.Core, xml_path: str | os.PathLike, device: str,
                 cache_dir: str | os.PathLike | None = None, config: Mapping[str, Any] | None = None, *,
                 allow_fallback: bool = False):
        self.path = Path(xml_path)
        self.compiled, self.device, self.description = compile_ir(
            core, xml_path, device, cache_dir, config, allow_fallback=allow_fallback
        )
        self._inputs = {p.get_any_name(): _numpy_dtype(p) for p in self.compiled.inputs}
        self.input_names = list(self._inputs)
        self.output_names = [p.get_any_name() for p in self.compiled.outputs]
        self._request = self.compiled.create_infer_request()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once.

        Args:
            feeds: Input name -> array, names as in ``SUBPART_IO`` (see
                :mod:`higgs_pack.runtime.pipeline` for shapes and dtypes).

        Returns:
            Output name -> array (float32 or int64), owned by the caller.

        Raises:
            ValueError: ``feeds`` lacks an input or has an unknown one.
        """
        if set(feeds) != set(self._inputs):
            raise ValueError(
                f"{self.path.name}: feeds {sorted(feeds)} do not match the IR inputs {self.input_names}"
            )
        cast = {k: np.ascontiguousarray(v, dtype=self._inputs[k]) for k, v in feeds.items()}
        # Inputs are read in place (the call is synchronous); outputs are views of the request's
        # memory, copied once into arrays the caller owns.
        results = self._request.infer(cast, share_inputs=True, share_outputs=True)
        return {name: _output(np.array(results[port], copy=True))
                for name, port in zip(self.output_names, self.compiled.outputs, strict=True)}


class OvStatefulDecoder:
    """The stateful Qwen3 decoder IR (a ``Decoder``): the KV cache lives in the request's state.

    Each :meth:`forward` appends positions: it feeds ``attention_mask`` = ones
    [1, past+S], ``position_ids`` = past..past+S-1 [1, S] and ``beam_idx`` = [0],
    whichever the IR declares.

    Args:
        core: The ``openvino.Core``.
        xml_path: The decoder's ``.xml`` (from ``convert_llm_decoder``).
        device: OpenVINO device.
        cache_dir: Model cache directory or ``None``.
        config: Extra compile properties (see :func:`precision_config` with ``stateful=True``).
        max_length: Most positions one request may use (the manifest's
            ``max_position_embeddings`` or less).
        allow_fallback: See :class:`OvSubPart`.

    Attributes:
        compiled, device, description: As :class:`OvSubPart`.
        max_length: As given.
        length: Positions in the cache since the last :meth:`reset`.

    Raises:
        BundleError: The IR file is missing.
        ExecutionProviderUnavailable: As :func:`compile_ir`.
        SignatureMismatch: The IR has no state (a stateless decoder), no
            ``inputs_embeds`` input or no ``hidden_states`` output.
    """

    def __init__(self, core: ov.Core, xml_path: str | os.PathLike, device: str,
                 cache_dir: str | os.PathLike | None = None, config: Mapping[str, Any] | None = None, *,
                 max_length: int, allow_fallback: bool = False):
        self.path = Path(xml_path)
        self.max_length = int(max_length)
        self.compiled, self.device, self.description = compile_ir(
            core, xml_path, device, cache_dir, config, allow_fallback=allow_fallback
        )
        inputs = {p.get_any_name(): _numpy_dtype(p) for p in self.compiled.inputs}
        outputs = [p.get_any_name() for p in self.compiled.outputs]
        self._request = self.compiled.create_infer_request()
        if not self._request.query_state():
            raise SignatureMismatch(
                f"{self.path.name}: the decoder IR is stateless (no ReadValue/Assign state; inputs "
                f"{sorted(inputs)[:6]}{' …' if len(inputs) > 6 else ''}) but the manifest declares a stateful "
                "KV-cache decoder (llm_decoder options.stateful = true). The bundle's files and manifest "
                "do not belong together: rebuild it with `higgs-pack build --target openvino`"
            )
        if "inputs_embeds" not in inputs or DECODER_OUTPUT not in outputs:
            raise SignatureMismatch(
                f"{self.path.name}: expected an inputs_embeds input and a {DECODER_OUTPUT} output, IR has "
                f"inputs {sorted(inputs)} and outputs {outputs}; rebuild the bundle with the openvino target"
            )
        unknown = sorted(set(inputs) - set(DECODER_INPUTS))
        if unknown:
            raise SignatureMismatch(
                f"{self.path.name}: inputs {unknown} are not fed by the stateful decoder runner (it feeds "
                f"{list(DECODER_INPUTS)}); rebuild the bundle with the openvino target"
            )
        self._inputs = inputs
        self._output = self.compiled.output(DECODER_OUTPUT)
        self.length = 0

    def reset(self) -> None:
        """Forget the KV cache; the next :meth:`forward` starts at position 0."""
        self._request.reset_state()
        self.length = 0

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """Append ``S`` positions and return their hidden states.

        Args:
            inputs_embeds: float32 [1, S, hidden] (cast to the IR's type).

        Returns:
            float32 [1, S, hidden]: final-norm hidden states of the new positions.

        Raises:
            ValueError: ``inputs_embeds`` is not [1, S, hidden] with S >= 1.
            InputError: The cache would exceed :attr:`max_length` positions.
        """
        embeds = np.asarray(inputs_embeds)
        if embeds.ndim != 3 or embeds.shape[0] != 1 or embeds.shape[1] < 1:
            raise ValueError(f"inputs_embeds must be [1, S, hidden] with S >= 1, got {embeds.shape}")
        s = embeds.shape[1]
        total = self.length + s
        if total > self.max_length:
            raise InputError(
                f"the decoder would hold {total} positions, more than max_length={self.max_length}; "
                "shorten the text or lower max_frames="
            )
        feeds = {
            "inputs_embeds": np.ascontiguousarray(embeds, dtype=self._inputs["inputs_embeds"]),
            "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": np.arange(self.length, total, dtype=np.int64)[None],
            "beam_idx": np.zeros((1,), dtype=np.int32),
        }
        feeds = {k: v.astype(self._inputs[k], copy=False) for k, v in feeds.items() if k in self._inputs}
        results = self._request.infer(feeds, share_inputs=True, share_outputs=True)
        self.length = total
        return np.array(results[self._output], dtype=np.float32, copy=True)


# ----------------------------------------------------------------------------- static bundles (npu)


def _take(array: np.ndarray, axis: int, start: int, end: int) -> np.ndarray:
    index: list[Any] = [slice(None)] * array.ndim
    index[axis] = slice(start, end)
    return array[tuple(index)]


def _static_shape(port, where: str) -> list[int]:
    shape = port.get_partial_shape()
    if shape.is_dynamic:
        raise SignatureMismatch(
            f"{where}: {port.get_any_name()} has dynamic shape {shape} in the IR where the manifest promises a "
            "static one (options.static); the bundle's files and manifest do not belong together: rebuild it"
        )
    return [int(d.get_length()) for d in shape]


class OvStaticSubPart(OvSubPart):
    """A sub-part compiled with static shapes (NPU bundles): pads or chunks real inputs.

    Along its chunk axis (``chunking`` from the manifest: ``input``, ``input_axis``,
    ``output``, ``output_axis``, ``context``, ``split``, ``valid_input``) an input
    shorter than the static length is zero-padded and the output cut back; a longer
    one is cut into windows (:func:`chunk_windows`, with ``context`` positions of
    neighbours per side) whose kept outputs are joined. ``valid_input`` (the codec
    decoder's ``valid_frames``) tells the graph how many positions of a window are
    real. The interface is :class:`OvSubPart`'s: the TTS loop does not know.

    Raises:
        InputError: An input is longer than the static length and ``split`` is false
            (``text_embed``: the prompt), or differs from the static shape on
            another axis.
    """

    def __init__(self, core: ov.Core, xml_path: str | os.PathLike, device: str,
                 cache_dir: str | os.PathLike | None = None, config: Mapping[str, Any] | None = None, *,
                 chunking: Mapping[str, Any], subpart: str = "", allow_fallback: bool = False):
        super().__init__(core, xml_path, device, cache_dir, config, allow_fallback=allow_fallback)
        self.subpart = subpart or self.path.stem
        try:
            self._in, self._axis = str(chunking["input"]), int(chunking["input_axis"])
            self._out, self._out_axis = str(chunking["output"]), int(chunking["output_axis"])
            self.context = int(chunking.get("context", 0))
            self._split = bool(chunking.get("split", True))
            self._valid = chunking.get("valid_input")
            self.in_shape = _static_shape(self.compiled.input(self._in), self.subpart)
            out_shape = _static_shape(self.compiled.output(self._out), self.subpart)
        except (KeyError, RuntimeError, TypeError, ValueError) as exc:
            raise SignatureMismatch(
                f"{self.subpart}: the manifest's chunking {dict(chunking)} does not fit the IR "
                f"(inputs {self.input_names}, outputs {self.output_names}): {exc}; rebuild the bundle"
            ) from exc
        self.chunk = self.in_shape[self._axis]
        self.out_chunk = out_shape[self._out_axis]
        expected = {self._in} | ({self._valid} if self._valid else set())
        if set(self.input_names) != expected:
            raise SignatureMismatch(f"{self.subpart}: IR inputs {self.input_names}, the manifest's chunking "
                                    f"expects {sorted(expected)}; rebuild the bundle")

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on inputs of any length along the chunk axis (see the class docstring)."""
        if set(feeds) != {self._in}:
            raise ValueError(f"{self.subpart}: feeds {sorted(feeds)} do not match the input {self._in!r}")
        x = np.asarray(feeds[self._in])
        wrong = [i for i in range(len(self.in_shape)) if i != self._axis and
                 (x.ndim != len(self.in_shape) or x.shape[i] != self.in_shape[i])]
        if x.ndim != len(self.in_shape) or wrong:
            raise InputError(
                f"{self.subpart}: {self._in} has shape {list(x.shape)}; this static-shape (NPU) bundle takes "
                f"{self.in_shape}, where only axis {self._axis} may differ (padded or chunked)"
            )
        n = int(x.shape[self._axis])
        if n > self.chunk and not self._split:
            raise InputError(
                f"{self.subpart}: {self._in} has {n} positions, more than the static length {self.chunk} this "
                "NPU bundle was built with (generation.max_prompt_length); shorten the text or the reference "
                "audio, or use the openvino bundle built without --npu"
            )
        if n == 0:
            raise ValueError(f"{self.subpart}: {self._in} is empty along axis {self._axis}")
        pieces = []
        for start, end, keep_start, keep_end in chunk_windows(n, self.chunk, self.context):
            window = _take(x, self._axis, start, end)
            if end - start < self.chunk:
                pad = [(0, 0)] * x.ndim
                pad[self._axis] = (0, self.chunk - (end - start))
                window = np.pad(window, pad)
            run_feeds = {self._in: window}
            if self._valid:
                run_feeds[self._valid] = np.asarray([end - start], dtype=np.int64)
            y = super().run(run_feeds)[self._out]
            a, b = (keep_start - start) * self.out_chunk, (keep_end - start) * self.out_chunk
            if a % self.chunk or b % self.chunk:
                raise InputError(f"{self.subpart}: {n} positions do not map to whole output positions "
                                 f"({self.chunk} in -> {self.out_chunk} out)")
            pieces.append(_take(y, self._out_axis, a // self.chunk, b // self.chunk))
        return {self._out: pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=self._out_axis)}


class OvStaticKVDecoder:
    """The stateless static decoder (NPU bundles, ``convert_static_decoder``): the KV
    cache lives in fixed-size numpy buffers owned here (a ``Decoder``).

    Each call feeds ``step`` positions (padded), an ``attention_mask`` marking the
    buffer slots in use and the real new rows, ``position_ids`` and every layer's
    buffers; the new keys/values the IR returns are written into the buffers at the
    current length. The prompt goes through the same static graph ``step``
    positions at a time.

    Args:
        core, xml_path, device, cache_dir, config, allow_fallback: As :class:`OvSubPart`.
        max_prompt_length: Longest prompt accepted (the manifest's
            ``generation.max_prompt_length``; default the KV length).

    Attributes:
        max_length: The KV length (prompt + generated frames).
        max_prompt_length: As given (at most ``max_length``).
        step: Positions per call.
        length: Positions held since the last :meth:`reset`.

    Raises:
        SignatureMismatch: The IR is stateful, lacks the static decoder's inputs or
            outputs, or has a dynamic shape.
    """

    def __init__(self, core: ov.Core, xml_path: str | os.PathLike, device: str,
                 cache_dir: str | os.PathLike | None = None, config: Mapping[str, Any] | None = None, *,
                 max_prompt_length: int | None = None, allow_fallback: bool = False):
        self.path = Path(xml_path)
        self.compiled, self.device, self.description = compile_ir(
            core, xml_path, device, cache_dir, config, allow_fallback=allow_fallback
        )
        self._request = self.compiled.create_infer_request()
        inputs = {p.get_any_name(): p for p in self.compiled.inputs}
        outputs = {p.get_any_name(): p for p in self.compiled.outputs}
        if self._request.query_state():
            raise SignatureMismatch(
                f"{self.path.name}: the decoder IR is stateful but the manifest declares the static, stateless "
                "KV-window decoder (llm_decoder options.static = true); rebuild the bundle with --npu"
            )
        past = sorted((n for n in inputs if n.startswith("past_key_values.")), key=_layer_order)
        needed = {"inputs_embeds", "attention_mask", "position_ids"}
        presents = [n.replace("past_key_values.", "present.") for n in past]
        if not past or not needed <= set(inputs) or DECODER_OUTPUT not in outputs or \
                any(n not in outputs for n in presents):
            raise SignatureMismatch(
                f"{self.path.name}: not a static KV-window decoder: IR inputs {sorted(inputs)}, outputs "
                f"{sorted(outputs)}; expected {sorted(needed)} + past_key_values.<i>.key|value -> "
                f"{DECODER_OUTPUT} + present.<i>.key|value"
            )
        shapes = {n: _static_shape(p, "llm_decoder") for n, p in inputs.items()}
        self.step = shapes["inputs_embeds"][1]
        self.hidden = shapes["inputs_embeds"][2]
        self.max_length = shapes[past[0]][2]
        if shapes["attention_mask"] != [1, self.max_length + self.step]:
            raise SignatureMismatch(f"{self.path.name}: attention_mask is {shapes['attention_mask']}, expected "
                                    f"[1, {self.max_length + self.step}]")
        self.max_prompt_length = min(int(max_prompt_length or self.max_length), self.max_length)
        self._pairs = [(n, outputs[n.replace("past_key_values.", "present.")]) for n in past]
        self._buffers = {n: np.zeros(shapes[n], dtype=_numpy_dtype(inputs[n])) for n in past}
        self._dtypes = {n: _numpy_dtype(p) for n, p in inputs.items()}
        self._hidden = outputs[DECODER_OUTPUT]
        self.length = 0

    def reset(self) -> None:
        """Forget the KV cache (its slots are masked out, not cleared)."""
        self.length = 0

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """Append ``S`` positions and return their hidden states.

        Args:
            inputs_embeds: float32 [1, S, hidden].

        Returns:
            float32 [1, S, hidden].

        Raises:
            ValueError: Not [1, S, hidden].
            InputError: A prompt (the first call after :meth:`reset`) longer than
                :attr:`max_prompt_length`, or more positions than the KV window holds.
        """
        embeds = np.asarray(inputs_embeds)
        if embeds.ndim != 3 or embeds.shape[0] != 1 or embeds.shape[1] < 1 or embeds.shape[2] != self.hidden:
            raise ValueError(f"inputs_embeds must be [1, S, {self.hidden}] with S >= 1, got {embeds.shape}")
        s = embeds.shape[1]
        if self.length == 0 and s > self.max_prompt_length:
            raise InputError(
                f"the prompt has {s} positions, more than this NPU bundle's static prompt length "
                f"{self.max_prompt_length} (generation.max_prompt_length; KV window {self.max_length}): shorten "
                "the text or the reference audio, or use the openvino bundle built without --npu"
            )
        if self.length + s > self.max_length:
            raise InputError(
                f"the decoder would hold {self.length + s} positions, more than this NPU bundle's static KV "
                f"window of {self.max_length}; shorten the text or lower max_frames="
            )
        kv, step = self.max_length, self.step
        out = np.empty((1, s, self.hidden), dtype=np.float32)
        for start in range(0, s, step):
            rows = min(step, s - start)
            x = np.zeros((1, step, self.hidden), dtype=self._dtypes["inputs_embeds"])
            x[:, :rows] = embeds[:, start:start + rows]
            mask = np.zeros((1, kv + step), dtype=self._dtypes["attention_mask"])
            mask[0, :self.length] = 1
            mask[0, kv:kv + rows] = 1
            positions = np.arange(self.length, self.length + step, dtype=self._dtypes["position_ids"])[None]
            feeds = {"inputs_embeds": x, "attention_mask": mask, "position_ids": positions, **self._buffers}
            results = self._request.infer(feeds, share_inputs=True, share_outputs=True)
            for name, port in self._pairs:
                self._buffers[name][:, :, self.length:self.length + rows] = results[port][:, :, :rows]
            out[:, start:start + rows] = results[self._hidden][:, :rows]
            self.length += rows
        return out


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else -1, parts[-1])


def open_openvino_parts(bundle: Any, *, device: str | None = None, allow_fallback: bool = False,
                        cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Compile every sub-part of an OpenVINO IR bundle (used by ``runtime.bundle.load``).

    fp32 sub-parts are compiled with :func:`precision_config` so that an fp32 bundle
    really computes in fp32 (OpenVINO's CPU plugin otherwise picks bf16 on AMX
    CPUs and a u8 KV cache; its GPU plugin f16).

    Args:
        bundle: an opened ``runtime.bundle.Bundle``.
        device: OpenVINO device overriding the manifest's (``CPU``, ``GPU``, ``NPU``, ``AUTO``, ``HETERO:…``).
        allow_fallback: compile on CPU when the device is missing (logged, described).
        cache_dir: model cache; default ``<cache root>/openvino/<bundle name>-<checkpoint digest>``.

    Returns:
        ``{sub-part name: runner, "description": {sub-part: device description}}``.

    Raises:
        ExecutionProviderUnavailable: unknown or missing device (and no fallback asked).
        SignatureMismatch: an IR's I/O differs from the manifest, or the decoder is stateless.
    """
    from higgs_pack.runtime.paths import cache_root

    m = bundle.manifest
    core = ov.Core()
    wanted = device or m["device"] or "CPU"
    chosen, _ = check_device(core, wanted, allow_fallback=allow_fallback)
    if cache_dir is None:
        cache_dir = cache_root() / "openvino" / f"{m['name']}-{m['model']['checkpoint_sha256'][:12]}"
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    parts: dict[str, Any] = {"description": {}}
    for part, spec in m["subparts"].items():
        xml = bundle.file(spec["entry"])
        options = spec["options"]
        part_device = subpart_device(chosen, options)
        extra = dict(m["provider_options"].get(_device_base(part_device), {}))
        recorded = dict((options.get("compile_properties") or {}).get(_device_base(part_device), {}))
        stateful = bool(options.get("stateful", part == "llm_decoder"))
        config = {**precision_config(part_device, spec["precision"], stateful=stateful), **recorded, **extra}
        static = bool(options.get("static"))
        if part == "llm_decoder" and static:
            runner: Any = OvStaticKVDecoder(core, xml, part_device, cache_dir, config,
                                            max_prompt_length=m["generation"].get("max_prompt_length"),
                                            allow_fallback=allow_fallback)
        elif part == "llm_decoder":
            limit = m["generation"].get("max_prompt_length") or m["constants"]["max_position_embeddings"]
            runner = OvStatefulDecoder(core, xml, part_device, cache_dir, config, max_length=limit,
                                       allow_fallback=allow_fallback)
        elif static and options.get("chunking"):
            runner = OvStaticSubPart(core, xml, part_device, cache_dir, config, chunking=options["chunking"],
                                     subpart=part, allow_fallback=allow_fallback)
        else:
            runner = OvSubPart(core, xml, part_device, cache_dir, config, allow_fallback=allow_fallback)
        check_signature(runner, part, spec)
        parts[part] = runner
        pinned = f" (pinned by the manifest instead of {chosen})" if part_device != chosen else ""
        parts["description"][part] = f"OpenVINO {runner.description}{pinned}"
    return parts


def _device_base(device: str) -> str:
    """``GPU.1`` -> ``GPU``; ``HETERO:GPU,CPU`` -> ``HETERO``."""
    return device.split(":")[0].split(".")[0]


def subpart_device(device: str, options: Mapping[str, Any]) -> str:
    """The device one sub-part is compiled for: the bundle's, unless the sub-part's
    manifest options pin another for it (``device_overrides``: ``{"NPU": "CPU"}`` keeps
    the dynamic codec encoder of an NPU bundle on the CPU)."""
    overrides = options.get("device_overrides") or {}
    return normalize_device(overrides.get(_device_base(device), device))


# ----------------------------------------------------------------------------- IR checks (verify)


def ir_state_variables(xml_path: str | os.PathLike) -> list[str]:
    """Names of the state variables (ReadValue/Assign) of an IR; empty for a stateless one.

    Reads the graph only (no compilation).
    """
    model = ov.Core().read_model(str(xml_path))
    return sorted(v.info.variable_id for v in model.get_variables())


def static_shape_problems(bundle: Any) -> dict[str, list[str]]:
    """Where a bundle promises static shapes but its IRs or manifest do not have them.

    A sub-part promises static shapes with ``options.static = true``; then every
    input and output of its IR must have a fixed shape, equal to
    ``options.static_shapes[name]`` and to the shape its manifest signature declares.

    Args:
        bundle: an opened ``runtime.bundle.Bundle``.

    Returns:
        sub-part -> problems (human-readable), for the sub-parts that promise
        static shapes (an empty list: the promise holds).
    """
    core = ov.Core()
    found: dict[str, list[str]] = {}
    for part, spec in bundle.manifest["subparts"].items():
        options = spec["options"]
        if not options.get("static"):
            continue
        problems: list[str] = []
        promised = options.get("static_shapes") or {}
        declared = {t["name"]: t["shape"] for t in (*spec["inputs"], *spec["outputs"])}
        model = core.read_model(str(bundle.file(spec["entry"])))
        for port in (*model.inputs, *model.outputs):
            name, shape = port.get_any_name(), port.get_partial_shape()
            if shape.is_dynamic:
                problems.append(f"{name} is {shape} in the IR")
                continue
            dims = [int(d.get_length()) for d in shape]
            if name in promised and list(promised[name]) != dims:
                problems.append(f"{name} is {dims} in the IR, options.static_shapes says {promised[name]}")
            if name in declared and list(declared[name]) != dims:
                problems.append(f"{name} is {dims} in the IR, the manifest signature says {declared[name]}")
        for name, shape in declared.items():
            if any(not isinstance(d, int) for d in shape):
                problems.append(f"the manifest signature declares {name} {shape} (not static)")
        found[part] = problems
    return found
