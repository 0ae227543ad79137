"""OpenVINO runners: a sub-part (:class:`OvSubPart`) and the stateful decoder
(:class:`OvStatefulDecoder`) compiled on one device, with the load/run interface of
:mod:`higgs_pack.runtime.loop.pipeline`.

Compiling from the ``.xml`` path with ``CACHE_DIR`` set (:func:`compile_ir`) lets OpenVINO
import the compiled blob on the next load instead of reading and compiling the IR again.
After compiling, the devices OpenVINO reports in ``EXECUTION_DEVICES`` are checked too.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from higgs_pack.errors import (
    BundleError,
    ExecutionProviderUnavailable,
    SignatureMismatch,
    last_line,
)
from higgs_pack.runtime.backends.openvino.devices import META_DEVICES, check_device
from higgs_pack.runtime.loop.pipeline import check_decoder_room, check_io_signature
from higgs_pack.runtime.machine.mapped_pages import PageOutResult, paging_out

#: Inputs the stateful decoder IR (optimum-intel, see ``exporters/openvino/decoder.py``) may declare.
DECODER_INPUTS: tuple[str, ...] = ("inputs_embeds", "attention_mask", "position_ids", "beam_idx")

#: Name of the decoder IR's output.
DECODER_OUTPUT = "hidden_states"


#: What OpenVINO says when an IR's weights file does not fit its XML, in a plain RuntimeError (it
#: has no type for it: its own GeneralFailure and the like are not raised here).  Measured with
#: OpenVINO 2026.4: a truncated .bin gives "Check 'is_valid_weights_range(...)' failed ...
#: Incorrect weights in bin file!" (tests/test_errors.py compiles such an IR).
_DAMAGED_IR = re.compile(r"weights in bin file|bin file is|Incorrect weights", re.IGNORECASE)


def numpy_dtype(port) -> np.dtype:
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
        device: Requested device (see :func:`~higgs_pack.runtime.backends.openvino.devices.normalize_device`).
        cache_dir: OpenVINO model cache directory (``CACHE_DIR``); created if needed.
        config: Extra compile properties (``INFERENCE_PRECISION_HINT``, ``NUM_STREAMS``...).
        allow_fallback: See :func:`~higgs_pack.runtime.backends.openvino.devices.check_device`.

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
    return {p.get_any_name(): (numpy_dtype(p).name, p.get_partial_shape().rank.get_length()) for p in ports}


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
        config: Extra compile properties (see :func:`~higgs_pack.runtime.backends.openvino.devices.precision_config`).
        allow_fallback: Compile for CPU when ``device`` is missing (logged, and
            said in :attr:`description`).
        step_inputs: Input name -> shape of the once-per-frame call (see
            :func:`~higgs_pack.runtime.loop.pipeline.step_input_shapes`), whose outputs are
            copied into buffers this runner keeps for that call and returned as those buffers
            (no allocation per frame); None: always new arrays.

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
                 allow_fallback: bool = False, step_inputs: Mapping[str, tuple[int, ...]] | None = None):
        self.path = Path(xml_path)
        self.compiled, self.device, self.description = compile_ir(
            core, xml_path, device, cache_dir, config, allow_fallback=allow_fallback
        )
        self._step_inputs = {k: tuple(v) for k, v in step_inputs.items()} if step_inputs else None
        self._inputs = {p.get_any_name(): numpy_dtype(p) for p in self.compiled.inputs}
        self.input_names = list(self._inputs)
        self.output_names = [p.get_any_name() for p in self.compiled.outputs]
        self._request = self.compiled.create_infer_request()
        # One infer request per sub-part: calls from several threads (the engine's readers each
        # decoding their codec chunks, the server encoding voices) take turns on it.
        self._lock = threading.Lock()
        self._step_outputs: dict[str, np.ndarray] = {}  # output name -> the per-step call's buffer

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once.

        Args:
            feeds: Input name -> array, names as in ``SUBPART_IO`` (see
                :mod:`higgs_pack.runtime.loop.pipeline` for shapes and dtypes).

        Returns:
            Output name -> array (float32 or int64).  For the per-step shapes
            (``step_inputs``): this runner's buffers for that call, valid until the next call
            with those shapes (the loop reads them before; copy to keep them).  Otherwise
            arrays owned by the caller.

        Raises:
            ValueError: ``feeds`` lacks an input or has an unknown one.
        """
        if set(feeds) != set(self._inputs):
            raise ValueError(
                f"{self.path.name}: feeds {sorted(feeds)} do not match the IR inputs {self.input_names}"
            )
        cast = {k: np.ascontiguousarray(v, dtype=self._inputs[k]) for k, v in feeds.items()}
        # Inputs are read in place (the call is synchronous; this is the compiled model's only
        # infer request, see OvStatefulDecoder's share_inputs); outputs are views of the request's
        # memory, copied before the lock is let go.  A per-step call's outputs go into this
        # runner's own buffers, not the request's memory: the request writes a call of any shape
        # into the output memory it holds when that is large enough (measured, openvino 2026.4.1:
        # the audio_embed view of a [1, 1, 8] call was overwritten by a later [1, 50, 8] call once
        # the request had run a long one), and the engine embeds a joining prompt on the
        # submitting thread while its own thread still reads the last step's view.
        steps = self._step_inputs
        keep = steps is not None and all(steps.get(k) == v.shape for k, v in cast.items())
        with self._lock:
            results = self._request.infer(cast, share_inputs=True, share_outputs=True)
            if not keep:
                return {name: _output(np.array(results[port], copy=True))
                        for name, port in zip(self.output_names, self.compiled.outputs, strict=True)}
            out = {}
            for name, port in zip(self.output_names, self.compiled.outputs, strict=True):
                value = _output(results[port])
                buffer = self._step_outputs.get(name)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = self._step_outputs[name] = np.empty_like(value)
                np.copyto(buffer, value)
                out[name] = buffer
            return out


def state_layout(compiled) -> str:
    """``openvino:state:<key cache precision>/<value cache precision>`` of a compiled stateful
    decoder (``KEY_CACHE_PRECISION`` / ``VALUE_CACHE_PRECISION``, else ``KV_CACHE_PRECISION``):
    the layout of its voice-prefix entries (:mod:`~higgs_pack.runtime.loop.prefix_cache`)."""
    def prop(name):
        try:
            value = compiled.get_property(name)
        except RuntimeError:
            return None
        return str(value.get_type_name() if hasattr(value, "get_type_name") else value)

    kv = prop("KV_CACHE_PRECISION") or "default"
    return f"openvino:state:{prop('KEY_CACHE_PRECISION') or kv}/{prop('VALUE_CACHE_PRECISION') or kv}"


def read_state(request, index: int, columns) -> dict[str, np.ndarray]:
    """Copies of batch row ``index``, state ``columns``, of every state variable of an infer
    request: name -> float32 [kv_heads, len(columns), head_dim]."""
    return {v.name: np.array(v.state.data[index][:, columns], dtype=np.float32, copy=True)
            for v in request.query_state()}


def write_state(request, arrays: dict[str, np.ndarray], length: int) -> None:
    """Set every state variable of an infer request to one row of ``length`` positions from
    ``arrays`` (name -> [kv_heads, length, head_dim]).

    Raises:
        KeyError, ValueError: the names are not the request's variables, or a shape is wrong
            (checked before any variable is set).
    """
    from higgs_pack.runtime.loop.prefix_cache import check_prefix_arrays

    variables = request.query_state()
    check_prefix_arrays(arrays, [v.name for v in variables], length)
    request.reset_state()
    for variable in request.query_state():
        variable.state = ov.Tensor(np.ascontiguousarray(arrays[variable.name], dtype=np.float32)[None])


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
        config: Extra compile properties (see :func:`~higgs_pack.runtime.backends.openvino.devices.precision_config` with ``stateful=True``).
        max_length: Most positions one request may use (the manifest's
            ``max_position_embeddings`` or less).
        allow_fallback: See :class:`OvSubPart`.
        share_inputs: ``InferRequest.infer``'s flag: read the inputs in place instead of
            copying them into the request.  Off by default: the CPU plugin binds a shared
            input's memory to the input of the graph that every infer request of one compiled
            model (one stream) runs on, and it stays bound after the infer; another request's
            infer then copies its own input into that memory.  Measured with OpenVINO 2026.4.1 on
            the tiny bundle (issue 30 item 5), with the spliced stateful engine that batched on
            a second request of this compiled model until the paged engine replaced it: after
            its first two-row step, this decoder's ``attention_mask`` array held the batch's
            mask with its zeros of left padding, and every later ``synthesize`` gave other codes
            from its second step on.  On only for a compiled model no other infer
            request uses (the benchmark); off costs a copy of ``inputs_embeds`` and two int64
            rows per step: the same speed within noise on the bench bundle
            (``python -m bench.ab ov-properties``,
            :func:`~higgs_pack.runtime.backends.openvino.devices.precision_config`); on the tiny
            bundle, whose step is all call overhead, 1.84 against 1.23 ms best (2.61 / 2.19
            median; 20 interleaved rounds of 300 steps, AMD EPYC 2 vCPUs at load 12), which is
            under 0.5 % of a full-size openvino int4 step (117 ms).
        share_outputs: return the output as a view of the request's memory (then copied once
            into the returned array) instead of copying it twice (on by default).
        page_out_weights: Run the first :meth:`forward` inside
            :func:`~higgs_pack.runtime.machine.mapped_pages.paging_out` on the IR's ``.bin``, for a
            device that copies the weights into its own buffers then (see
            :func:`~higgs_pack.runtime.backends.openvino.devices.cpu_packs_weights`); pass no
            ``cache_dir`` with it (importing the cached blob copies the weights twice).

    Attributes:
        compiled, device, description: As :class:`OvSubPart`.
        core, config: the ``openvino.Core`` and compile properties as given (the paged
            decoder compiles its form of this IR with them).
        page_out: What the paging-out did on the first forward (``None`` before it, or
            when ``page_out_weights`` is off).
        max_length: As given.
        shares_inputs: ``share_inputs`` as given.
        length: Positions in the cache since the last :meth:`reset`.

    Raises:
        BundleError: The IR file is missing.
        ExecutionProviderUnavailable: As :func:`compile_ir`.
        SignatureMismatch: The IR has no state (a stateless decoder), no
            ``inputs_embeds`` input or no ``hidden_states`` output.
    """

    def __init__(self, core: ov.Core, xml_path: str | os.PathLike, device: str,
                 cache_dir: str | os.PathLike | None = None, config: Mapping[str, Any] | None = None, *,
                 max_length: int, allow_fallback: bool = False, share_inputs: bool = False,
                 share_outputs: bool = True, page_out_weights: bool = False):
        self.path = Path(xml_path)
        self.core, self.config = core, dict(config or {})
        self._page_out_weights = bool(page_out_weights)
        self.page_out: PageOutResult | None = None
        self.max_length = int(max_length)
        self.shares_inputs = bool(share_inputs)
        self._share = {"share_inputs": self.shares_inputs, "share_outputs": bool(share_outputs)}
        self.compiled, self.device, self.description = compile_ir(
            core, xml_path, device, cache_dir, config, allow_fallback=allow_fallback
        )
        inputs = {p.get_any_name(): numpy_dtype(p) for p in self.compiled.inputs}
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
        # Made once: every step feeds views of these (the mask grows, the positions move).
        self._mask = np.ones((1, self.max_length), dtype=inputs.get("attention_mask", np.int64))
        self._positions = np.arange(self.max_length, dtype=inputs.get("position_ids", np.int64))[None]
        self._beam = np.zeros((1,), dtype=inputs.get("beam_idx", np.int32))
        self.length = 0

    def reset(self) -> None:
        """Forget the KV cache; the next :meth:`forward` starts at position 0."""
        self._request.reset_state()
        self.length = 0

    @property
    def prefix_layout(self) -> str:
        """The KV layout of its voice-prefix entries (:func:`state_layout`)."""
        return state_layout(self.compiled)

    def read_prefix(self, length: int) -> dict[str, np.ndarray]:
        """A copy of the state's first ``length`` positions: variable -> float32 [kv_heads, length,
        head_dim] (the plugin dequantizes a u8 cache as it reads it)."""
        if length > self.length:
            raise ValueError(f"the state holds {self.length} positions, not {length}")
        return read_state(self._request, 0, slice(0, length))

    def write_prefix(self, arrays: dict[str, np.ndarray], length: int) -> None:
        """Start over with ``arrays`` (:meth:`read_prefix`'s) as the state's positions
        0..length-1 (the plugin quantizes them again into a u8 cache); the next :meth:`forward`
        continues at ``length``.

        Raises:
            KeyError, ValueError: names or shapes other than this decoder's state (nothing changed).
        """
        check_decoder_room(length, self.max_length)
        write_state(self._request, arrays, length)
        self.length = length

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
        check_decoder_room(total, self.max_length)
        feeds = {
            "inputs_embeds": np.ascontiguousarray(embeds, dtype=self._inputs["inputs_embeds"]),
            "attention_mask": self._mask[:, :total],
            "position_ids": self._positions[:, self.length:total],
            "beam_idx": self._beam,
        }
        feeds = {k: v for k, v in feeds.items() if k in self._inputs}
        if self._page_out_weights and self.page_out is None:  # the first forward: the CPU plugin packs now
            with paging_out(self.path.with_suffix(".bin")) as self.page_out:
                results = self._request.infer(feeds, **self._share)
        else:
            results = self._request.infer(feeds, **self._share)
        self.length = total
        return np.array(results[self._output], dtype=np.float32, copy=True)
