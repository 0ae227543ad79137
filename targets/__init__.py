"""Target declarations (cpu, cuda, dml, openvino), their registry and the build loop."""
