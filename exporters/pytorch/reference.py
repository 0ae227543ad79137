"""The PyTorch oracle: the checkpoint's torch modules behind the runtime's backend interface.

:func:`reference_pipeline` returns a :class:`higgs_pack.runtime.loop.pipeline.Pipeline`
whose sub-parts are the float32 modules of :mod:`higgs_pack.exporters.pytorch.modules`
(wrapped by :class:`TorchRunner`) and whose decoder is transformers' ``Qwen3Model``
with a ``DynamicCache`` (:class:`TorchDecoder`).  The runtime's generation loop runs on
it unchanged, so golden outputs captured at build time and parity tests measure the
export alone (DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from higgs_pack.errors import InputError, Problem
from higgs_pack.exporters.pytorch.modules import build_modules
from higgs_pack.manifests.model import SUBPART_IO, SubPart
from higgs_pack.runtime.loop.pipeline import Pipeline

if TYPE_CHECKING:
    from higgs_pack.exporters.checkpoint.reader import HiggsCheckpoint

#: What :attr:`Pipeline.description` says for every sub-part of the oracle.
DESCRIPTION = "pytorch"


def _to_torch(name: str, value: Any) -> torch.Tensor:
    array = np.asarray(value)
    if np.issubdtype(array.dtype, np.integer):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if np.issubdtype(array.dtype, np.floating):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    raise InputError.of(Problem.said(f"input {name!r} has dtype {array.dtype}; expected integers or floats"))


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.is_floating_point():
        return tensor.detach().to(torch.float32).numpy()
    return tensor.detach().to(torch.int64).numpy()


class TorchRunner:
    """One stateless sub-part module behind the ``SubPartRunner`` protocol.

    numpy in, numpy out: integer feeds become int64 tensors, float feeds float32;
    outputs come back as float32 / int64 arrays.  Runs under ``torch.no_grad``.

    Args:
        module: The float32 eval-mode module (positional inputs in ``input_names`` order).
        input_names: Feed names, in the module's argument order.
        output_names: Output names, in the module's return order.

    Raises:
        InputError: (from ``run``) a feed is missing or not numeric.
    """

    def __init__(
        self, module: nn.Module, input_names: tuple[str, ...], output_names: tuple[str, ...]
    ) -> None:
        self.module = module.eval()
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once; keys are the names of ``SUBPART_IO``."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise InputError.of(
                Problem.said(f"missing input {missing[0]!r}; this sub-part takes {list(self.input_names)}", code="missing_field")
            )
        args = [_to_torch(n, feeds[n]) for n in self.input_names]
        with torch.no_grad():
            out = self.module(*args)
        outs = out if isinstance(out, tuple) else (out,)
        return {name: _to_numpy(t) for name, t in zip(self.output_names, outs, strict=True)}


class _Upcast:
    """Forward hooks that run one module in float32 while its stored weights stay bf16.

    Before the module's forward, every non-float32 parameter of it (and of its
    children) is swapped for a float32 copy, and the parameters named by ``replace``
    (``{"self_attn.q_proj.weight": array}``, called with the layer index) for the given
    float32 arrays; after it, the stored ones are put back and the copies dropped.
    bf16 -> float32 is exact, so the module computes what a float32 model computes, with
    one layer's float32 weights alive at a time.
    """

    def __init__(self, index: int = 0, replace: Callable[[int], dict[str, np.ndarray]] | None = None) -> None:
        self.index = index
        self.replace = replace
        self._saved: list[tuple[nn.Module, str, nn.Parameter]] = []

    def _swap(self, sub: nn.Module, name: str, value: torch.Tensor) -> None:
        self._saved.append((sub, name, sub._parameters[name]))
        sub._parameters[name] = nn.Parameter(value, requires_grad=False)

    def before(self, module: nn.Module, _args: Any) -> None:
        replaced = self.replace(self.index) if self.replace is not None else {}
        for path, array in replaced.items():
            owner, _, leaf = path.rpartition(".")
            sub = module.get_submodule(owner)
            if tuple(sub._parameters[leaf].shape) != tuple(array.shape):
                raise InputError.of(Problem.said(f"layer {self.index} {path}: read-back weight has shape {list(array.shape)}, "
                                                 f"expected {list(sub._parameters[leaf].shape)}"))
            self._swap(sub, leaf, torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)))
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None and param.dtype != torch.float32:
                    self._swap(sub, name, param.detach().float())

    def after(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        for sub, name, param in reversed(self._saved):
            sub._parameters[name] = param
        self._saved.clear()


def upcast_per_layer(model: nn.Module, replace: Callable[[int], dict[str, np.ndarray]] | None = None) -> nn.Module:
    """Make a transformers ``Qwen3Model`` with bf16 weights compute in float32, layer by layer.

    Each decoder layer and the final norm get :class:`_Upcast` hooks, so peak memory is
    the stored weights plus one layer in float32 (the 4B body: 7.3 GiB bf16 + 0.4 GiB)
    instead of the 14.6 GiB float32 model.

    Args:
        model: the ``Qwen3Model`` (:func:`~higgs_pack.exporters.checkpoint.models.qwen3_model` with ``stored_dtype=True``).
        replace: optional ``f(layer_index) -> {parameter path in the layer: float32 array}``:
            those parameters are taken from ``f`` instead of the model for that layer's
            forward (the matched oracle: weights read back from a bundle, see
            :mod:`higgs_pack.exporters.pytorch.dequantize`).

    Returns:
        ``model``.
    """
    for index, module in enumerate([*model.layers, model.norm]):
        hooks = _Upcast(index, replace if index < len(model.layers) else None)
        module.register_forward_pre_hook(hooks.before)
        module.register_forward_hook(hooks.after)
    return model


class TorchDecoder:
    """The Qwen3 body with a transformers ``DynamicCache``, behind the ``Decoder`` protocol.

    ``forward`` appends ``inputs_embeds`` to the positions seen since :meth:`reset`
    (positions continue from the cache length, attention is causal over all of them)
    and returns the final-norm hidden states of the new positions, float32.

    Args:
        model: A float32 eval-mode transformers ``Qwen3Model`` (:func:`~higgs_pack.exporters.checkpoint.models.qwen3_model`).
        max_length: Most positions per request (default: ``max_position_embeddings``).

    Raises:
        InputError: (from ``forward``) not [1, S, H], or the request would pass ``max_length``.
    """

    def __init__(self, model: nn.Module, max_length: int | None = None) -> None:
        self.model = model.eval()
        self.hidden_size = int(model.config.hidden_size)
        self.max_length = int(max_length or model.config.max_position_embeddings)
        self.reset()

    @property
    def length(self) -> int:
        """Positions in the cache."""
        return self._length

    def reset(self) -> None:
        """Forget the KV cache; the next ``forward`` starts at position 0."""
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.model.config)
        self._length = 0

    def kv_cache(self) -> dict[str, np.ndarray]:
        """The cached keys and values, named as the ONNX decoder's outputs: ``present.{i}.key`` /
        ``present.{i}.value`` -> float32 [1, kv_heads, positions, head_dim] (keys after q/k-norm
        and RoPE, as GroupQueryAttention caches them); empty before the first ``forward``."""
        out: dict[str, np.ndarray] = {}
        for i, layer in enumerate(getattr(self._cache, "layers", [])):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None:
                continue
            out[f"present.{i}.key"] = _to_numpy(keys).copy()
            out[f"present.{i}.value"] = _to_numpy(values).copy()
        return out

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """float32 [1, S, H] -> float32 [1, S, H] (final-norm hidden states)."""
        x = _to_torch("inputs_embeds", inputs_embeds)
        if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != self.hidden_size or x.shape[1] < 1:
            raise InputError.of(
                Problem.said(f"decoder input has shape {list(x.shape)}; expected [1, S, {self.hidden_size}]")
            )
        if self._length + x.shape[1] > self.max_length:
            raise InputError.of(
                Problem.said(f"the request needs {self._length + x.shape[1]} positions, more than the "
                             f"decoder's {self.max_length}; shorten the text or lower max_frames.", code="input_too_long")
            )
        with torch.no_grad():
            out = self.model(inputs_embeds=x, past_key_values=self._cache, use_cache=True)
        self._cache = out.past_key_values
        self._length += int(x.shape[1])
        return _to_numpy(out.last_hidden_state)


def reference_pipeline(ckpt: HiggsCheckpoint, *, with_encoder: bool = True) -> Pipeline:
    """The PyTorch oracle of ``ckpt`` as a runtime ``Pipeline`` (float32 compute, CPU).

    Weights stay in the checkpoint's dtype and each decoder layer runs in float32
    (:func:`upcast_per_layer`), so the 4B oracle needs about 9 GiB, not 17.

    Args:
        ckpt: An opened checkpoint.
        with_encoder: Also build the codec encoder (needed for voice cloning).

    Returns:
        A Pipeline with the checkpoint's tokenizer and constants, :class:`TorchRunner`
        sub-parts, a :class:`TorchDecoder`, ``description`` = ``"pytorch"`` for every
        sub-part and empty ``generation_defaults`` (the loop has its own).

    Raises:
        CheckpointError: the checkpoint's tensors do not load.
    """
    wanted = [SubPart.TEXT_EMBED, SubPart.AUDIO_EMBED, SubPart.AUDIO_HEADS, SubPart.AUDIO_TOKENIZER]
    if with_encoder:
        wanted.append(SubPart.AUDIO_ENCODER)
    modules = build_modules(ckpt, wanted, keep_dtype=True)
    runners = {sp: TorchRunner(m, *SUBPART_IO[sp]) for sp, m in modules.items()}
    from higgs_pack.exporters.checkpoint.models import qwen3_model

    body = upcast_per_layer(qwen3_model(ckpt, stored_dtype=True))
    ckpt.close()
    decoder = TorchDecoder(body, ckpt.constants.max_position_embeddings)
    described = [*wanted, SubPart.LLM_DECODER]
    return Pipeline(
        tokenizer=ckpt.tokenizer,
        constants=ckpt.constants,
        text_embed=runners[SubPart.TEXT_EMBED],
        decoder=decoder,
        audio_embed=runners[SubPart.AUDIO_EMBED],
        audio_heads=runners[SubPart.AUDIO_HEADS],
        audio_tokenizer=runners[SubPart.AUDIO_TOKENIZER],
        audio_encoder=runners.get(SubPart.AUDIO_ENCODER),
        description={sp.value: DESCRIPTION for sp in described},
        generation_defaults={},
    )
