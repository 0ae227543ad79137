"""The float weights a built sub-part really computes with, read back from its files.

Verification separates two errors (DESIGN.md, "Verification judges the export"):
*export error*, what the build got wrong, and *quantization error*, what int4/int8/fp16
costs.  The golden capture runs the PyTorch oracle twice where a sub-part's weights were
quantized or cast: once with the checkpoint's weights (float reference) and once with the
weights read back from the bundle by this module (matched reference).  A correct export
matches the matched reference up to compute noise; a wrong layer order, a dropped norm or
a scaled weight does not, however much quantization noise there is.

Readers, one weight at a time (the 4B decoder is never materialised in float32):

* ONNX ``MatMulNBits`` (``com.microsoft``; ModelBuilder's and Olive's int4 MatMuls):
  ``W[n, k] = (q[n, k] - zero_point[n, k // block]) * scale[n, k // block]`` with q the
  4-bit values packed two per byte low nibble first and zero point 8 when absent
  (the operator's specification, onnxruntime docs/ContribOperators.md).
* ONNX ``GatherBlockQuantized`` and every other ONNX form: run by ONNX Runtime itself
  (a Gather of every row), so no format detail is restated here.
* ONNX ``MatMul`` with a float16/float32 initializer: cast to float32.
* OpenVINO IR: the weight input of each MatMul (NNCF's decompression chain, or a
  Convert of f16/bf16 constants) is evaluated by OpenVINO itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.errors import BuildError

#: ModelBuilder's decoder MatMul node names: /model/layers.{i}/{attn|mlp}/{proj}/MatMul[_Q4].
MODELBUILDER_NODE = re.compile(r"^/model/layers\.(\d+)/(attn|mlp)/(\w+)/MatMul(?:_Q\d+)?$")
#: ModelBuilder projection name -> Qwen3DecoderLayer parameter(s); fused ones are split
#: along the output axis in this order.
MODELBUILDER_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "q_proj": ("self_attn.q_proj.weight",),
    "k_proj": ("self_attn.k_proj.weight",),
    "v_proj": ("self_attn.v_proj.weight",),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "gate_proj": ("mlp.gate_proj.weight",),
    "up_proj": ("mlp.up_proj.weight",),
    "down_proj": ("mlp.down_proj.weight",),
}
#: optimum-intel decoder MatMul names: __module.model.layers.{i}.{self_attn|mlp}.{proj}/aten::linear/MatMul.
#: (``ov_ext::linear`` when the export kept 16-bit weights with patch_16bit_model.)
#: (``body.layers…`` in the static NPU decoder, whose wrapper holds the Qwen3 body as ``body``.)
OPTIMUM_NODE = re.compile(r"(?:model|body)\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)/(?:aten|ov_ext)::linear/MatMul")
#: The projections every Qwen3 decoder layer has, as Qwen3DecoderLayer parameter names.
LAYER_PROJECTIONS = frozenset({
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"})


def require_projections(found: dict[str, np.ndarray], layer: int, where: Path) -> dict[str, np.ndarray]:
    """``found`` if it has exactly the seven projections of a layer, else a BuildError naming the gap."""
    if set(found) != LAYER_PROJECTIONS:
        missing = sorted(LAYER_PROJECTIONS - set(found))
        raise BuildError(f"{where}: read back {sorted(found)} for layer {layer}, missing {missing}: the graph's "
                         "node names are not the exporter's known layout, so its weights cannot be checked")
    return found


def unpack_matmul_nbits(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                        *, n: int, k: int, bits: int, block_size: int) -> np.ndarray:
    """float32 [N, K] weight of a ``MatMulNBits`` node (4 bits only).

    Args:
        packed: uint8 [N, blocks, block_size // 2].
        scales: [N * blocks] or [N, blocks], float32/float16.
        zero_points: uint8 [N * ceil(blocks / 2)] packed like the weights, or None (8).

    Raises:
        BuildError: bits other than 4.
    """
    if bits != 4:
        raise BuildError(f"MatMulNBits with bits={bits}: only 4-bit weights are read back")
    blocks = (k + block_size - 1) // block_size
    raw = packed.reshape(n, blocks, -1)
    q = np.empty((n, blocks, raw.shape[2] * 2), dtype=np.float32)
    q[:, :, 0::2] = raw & 0x0F
    q[:, :, 1::2] = raw >> 4
    scale = scales.astype(np.float32).reshape(n, blocks, 1)
    if zero_points is None:
        zero = np.float32(8.0)
    else:
        zp = zero_points.reshape(n, -1)
        both = np.empty((n, zp.shape[1] * 2), dtype=np.float32)
        both[:, 0::2] = zp & 0x0F
        both[:, 1::2] = zp >> 4
        zero = both[:, :blocks].reshape(n, blocks, 1)
    return ((q - zero) * scale).reshape(n, -1)[:, :k]


class OnnxWeights:
    """Reads the float weight behind each weight-bearing node of an ONNX graph, on demand.

    The graph is loaded without its external data; each request reads just the tensors
    of one node.
    """

    def __init__(self, model_path: str | Path) -> None:
        import onnx

        self.path = Path(model_path)
        self.model = onnx.load(str(self.path), load_external_data=False)
        self.nodes = {node.name: node for node in self.model.graph.node}
        self.initializers = {t.name: t for t in self.model.graph.initializer}

    def _array(self, name: str) -> np.ndarray:
        from onnx import TensorProto, external_data_helper, numpy_helper

        tensor = TensorProto()
        tensor.CopyFrom(self.initializers[name])
        if external_data_helper.uses_external_data(tensor):
            external_data_helper.load_external_data_for_tensor(tensor, str(self.path.parent))
            del tensor.external_data[:]
            tensor.data_location = TensorProto.DEFAULT
        return numpy_helper.to_array(tensor)

    def _attrs(self, node: Any) -> dict[str, Any]:
        import onnx

        return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    def weight(self, node_name: str) -> np.ndarray:
        """float32 weight of one node: [N, K] (= torch Linear ``weight``) for MatMul kinds,
        the [rows, columns] table for Gather kinds.

        Raises:
            BuildError: no such node, or it has no constant weight.
        """
        node = self.nodes.get(node_name)
        if node is None:
            raise BuildError(f"{self.path}: no node {node_name!r}; the graph's layout is not the one expected")
        if node.op_type == "MatMulNBits":
            a = self._attrs(node)
            zp = self._array(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            return unpack_matmul_nbits(self._array(node.input[1]), self._array(node.input[2]), zp,
                                       n=int(a["N"]), k=int(a["K"]), bits=int(a["bits"]),
                                       block_size=int(a["block_size"]))
        if node.op_type == "MatMul" and node.input[1] in self.initializers:
            return np.ascontiguousarray(self._array(node.input[1]).astype(np.float32).T)
        if node.op_type in ("Gather", "GatherBlockQuantized") and node.input[0] in self.initializers:
            return self._gather_all(node)
        raise BuildError(f"{self.path}: node {node_name!r} ({node.op_type}) has no constant weight to read back")

    def _gather_all(self, node: Any) -> np.ndarray:
        """Every row of a (possibly block-quantized) Gather, dequantized by ONNX Runtime."""
        import onnx
        import onnxruntime as ort

        inits = [self._load(n) for n in node.input if n and n in self.initializers]
        rows = int(self.initializers[node.input[0]].dims[0])
        ids = onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [rows])
        out = onnx.helper.make_tensor_value_info("table", onnx.TensorProto.FLOAT, None)
        inputs = [("ids" if i == 1 else n) for i, n in enumerate(node.input)]
        clone = onnx.helper.make_node(node.op_type, inputs, ["gathered"], domain=node.domain,
                                      **self._attrs(node))
        cast = onnx.helper.make_node("Cast", ["gathered"], ["table"], to=onnx.TensorProto.FLOAT)
        graph = onnx.helper.make_graph([clone, cast], "gather_all", [ids], [out], initializer=inits)
        model = onnx.helper.make_model(graph, opset_imports=list(self.model.opset_import))
        model.ir_version = self.model.ir_version
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {"ids": np.arange(rows, dtype=np.int64)})[0]

    def _load(self, name: str) -> Any:
        from onnx import numpy_helper

        return numpy_helper.from_array(self._array(name), name)

    def weight_nodes(self) -> list[str]:
        """Names of nodes whose second (MatMul) or first (Gather) input is a weight initializer."""
        out = []
        for node in self.model.graph.node:
            if node.op_type in ("MatMulNBits",) or (
                node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in self.initializers
            ) or (node.op_type in ("Gather", "GatherBlockQuantized") and node.input[0] in self.initializers):
                out.append(node.name)
        return out

    def modelbuilder_layer(self, layer: int, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        """Layer ``layer``'s projection weights of a ModelBuilder decoder, by Qwen3DecoderLayer name.

        Args:
            sizes: output rows of each parameter (``self_attn.q_proj.weight`` -> heads*head_dim…),
                to split fused projections.
        """
        out: dict[str, np.ndarray] = {}
        for name in self.nodes:
            match = MODELBUILDER_NODE.match(name)
            if match is None or int(match.group(1)) != layer:
                continue
            params = MODELBUILDER_PROJECTIONS.get(match.group(3))
            if params is None:
                raise BuildError(f"{self.path}: unknown ModelBuilder projection {match.group(3)!r} in {name}")
            w = self.weight(name)
            edges = np.cumsum([0, *(sizes[p] for p in params)])
            if edges[-1] != w.shape[0]:
                raise BuildError(f"{self.path}: {name} has {w.shape[0]} output rows, expected {edges[-1]}")
            for p, lo, hi in zip(params, edges[:-1], edges[1:], strict=True):
                out[p] = w[lo:hi]
        return require_projections(out, layer, self.path)


class OpenVinoWeights:
    """Reads the float weight each MatMul of an OpenVINO IR computes with, evaluated by OpenVINO."""

    def __init__(self, xml: str | Path) -> None:
        import openvino as ov

        self.xml = Path(xml)
        self.core = ov.Core()
        self.model = self.core.read_model(self.xml)
        self.matmuls = {op.get_friendly_name(): op for op in self.model.get_ops() if op.get_type_name() == "MatMul"}

    def weight_of(self, op: Any) -> np.ndarray:
        """float32 [N, K] of a MatMul whose second input is a constant (decompression) subgraph."""
        return self.weights_of([op])[0]

    def weights_of(self, ops: list[Any]) -> list[np.ndarray]:
        """float32 [N, K] of each MatMul in ``ops``, evaluated in one compiled model (one
        compilation per layer instead of one per weight: at full size the OpenVINO read-back
        compiled 252 single-weight models per pass, most of a 15-minute golden step)."""
        sources = []
        for op in ops:
            source = op.input(1).get_source_output()
            if not self._constant_only(source.get_node()):
                raise BuildError(f"{self.xml}: MatMul {op.get_friendly_name()} has no constant weight")
            sources.append(source)
        out = []
        for op, w in zip(ops, self._evaluate(sources), strict=True):
            transpose_b = op.get_attributes().get("transpose_b", False)
            out.append(np.ascontiguousarray(w if transpose_b else w.T))
        return out

    @staticmethod
    def _constant_only(node: Any, seen: set[int] | None = None) -> bool:
        seen = seen if seen is not None else set()
        if id(node) in seen:
            return True
        seen.add(id(node))
        if node.get_type_name() == "Parameter" or node.get_type_name() == "ReadValue":
            return False
        return all(OpenVinoWeights._constant_only(i.get_source_output().get_node(), seen) for i in node.inputs())

    def optimum_layer(self, layer: int) -> dict[str, np.ndarray]:
        """Layer ``layer``'s projection weights of an optimum-intel decoder IR, by Qwen3DecoderLayer name."""
        names, ops = [], []
        for name, op in self.matmuls.items():
            match = OPTIMUM_NODE.search(name)
            if match and int(match.group(1)) == layer:
                names.append(f"{match.group(2)}.{match.group(3)}.weight")
                ops.append(op)
        out = dict(zip(names, self.weights_of(ops), strict=True)) if ops else {}
        return require_projections(out, layer, self.xml)

    def _evaluate(self, sources: list[Any]) -> list[np.ndarray]:
        """The f32 values of constant subgraph outputs, computed by OpenVINO's CPU plugin."""
        import openvino as ov

        results = [ov.opset13.result(ov.opset13.convert(source, "f32")) for source in sources]
        compiled = self.core.compile_model(ov.Model(results, [], "weights"), "CPU",
                                           {"INFERENCE_PRECISION_HINT": "f32"})
        values = compiled({})
        return [values[compiled.output(i)] for i in range(len(results))]

    def single_weight(self) -> np.ndarray:
        """The one weight of a small sub-part IR: a Gather's table [rows, columns] or a
        MatMul's weight [N, K], evaluated by OpenVINO.

        Raises:
            BuildError: none or several constant weights.
        """
        found = []
        for op in self.model.get_ops():
            kind = op.get_type_name()
            if kind == "MatMul" and self._constant_only(op.input(1).get_source_output().get_node()):
                found.append(("MatMul", op))
            elif kind == "Gather" and self._constant_only(op.input(0).get_source_output().get_node()) \
                    and op.input(0).get_partial_shape().rank.get_length() == 2:
                found.append(("Gather", op))
        if len(found) != 1:
            raise BuildError(f"{self.xml}: expected one weight-bearing MatMul or Gather, found "
                             f"{[op.get_friendly_name() for _, op in found]}")
        kind, op = found[0]
        if kind == "MatMul":
            return self.weight_of(op)
        return np.ascontiguousarray(self._evaluate([op.input(0).get_source_output()])[0])
