"""MatMul -> MatMulNBits over a graph whose weights stay on disk, one weight at a time.

ModelBuilder 0.18 quantizes its int4 decoders at save time by handing the whole
float model proto to ONNX Runtime's ``MatMulNBitsQuantizer`` (MODEL.md: ~13.5 GiB of
fp32 proto plus the bf16 checkpoint for the 4B model; onnxruntime-genai#2047).  This
module runs the same per-node quantizer that ``MatMulNBitsQuantizer`` runs
(``DefaultWeightOnlyQuantizer.quantize``, ONNX Runtime's MLAS block quantization)
over a float graph ModelBuilder wrote with external data, reading one weight
from disk, quantizing it, appending the result to the new external-data file and
dropping it.  Peak memory is one float weight plus its packed form; the output
graph is the one ModelBuilder's int4 build writes (same node names, same packed
bytes: ``tests/test_matmul_nbits.py`` compares them on the tiny checkpoint).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from higgs_pack.errors import BuildError

#: Tensors at least this large start at a multiple of :data:`ALIGNMENT` in the
#: external-data file, so ONNX Runtime can memory-map them.
ALIGN_THRESHOLD = 1 << 20
#: Offset alignment of large tensors (64 KiB: the Windows allocation granularity,
#: a multiple of every Linux page size).
ALIGNMENT = 1 << 16
#: Bytes copied per read when moving a tensor that stays float.
_COPY_CHUNK = 1 << 24


class _ExternalDataWriter:
    """Appends tensor bytes to one external-data file and points the protos at them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = path.name
        self._file = path.open("wb")
        self.offset = 0

    def _start(self, nbytes: int) -> int:
        if nbytes >= ALIGN_THRESHOLD and self.offset % ALIGNMENT:
            pad = ALIGNMENT - self.offset % ALIGNMENT
            self._file.write(b"\0" * pad)
            self.offset += pad
        return self.offset

    def _point(self, tensor: Any, offset: int, length: int) -> None:
        from onnx import TensorProto, external_data_helper

        if not tensor.HasField("raw_data"):
            tensor.raw_data = b""
        del tensor.external_data[:]
        external_data_helper.set_external_data(tensor, self.location, offset=offset, length=length)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL

    def add(self, tensor: Any) -> None:
        """Move an in-memory tensor's data to the file (the proto keeps only the reference)."""
        from onnx import numpy_helper

        if not tensor.HasField("raw_data"):
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
        data = tensor.raw_data
        offset = self._start(len(data))
        self._file.write(data)
        self.offset += len(data)
        self._point(tensor, offset, len(data))

    def copy(self, tensor: Any, base_dir: Path) -> None:
        """Copy a tensor's data (inline or external in ``base_dir``) in chunks."""
        from onnx import external_data_helper

        if not external_data_helper.uses_external_data(tensor):
            self.add(tensor)
            return
        info = external_data_helper.ExternalDataInfo(tensor)
        source = base_dir / info.location
        length = info.length if info.length is not None else source.stat().st_size - (info.offset or 0)
        offset = self._start(length)
        with source.open("rb") as f:
            f.seek(info.offset or 0)
            left = length
            while left:
                chunk = f.read(min(_COPY_CHUNK, left))
                if not chunk:
                    raise BuildError(f"{source} ends before tensor {tensor.name!r}'s data; the float graph is truncated")
                self._file.write(chunk)
                left -= len(chunk)
        self.offset += length
        self._point(tensor, offset, length)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def _load_tensor(tensor: Any, base_dir: Path) -> Any:
    """A copy of ``tensor`` with its external data read into memory (this one tensor only)."""
    from onnx import TensorProto, external_data_helper

    loaded = TensorProto()
    loaded.CopyFrom(tensor)
    if external_data_helper.uses_external_data(loaded):
        external_data_helper.load_external_data_for_tensor(loaded, str(base_dir))
        del loaded.external_data[:]
        loaded.data_location = TensorProto.DEFAULT
    return loaded


def quantize_matmuls(
    source: str | Path,
    target: str | Path,
    *,
    bits: int = 4,
    block_size: int = 32,
    is_symmetric: bool = True,
    accuracy_level: int | None = None,
    nodes_to_exclude: Iterable[str] = (),
) -> dict[str, Any]:
    """Quantize every MatMul with a constant weight of ``source`` into ``target``.

    Each eligible ``MatMul`` (constant 2-D weight B [K, N] used by that node only) is
    replaced by ONNX Runtime's ``MatMulNBits`` (``com.microsoft``; weight packed
    [N, ceil(K/block_size), block_size*bits/8] uint8, scales [N, blocks] in the weight's
    float dtype, zero points only when asymmetric) exactly as ``MatMulNBitsQuantizer``
    with the default (MLAS round-to-nearest) algorithm does; every other node and
    initializer is copied unchanged.  Weights are read from ``source``'s external data
    one at a time and all tensors of ``target`` go to ``<target>.data``.

    Args:
        source: A float ONNX graph (fp32 or fp16 weights) with external data.
        target: The ``.onnx`` path to write (its directory must exist; must differ from
            ``source``).
        bits: 4 or 8.
        block_size: Weights per quantization block along K (a power of 2, >= 16).
        is_symmetric: Symmetric blocks (no zero points), as ModelBuilder's default.
        accuracy_level: ``MatMulNBits`` ``accuracy_level`` attribute (0-4; 4 = int8
            compute on CPU), ``None`` for the op's default.
        nodes_to_exclude: Node names to keep as float ``MatMul``.

    Returns:
        ``{"quantized": n, "kept_float": [names], "largest_weight_bytes": b}``.

    Raises:
        BuildError: ``source`` is missing or its external data is truncated; or
            out of disk space while writing (the message names the folder).
    """
    import onnx

    source, target = Path(source), Path(target)
    if source.resolve() == target.resolve():
        raise BuildError(f"quantize_matmuls would overwrite its input {source}; pass another target")
    if not source.is_file():
        raise BuildError(f"{source} does not exist; the float decoder graph was not written")
    model = onnx.load(str(source), load_external_data=False)
    graph = model.graph
    base_dir = source.parent
    initializers = {t.name: t for t in graph.initializer}
    quantizer = _weight_only_quantizer(bits, block_size, is_symmetric, accuracy_level)
    writer = _ExternalDataWriter(target.parent / f"{target.name}.data")
    try:
        nodes, replaced, kept_float, largest = _quantized_nodes(graph, initializers, set(nodes_to_exclude),
                                                                quantizer, writer, base_dir)
        kept = [t for t in graph.initializer if t.name not in replaced]
        for tensor in kept:
            if tensor.name in initializers:  # original tensors: copy their bytes over
                writer.copy(tensor, base_dir)
        del graph.initializer[:]
        graph.initializer.extend(kept)
        del graph.node[:]
        graph.node.extend(nodes)
        if not any(op.domain == "com.microsoft" for op in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
        writer.close()
        onnx.save_model(model, str(target))
    except OSError as exc:
        raise_disk_error(exc, target.parent)
        raise
    return {"quantized": len(replaced), "kept_float": kept_float, "largest_weight_bytes": largest}


def _weight_only_quantizer(bits: int, block_size: int, is_symmetric: bool, accuracy_level: int | None) -> Any:
    """ONNX Runtime's ``MatMulNBitsQuantizer`` default (round-to-nearest) quantizer, one node at a time."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )
    from onnxruntime.quantization.quant_utils import QuantFormat

    return DefaultWeightOnlyQuantizer(
        DefaultWeightOnlyQuantConfig(
            block_size=block_size,
            is_symmetric=is_symmetric,
            accuracy_level=accuracy_level,
            quant_format=QuantFormat.QOperator,
            op_types_to_quantize=("MatMul",),
            bits=bits,
        )
    )


def _quantized_nodes(graph: Any, initializers: dict[str, Any], exclude: set[str], quantizer: Any,
                     writer: _ExternalDataWriter, base_dir: Path) -> tuple[list[Any], set[str], list[str], int]:
    """``graph``'s nodes with each eligible MatMul replaced by ``quantizer``'s nodes, their new tensors
    written and appended to the graph's initializers; ``(nodes, replaced weights, MatMuls kept float,
    largest float weight in bytes)``."""
    import onnx

    uses = Counter(name for node in graph.node for name in node.input)
    replaced: set[str] = set()
    kept_float: list[str] = []
    largest = 0
    nodes = []
    for node in graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if weight is None or node.name in exclude or uses[weight.name] != 1 or len(weight.dims) != 2:
            if node.op_type == "MatMul":
                kept_float.append(node.name)
            nodes.append(node)
            continue
        holder = onnx.helper.make_graph([], "weight", [], [], initializer=[_load_tensor(weight, base_dir)])
        largest = max(largest, len(holder.initializer[0].raw_data))
        new_nodes = quantizer.quantize(node, [holder])
        for tensor in holder.initializer[1:]:  # the packed weight, scales (and zero points)
            writer.add(tensor)
            graph.initializer.append(tensor)
        del holder
        nodes.extend(new_nodes)
        replaced.add(weight.name)
    return nodes, replaced, kept_float, largest


def raise_disk_error(exc: OSError, folder: Path) -> None:
    """Re-raise ``exc`` as a :class:`BuildError` naming ``folder`` when the disk is full."""
    import errno
    import shutil

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(folder).free
        raise BuildError(
            f"out of disk space in {folder} ({free / 2**30:.1f} GiB free); free space there or "
            "put the build's scratch elsewhere with --work-dir / HIGGS_PACK_WORK_DIR"
        ) from exc
