"""Static-shape planning of a small sub-part (``convert_subpart(static_axes=...)``, the ``npu`` variant).

:class:`StaticPlan` fixes every input axis, measures the chunk context the runtime adds
when it splits a longer input (the module's receptive field) and, for the codec decoder,
wraps the module so that a ``valid_<axis>`` input zeroes every convolution input past
the real positions: a padded chunk then decodes exactly like the unpadded codes. The
manifest options it returns (``static``, ``static_shapes``, ``chunking``) tell the
runtime how to pad or chunk (``higgs_pack.runtime.backends.openvino.static_runners.OvStaticSubPart``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import openvino as ov

from higgs_pack.errors import BuildError, BuildPlanError
from higgs_pack.exporters.result import TensorSpec
from higgs_pack.manifests.model import SubPart

if TYPE_CHECKING:
    import torch

def _resize(example: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """Repeat (then cut) an example tensor along ``axis`` to ``size`` positions."""
    import torch

    n = int(example.shape[axis])
    reps = -(-size // n)
    return torch.cat([example] * reps, dim=axis).narrow(axis, 0, size).contiguous()


def _receptive_field(module: torch.nn.Module, example: torch.Tensor, axis: int, out_axis: int) -> int:
    """How far (in input positions along ``axis``) one changed input position changes the output
    (:func:`higgs_pack.runtime.loop.chunking.receptive_reach` on the PyTorch module)."""
    from higgs_pack.exporters.pytorch.modules import numpy_function
    from higgs_pack.runtime.loop.chunking import NotLocalError, receptive_reach

    try:
        return receptive_reach(numpy_function(module), example.numpy(), axis, out_axis)
    except NotLocalError as exc:
        raise BuildError(f"{exc}; raise the chunk size in static_axes= or give chunk_context= explicitly") from exc


class StaticPlan:
    """The static-shape options of one sub-part (see ``convert_subpart(static_axes=...)``)."""

    def __init__(self, subpart: SubPart, module: Any, examples: tuple, input_names: list[str],
                 shapes: list[list[int]], chunking: dict[str, Any], wrapper: Any = None) -> None:
        self.subpart, self.module, self.examples = subpart, module, examples
        self.input_names, self.shapes, self.chunking, self.wrapper = input_names, shapes, chunking, wrapper

    @classmethod
    def make(cls, subpart: SubPart, module: Any, example_inputs: Sequence[Any], input_names: list[str],
             output_names: list[str], input_shapes: Sequence[Sequence[int | str | None]] | None,
             dynamic_axes: Mapping[str, Any] | None, static_axes: Mapping[str, int], chunk_context: int | str,
             pad_mask: bool, allow_chunks: bool) -> StaticPlan:
        import torch

        where = f"{subpart.value}: static_axes={dict(static_axes)}"
        if dynamic_axes is None or input_shapes is None:
            raise BuildPlanError(f"{where} needs dynamic_axes= naming the symbolic axes")
        if len(input_names) != 1 or len(output_names) != 1:
            raise BuildPlanError(f"{where}: static sub-parts take one input and give one output, "
                                 f"got {input_names} -> {output_names}")
        labels = [d for d in input_shapes[0] if isinstance(d, str)]
        missing = sorted(set(labels) - set(static_axes))
        if missing:
            raise BuildPlanError(f"{where} gives no size for axes {missing} of {input_names[0]} {list(input_shapes[0])}")
        if any(not isinstance(v, int) or v < 1 for v in static_axes.values()):
            raise BuildPlanError(f"{where}: sizes must be positive ints")
        shape = [static_axes[d] if isinstance(d, str) else int(d) for d in input_shapes[0]]
        seq = [i for i, d in enumerate(input_shapes[0]) if isinstance(d, str) and d != "batch"]
        out_axes = dynamic_axes.get(output_names[0]) or {}
        out_seq = [int(a) for a, label in (out_axes.items() if isinstance(out_axes, Mapping) else ())
                   if label != "batch"]
        if len(seq) != 1 or len(out_seq) != 1:
            raise BuildPlanError(f"{where}: expected one non-batch symbolic axis on {input_names[0]} and "
                                 f"{output_names[0]}, dynamic_axes are {dict(dynamic_axes)}")
        axis, out_axis = seq[0], out_seq[0]
        chunk = shape[axis]
        example = example_inputs[0]
        for i, size in enumerate(shape):
            example = _resize(example, i, size)
        if chunk_context == "auto":
            context = _receptive_field(module, example, axis, out_axis) + 1 if allow_chunks and chunk > 1 else 0
        else:
            context = int(chunk_context)
        if allow_chunks and context and 2 * context >= chunk:
            raise BuildPlanError(f"{where}: chunk_context {context} leaves no core in a {chunk}-position chunk; "
                                 "raise the static size or lower chunk_context")
        label = input_shapes[0][axis]
        chunking = {"input": input_names[0], "input_axis": axis, "output": output_names[0],
                    "output_axis": out_axis, "context": context, "split": bool(allow_chunks),
                    "valid_input": None}
        names, shapes, examples, wrapper = [input_names[0]], [shape], (example,), None
        if pad_mask:
            wrapper = _pad_masked(module, chunk)
            valid = f"valid_{label}"
            chunking["valid_input"] = valid
            names, shapes = [*names, valid], [*shapes, [1]]
            examples = (example, torch.tensor([chunk], dtype=torch.int64))
        return cls(subpart, wrapper if wrapper is not None else module, examples, names, shapes, chunking, wrapper)

    def traced(self) -> tuple[Any, tuple, list[str], list[list[int]]]:
        """What to convert: module, example inputs (at the static shape), input names and shapes."""
        return self.module, self.examples, self.input_names, self.shapes

    def check_static(self, model: ov.Model) -> None:
        dynamic = [f"{p.get_any_name()} {p.get_partial_shape()}" for p in (*model.inputs, *model.outputs)
                   if p.get_partial_shape().is_dynamic]
        if dynamic:
            raise BuildError(f"{self.subpart.value}: {dynamic} stayed dynamic after reshaping to {self.shapes}")

    def release(self) -> None:
        if self.wrapper is not None:
            self.wrapper.remove_hooks()

    def manifest_options(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> dict[str, Any]:
        return {
            "static": True,
            "static_shapes": {t.name: list(t.shape) for t in (*inputs, *outputs)},
            "chunking": dict(self.chunking),
        }


def _pad_masked(module: Any, chunk: int) -> Any:
    """Wrap a one-input convolutional module: ``forward(inputs, valid)`` zeroes every
    Conv1d/ConvTranspose1d input beyond ``valid`` positions of the chunk (scaled to the
    layer's rate, ``length // chunk`` samples per position)."""
    import torch

    class PadMasked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module
            self._valid: Any = None
            self._handles = [m.register_forward_pre_hook(self._mask) for m in module.modules()
                             if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))]
            if not self._handles:
                raise BuildPlanError("pad_mask=True needs a module with Conv1d/ConvTranspose1d layers")

        def _mask(self, _layer: Any, args: tuple) -> tuple | None:
            if self._valid is None:
                return None
            x = args[0]
            length = int(x.shape[-1])
            if length % chunk:
                raise BuildError(f"pad_mask: a convolution input has {length} positions, not a multiple of "
                                 f"the {chunk}-position chunk; this module cannot be masked per layer")
            keep = torch.arange(length) < self._valid * (length // chunk)
            return (x * keep.to(x.dtype), *args[1:])

        def forward(self, inputs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            self._valid = valid
            try:
                return self.inner(inputs)
            finally:
                self._valid = None

        def remove_hooks(self) -> None:
            for handle in self._handles:
                handle.remove()

    return PadMasked().eval()
