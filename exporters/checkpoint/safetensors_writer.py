"""A small streaming safetensors writer: one tensor in memory at a time.

:func:`write_safetensors` writes one file, :func:`write_sharded_safetensors` a
``model.safetensors`` or shards plus an index as transformers writes them. Shared by the
tiny-checkpoint generator (:mod:`higgs_pack.exporters.checkpoint.tiny`) and
:func:`~higgs_pack.exporters.checkpoint.models.write_qwen3_hf_dir`,
so neither ever holds a whole model in memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_pack.exporters.checkpoint.layout import INDEX_NAME, SINGLE_NAME

if TYPE_CHECKING:  # heavy imports stay lazy: planning must not import torch
    import torch

ST_DTYPES: dict[str, tuple[str, int]] = {
    "torch.bfloat16": ("BF16", 2),
    "torch.float16": ("F16", 2),
    "torch.float32": ("F32", 4),
    "torch.float64": ("F64", 8),
    "torch.int64": ("I64", 8),
    "torch.int32": ("I32", 4),
    "torch.int16": ("I16", 2),
    "torch.int8": ("I8", 1),
    "torch.uint8": ("U8", 1),
    "torch.bool": ("BOOL", 1),
}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor to be written: its name, shape and dtype, and how to make it.

    ``make`` is called exactly once, when the tensor's bytes are written, so a writer
    holds one tensor in memory at a time.

    Attributes:
        name: Tensor name in the safetensors file.
        shape: Tensor shape.
        dtype: ``torch.dtype`` the made tensor must have.
        make: Zero-argument callable returning a ``torch.Tensor`` of ``shape``/``dtype``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * _st_dtype(self.dtype)[1]


def _st_dtype(dtype: Any) -> tuple[str, int]:
    try:
        return ST_DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be written to safetensors by higgs-pack") from None


def write_safetensors(
    path: Path, specs: Sequence[LazyTensor], metadata: dict[str, str] | None = None
) -> int:
    """Write one safetensors file, streaming: one tensor in memory at a time.

    The header (names, dtypes, shapes, offsets) is computed from ``specs`` before any
    tensor is made; then each tensor is made, written and freed.  The file is written
    to ``path + ".partial"`` and renamed at the end.  Output is byte-identical for
    identical specs and tensor values (sorted header keys, no timestamps).

    Args:
        path: Destination file.
        specs: The tensors, in the order their data is laid out.
        metadata: Optional ``__metadata__`` string map (default ``{"format": "pt"}``).

    Returns:
        The number of data bytes written (excluding the header).

    Raises:
        ValueError: duplicate names, or a made tensor whose shape or dtype differs
            from its spec.
    """
    import torch

    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    for spec in specs:
        if spec.name in entries:
            raise ValueError(f"tensor {spec.name!r} appears twice")
        code, _ = _st_dtype(spec.dtype)
        entries[spec.name] = {
            "dtype": code,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    header.update(sorted(entries.items()))
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            tensor = spec.make()
            if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"tensor {spec.name!r}: made {tuple(tensor.shape)} {tensor.dtype}, "
                    f"spec says {tuple(spec.shape)} {spec.dtype}"
                )
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
            del tensor, data
    os.replace(partial, path)
    return offset


def plan_shards(specs: Sequence[LazyTensor], max_shard_bytes: int) -> list[list[LazyTensor]]:
    """Split ``specs`` in order into shards of at most ``max_shard_bytes`` data bytes.

    A tensor larger than the limit gets a shard of its own.
    """
    shards: list[list[LazyTensor]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_sharded_safetensors(
    out_dir: Path, specs: Sequence[LazyTensor], max_shard_bytes: int
) -> list[Path]:
    """Write ``specs`` as ``model.safetensors`` or as shards with an index.

    One shard is written as ``model.safetensors``; several as
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size": N}, "weight_map": {name: file}}``, as transformers
    writes it).  Weight files already in ``out_dir`` are removed first.  Streaming:
    one tensor in memory at a time.

    Args:
        out_dir: Existing directory to write into.
        specs: Tensors in layout order.
        max_shard_bytes: Most data bytes per shard.

    Returns:
        The written weight files (plus the index when sharded), in order.
    """
    out_dir = Path(out_dir)
    for old in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_NAME]:
        if old.is_file():
            old.unlink()
    shards = plan_shards(specs, max_shard_bytes)
    if len(shards) == 1:
        path = out_dir / SINGLE_NAME
        write_safetensors(path, shards[0])
        return [path]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out_dir / name, shard)
        weight_map.update({spec.name: name for spec in shard})
        written.append(out_dir / name)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*written, out_dir / INDEX_NAME]
