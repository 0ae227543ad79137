"""The decoder and system benchmark (``python -m bench``, ``nox -s bench``): systems measured in
their own processes (workers.py), the engine at several batch sizes (batch.py), the bare decoder
step beside llama.cpp's (steps.py, llama_cpp.py), GEMM peaks (gemm.py), the stateful codec
streamed (stream_codec.py), the records and goals (records.py) and their tables (report.py)."""
