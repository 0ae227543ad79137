"""The benchmark of higgs-pack: a folder of the checkout, not part of the wheel (nothing in the
package imports it).  Run it from the repository root: ``python -m bench`` (:mod:`bench.cli`,
``nox -s bench``), ``python -m bench.serve_load`` (``nox -s serve-bench``) and
``python -m bench.ab`` (decoder settings side by side).

Rooms, each importing only those before it: :mod:`~bench.systems` (names, defaults, goals,
the worker process, shared helpers); :mod:`~bench.workers` (one system measured in its own
process); :mod:`~bench.records` (ratios, goals, tables, JSON); :mod:`~bench.batch` (the engine
at several batch sizes, ``--fit-run``); :mod:`~bench.llama_cpp` and :mod:`~bench.decoder_steps`
(the bare decoder step beside llama.cpp's); :mod:`~bench.report` (``dist/bench.html``);
:mod:`~bench.run` (one run); :mod:`~bench.cli`; the load test (:mod:`~bench.serve_checks`,
:mod:`~bench.serve_workers`, :mod:`~bench.serve_report`, :mod:`~bench.serve_load`); and
:mod:`~bench.ab`.
"""
