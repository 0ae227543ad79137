"""ONNX Runtime int4 decoder options measured side by side on this machine (issue 9 item 5).

``python -m bench.ort_int4_options [--preset bench] [--out FILE]`` exports
the cpu target's ``llm_decoder`` once per ModelBuilder int4 option set (``block_size`` 32 /
64 / 128, ``accuracy_level`` 4 = int8 compute and 1 = float32 compute, symmetric as
ModelBuilder's default), each through the build's own decoder step (ModelBuilder's float
graph, then the streamed MatMulNBits pass), plus the fp32 decoder as the parity reference,
and times the bare decoder (:class:`~higgs_pack.runtime.backends.onnxruntime.runners.OrtDecoder`: shared KV
buffers, IOBinding, the runtime's session options; no heads, embed or sampling) on the CPU
execution provider, interleaved, at each context length.

Per option set it reports the weight bytes (the external data: int4 nibbles plus one
float32 scale per block, so ``block_size`` sets the bytes read per step), the best and
median ms per step, and the hidden states' cosine and relative L2 against the fp32
decoder.  The fp32 reference is opened the way ``--low-memory`` opens a float decoder
(weights read in place from the mapped file, pages handed back after every step), so the
full preset's 14.5 GB reference does not sit beside the int4 variants in memory; its own
times are not a measure of anything.  Every record carries the CPU model and ISA: MLAS's
int8-compute MatMulNBits kernels use AVX2, AVX-512 VNNI or AMX where the CPU has them, so
rankings differ between CPUs.  The decoders are written under ``--work`` (kept and reused)
or a scratch folder removed at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.decoder_variants import (
    REFERENCE,
    TIMING_HEADER,
    add_timing_arguments,
    export_decoder_variants,
    load_average,
    machine_record,
    row_facts,
    time_interleaved,
    timing_columns,
    work_folder,
)


def _options(block_size: int, accuracy_level: int) -> dict[str, Any]:
    return {"extra_options": {"block_size": block_size, "accuracy_level": accuracy_level}}


#: ModelBuilder int4 option sets: name -> options of the cpu target's decoder exporter.
VARIANTS: dict[str, dict[str, Any]] = {
    "b32_l4": _options(32, 4),
    "b64_l4": _options(64, 4),
    "b128_l4": _options(128, 4),
    "b32_l1": _options(32, 1),
    "b128_l1": _options(128, 1),
}


def default_variant() -> str:
    """The :data:`VARIANTS` name a cpu int4 build uses today: the cpu target's decoder
    ``extra_options`` over ModelBuilder's defaults and the cpu provider row's accuracy_level."""
    from higgs_pack.exporters.modelbuilder import INT4_DEFAULTS
    from higgs_pack.manifests.constants import EXECUTION_PROVIDERS, SubPart
    from higgs_pack.targets.plan import make_plan

    row = next(r for r in make_plan("cpu", "int4").rows if r.subpart == SubPart.LLM_DECODER)
    extra = row.options.get("extra_options") or {}
    block = extra.get("block_size", INT4_DEFAULTS["block_size"])
    level = extra.get("accuracy_level", EXECUTION_PROVIDERS["cpu"].modelbuilder.accuracy_level)
    return f"b{block}_l{level}"


def open_decoders(decoders: dict[str, dict[str, Any]], names: list[str], config: dict[str, Any],
                  max_length: int) -> dict[str, Any]:
    """:class:`~higgs_pack.runtime.backends.onnxruntime.runners.OrtDecoder` per name on the CPU execution provider,
    with the runtime's default session options; :data:`REFERENCE` is opened lean
    (``prepacking=False``, weights paged out after each step), as ``--low-memory`` does."""
    from higgs_pack.runtime.backends.onnxruntime.runners import OrtDecoder
    from higgs_pack.runtime.backends.onnxruntime.sessions import create_session

    out = {}
    for name in names:
        path = Path(decoders[name]["path"])
        lean = name == REFERENCE
        session, _ = create_session(path, "cpu", prepacking=not lean)
        weights = tuple(p for p in path.parent.iterdir() if p.suffix == ".data") if lean else ()
        out[name] = OrtDecoder(session, max_length=max_length, kv_heads=config["num_key_value_heads"],
                               head_dim=config["head_dim"], page_out_weights=weights)
    return out


def run(preset: str = "bench", *, seed: int = 0, names: list[str] | None = None, reference: bool = True,
        contexts: tuple[int, ...] = (64, 900), steps: int = 8, repeats: int = 15,
        work: Path | None = None) -> dict[str, Any]:
    """Export the decoders, measure them at every context, and return the report.

    Args:
        preset: checkpoint preset (``tiny``, ``bench``, ``full``).
        names: :data:`VARIANTS` to measure (default all).
        reference: also export and run the fp32 decoder (parity columns).
        work: folder for the decoders, kept and reused by later runs; default a scratch
            folder removed at the end.

    Returns:
        ``{"machine": {"cpu", "model", "isa", "logical_cpus"}, "onnxruntime", "preset",
        "steps", "repeats", "default", "weights": {name: export facts}, "results": [one
        record per variant and context: "variant", "block_size", "accuracy_level",
        :func:`~bench.decoder_variants.time_interleaved`'s fields, "cpu",
        "isa", "vnni", "load_before", "load_after"]}``.

    Raises:
        KeyError: an unknown variant name.
    """
    import onnxruntime

    from higgs_pack.targets.build import default_checkpoint

    names = list(names or VARIANTS)
    chosen = names + ([REFERENCE] if reference else [])
    machine = machine_record()
    checkpoint = default_checkpoint(preset, seed)
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["text_config"]
    with work_folder(work, "higgs-pack-ort-int4-") as folder:
        exported = export_decoder_variants("cpu", checkpoint, folder, VARIANTS, chosen)
        results = []
        for context in contexts:
            decoders = open_decoders(exported, chosen, config, context + repeats * steps + 1)
            before = load_average()
            timed = time_interleaved(decoders, hidden=int(config["hidden_size"]), context=context, steps=steps,
                                     repeats=repeats, seed=seed)
            after = load_average()
            del decoders
            for name in chosen:
                q = exported[name]["quantization"]
                results.append({"variant": name, "block_size": q.get("block_size"),
                                "accuracy_level": q.get("accuracy_level"), **timed[name],
                                **row_facts(machine, before, after)})
    weights = {name: {k: v for k, v in facts.items() if k != "path"} for name, facts in exported.items()}
    return {"machine": machine, "onnxruntime": onnxruntime.__version__, "preset": preset, "steps": steps, "repeats": repeats,
            "default": default_variant(), "weights": weights, "results": results}


def table(report: dict[str, Any]) -> str:
    """The report as a text table (one row per variant and context)."""
    lines = [f"{report['machine']['cpu']}, onnxruntime {report['onnxruntime']}, preset {report['preset']}, "
             f"{report['steps']} steps x {report['repeats']} rounds; default {report['default']}",
             f"{'variant':<10}{'block':>6}{'level':>6}{TIMING_HEADER}"]
    for row in report["results"]:
        mb = report["weights"][row["variant"]]["weights_mb"]
        lines.append(f"{row['variant']:<10}{row['block_size'] or '-':>6}{row['accuracy_level'] or '-':>6}"
                     f"{timing_columns(row, mb)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ort_int4_options",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench", choices=("tiny", "bench", "full"),
                   help="checkpoint preset (full: 4B dimensions; each variant's export needs ~16 GB of scratch)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated option sets (default all: {','.join(VARIANTS)})")
    p.add_argument("--no-reference", action="store_true", help="skip the fp32 decoder (no parity columns)")
    add_timing_arguments(p, contexts=(64, 900), what="decoders")
    args = p.parse_args(argv)
    names = [n for n in args.variants.split(",") if n.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    report = run(args.preset, seed=args.seed, names=names, reference=not args.no_reference,
                 contexts=tuple(args.contexts), steps=args.steps, repeats=args.repeats, work=args.work)
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
