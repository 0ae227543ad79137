"""The ONNX Runtime backend (cpu, cuda, dml and the OpenVINO execution provider)."""
