"""ONNX exporters: the decoder through ModelBuilder (modelbuilder.py, its quantized KV cache in
kv_quantization.py, the streamed int4 pass in matmul_nbits.py), the small sub-parts through Olive
(olive.py), and what an ONNX file declares (graphs.py).

Imports of the ``onnx`` package in these modules are absolute, so they reach the real package;
the room is never imported by name (``from higgs_pack.exporters import onnx``), which would
hide it (tests/test_import_direction.py checks)."""
