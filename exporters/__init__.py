"""Exporters: checkpoint reading, PyTorch sub-part modules, ModelBuilder, Olive and OpenVINO."""
