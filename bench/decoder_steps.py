"""The bare decoder step side by side with llama.cpp (issue 19): ``B`` rows stepped together
after a prefill of ``L`` positions each, for our bundles (their engine's batched decoder,
:meth:`~higgs_pack.runtime.backends.Backend.batched_decoder`: ``BatchedOrtDecoder`` on a cpu
bundle) and for llama.cpp GGUFs (:class:`~bench.llama_cpp.LlamaDecoder`),
in one run.

Protocol (:func:`time_steps`, the same for every system): per context ``L``, every row is
prefilled with ``L`` positions, then per batch ``B`` (ascending) one untimed step of rows
``0..B-1`` and :data:`~bench.systems.CONTEXT_STEPS` timed ones (median
reported); row 0 grows by the steps of the smaller batches first (a few positions).  Every
system runs in its own process (``our_steps`` / ``llama_steps`` workers), the systems take
turns over :data:`~bench.systems.CONTEXT_ROUNDS` rounds (the order rotated
every round) and each (B, L) keeps its fastest round, as ``--rounds`` does for the loop.

Records (``"kind": "decoder_step"``, one per system) carry ``rows`` of ``{batch, context,
step_ms, step_ms_rounds}`` (llama.cpp also ``step_ms_no_output``), the weight bytes, the
threads, the load average and the machine; each llama.cpp row has ``over`` = llama.cpp's
step over each of our systems' at the same (B, L) (above 1: ours is faster).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import llama_cpp
from bench.records import base_record
from bench.systems import (
    CONTEXT_STEPS,
    WorkerError,
    load_average,
    ov_cache_dir,
    peak_rss_mb,
    spawn,
    table,
)
from bench.workers import kv_itemsize

#: The record kind.
KIND = "decoder_step"


def default_threads() -> int:
    """CPUs this process may run on (ONNX Runtime's default pool: one thread per core here)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def positions_needed(contexts: Sequence[int], batches: Sequence[int], steps: int, passes: int) -> int:
    """Positions row 0 reaches in :func:`time_steps`: the longest prefill plus ``passes`` runs of
    ``steps + 1`` steps per batch size, plus one."""
    return max(contexts) + len(batches) * passes * (steps + 1) + 1


def time_steps(*, prefill: Callable[[int, int], Any], step: Callable[[range, bool], Any],
               batches: Sequence[int], contexts: Sequence[int], steps: int = CONTEXT_STEPS,
               no_output: bool = False) -> list[dict[str, Any]]:
    """Time the decode step of ``B`` rows at each context (the module's protocol).

    Args:
        prefill: ``prefill(row, L)`` starts row ``row`` over with ``L`` positions.
        step: ``step(rows, wants_output)`` advances every row of ``rows`` by one position
            in one call.
        batches: batch sizes (the rows ``0..B-1``), each >= 1.
        contexts: prefill lengths, each >= 1.
        steps: timed steps per (B, L), >= 1.
        no_output: also time ``steps`` steps with ``wants_output`` false (``step_ms_no_output``).

    Returns:
        One dict per (L, B): ``batch``, ``context``, ``step_ms`` (median ms of one step of all
        B rows) and, with ``no_output``, ``step_ms_no_output``.

    Raises:
        InputError: an empty or non-positive batch, context or step count.
    """
    from higgs_pack.manifests.errors import InputError

    if not batches or not contexts or steps < 1 or min(batches) < 1 or min(contexts) < 1:
        raise InputError(f"batches and contexts must be non-empty and positive, steps >= 1; got {list(batches)}, "
                         f"{list(contexts)}, {steps}")
    out = []
    for length in contexts:
        for row in range(max(batches)):
            prefill(row, length)
        for batch in sorted(batches):
            rows = range(batch)
            rec: dict[str, Any] = {"batch": batch, "context": length}
            for key, wants in (("step_ms", True), ("step_ms_no_output", False))[: 2 if no_output else 1]:
                step(rows, wants)  # untimed: a new shape
                times = []
                for _ in range(steps):
                    t = time.perf_counter()
                    step(rows, wants)
                    times.append(time.perf_counter() - t)
                rec[key] = round(statistics.median(times) * 1e3, 4)
            out.append(rec)
    return out


def measure_our_steps(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``our_steps`` worker: one bundle's bare batched decoder at every batch and context.

    The rows are fed the bench prompt's embeddings (repeated to ``L`` positions) and the
    audio embedding of the BOC frame, as the loop's bare-decoder timings are; a batch the
    backend refuses (OpenVINO above 1) is a row with ``refused`` (its reason).

    Args:
        spec: ``bundle``, ``device``, ``ov_cache``, ``text``, ``batches``, ``contexts``, ``steps``.

    Returns:
        ``{"rows", "kv_itemsize", "load_s", "loadavg" (before, after), "peak_rss_mb"}``.
    """
    import numpy as np

    import higgs_pack
    from higgs_pack.manifests.errors import InputError
    from higgs_pack.runtime.backends import backend_of
    from higgs_pack.runtime.loop.generate import build_prompt

    before = load_average()
    t = time.perf_counter()
    tts = higgs_pack.load(spec["bundle"], spec.get("device") or "auto", cache_dir=spec.get("ov_cache"))
    load_s = time.perf_counter() - t
    pipeline, c = tts.pipeline, tts.pipeline.constants
    prompt = build_prompt(pipeline, spec["text"]).astype(np.float32)[0]
    embed = pipeline.audio_embed.run({"codes": np.full((1, 1, c.num_codebooks), c.boc, dtype=np.int64)})
    embed = np.array(embed["audio_embeds"], dtype=np.float32, copy=True)
    batches, contexts, steps = list(spec["batches"]), list(spec["contexts"]), int(spec["steps"])
    length = positions_needed(contexts, batches, steps, 1)
    backend = backend_of(tts.bundle.manifest)
    refused: dict[int, str] = {}
    try:
        decoder = backend.batched_decoder(pipeline, max(batches), length)
    except InputError as exc:
        refused = {b: str(exc) for b in batches if b > 1}
        decoder = backend.batched_decoder(pipeline, 1, length)
    usable = [b for b in batches if b not in refused]
    rows: list[dict[str, Any]] = []
    if usable:
        rows = time_steps(
            prefill=lambda row, n: decoder.prefill(row, np.resize(prompt, (n, prompt.shape[-1]))[None]),
            step=lambda rs, _out: decoder.step(np.arange(len(rs)), np.repeat(embed, len(rs), axis=0)),
            batches=usable, contexts=contexts, steps=steps)
    rows += [{"batch": b, "context": n, "refused": why} for b, why in refused.items() for n in contexts]
    return {"rows": rows, "kv_itemsize": kv_itemsize(pipeline.decoder), "load_s": round(load_s, 3),
            "loadavg": [before, load_average()], "peak_rss_mb": peak_rss_mb()}


def merge_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (batch, context): the fastest round's ``step_ms`` (and ``step_ms_no_output``), every
    round's in ``<field>_rounds``; refused rows kept once.

    Raises:
        ValueError: the rounds do not hold the same (batch, context) rows.
    """
    keyed = [{(r["batch"], r["context"]): r for r in run["rows"]} for run in runs]
    if any(k.keys() != keyed[0].keys() for k in keyed):
        raise ValueError("the rounds measured different (batch, context) rows")
    out = []
    for key, first in sorted(keyed[0].items()):
        if "refused" in first:
            out.append(dict(first))
            continue
        row = {"batch": key[0], "context": key[1]}
        for field in ("step_ms", "step_ms_no_output"):
            if field in first:
                values = [k[key][field] for k in keyed]
                row[field] = min(values)
                row[field + "_rounds"] = values
        out.append(row)
    return out


def add_step_ratios(records: list[dict[str, Any]]) -> None:
    """In place: every llama.cpp record's rows get ``over`` = {our label: llama.cpp's step_ms
    over ours at the same (batch, context)} (and ``over_no_output`` from ``step_ms_no_output``)."""
    ours = [r for r in records if r.get("backend") != "llama.cpp" and "rows" in r]
    for rec in records:
        if rec.get("backend") != "llama.cpp" or "rows" not in rec:
            continue
        for row in rec["rows"]:
            for field, name in (("step_ms", "over"), ("step_ms_no_output", "over_no_output")):
                if field not in row:
                    continue
                row[name] = {}
                for other in ours:
                    match = next((o for o in other["rows"] if o["batch"] == row["batch"]
                                  and o["context"] == row["context"] and "step_ms" in o), None)
                    if match:
                        row[name][other["label"]] = round(row[field] / match["step_ms"], 3)


def run_step_comparison(llama: list[Any], ours: list[tuple[Any, Path, dict[str, Any]]], checkpoint: Path,
                        cache: Path, *, preset: str, contexts: Sequence[int], batches: Sequence[int],
                        rounds: int, text: str, machine: dict[str, Any], threads: int | None = None,
                        timeout: float | None = None, say: Callable[[str], None] = lambda _m: None
                        ) -> list[dict[str, Any]]:
    """Convert (or reuse) the GGUFs, then time every system's step in turns; one record each.

    Args:
        llama: the llama.cpp ``SystemSpec``s (``precision`` = the quant).
        ours: ``(spec, bundle path, manifest)`` of our bundles to time beside them.
        checkpoint: the checkpoint the bundles were built from (and the GGUFs are made from).
        cache: the bench cache (GGUFs in ``cache/llama.cpp/``).
        rounds: turns over the systems (each (B, L) keeps its fastest).
        threads: llama.cpp threads (default: :func:`default_threads`, ONNX Runtime's own count).

    Returns:
        ``"kind": "decoder_step"`` records (a failed system: ``error`` and no rows).
    """
    from higgs_pack.manifests.errors import HiggsPackError

    threads = threads or default_threads()
    common = {"contexts": list(contexts), "batches": list(batches), "steps": CONTEXT_STEPS, "text": text}
    records, jobs = [], []
    for spec, path, manifest in ours:
        rec = {**base_record(manifest, spec, preset), "kind": KIND, "machine": machine}
        records.append(rec)
        jobs.append(("our_steps", {**common, "bundle": str(path), "device": spec.device,
                                   "ov_cache": str(ov_cache_dir(cache, path, spec))}))
    missing = llama_cpp.llama_cpp_missing()
    ggufs: dict[str, Any] = {}
    if llama and not missing:
        try:
            ggufs = llama_cpp.ensure_ggufs(checkpoint, cache, [s.precision for s in llama], threads=threads, log=say)
        except HiggsPackError as exc:
            missing = f"conversion: {exc}"
    for spec in llama:
        rec = {"kind": KIND, "system": "llama.cpp", "label": spec.label, "precision": spec.precision,
               "preset": preset, "backend": "llama.cpp", "device": "cpu", "machine": machine, "threads": threads}
        if missing:
            rec["error"] = missing
            records.append(rec)
            jobs.append(None)
            continue
        q = ggufs["quants"][spec.precision]
        rec.update({"llama_cpp_python": ggufs["version"], "llama_cpp_commit": ggufs.get("llama_cpp_commit"),
                    "gguf": q["path"], "conversion": {k: v for k, v in ggufs.items() if k in ("float", "cached")},
                    **{k: v for k, v in q.items() if k != "path"}})
        rec["decoder_weight_mb"] = q["decoder_bytes"] / 1e6
        records.append(rec)
        jobs.append(("llama_steps", {**common, "gguf": q["path"], "threads": threads}))
    runs: list[list[dict[str, Any]]] = [[] for _ in records]
    live = [i for i, job in enumerate(jobs) if job is not None]
    for r in range(max(1, rounds)):
        for i in live[r % len(live):] + live[: r % len(live)] if live else []:
            if "error" in records[i]:
                continue
            task, job = jobs[i]
            say(f"timing the decoder step of {records[i]['label']} (round {r + 1}/{rounds})")
            try:
                runs[i].append(spawn(task, job, cache=cache, timeout=timeout))
            except (WorkerError, subprocess.TimeoutExpired) as exc:
                records[i]["error"] = str(exc)
    for rec, got in zip(records, runs, strict=True):
        if "error" in rec or not got:
            continue
        rec["rows"] = merge_rounds(got)
        rec["loadavg"] = [x for run in got for x in run["loadavg"]]
        rec["peak_rss_mb"] = max(run["peak_rss_mb"] for run in got)
        rec["load_s"] = min(run["load_s"] for run in got)
        for key in ("dims", "system_info", "kv_itemsize"):
            if key in got[0]:
                rec[key] = got[0][key]
    add_step_ratios(records)
    return records


def step_table_rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the side-by-side table: one row per (batch, context), one column per
    system's ``step_ms`` (llama.cpp also without output) and one per llama.cpp-over-ours ratio."""
    measured = [r for r in records if r.get("kind") == KIND and r.get("rows")]
    keys = sorted({(row["batch"], row["context"]) for r in measured for row in r["rows"]})
    ours = [r for r in measured if r.get("backend") != "llama.cpp"]
    llama = [r for r in measured if r.get("backend") == "llama.cpp"]
    headers = ["B", "ctx"] + [f"{r['label']} ms" for r in ours]
    for r in llama:
        headers += [f"{r['label']} ms", f"{r['label']} no-out ms"] + [f"{r['label']}/{o['label']}" for o in ours]
    rows = []
    for batch, context in keys:
        def cell(rec: dict[str, Any], field: str, b: int = batch, n: int = context) -> str:
            row = next((x for x in rec["rows"] if x["batch"] == b and x["context"] == n), {})
            if "refused" in row:
                return "refused"
            value = row.get(field)
            return f"{value:.2f}" if isinstance(value, (int, float)) else "-"

        line = [str(batch), str(context)] + [cell(r, "step_ms") for r in ours]
        for r in llama:
            row = next((x for x in r["rows"] if x["batch"] == batch and x["context"] == context), {})
            line += [cell(r, "step_ms"), cell(r, "step_ms_no_output")]
            line += [f"{row['over'][o['label']]:.2f}x" if o["label"] in row.get("over", {}) else "-" for o in ours]
        rows.append(line)
    return headers, rows


def step_facts(records: list[dict[str, Any]]) -> list[str]:
    """One line per system: weights, threads, versions, load average (or its error)."""
    lines = []
    for r in (r for r in records if r.get("kind") == KIND):
        if "error" in r:
            lines.append(f"{r['label']} [{r['preset']}]: ERROR {r['error']}")
            continue
        load = [x for x in r.get("loadavg", []) if x is not None]
        load_text = f"load average {min(load):.2f}-{max(load):.2f}" if load else "load average unknown"
        if r.get("backend") == "llama.cpp":
            conv = (r.get("conversion") or {}).get("float") or {}
            lines.append(
                f"{r['label']} [{r['preset']}]: llama-cpp-python {r['llama_cpp_python']} (llama.cpp "
                f"{r.get('llama_cpp_commit')}), {r['threads']} threads, decoder layers {r['decoder_bytes'] / 1e6:.1f} MB "
                f"+ text head {r['head_tensor']} {r['head_type']} {r['head_bytes'] / 1e6:.1f} MB (run on every "
                f"row that asks for logits), GGUF {r['gguf_bytes'] / 1e6:.1f} MB; dims {r.get('dims')}; converter "
                f"{conv.get('convert_s')} s, peak RSS {conv.get('convert_peak_rss_mb')} MiB (anon "
                f"{conv.get('convert_peak_anon_mb')})"
                f"{' (cached)' if (r.get('conversion') or {}).get('cached') else ''}; {load_text}")
        else:
            lines.append(f"{r['label']} [{r['preset']}]: decoder weights {r.get('decoder_weight_mb', 0):.1f} MB, "
                         f"KV itemsize {r.get('kv_itemsize')}, ONNX Runtime/OpenVINO default threads; {load_text}")
    return lines


def render_steps(records: list[dict[str, Any]]) -> str:
    """The step comparison as a text table and its facts; empty without such records."""
    mine = [r for r in records if r.get("kind") == KIND]
    if not mine:
        return ""
    headers, rows = step_table_rows(mine)
    presets = sorted({r["preset"] for r in mine})
    text = table(f"decoder step (ms), ours beside llama.cpp, preset {', '.join(presets)}", headers, rows) if rows else ""
    return (text + "\n" + "\n".join(step_facts(mine))).strip("\n")


def measure_llama_steps(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``llama_steps`` worker: one GGUF's decode step at every batch and context.

    Args:
        spec: ``gguf`` (path), ``batches``, ``contexts``, ``steps``, ``threads``, ``seed``.

    Returns:
        ``{"rows": [{batch, context, step_ms, step_ms_no_output}], "dims", "system_info",
        "threads", "load_s", "loadavg" (before, after), "peak_rss_mb"}``
        (:func:`time_steps`).
    """
    import numpy as np

    before = load_average()
    batches, contexts, steps = list(spec["batches"]), list(spec["contexts"]), int(spec["steps"])
    t = time.perf_counter()
    dec = llama_cpp.LlamaDecoder(Path(spec["gguf"]), max_batch=max(batches), max_length=positions_needed(contexts, batches, steps, 2), threads=int(spec["threads"]))
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(spec.get("seed", 0))
    ids = rng.integers(0, min(dec.n_vocab, 150000), size=max(contexts) + 2 * steps + 4).tolist()
    try:
        rows = time_steps(
            prefill=lambda row, length: dec.prefill(row, ids[:length]),
            step=lambda rows, out: dec.step(list(rows), ids[:len(rows)], logits=out),
            batches=batches, contexts=contexts, steps=steps, no_output=True)
        dims = dec.dims()
    finally:
        dec.close()
    return {"rows": rows, "dims": dims, "system_info": llama_cpp.system_info(), "threads": int(spec["threads"]),
            "load_s": round(load_s, 3), "loadavg": [before, load_average()], "peak_rss_mb": peak_rss_mb()}
