"""Settings side by side on this machine: ``python -m bench.ab`` (settings.py: ONNX Runtime int4
and KV-cache options, OpenVINO properties; and the tools it runs: rolling.py, long_text.py and the
decoder room's GEMM peaks) and ``python -m bench.ab.paged`` (paged.py: OpenVINO's paged engine
at two settings, and its u8 cache against an f32 one)."""
