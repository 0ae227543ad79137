"""The native OpenVINO backend (OpenVINO IR on CPU, GPU and NPU devices)."""
