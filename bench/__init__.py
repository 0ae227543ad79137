"""The benchmark of higgs-pack, a folder of the checkout (not in the wheel), one room per tool:

* ``decoder/``: the decoder and system benchmark, ``python -m bench`` (``nox -s bench``): the
  PyTorch reference and built bundles side by side, the engine at several batch sizes, the bare
  decoder step beside llama.cpp's, GEMM peaks, the stateful codec streamed
  (``python -m bench.decoder.stream_codec``);
* ``serving/``: ``higgs-pack serve`` measured from outside, ``python -m bench.serving.load``
  (``nox -s serve-bench``), ``python -m bench.serving.agent`` (``nox -s agent-bench``) and
  ``python -m bench.serving.formats``;
* ``ab/``: settings side by side, ``python -m bench.ab {ort-int4,...}`` and
  ``python -m bench.ab.paged``;
* ``common/``: what every tool shares: the machine, memory and CPU readings, the system names and
  worker processes (systems.py), the goals' states, the JSON file and the HTML pieces (report.py).

Rooms import ``common/``; ``serving/`` and ``ab/`` may also import ``decoder/`` (bundles built
for a preset, the batch worker, the GEMM micro-benchmark); ``decoder/`` imports neither.
"""
