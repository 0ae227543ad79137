"""Exporters, in rooms: checkpoint/ (reading and writing checkpoints), pytorch/ (the sub-part
modules and the oracle), onnx/ (ModelBuilder, Olive) and openvino/; at the root what every
exporter shares: catalog.py (the data-only table of exporters), result.py (what an exporter
returns), process.py (heavy steps in child processes) and space.py (disk space per exporter)."""
