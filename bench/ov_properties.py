"""OpenVINO decoder settings measured side by side on this machine (issue 9 item 3).

``python -m bench.ov_properties [--preset bench] [--out FILE]`` times the
bare stateful decoder (:class:`~higgs_pack.runtime.backends.openvino.runners.OvStatefulDecoder`, no
heads, embed or sampling) on the CPU device for:

* compile properties on the default int4 IR (NNCF INT4_SYM, group 64):
  ``KV_CACHE_PRECISION`` u8 / u4 / f16 / f32, ``KEY_CACHE_PRECISION`` u8 with
  ``VALUE_CACHE_PRECISION`` u4 (each KV setting's hidden states are also compared with the
  same IR's f32 KV cache, ``cosine_vs_kv_f32`` / ``rel_l2_vs_kv_f32``, so a quantized cache is
  judged apart from the int4 weights' own error; the precisions the compiled model reports
  back are recorded as ``compiled``, since a plugin may ignore a precision its kernels lack),
  ``PERFORMANCE_HINT`` LATENCY / THROUGHPUT,
  ``INFERENCE_PRECISION_HINT`` f32 / bf16 (the plugin's default is bf16 on CPUs with AMX or
  AVX-512 BF16, f32 elsewhere), and
  ``InferRequest.infer``'s ``share_inputs``/``share_outputs`` on / off;
* weight compression: INT4_ASYM and INT4_SYM at group sizes 128 and 64, each IR exported
  by the openvino target's own decoder step (its recipe options laid over by a build
  variant, :func:`~bench.decoder_variants.export_decoder_variants`), with the runtime's default properties;
* the fp32 IR with f32 inference and KV precision: the reference every variant's hidden
  states are compared with (``cosine``, ``rel_l2``; the fp32 IR matches the PyTorch
  oracle to cosine 0.9999999, MODEL.md).

Timing: one prompt of ``context`` random embeddings is prefilled per variant, then
``repeats`` rounds of ``steps`` one-position steps run with the variants interleaved
(round-robin, the order rotated every round), so load changes on a shared machine hit
all of them alike; each variant reports its best round (``step_ms_best``) and the
median round (``step_ms_median``), in ms per step.  The context grows by ``steps`` per
round (defaults: 15 rounds of 8 steps).  Every record carries the CPU model and ISA (:func:`higgs_pack.runtime.cpu.cpu_info`)
and the load average before and after, because OpenVINO's int4 kernels depend on the ISA
(dynamic activation quantization needs AVX2-VNNI or AVX-512-VNNI; without it int4
weights are decompressed to f32).  The IRs are written under a scratch folder in the
system temp folder and removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
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

#: Weight-compression variants of the int4 decoder: name -> options of the openvino target's
#: decoder exporter (``convert_llm_decoder``'s ``symmetric`` / ``group_size``).
WEIGHT_VARIANTS: dict[str, dict[str, Any]] = {
    "int4_asym_g128": {"symmetric": False, "group_size": 128},
    "int4_asym_g64": {"symmetric": False, "group_size": 64},
    "int4_sym_g128": {"symmetric": True, "group_size": 128},
    "int4_sym_g64": {"symmetric": True, "group_size": 64},
}
#: ``KV_CACHE_PRECISION`` values measured (OpenVINO 2026 CPU plugin: u8 is its default after
#: NNCF compression on x86; MODEL.md "Batching and KV-cache facts").
KV_PRECISIONS = ("u8", "u4", "f16", "f32")
#: The setting each KV setting is also compared with (same IR, float KV cache).
KV_REFERENCE = "kv_f32"
#: Compiled-model properties read back per setting (what the plugin really uses).
READ_BACK = ("KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION", "INFERENCE_PRECISION_HINT")
#: The IR the compile-property variants run on (the openvino target's int4 default,
#: :data:`~higgs_pack.targets.declarations.OPENVINO_DECODER_INT4`).
DEFAULT_WEIGHTS = "int4_sym_g64"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One measured decoder configuration.

    Attributes:
        name: short label (``kv_f16``, ``hint_throughput``, ``int4_sym_g64``...).
        weights: key of the IR (a :data:`WEIGHT_VARIANTS` name or :data:`REFERENCE`).
        properties: CPU compile properties.
        share: ``share_inputs`` and ``share_outputs`` of every ``infer`` call.
        varies: what this setting changes from the runtime's default.
    """

    name: str
    weights: str
    properties: dict[str, str]
    share: bool = True
    varies: str = "default"


def settings() -> list[Setting]:
    """Every configuration measured: the runtime's default first, one change per setting."""
    from higgs_pack.runtime.backends.openvino.devices import (
        decoder_compile_properties,
        precision_config,
    )

    # What the runtime compiles an int4 decoder with on the CPU (openvino_backend's merge).
    default = {**precision_config("CPU", "int4", stateful=True), **decoder_compile_properties("int4", stateful=True)["CPU"]}
    out = [Setting("default", DEFAULT_WEIGHTS, dict(default))]
    for kv in KV_PRECISIONS:
        if kv != default.get("KV_CACHE_PRECISION"):
            out.append(Setting(f"kv_{kv}", DEFAULT_WEIGHTS, {**default, "KV_CACHE_PRECISION": kv}, varies="kv cache"))
    out.append(Setting("kv_key_u8_value_u4", DEFAULT_WEIGHTS,
                       {**default, "KEY_CACHE_PRECISION": "u8", "VALUE_CACHE_PRECISION": "u4"}, varies="kv cache"))
    for hint in ("LATENCY", "THROUGHPUT"):
        if hint != default.get("PERFORMANCE_HINT"):
            out.append(Setting(f"hint_{hint.lower()}", DEFAULT_WEIGHTS, {**default, "PERFORMANCE_HINT": hint},
                               varies="performance hint"))
    for precision in ("f32", "bf16"):
        if precision != default.get("INFERENCE_PRECISION_HINT"):
            out.append(Setting(f"infer_{precision}", DEFAULT_WEIGHTS, {**default, "INFERENCE_PRECISION_HINT": precision},
                               varies="inference precision"))
    out.append(Setting("share_off", DEFAULT_WEIGHTS, dict(default), share=False, varies="share_inputs/outputs"))
    for name in WEIGHT_VARIANTS:
        if name != DEFAULT_WEIGHTS:
            out.append(Setting(name, name, dict(default), varies="weight compression"))
    out.append(Setting(REFERENCE, REFERENCE, {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
                                              "KV_CACHE_PRECISION": "f32"}, varies="reference"))
    return out


def measure(irs: dict[str, dict[str, Any]], chosen: list[Setting], *, hidden: int, context: int, steps: int,
            repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """Time every setting's decoder step at one context length, interleaved, and compare its
    hidden states with the :data:`REFERENCE` setting's (same inputs).

    Args:
        irs: from :func:`~bench.decoder_variants.export_decoder_variants`.
        chosen: the settings (the reference among them for parity).
        hidden: the decoder's hidden size.
        context: prompt positions prefilled before the timed steps.
        steps: one-position steps per round.
        repeats: rounds per setting.

    Returns:
        One record per setting: ``setting``, ``weights``, ``properties``, ``share``,
        ``varies``, ``compiled`` (:func:`read_back`), ``context``, ``step_ms_best``, ``step_ms_median``, ``rounds_ms``,
        ``prefill_ms`` and, against the reference's hidden states of the first round,
        ``cosine`` and ``rel_l2`` (worst step).
    """
    import openvino as ov

    from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder

    core = ov.Core()
    decoders = {s.name: OvStatefulDecoder(core, irs[s.weights]["path"], "CPU", None, s.properties,
                                          max_length=context + repeats * steps + 1, share_inputs=s.share,
                                          share_outputs=s.share) for s in chosen}
    timed = time_interleaved(decoders, hidden=hidden, context=context, steps=steps, repeats=repeats, seed=seed,
                             also_against=KV_REFERENCE)
    return [{"setting": s.name, "weights": s.weights, "properties": s.properties, "share": s.share,
             "varies": s.varies, "compiled": read_back(decoders[s.name].compiled), **timed[s.name]} for s in chosen]


def read_back(compiled: Any) -> dict[str, str]:
    """The :data:`READ_BACK` properties of a compiled model as strings (element types as
    OpenVINO names them: ``u8``, ``u4``, ``f16``, ``f32``; absent: not reported)."""
    out = {}
    for name in READ_BACK:
        try:
            value = compiled.get_property(name)
        except Exception:  # an older plugin without the property
            continue
        out[name] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)  # ov.Type -> "u8"
    return out


def run(preset: str = "bench", *, seed: int = 0, contexts: tuple[int, ...] = (64, 768), steps: int = 8,
        repeats: int = 15, work: Path | None = None, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Export the IRs, measure every setting at every context, and return the report.

    Args:
        only: names of the settings to measure (empty: all); the default setting and the
            references are always measured.

    Raises:
        ValueError: a name in ``only`` is not a setting.

        work: folder for the IRs, kept and reused by later runs (IRs already there are not
            exported again); default a scratch folder removed at the end.

    Returns:
        ``{"machine": {"cpu", "model", "isa", "logical_cpus"}, "openvino", "preset", "steps",
        "repeats", "weights": {name: export facts}, "results": [records of :func:`measure`,
        each with "cpu", "isa", "load_before", "load_after"]}``.
    """
    from higgs_pack.runtime.backends.openvino.devices import runtime_versions
    from higgs_pack.targets.build import default_checkpoint

    machine = machine_record()
    checkpoint = default_checkpoint(preset, seed)
    hidden = int(json.loads((checkpoint / "config.json").read_text())["text_config"]["hidden_size"])
    chosen = settings()
    if only:
        unknown = sorted(set(only) - {s.name for s in chosen})
        if unknown:
            raise ValueError(f"unknown settings {unknown}; known: {[s.name for s in chosen]}")
        keep = {*only, "default", REFERENCE, KV_REFERENCE}
        chosen = [s for s in chosen if s.name in keep]
    with work_folder(work, "higgs-pack-ov-properties-") as folder:
        irs = export_decoder_variants("openvino", checkpoint, folder, WEIGHT_VARIANTS,
                                      list(dict.fromkeys(s.weights for s in chosen)))
        results = []
        for context in contexts:
            before = load_average()
            rows = measure(irs, chosen, hidden=hidden, context=context, steps=steps, repeats=repeats, seed=seed)
            after = load_average()
            for row in rows:
                row.update(row_facts(machine, before, after))
            results += rows
    irs = {name: {k: v for k, v in facts.items() if k != "path"} for name, facts in irs.items()}
    return {"machine": machine, **runtime_versions(), "preset": preset, "steps": steps, "repeats": repeats, "weights": irs,
            "results": results}


def table(report: dict[str, Any]) -> str:
    """The report as a text table (one row per setting and context)."""
    lines = [f"{report['machine']['cpu']}, openvino {report['openvino']}, preset {report['preset']}, "
             f"{report['steps']} steps x {report['repeats']} rounds",
             f"{'setting':<19}{'weights':<16}{TIMING_HEADER}"]
    for row in report["results"]:
        mb = report["weights"][row["weights"]]["weights_mb"]
        kv = ""
        if row["varies"] == "kv cache" or row["setting"] == "default":
            compiled = row.get("compiled", {})
            kv = (f"  vs kv_f32: cosine {row.get('cosine_vs_kv_f32', float('nan')):.6f} rel_l2 "
                  f"{row.get('rel_l2_vs_kv_f32', float('nan')):.4f}; compiled K/V "
                  f"{compiled.get('KEY_CACHE_PRECISION', '?')}/{compiled.get('VALUE_CACHE_PRECISION', '?')}")
        lines.append(f"{row['setting']:<19}{row['weights']:<16}{timing_columns(row, mb)}{kv}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ov_properties",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench", choices=("tiny", "bench"),
                   help="checkpoint preset (the full preset is the lead's: not offered here)")
    add_timing_arguments(p, contexts=(64, 768), what="IRs")
    p.add_argument("--settings", default="", help="comma-separated settings to measure (default: all; e.g. "
                                                  "kv_u4,kv_key_u8_value_u4 for the KV cache only)")
    args = p.parse_args(argv)
    try:
        report = run(args.preset, seed=args.seed, contexts=tuple(args.contexts), steps=args.steps,
                     repeats=args.repeats, work=args.work,
                     only=tuple(n for n in args.settings.split(",") if n.strip()))
    except ValueError as exc:
        p.error(str(exc))
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
