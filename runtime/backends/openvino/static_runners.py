"""Runners of static (NPU) bundles, with the interface of the dynamic ones:
:class:`OvStaticSubPart` pads or chunks inputs into the static shapes the manifest declares
(``options.chunking``), and :class:`OvStaticKVDecoder` keeps the KV cache in fixed-size
buffers for the stateless decoder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from higgs_pack.errors import (
    InputError,
    Problem,
    SignatureMismatch,
)
from higgs_pack.runtime.backends.openvino.runners import (
    DECODER_OUTPUT,
    OvSubPart,
    compile_ir,
    numpy_dtype,
)
from higgs_pack.runtime.loop.chunking import chunk_windows


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
            raise InputError.of(
                Problem.said(f"{self.subpart}: {self._in} has shape {list(x.shape)}; this static-shape (NPU) bundle takes "
                             f"{self.in_shape}, where only axis {self._axis} may differ (padded or chunked)")
            )
        n = int(x.shape[self._axis])
        if n > self.chunk and not self._split:
            raise InputError.of(
                Problem.said(f"{self.subpart}: {self._in} has {n} positions, more than the static length {self.chunk} this "
                             "NPU bundle was built with (generation.max_prompt_length); shorten the text or the reference "
                             "audio, or use the openvino bundle built without --npu", code="input_too_long")
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
                raise InputError.of(Problem.said(f"{self.subpart}: {n} positions do not map to whole output positions "
                                                 f"({self.chunk} in -> {self.out_chunk} out)"))
            pieces.append(_take(y, self._out_axis, a // self.chunk, b // self.chunk))
        return {self._out: pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=self._out_axis)}


class OvStaticKVDecoder:
    """The stateless static decoder (NPU bundles, ``convert_static_decoder``): the KV
    cache lives in fixed-size numpy buffers owned here (a ``Decoder``).

    It takes no part in the voice prefix cache (:mod:`~higgs_pack.runtime.loop.prefix_cache`):
    :attr:`prefix_refusal` says why.

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

    prefix_layout = None
    prefix_refusal = ("the NPU variant's decoder feeds its KV cache to a static-shape stateless graph in fixed "
                      "buffers and computes a prompt in static windows of positions, so a cached prefix is not "
                      "copied in: each prompt is prefilled whole")

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
        self._buffers = {n: np.zeros(shapes[n], dtype=numpy_dtype(inputs[n])) for n in past}
        self._dtypes = {n: numpy_dtype(p) for n, p in inputs.items()}
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
            raise InputError.of(
                Problem.said(f"the prompt has {s} positions, more than this NPU bundle's static prompt length "
                             f"{self.max_prompt_length} (generation.max_prompt_length; KV window {self.max_length}): shorten "
                             "the text or the reference audio, or use the openvino bundle built without --npu", code="input_too_long")
            )
        if self.length + s > self.max_length:
            raise InputError.of(
                Problem.said(f"the decoder would hold {self.length + s} positions, more than this NPU bundle's static KV "
                             f"window of {self.max_length}; shorten the text or lower max_frames=", code="input_too_long")
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
