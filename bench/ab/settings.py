"""Decoder settings side by side on this machine: ``python -m bench.ab {ort-int4,ort-kv-cache,
ov-properties,gemm-peak,rolling-context,long-text}``.  Each variant's ``llm_decoder`` is exported
as a build does, opened bare, prefilled with one random prompt, timed in rounds with the variants
interleaved (order rotated) and its hidden states compared with a reference's; every row names
the CPU, its ISA and the load.  Printed as Markdown (docs/measurements.md), JSON with ``--out``.

* ``ort-int4``: ModelBuilder int4 ``block_size`` x ``accuracy_level`` against the fp32 decoder;
* ``ort-kv-cache``: float and int8 KV caches, with code agreement and a teacher-forced sequence;
* ``ov-properties``: OpenVINO CPU compile properties and NNCF INT4 SYM/ASYM x group 64/128, against
  the fp32 IR (KV settings also against the same IR's f32 cache, ``*_vs_kv_f32``);
* ``gemm-peak``, ``rolling-context BUNDLE``, ``long-text BUNDLE``: :mod:`bench.decoder.gemm`,
  :mod:`bench.ab.rolling`, :mod:`bench.ab.long_text`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bench.ab import long_text, rolling
from bench.common.systems import loadavg, machine_facts, markdown, peak_rss_mb, print_report
from bench.decoder import gemm
from higgs_pack.manifests.model import SubPart

#: The variant every other one's hidden states are compared with: the target's fp32 decoder.
REFERENCE = "fp32"
ORT_INT4_VARIANTS = {f"b{block}_l{level}": {"extra_options": {"block_size": block, "accuracy_level": level}}
                     for block, level in ((32, 4), (64, 4), (128, 4), (32, 1), (128, 1))}
#: The KV caches compared (the first is each precision's reference), the precisions, the loop's text.
KV_CACHES = ("float", "int8")
KV_PRECISIONS = ("int4", "fp32")
LOOP_TEXT = "The quick brown fox jumps over the lazy dog. Packaging models for every device is hard work."
OV_WEIGHT_VARIANTS = {f"int4_{'sym' if sym else 'asym'}_g{group}": {"symmetric": sym, "group_size": group}
                      for sym in (False, True) for group in (128, 64)}
OV_DEFAULT_WEIGHTS = "int4_sym_g64"
KV_REFERENCE = "kv_f32"
#: Compiled-model properties read back per setting (what the plugin really uses).
READ_BACK = ("KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION", "INFERENCE_PRECISION_HINT")
TIMING_HEADERS = ["ctx", "best / median ms", "cosine", "rel_l2", "MB", "load"]


def export_variants(target_name: str, checkpoint: Path, work: Path, variants: Mapping[str, Mapping[str, Any]],
                    names: list[str], *, precision: str = "int4") -> dict[str, dict[str, Any]]:
    """The ``llm_decoder`` of a target exported once per name (a key of ``variants``, laid over the
    recipe at ``precision``, or :data:`REFERENCE`), each in a child process, reused where
    ``work/<name>/done.json`` is: name -> ``{path, weights_mb, quantization, export_s, export_peak_rss_mb}``."""
    from higgs_pack.exporters.process import run_step
    from higgs_pack.targets.base import Variant
    from higgs_pack.targets.plan import make_plan
    from higgs_pack.targets.registry import get_target

    target = get_target(target_name)
    work.mkdir(parents=True, exist_ok=True)
    out = {n: json.loads((work / n / "done.json").read_text()) for n in names if (work / n / "done.json").is_file()}
    if len(out) == len(names):
        return out
    hf_dir, _ = run_step("higgs_pack.targets.steps:write_hf_dir",
                         {"checkpoint": str(checkpoint), "out_dir": str(work / "qwen3-hf")},
                         name="remapping the checkpoint to a Qwen3 directory", folders=[work], work_dir=work)
    try:
        for name in (n for n in names if n not in out):
            variant = Variant(name, options={SubPart.LLM_DECODER: dict(variants.get(name, {}))})
            plan = (make_plan(target, "fp32") if name == REFERENCE else
                    make_plan(dataclasses.replace(target, variants=(*target.variants, variant)), precision, name))
            row = next(r for r in plan.rows if r.subpart == SubPart.LLM_DECODER)
            bundle, scratch = work / name, work / f"{name}-scratch"
            try:
                result, record = run_step(
                    "higgs_pack.targets.steps:export_decoder",
                    {"hf_dir": hf_dir, "exporter": row.exporter.name, "part": row.subpart.value,
                     "precision": row.precision, "bundle_dir": str(bundle), "work_dir": str(scratch),
                     "options": dict(row.options)}, name=f"exporting llm_decoder ({name})", folders=[work], work_dir=work)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            weights = [bundle / f for f in result["files"] if f.endswith((".data", ".bin"))]
            out[name] = {"path": str(bundle / result["entry"]),
                         "weights_mb": round(sum(f.stat().st_size for f in weights) / 1e6, 2),
                         "quantization": result["quantization"], "export_s": round(record.seconds, 1),
                         "export_peak_rss_mb": round(record.peak_rss_mb, 1)}
            (bundle / "done.json").write_text(json.dumps(out[name]), encoding="utf-8")
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
    return out


def time_interleaved(decoders: Mapping[str, Any], *, hidden: int, context: int, steps: int, repeats: int,
                     seed: int = 0, reference: str = REFERENCE, also_against: str | None = None
                     ) -> dict[str, dict[str, Any]]:
    """Every decoder (``forward(float32 [1, S, H])``) prefilled with one random prompt, then
    ``repeats`` rounds of ``steps`` steps, the order rotated each round: ``context``, ``prefill_ms``,
    ``rounds_ms``, ``step_ms_best``, ``step_ms_median`` and, against ``reference`` (and
    ``also_against``: ``*_vs_<name>``), the worst step's ``cosine`` and ``rel_l2`` in the first round."""
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
            t = time.perf_counter()
            outs = [decoders[name].forward(x) for x in feeds[r * steps:(r + 1) * steps]]
            records[name]["rounds_ms"].append(round(1e3 * (time.perf_counter() - t) / steps, 3))
            hidden_states.setdefault(name, outs)
    for name, rec in records.items():
        rec.update(step_ms_best=min(rec["rounds_ms"]), step_ms_median=round(statistics.median(rec["rounds_ms"]), 3))
        for against, suffix in ((reference, ""), (also_against, f"_vs_{also_against}")):
            if against in hidden_states:
                pairs = list(zip(hidden_states[against], hidden_states[name], strict=True))
                rec[f"cosine{suffix}"] = round(min(compare(a, b, "cosine")[0] for a, b in pairs), 6)
                rec[f"rel_l2{suffix}"] = round(max(rel_l2(a, b) for a, b in pairs), 6)
    return records


def each_context(args: argparse.Namespace, machine: Mapping[str, Any], hidden: int,
                 open_all: Callable[[int], dict[str, Any]], extra: Callable[[dict, str], dict] = lambda d, n: {},
                 **kw: Any) -> list[dict[str, dict[str, Any]]]:
    """Per ``--contexts`` length, the decoders ``open_all(positions)`` opened for it (and closed
    before the next) timed by :func:`time_interleaved`: name -> its row with the CPU model, ISA
    flags, VNNI, the load before and after, and ``extra(decoders, name)``."""
    out = []
    for context in args.contexts:
        decoders, before = open_all(context + args.repeats * args.steps + 1), loadavg()
        timed = time_interleaved(decoders, hidden=hidden, context=context, steps=args.steps, repeats=args.repeats,
                                 seed=args.seed, **kw)
        cpu = {"cpu": machine["model"], "isa": machine["isa"]["flags"], "vnni": machine["isa"]["vnni"]}
        out.append({n: {**t, **cpu, "load_before": before, "load_after": loadavg(), **extra(decoders, n)}
                    for n, t in timed.items()})
        del decoders
    return out


def timing_cells(row: Mapping[str, Any], weights_mb: float) -> list[Any]:
    return [row["context"], f"{row['step_ms_best']:.2f} / {row['step_ms_median']:.2f}", row.get("cosine"),
            row.get("rel_l2"), weights_mb, f"{(row['load_before'] or ['?'])[0]} -> {(row['load_after'] or ['?'])[0]}"]


def strip_paths(exported: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {k: v for k, v in facts.items() if k != "path"} for name, facts in exported.items()}


def text_config(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["text_config"]


def open_ort(path: str, config: Mapping[str, Any], max_length: int, *, lean: bool = False) -> Any:
    """An OrtDecoder on the CPU provider with the runtime decoder's thread pool; ``lean``: opened as
    ``--low-memory`` opens a float decoder (weights read in place and paged out after every step)."""
    from higgs_pack.runtime.backends.onnxruntime.runners import OrtDecoder
    from higgs_pack.runtime.backends.onnxruntime.sessions import DECODER_THREAD_POOL, create_session

    session, _ = create_session(Path(path), "cpu", prepacking=not lean, session_options=dict(DECODER_THREAD_POOL))
    weights = tuple(p for p in Path(path).parent.iterdir() if p.suffix == ".data") if lean else ()
    return OrtDecoder(session, max_length=max_length, kv_heads=config["num_key_value_heads"],
                      head_dim=config["head_dim"], page_out_weights=weights)


def default_int4_variant() -> str:
    """The :data:`ORT_INT4_VARIANTS` name a cpu int4 build uses today."""
    from higgs_pack.exporters.onnx.modelbuilder import INT4_DEFAULTS
    from higgs_pack.manifests.providers import EXECUTION_PROVIDERS
    from higgs_pack.targets.plan import make_plan

    row = next(r for r in make_plan("cpu", "int4").rows if r.subpart == SubPart.LLM_DECODER)
    extra = row.options.get("extra_options") or {}
    return (f"b{extra.get('block_size', INT4_DEFAULTS['block_size'])}_"
            f"l{extra.get('accuracy_level', EXECUTION_PROVIDERS['cpu'].modelbuilder.accuracy_level)}")


def ort_int4(args: argparse.Namespace, folder: Path, checkpoint: Path, machine: dict[str, Any]) -> dict[str, Any]:
    """``ort-int4``: ``default``, ``weights`` and a result per variant and context."""
    config, chosen = text_config(checkpoint), [*args.variants, REFERENCE]
    exported = export_variants("cpu", checkpoint, folder, ORT_INT4_VARIANTS, chosen)
    results = [{"variant": name, **{k: exported[name]["quantization"].get(k) for k in ("block_size", "accuracy_level")},
                **rows[name]} for rows in each_context(args, machine, int(config["hidden_size"]), lambda n: {
                    name: open_ort(exported[name]["path"], config, n, lean=name == REFERENCE) for name in chosen})
               for name in chosen]
    return {"default": default_int4_variant(), "weights": strip_paths(exported), "results": results}


def ort_int4_table(report: dict[str, Any]) -> str:
    rows = [[r["variant"], r["block_size"], r["accuracy_level"],
             *timing_cells(r, report["weights"][r["variant"]]["weights_mb"])] for r in report["results"]]
    return f"default {report['default']}\n\n" + markdown(["variant", "block", "level", *TIMING_HEADERS], rows)


class Recording:
    """A decoder keeping its one-position outputs."""

    def __init__(self, decoder: Any) -> None:
        self.decoder, self.steps = decoder, []

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        out = self.decoder.forward(inputs_embeds)
        if out.shape[1] == 1:
            self.steps.append(out)
        return out


def heads_table(checkpoint: Path) -> tuple[np.ndarray, np.ndarray, dict[str, int], Any, int]:
    """``(W, text table, special ids, tokenizer, N)``: the audio heads' weight float32 [N * V, H] (the
    tied fused embedding without a separate head), the text embedding, N codebooks."""
    from tokenizers import Tokenizer

    from higgs_pack.exporters.checkpoint.layout import (
        AUDIO_EMBEDDING,
        AUDIO_HEAD_PREFIX,
        TEXT_EMBEDDING,
    )
    from higgs_pack.exporters.checkpoint.reader import open_checkpoint

    with open_checkpoint(checkpoint) as ckpt:
        head = next((n for n in ckpt.tensor_names() if n.startswith(AUDIO_HEAD_PREFIX) and n.endswith("weight")),
                    AUDIO_EMBEDDING)
        tokenizer = Tokenizer.from_file(str(next(p for p in ckpt.tokenizer_files() if p.name == "tokenizer.json")))
        return (ckpt.tensor(head).float().numpy(), ckpt.tensor(TEXT_EMBEDDING).float().numpy(),
                dict(ckpt.constants.special_tokens), tokenizer, int(ckpt.constants.num_codebooks))


def codes_of(hidden: np.ndarray, w: np.ndarray, codebooks: int) -> np.ndarray:
    """Each codebook's greedy code at the last position of ``hidden``."""
    return (hidden.reshape(-1, hidden.shape[-1])[-1] @ w.T).reshape(codebooks, -1).argmax(axis=1)


def code_agreement(reference: list[np.ndarray], got: list[np.ndarray], w: np.ndarray, codebooks: int
                   ) -> dict[str, float]:
    """Shares of positions whose first code (``first_code``) and all codes (``all_codes``) agree."""
    pairs = [(codes_of(a, w, codebooks), codes_of(b, w, codebooks)) for a, b in zip(reference, got, strict=True)]
    return {"first_code": round(float(np.mean([a[0] == b[0] for a, b in pairs])), 4),
            "all_codes": round(float(np.mean([(a == b).all() for a, b in pairs])), 4)}


def teacher_forced(decoders: dict[str, Any], reference: str, prompt: np.ndarray, w: np.ndarray, codebooks: int,
                   frames: int) -> dict[str, dict[str, Any]]:
    """``prompt`` then ``frames`` positions fed the audio embedding of the reference's greedy codes:
    per decoder the error against the reference and the code agreement."""
    from higgs_pack.runtime.verification.report import compare, rel_l2

    vocab = w.shape[0] // codebooks
    outs = {name: [d.forward(prompt)[:, -1:]] for name, d in decoders.items()}
    for _ in range(frames):
        codes = codes_of(outs[reference][-1], w, codebooks)
        embed = w[codes + np.arange(codebooks) * vocab].sum(axis=0, dtype=np.float32)[None, None]
        for name, decoder in decoders.items():
            outs[name].append(decoder.forward(embed))
    result = {}
    for name, got in outs.items():
        pairs = list(zip(outs[reference], got, strict=True))
        errors = [rel_l2(a, b) for a, b in pairs]
        result[name] = {"positions": prompt.shape[1] + frames, "rel_l2_max": round(max(errors), 6),
                        "rel_l2_median": round(statistics.median(errors), 6),
                        "cosine_min": round(min(compare(a, b, "cosine")[0] for a, b in pairs), 6),
                        **code_agreement(outs[reference], got, w, codebooks)}
    return result


def ort_kv_cache(args: argparse.Namespace, folder: Path, checkpoint: Path, machine: dict[str, Any]) -> dict[str, Any]:
    """``ort-kv-cache``: ``decoders``, a result per decoder and context, the teacher-forced ``loop``."""
    config = text_config(checkpoint)
    w, text_table, special, tokenizer, codebooks = heads_table(checkpoint)
    ids = [special["tts"], special["text"], *tokenizer.encode(LOOP_TEXT, add_special_tokens=False).ids, special["audio"]]
    prompt = text_table[np.asarray(ids)][None].astype(np.float32)
    del text_table
    per_position = 2 * int(config["num_hidden_layers"]) * int(config["num_key_value_heads"]) * int(config["head_dim"])
    decoders: dict[str, dict[str, Any]] = {}
    results: list[dict[str, Any]] = []
    loop: dict[str, dict[str, Any]] = {}
    for precision in args.precisions:
        variants = {f"{precision}-{kv}": ({} if kv == "float" else {"kv_cache": kv}) for kv in KV_CACHES}
        names, reference = list(variants), f"{precision}-float"
        exported = export_variants("cpu", checkpoint, folder / precision, variants, names, precision=precision)
        decoders.update({n: {**strip_paths(exported)[n], "kv_bytes_per_position": per_position * (4 if n == reference
                                                                                                else 1)} for n in names})
        results += [{"variant": name, "precision": precision, "kv_cache": name.split("-", 1)[1], **rows[name]}
                    for rows in each_context(args, machine, int(config["hidden_size"]), lambda n, e=exported, ns=names: {
                        name: Recording(open_ort(e[name]["path"], config, n)) for name in ns},
                        lambda d, n, r=reference: code_agreement(d[r].steps, d[n].steps, w, codebooks), reference=reference)
                    for name in names]
        if args.frames:
            opened = {n: open_ort(exported[n]["path"], config, prompt.shape[1] + args.frames + 1) for n in names}
            loop.update(teacher_forced(opened, reference, prompt, w, codebooks, args.frames))
            del opened
    return {"frames": args.frames, "loop_text": LOOP_TEXT, "decoders": decoders, "results": results, "loop": loop,
            "peak_rss_mb": round(peak_rss_mb(), 1)}


def ort_kv_cache_table(report: dict[str, Any]) -> str:
    rows = [[r["variant"], report["decoders"][r["variant"]]["kv_bytes_per_position"],
             *timing_cells(r, report["decoders"][r["variant"]]["weights_mb"]), r["first_code"]]
            for r in report["results"]]
    text = markdown(["decoder", "KV B/pos", *TIMING_HEADERS, "code0"], rows)
    if report["loop"]:
        text += (f"\n\nTTS-shaped sequence, {report['frames']} frames teacher-forced:\n\n"
                 + markdown(["decoder", "positions", "rel_l2 max / median", "cosine min", "code0", "all codes"],
                            [[n, r["positions"], f"{r['rel_l2_max']:.4f} / {r['rel_l2_median']:.4f}", r["cosine_min"],
                              r["first_code"], r["all_codes"]] for n, r in report["loop"].items()]))
    return text + f"\n\npeak RSS of the measuring process {report['peak_rss_mb']} MB"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One OpenVINO decoder configuration: IR, CPU compile properties, shared I/O, what it varies."""

    name: str
    weights: str
    properties: dict[str, str]
    share: bool = True
    varies: str = "default"


def ov_settings() -> list[Setting]:
    """Every configuration measured: the runtime's default first, then one change each."""
    from higgs_pack.runtime.backends.openvino.devices import (
        decoder_compile_properties,
        precision_config,
    )

    default = {**precision_config("CPU", "int4", stateful=True), **decoder_compile_properties("int4", stateful=True)["CPU"]}

    def changed(name: str, varies: str, **props: str) -> Setting:
        return Setting(name, OV_DEFAULT_WEIGHTS, {**default, **props}, varies=varies)

    return [Setting("default", OV_DEFAULT_WEIGHTS, dict(default)),
            *(changed(f"kv_{kv}", "kv cache", KV_CACHE_PRECISION=kv) for kv in ("u8", "u4", "f16", "f32")
              if kv != default.get("KV_CACHE_PRECISION")),
            changed("kv_key_u8_value_u4", "kv cache", KEY_CACHE_PRECISION="u8", VALUE_CACHE_PRECISION="u4"),
            *(changed(f"hint_{hint.lower()}", "performance hint", PERFORMANCE_HINT=hint)
              for hint in ("LATENCY", "THROUGHPUT") if hint != default.get("PERFORMANCE_HINT")),
            *(changed(f"infer_{p}", "inference precision", INFERENCE_PRECISION_HINT=p)
              for p in ("f32", "bf16") if p != default.get("INFERENCE_PRECISION_HINT")),
            Setting("share_off", OV_DEFAULT_WEIGHTS, dict(default), share=False, varies="share_inputs/outputs"),
            *(Setting(n, n, dict(default), varies="weight compression") for n in OV_WEIGHT_VARIANTS
              if n != OV_DEFAULT_WEIGHTS),
            Setting(REFERENCE, REFERENCE, {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
                                           "KV_CACHE_PRECISION": "f32"}, varies="reference")]


def read_back(compiled: Any) -> dict[str, str]:
    """The compiled model's :data:`READ_BACK` properties (those its plugin has)."""
    out = {}
    for name in READ_BACK:
        try:
            value = compiled.get_property(name)
        except Exception:  # a plugin without the property
            continue
        out[name] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
    return out


def ov_properties(args: argparse.Namespace, folder: Path, checkpoint: Path, machine: dict[str, Any]) -> dict[str, Any]:
    """``ov-properties``: ``weights`` and a result per setting and context."""
    import openvino as ov

    from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder

    keep = {*args.settings, "default", REFERENCE, KV_REFERENCE}
    chosen = [s for s in ov_settings() if not args.settings or s.name in keep]
    irs = export_variants("openvino", checkpoint, folder, OV_WEIGHT_VARIANTS, list(dict.fromkeys(s.weights for s in chosen)))
    core = ov.Core()
    results = [{"setting": s.name, "weights": s.weights, "properties": s.properties, "share": s.share,
                "varies": s.varies, **rows[s.name]}
               for rows in each_context(args, machine, int(text_config(checkpoint)["hidden_size"]), lambda n: {
                   s.name: OvStatefulDecoder(core, irs[s.weights]["path"], "CPU", None, s.properties, max_length=n,
                                             share_inputs=s.share, share_outputs=s.share) for s in chosen},
                   lambda d, n: {"compiled": read_back(d[n].compiled)}, also_against=KV_REFERENCE)
               for s in chosen]
    return {"weights": strip_paths(irs), "results": results}


def ov_properties_table(report: dict[str, Any]) -> str:
    rows = []
    for r in report["results"]:
        c = r["compiled"]
        kv = (f"{r.get('cosine_vs_kv_f32')} / {r.get('rel_l2_vs_kv_f32')}; K/V {c.get('KEY_CACHE_PRECISION', '?')}/"
              f"{c.get('VALUE_CACHE_PRECISION', '?')}" if r["varies"] == "kv cache" or r["setting"] == "default" else None)
        rows.append([r["setting"], r["weights"], *timing_cells(r, report["weights"][r["weights"]]["weights_mb"]), kv])
    return markdown(["setting", "weights", *TIMING_HEADERS, "vs kv_f32: cosine / rel_l2"], rows)


#: The tools of their own modules (``add_arguments``, ``command``, ``table``, ``HELP``).
TOOLS = {"gemm-peak": gemm, "rolling-context": rolling, "long-text": long_text}
#: sub-command -> (measure, table, the runtime whose version is recorded, default contexts, option lists).
COMMANDS = {
    "ort-int4": (ort_int4, ort_int4_table, "onnxruntime", (64, 900), ("variants", lambda: ORT_INT4_VARIANTS)),
    "ort-kv-cache": (ort_kv_cache, ort_kv_cache_table, "onnxruntime", (64, 900), ("precisions", lambda: KV_PRECISIONS)),
    "ov-properties": (ov_properties, ov_properties_table, "openvino", (64, 768),
                      ("settings", lambda: [s.name for s in ov_settings()])),
}


def report_table(report: Mapping[str, Any]) -> str:
    """The Markdown tables of any ``python -m bench.ab`` report (its ``--out`` JSON), by its
    ``command``: what the tool printed when it ran (the docs' ``ab`` tables, docs/hooks).

    Raises:
        KeyError: a report without a known ``command``.
    """
    tables = {**{name: entry[1] for name, entry in COMMANDS.items()}, **{n: t.table for n, t in TOOLS.items()}}
    if report["command"] not in tables:
        raise KeyError(f"unknown bench.ab command {report['command']!r} (one of {', '.join(tables)})")
    return tables[report["command"]](report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, (*_, contexts, (option, _known)) in COMMANDS.items():
        s = sub.add_parser(name, help=f"see the module docstring: {name}")
        s.add_argument("--preset", default="bench", choices=("tiny", "bench") + ("full",) * (name != "ov-properties"),
                       help="checkpoint preset (full: 4B dimensions, ~16 GB per export)")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--contexts", type=int, nargs="+", default=list(contexts), help="prompt positions before the steps")
        s.add_argument("--steps", type=int, default=8, help="one-position steps per round")
        s.add_argument("--repeats", type=int, default=15, help="rounds per variant (best and median reported)")
        s.add_argument("--out", type=Path, help="write the JSON report here")
        s.add_argument("--work", type=Path, help="keep the exports in this folder and reuse them in later runs")
        s.add_argument(f"--{option}", default="" if option == "settings" else ",".join(_known()),
                       help=f"comma-separated {option} (default all)")
    sub.choices["ort-kv-cache"].add_argument("--frames", type=int, default=400, help="teacher-forced frames (0: none)")
    for name, tool in TOOLS.items():
        tool.add_arguments(sub.add_parser(name, help=tool.HELP))
    args = p.parse_args(argv)
    if args.command in TOOLS:
        return TOOLS[args.command].command(args)
    measure, table, runtime, _, (option, known) = COMMANDS[args.command]
    got = [n for n in getattr(args, option).split(",") if n.strip()]
    unknown = sorted(set(got) - set(known()))
    if unknown:
        p.error(f"unknown {option if option == 'settings' else option[:-1] + '(s)'} {unknown}; known: {', '.join(known())}")
    setattr(args, option, got)
    from higgs_pack.targets.build import default_checkpoint

    machine = machine_facts()
    checkpoint = default_checkpoint(args.preset, args.seed)
    folder = Path(args.work or tempfile.mkdtemp(prefix=f"higgs-pack-{args.command}-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        report = measure(args, folder, checkpoint, machine)
    finally:
        if args.work is None:
            shutil.rmtree(folder, ignore_errors=True)
    report = {"command": args.command, "machine": machine, runtime: __import__(runtime).__version__,
              "preset": args.preset, "steps": args.steps, "repeats": args.repeats, **report}
    return print_report(report, f"{machine['cpu']}, {runtime} {report[runtime]}, preset {args.preset}, "
                        f"{args.steps} steps x {args.repeats} rounds", table(report), args.out)

