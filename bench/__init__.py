"""The benchmark of higgs-pack, a folder of the checkout (not in the wheel): ``python -m bench``,
``python -m bench.serve_load`` and ``python -m bench.ab``.  Each room imports only those before
it: systems, gemm, workers, batch, stream_codec, llama_cpp, records, decoder_steps, report, run;
serve_checks, serve_live, serve_workers, serve_report, serve_load; rolling, long_text, ab.
"""
