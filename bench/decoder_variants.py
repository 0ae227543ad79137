"""Decoder variants exported the way ``higgs-pack build`` exports them, for the side-by-side
settings measurements (:mod:`.ov_properties` for OpenVINO, :mod:`.ort_int4_options` for
ONNX Runtime).

A variant is a name and the decoder exporter options a build variant lays over the target's
recipe (NNCF ``symmetric``/``group_size`` for openvino, ModelBuilder ``extra_options`` for
cpu); :data:`REFERENCE` (``fp32``) is the target's fp32 decoder, the parity reference.
Every export runs in a child process (:func:`higgs_pack.exporters.process.run_step`), so
the measuring process never holds an exporter's memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from higgs_pack.manifests.constants import SubPart

#: The name of the fp32 decoder every variant's hidden states are compared with.
REFERENCE = "fp32"


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none), recorded before
    and after each measurement: a busy shared machine shows there."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


@contextlib.contextmanager
def work_folder(work: Path | None, prefix: str) -> Iterator[Path]:
    """The folder the decoders are exported to: ``work`` (created if missing, kept, its
    exports reused by later runs) or, when None, a scratch folder in the system temp folder
    named ``prefix...``, removed when the ``with`` block ends, whatever happened."""
    path = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if work is None:
            shutil.rmtree(path, ignore_errors=True)


def export_decoder_variants(target_name: str, checkpoint: Path, work: Path, variants: Mapping[str, Mapping[str, Any]],
                            names: list[str], *, precision: str = "int4") -> dict[str, dict[str, Any]]:
    """Export the ``llm_decoder`` of ``target_name`` once per name in ``names``.

    Args:
        target_name: a registered target (``cpu``, ``openvino``...).
        checkpoint: the Higgs-Audio-v3 checkpoint directory.
        work: folder the decoders are written to (``work/<name>/llm_decoder/...``); a name
            whose ``work/<name>/done.json`` exists was exported by an earlier run into the
            same folder and is reused.
        variants: name -> exporter options laid over the recipe's for ``precision``.
        names: what to export: keys of ``variants`` and/or :data:`REFERENCE`.
        precision: the precision the variants are built at.

    Returns:
        name -> ``{"path": graph entry (.onnx or .xml), "weights_mb": its weight files in MB
        (external data or .bin), "quantization": what the exporter recorded, "export_s",
        "export_peak_rss_mb"}``.

    Raises:
        KeyError: a name that is neither a variant nor :data:`REFERENCE`.
        HiggsPackError: the export failed (out of memory and out of disk said as such).
    """
    from higgs_pack.exporters.process import run_step
    from higgs_pack.targets.base import Variant, get_target
    from higgs_pack.targets.plan import make_plan

    target = get_target(target_name)
    unknown = [n for n in names if n != REFERENCE and n not in variants]
    if unknown:
        raise KeyError(f"unknown decoder variant(s) {unknown}; known: {[*variants, REFERENCE]}")
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        done = work / name / "done.json"
        if done.is_file():
            out[name] = json.loads(done.read_text(encoding="utf-8"))
    if len(out) == len(names):
        return out
    hf_dir, _ = run_step("higgs_pack.targets.steps:write_hf_dir",
                         {"checkpoint": str(checkpoint), "out_dir": str(work / "qwen3-hf")},
                         name="remapping the checkpoint to a Qwen3 directory", folders=[work], work_dir=work)
    try:
        for name in names:
            if name in out:
                continue
            if name == REFERENCE:
                plan = make_plan(target, "fp32")
            else:
                variant = Variant(name, options={SubPart.LLM_DECODER: dict(variants[name])})
                plan = make_plan(dataclasses.replace(target, variants=(*target.variants, variant)), precision, name)
            row = next(r for r in plan.rows if r.subpart == SubPart.LLM_DECODER)
            bundle = work / name
            scratch = work / f"{name}-scratch"
            try:
                result, record = run_step(
                    "higgs_pack.targets.steps:export_decoder",
                    {"hf_dir": hf_dir, "exporter": row.exporter.name, "part": row.subpart.value,
                     "precision": row.precision, "bundle_dir": str(bundle), "work_dir": str(scratch),
                     "options": dict(row.options)},
                    name=f"exporting llm_decoder ({name})", folders=[work], work_dir=work)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            entry = bundle / result["entry"]
            weights = [bundle / f for f in result["files"] if f.endswith((".data", ".bin"))]
            out[name] = {"path": str(entry), "weights_mb": round(sum(f.stat().st_size for f in weights) / 1e6, 2),
                         "quantization": result["quantization"], "export_s": round(record.seconds, 1),
                         "export_peak_rss_mb": round(record.peak_rss_mb, 1)}
            (bundle / "done.json").write_text(json.dumps(out[name]), encoding="utf-8")
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
    return out


def time_interleaved(decoders: Mapping[str, Any], *, hidden: int, context: int, steps: int, repeats: int,
                     seed: int = 0, reference: str = REFERENCE,
                     also_against: str | None = None) -> dict[str, dict[str, Any]]:
    """Time one-position decoder steps of every decoder at one context length, interleaved, and
    compare each one's hidden states with ``reference``'s (same inputs).

    One prompt of ``context`` random ``inputs_embeds`` (float32 [1, context, hidden]) is
    prefilled into every decoder, then ``repeats`` rounds of ``steps`` steps run round-robin,
    the order rotated every round, so load changes on a shared machine hit all of them
    alike; the context grows by ``steps`` per round.

    Args:
        decoders: name -> an object with ``forward(inputs_embeds) -> hidden_states``
            (float32 [1, S, hidden] in and out) and a KV cache with room for
            ``context + repeats * steps`` positions, empty.
        reference: the name whose hidden states are the parity reference (absent: no parity).
        also_against: a second reference (e.g. the same weights with a float KV cache, to
            judge a quantized cache apart from the weights' own error): adds
            ``cosine_vs_<name>`` and ``rel_l2_vs_<name>`` the same way.

    Returns:
        name -> ``{"context", "prefill_ms", "rounds_ms" (ms per step, one per round),
        "step_ms_best", "step_ms_median"}`` plus, when ``reference`` is among ``decoders``,
        ``cosine`` (worst step) and ``rel_l2`` (worst step) over the first round.
    """
    import statistics
    import time

    import numpy as np

    from higgs_pack.runtime.verification.report import compare, rel_l2

    rng = np.random.default_rng(seed)
    prompt = rng.standard_normal((1, context, hidden)).astype(np.float32)
    feeds = rng.standard_normal((repeats * steps, 1, 1, hidden)).astype(np.float32)
    records: dict[str, dict[str, Any]] = {}
    hidden_states: dict[str, list[Any]] = {}
    for name, decoder in decoders.items():
        t = time.perf_counter()
        decoder.forward(prompt)
        records[name] = {"context": context, "prefill_ms": round(1e3 * (time.perf_counter() - t), 2), "rounds_ms": []}
    order = list(decoders)
    for r in range(repeats):
        for name in order[r % len(order):] + order[: r % len(order)]:
            decoder = decoders[name]
            outs = []
            t = time.perf_counter()
            for x in feeds[r * steps:(r + 1) * steps]:
                outs.append(decoder.forward(x))
            records[name]["rounds_ms"].append(round(1e3 * (time.perf_counter() - t) / steps, 3))
            if r == 0:
                hidden_states[name] = outs
    for name, rec in records.items():
        rec["step_ms_best"] = min(rec["rounds_ms"])
        rec["step_ms_median"] = round(statistics.median(rec["rounds_ms"]), 3)
        for against, suffix in ((reference, ""), (also_against, f"_vs_{also_against}")):
            if against in hidden_states:
                pairs = list(zip(hidden_states[against], hidden_states[name], strict=True))
                rec[f"cosine{suffix}"] = round(min(compare(a, b, "cosine")[0] for a, b in pairs), 6)
                rec[f"rel_l2{suffix}"] = round(max(rel_l2(a, b) for a, b in pairs), 6)
    return records


def machine_record() -> dict[str, Any]:
    """The CPU the measurement ran on: ``{"cpu": one-line description, "model", "isa" (flags,
    vnni, avx512), "logical_cpus"}`` (:func:`higgs_pack.runtime.cpu.cpu_info`)."""
    from higgs_pack.runtime.cpu import cpu_info

    cpu = cpu_info()
    return {"cpu": cpu.describe(), "model": cpu.model, "isa": cpu.isa, "logical_cpus": cpu.logical_cpus}


#: Header of the timing columns of :func:`timing_columns`.
TIMING_HEADER = f"{'ctx':>5}{'best ms':>9}{'median':>9}{'cosine':>10}{'rel_l2':>9}{'MB':>9}  load"


def timing_columns(row: Mapping[str, Any], weights_mb: float) -> str:
    """One result row's context, best / median ms per step, parity, weight MB and load averages."""
    return (f"{row['context']:>5}{row['step_ms_best']:>9.2f}{row['step_ms_median']:>9.2f}"
            f"{row.get('cosine', float('nan')):>10.5f}{row.get('rel_l2', float('nan')):>9.4f}"
            f"{weights_mb:>9.1f}  {row['load_before']}->{row['load_after']}")


def add_timing_arguments(parser: Any, *, contexts: tuple[int, ...], what: str) -> None:
    """The options both measurements take: ``--seed``, ``--contexts``, ``--steps``, ``--repeats``,
    ``--out`` and ``--work`` (``what``: the exported things, for the help)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contexts", type=int, nargs="+", default=list(contexts),
                        help="prompt positions before the steps")
    parser.add_argument("--steps", type=int, default=8, help="one-position steps per round")
    parser.add_argument("--repeats", type=int, default=15, help="rounds per variant (best and median reported)")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--work", type=Path, help=f"keep the exported {what} in this folder and reuse them in "
                        "later runs (default: a scratch folder, removed)")


def row_facts(machine: Mapping[str, Any], before: list[float], after: list[float]) -> dict[str, Any]:
    """What every result row carries besides its timing: the CPU model, its ISA flags, VNNI, and
    the load averages before and after the measurement (``machine`` from :func:`machine_record`)."""
    return {"cpu": machine["model"], "isa": machine["isa"]["flags"], "vnni": machine["isa"]["vnni"],
            "load_before": before, "load_after": after}
