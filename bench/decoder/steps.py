"""The bare decoder step beside llama.cpp's (issue 19): ``B`` rows stepped together after a
prefill of ``L`` positions each (:func:`time_steps`), our engine decoders and llama.cpp GGUFs
alike, each system in its own process, in turns over the rounds, each (B, L) keeping its fastest.
Records: ``"kind": "decoder_step"`` with ``rows`` of ``{batch, context, step_ms, step_ms_rounds}``
(llama.cpp also ``step_ms_no_output`` and ``over``: its step over each of ours).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common.systems import STEP_KIND, WorkerError, load_1m, ov_cache_dir, peak_rss_mb, spawn
from bench.decoder import llama_cpp
from bench.decoder.gemm import PREFILL_LENGTHS
from bench.decoder.records import base_record
from bench.decoder.workers import (
    CONTEXT_STEPS,
    PREFILL_ROUNDS,
    fastest_prefills,
    fixed_inputs,
    kv_itemsize,
    prefill_rates,
)


def default_threads() -> int:
    """CPUs this process may run on (ONNX Runtime's default pool)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def positions_needed(contexts: Sequence[int], batches: Sequence[int], steps: int, passes: int) -> int:
    """Positions row 0 reaches in :func:`time_steps`."""
    return max(contexts) + len(batches) * passes * (steps + 1) + 1


def time_steps(*, prefill: Callable[[int, int], Any], step: Callable[[range, bool], Any],
               batches: Sequence[int], contexts: Sequence[int], steps: int = CONTEXT_STEPS,
               no_output: bool = False) -> list[dict[str, Any]]:
    """Per context, ``prefill(row, L)`` every row, then per batch (ascending) one untimed and
    ``steps`` timed ``step(rows, wants_output)``: ``{batch, context, step_ms}`` (median ms) per
    (L, B), with ``no_output`` also ``step_ms_no_output``.  InputError for empty or non-positive sizes."""
    from higgs_pack.errors import InputError

    if not batches or not contexts or steps < 1 or min(batches) < 1 or min(contexts) < 1:
        raise InputError(f"batches and contexts must be non-empty and positive, steps >= 1; got {list(batches)}, "
                         f"{list(contexts)}, {steps}")
    out = []
    for length in contexts:
        for row in range(max(batches)):
            prefill(row, length)
        for batch in sorted(batches):
            rec: dict[str, Any] = {"batch": batch, "context": length}
            for key, wants in (("step_ms", True), ("step_ms_no_output", False))[: 2 if no_output else 1]:
                step(range(batch), wants)  # untimed: a new shape
                times = []
                for _ in range(steps):
                    t = time.perf_counter()
                    step(range(batch), wants)
                    times.append(time.perf_counter() - t)
                rec[key] = round(statistics.median(times) * 1e3, 4)
            out.append(rec)
    return out


def measure_our_steps(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``our_steps`` worker: a bundle's batched decoder fed the bench prompt (repeated to ``L``)
    and the BOC frame; a batch the backend refuses is a row with ``refused``.  With
    ``prefill_lengths``, also the bundle's own decoder's prefill rates (``bench.decoder.workers.
    prefill_rates``), so that a steps-only run puts ours beside llama.cpp's prompt processing."""
    import numpy as np

    import higgs_pack
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.backends import backend_of

    before, t = load_1m(), time.perf_counter()
    tts = higgs_pack.load(spec["bundle"], spec.get("device") or "auto", cache_dir=spec.get("ov_cache"))
    load_s = time.perf_counter() - t
    prompt, embed = fixed_inputs(tts.pipeline, spec["text"])
    prompt = prompt[0]
    batches, contexts, steps = list(spec["batches"]), list(spec["contexts"]), int(spec["steps"])
    length = positions_needed(contexts, batches, steps, 1)
    backend = backend_of(tts.bundle.manifest)
    refused: dict[int, str] = {}
    try:
        decoder = backend.batched_decoder(tts.pipeline, max(batches), length)
    except InputError as exc:
        refused = {b: str(exc) for b in batches if b > 1}
        decoder = backend.batched_decoder(tts.pipeline, 1, length)
    usable = [b for b in batches if b not in refused]
    rows = time_steps(
        prefill=lambda row, n: decoder.prefill(row, np.resize(prompt, (n, prompt.shape[-1]))[None]),
        step=lambda rs, _out: decoder.step(np.arange(len(rs)), np.repeat(embed, len(rs), axis=0)),
        batches=usable, contexts=contexts, steps=steps) if usable else []
    rows += [{"batch": b, "context": n, "refused": why} for b, why in refused.items() for n in contexts]
    lengths = list(spec.get("prefill_lengths", ()))
    prefill = prefill_rates(tts.pipeline.decoder, prompt[None], lengths,
                            int(spec.get("prefill_rounds", PREFILL_ROUNDS))) if lengths else {}
    return {"rows": rows, **prefill, "kv_itemsize": kv_itemsize(tts.pipeline.decoder), "load_s": round(load_s, 3),
            "loadavg": [before, load_1m()], "peak_rss_mb": peak_rss_mb()}


def measure_llama_steps(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``llama_steps`` worker: a GGUF's step on random token ids, with and without output."""
    import numpy as np

    before = load_1m()
    batches, contexts, steps = list(spec["batches"]), list(spec["contexts"]), int(spec["steps"])
    t = time.perf_counter()
    lengths = list(spec.get("prefill_lengths", PREFILL_LENGTHS))
    dec = llama_cpp.LlamaDecoder(Path(spec["gguf"]), max_batch=max(batches),
                                 max_length=max(positions_needed(contexts, batches, steps, 2), max(lengths, default=0) + 1),
                                 threads=int(spec["threads"]))
    load_s = time.perf_counter() - t
    ids = np.random.default_rng(spec.get("seed", 0)).integers(
        0, min(dec.n_vocab, 150000), size=max(*contexts, *lengths) + 2 * steps + 4).tolist()
    try:
        rows = time_steps(prefill=lambda row, length: dec.prefill(row, ids[:length]),
                          step=lambda rows, out: dec.step(list(rows), ids[:len(rows)], logits=out),
                          batches=batches, contexts=contexts, steps=steps, no_output=True)
        # llama.cpp's own prompt processing (llama_decode in batches of 512, logits of the last
        # position only, as llama-bench's pp) into sequence 0, emptied first
        prefill = fastest_prefills(lambda n: lambda: dec.prefill(0, ids[:n]), lengths,
                                   int(spec.get("prefill_rounds", PREFILL_ROUNDS)))
        dims = dec.dims()
    finally:
        dec.close()
    return {"rows": rows, "dims": dims, **prefill, "system_info": llama_cpp.system_info(), "threads": int(spec["threads"]),
            "load_s": round(load_s, 3), "loadavg": [before, load_1m()], "peak_rss_mb": peak_rss_mb()}


def merge_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (batch, context) the fastest round's ``step_ms`` (and ``step_ms_no_output``), every
    round's in ``<field>_rounds``; ValueError when the rounds hold other rows."""
    keyed = [{(r["batch"], r["context"]): r for r in run["rows"]} for run in runs]
    if any(k.keys() != keyed[0].keys() for k in keyed):
        raise ValueError("the rounds measured different (batch, context) rows")
    out = []
    for key, first in sorted(keyed[0].items()):
        row = dict(first) if "refused" in first else {"batch": key[0], "context": key[1]}
        for field in ("step_ms", "step_ms_no_output"):
            if field in first and "refused" not in first:
                values = [k[key][field] for k in keyed]
                row.update({field: min(values), field + "_rounds": values})
        out.append(row)
    return out


def fastest_prefill(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per length the fastest round's ``prefill_positions_per_s`` and ``prefill_ms_by_length``
    (none when the runs have no prefill)."""
    if not any(run.get("prefill_positions_per_s") for run in runs):
        return {}
    lengths = {n for run in runs for n in run.get("prefill_positions_per_s", {})}
    best = {n: max(run["prefill_positions_per_s"][n] for run in runs if n in run.get("prefill_positions_per_s", {}))
            for n in sorted(lengths, key=int)}
    return {"prefill_positions_per_s": best, "prefill_ms_by_length": {n: round(int(n) / v * 1e3, 1)
                                                                      for n, v in best.items()}}


def add_step_ratios(records: list[dict[str, Any]]) -> None:
    """In place: each llama.cpp row's ``over`` (and ``over_no_output``) = {our label: its step over ours}."""
    ours = [r for r in records if r.get("backend") != "llama.cpp" and "rows" in r]
    for rec in (r for r in records if r.get("backend") == "llama.cpp" and "rows" in r):
        for row in rec["rows"]:
            for field, name in (("step_ms", "over"), ("step_ms_no_output", "over_no_output")):
                if field in row:
                    row[name] = {}
                    for other in ours:
                        match = next((o for o in other["rows"] if (o["batch"], o["context"]) ==
                                      (row["batch"], row["context"]) and "step_ms" in o), None)
                        if match:
                            row[name][other["label"]] = round(row[field] / match["step_ms"], 3)


def run_step_comparison(llama: list[Any], ours: list[tuple[Any, Path, dict[str, Any]]], checkpoint: Path,
                        cache: Path, *, preset: str, contexts: Sequence[int], batches: Sequence[int],
                        rounds: int, text: str, machine: dict[str, Any], threads: int | None = None,
                        timeout: float | None = None, say: Callable[[str], None] = lambda _m: None,
                        prefill_lengths: Sequence[int] = PREFILL_LENGTHS, extra: dict[str, Any] | None = None
                        ) -> list[dict[str, Any]]:
    """Convert (or reuse) the GGUFs of the llama.cpp systems, then time ours (``(spec, bundle,
    manifest)``) and theirs in turns; one ``decoder_step`` record each (a failure: ``error``), with
    each system's prefill (llama.cpp's own prompt processing) at ``prefill_lengths`` and ``extra``
    (the run's GEMM peak)."""
    from higgs_pack.errors import HiggsPackError

    threads = threads or default_threads()
    common = {"contexts": list(contexts), "batches": list(batches), "steps": CONTEXT_STEPS, "text": text,
              "prefill_lengths": list(prefill_lengths), "prefill_rounds": 1}  # the rounds are the workers'
    records: list[dict[str, Any]] = []
    jobs: list[tuple[str, dict[str, Any]] | None] = []
    for spec, path, manifest in ours:
        records.append({**base_record(manifest, spec, preset), "kind": STEP_KIND, "machine": machine, **(extra or {})})
        jobs.append(("our_steps", {**common, "bundle": str(path), "device": spec.device,
                                   "ov_cache": str(ov_cache_dir(cache, path, spec))}))
    missing, ggufs = llama_cpp.llama_cpp_missing(), {}
    if llama and not missing:
        try:
            ggufs = llama_cpp.ensure_ggufs(checkpoint, cache, [s.precision for s in llama], threads=threads, log=say)
        except HiggsPackError as exc:
            missing = f"conversion: {exc}"
    for spec in llama:
        rec = {"kind": STEP_KIND, "system": "llama.cpp", "label": spec.label, "precision": spec.precision,
               "preset": preset, "backend": "llama.cpp", "device": "cpu", "machine": machine, "threads": threads,
               **(extra or {})}
        records.append(rec)
        if missing:
            rec["error"] = missing
            jobs.append(None)
            continue
        q = ggufs["quants"][spec.precision]
        rec.update({"llama_cpp_python": ggufs["version"], "llama_cpp_commit": ggufs.get("llama_cpp_commit"),
                    "gguf": q["path"], "conversion": {k: v for k, v in ggufs.items() if k in ("float", "cached")},
                    **{k: v for k, v in q.items() if k != "path"}, "decoder_weight_mb": q["decoder_bytes"] / 1e6})
        jobs.append(("llama_steps", {**common, "gguf": q["path"], "threads": threads}))
    runs: list[list[dict[str, Any]]] = [[] for _ in records]
    live = [i for i, job in enumerate(jobs) if job is not None]
    for r in range(max(1, rounds)):
        for i in live[r % len(live):] + live[: r % len(live)] if live else []:
            if "error" in records[i]:
                continue
            say(f"timing the decoder step of {records[i]['label']} (round {r + 1}/{rounds})")
            try:
                runs[i].append(spawn(*jobs[i], cache=cache, timeout=timeout))
            except (WorkerError, subprocess.TimeoutExpired) as exc:
                records[i]["error"] = str(exc)
    for rec, got in zip(records, runs, strict=True):
        if "error" not in rec and got:
            rec.update({"rows": merge_rounds(got), "loadavg": [x for run in got for x in run["loadavg"]],
                        "peak_rss_mb": max(run["peak_rss_mb"] for run in got),
                        "load_s": min(run["load_s"] for run in got), **fastest_prefill(got),
                        **{k: got[0][k] for k in ("dims", "system_info", "kv_itemsize") if k in got[0]}})
    add_step_ratios(records)
    return records
