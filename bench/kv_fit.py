"""The largest batch whose KV cache fits the memory budget, run rather than only computed.

:func:`~bench.records.batch_memory` computes ``fit_max_batch``, the most
rows whose KV cache at :data:`~bench.systems.FIT_POSITIONS` positions
fits :data:`~bench.systems.FIT_MEMORY_BYTES` beside the bundle's weights.
That arithmetic leaves out what a real process also holds (activations, the codec, the
runtime's own buffers, allocator slack).  ``--fit-run`` checks it: a fresh process loads
the whole bundle, opens the engine's batched decoder with that many rows of that many
positions, writes every position of every row's KV buffers (so every page is committed,
as it would be once the requests reach that length), and runs decode steps with every row
at its last positions.  Its peak resident memory (VmHWM, the whole process) is then judged
against the budget.

Only decoders whose KV cache is host memory the runtime owns can be filled this way (ONNX
Runtime's :class:`~higgs_pack.runtime.backends.onnxruntime.batched.BatchedOrtDecoder`); an
OpenVINO cache lives inside the plugin, which allocates it as positions are computed, so
its fit stays computed (the record says why).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

#: Decode steps timed once every row is full.
FIT_STEPS = 3


def fill_kv(decoder: Any, length: int, seed: int = 0) -> None:
    """Write ``length`` positions of every row of a batched decoder's KV buffers and mark the
    rows as holding them, as if each row had been prefilled with a ``length``-position prompt.

    Args:
        decoder: a :class:`~higgs_pack.runtime.backends.onnxruntime.batched.BatchedOrtDecoder`.
        length: positions per row (1 <= length < decoder.max_length).
        seed: seed of the values written (small normal floats; uniform integers for an
            int8/uint8 cache).

    Raises:
        ValueError: ``length`` out of range, or a decoder without host KV buffers.
    """
    kv = getattr(decoder, "kv", None)
    if not isinstance(kv, dict) or not kv or not hasattr(decoder, "lengths"):
        raise ValueError(f"{type(decoder).__name__} keeps no host KV buffers this bench can fill")
    if not 1 <= length < decoder.max_length:
        raise ValueError(f"length must be in 1..{decoder.max_length - 1}, got {length}")
    rng = np.random.default_rng(seed)
    for buffer in kv.values():
        for row in range(buffer.shape[0]):  # a row at a time: no second copy of the whole cache
            part = buffer[row, :, :length]
            if np.issubdtype(buffer.dtype, np.integer):
                info = np.iinfo(buffer.dtype)
                part[...] = rng.integers(info.min, info.max, size=part.shape, dtype=buffer.dtype, endpoint=True)
            else:
                part[...] = rng.standard_normal(part.shape, dtype=np.float32) * 0.1
    decoder.lengths[:] = length


def fit_run(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``fit`` worker: load the bundle, fill ``spec["batch"]`` rows of ``spec["positions"]``
    positions, run :data:`FIT_STEPS` decode steps with every row busy.

    Args:
        spec: the bench worker's spec (``bundle``, ``backend``, ``device``, ``ov_cache``) plus
            ``batch`` (rows, >= 1) and ``positions`` (positions per row, >= 2).

    Returns:
        ``{"fit_run_batch", "fit_run_positions", "fit_run_kv_bytes" (bytes the rows' KV holds),
        "fit_run_step_ms" (median step, all rows), "fit_run_peak_rss_mb" (this process, whole
        run), "fit_run_load_rss_mb" (after loading the bundle, before the KV)}``, or
        ``{"fit_run_skipped": reason}`` for a decoder whose cache this bench cannot fill.
    """
    from bench.workers import _load_bundle, _peak_rss_mb, _rss_now_mb
    from higgs_pack.runtime.backends import registered

    batch, positions = int(spec["batch"]), int(spec["positions"])
    pipeline, _ = _load_bundle(spec)
    load_rss = _rss_now_mb()
    try:
        decoder = registered()[spec["backend"]].batched_decoder(pipeline, batch, positions + FIT_STEPS)
    except Exception as exc:  # a backend that does not batch says why
        return {"fit_run_skipped": f"{type(exc).__name__}: {exc}"}
    if not isinstance(getattr(decoder, "kv", None), dict):
        return {"fit_run_skipped": f"{type(decoder).__name__} keeps its KV cache inside the runtime (it is "
                                   "allocated as positions are computed): the fit is computed only"}
    if not decoder.kv:
        return {"fit_run_skipped": f"{type(decoder).__name__}'s KV cache is in {decoder.kv_device} memory, "
                                   "allocated whole: the fit is computed only"}
    fill_kv(decoder, positions - 1)
    rows = np.arange(batch)
    embeds = np.random.default_rng(1).standard_normal((batch, 1, decoder.hidden_size), dtype=np.float32) * 0.1
    times = []
    for _ in range(FIT_STEPS):
        t0 = time.perf_counter()
        decoder.step(rows, embeds)
        times.append(time.perf_counter() - t0)
    return {"fit_run_batch": batch, "fit_run_positions": positions,
            "fit_run_kv_bytes": int(decoder.positions_held) * int(decoder.kv_bytes_per_position),
            "fit_run_step_ms": float(np.median(times) * 1e3), "fit_run_peak_rss_mb": round(_peak_rss_mb(), 1),
            "fit_run_load_rss_mb": None if load_rss is None else round(load_rss, 1)}
