"""GEMM peaks and the int4 MatMul paths of a prefill, on one decoder layer's MatMuls (issue 32).

One Qwen3 layer's seven projections (q, k, v, o, gate, up, down; ``K x N`` from a
``text_config``) as a synthetic ONNX graph with random float32 weights, in a bundle's arithmetic:
``fp32`` (MLAS SGEMM); ``int8`` (``quantize_dynamic``: per-channel weights,
``DynamicQuantizeMatMul``); ``int4_b<block>_l<level>[_asym]`` (``MatMulNBitsQuantizer``, as a cpu
int4 decoder); ``ov_*`` (OpenVINO: ``fp32``, NNCF ``int8_sym`` / ``int4_sym_g<G>``, with the CPU
properties the variant names).  Timed at ``M`` rows, the variants interleaved, best of the rounds;
GOP/s counts ``2 K N`` operations per row and projection.  ``gemm_peak_gops`` (the bench's record)
is the best ``fp32`` and ``int8`` figure over the row counts.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Qwen3-4B's decoder dimensions (Higgs-Audio-v3's ``text_config``), for runs without a checkpoint.
QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}
#: Prefill lengths the bench records (positions), and the row counts of the A/B.
PREFILL_LENGTHS = (64, 256, 1024)
AB_ROWS = (1, 64, 256, 1024)
#: Variants of the bench's peak and the A/B's default list.
PEAK_VARIANTS = ("fp32", "int8")
AB_VARIANTS = ("fp32", "int8", "int4_b32_l4", "int4_b64_l4", "int4_b128_l4", "int4_b32_l4_asym", "int4_b32_l1",
               "int4_b128_l1", "int4_b32_l0", "int4_b32_l2", "ov_fp32", "ov_int8_sym", "ov_int4_sym_g64",
               "ov_int4_sym_g128", "ov_int4_sym_g64_bf16", "ov_int4_sym_g64_dq0")
#: OpenVINO variant suffix -> CPU compile properties over the runtime's int4 decoder ones.
OV_SUFFIXES = {"": {}, "bf16": {"INFERENCE_PRECISION_HINT": "bf16"}, "dq0": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
               "dq32": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}}


def layer_shapes(config: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """One decoder layer's MatMuls ``(name, K, N)`` (y[M, N] = x[M, K] @ W[K, N]) from a ``text_config``."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    q = int(config["num_attention_heads"]) * int(config["head_dim"])
    kv = int(config["num_key_value_heads"]) * int(config["head_dim"])
    return [("q", hidden, q), ("k", hidden, kv), ("v", hidden, kv), ("o", q, hidden),
            ("gate", hidden, inter), ("up", hidden, inter), ("down", inter, hidden)]


def ops_per_row(shapes: Sequence[tuple[str, int, int]]) -> int:
    """Multiply-adds x 2 of one row through every MatMul of :func:`layer_shapes`."""
    return sum(2 * k * n for _, k, n in shapes)


def float_layer(shapes: Sequence[tuple[str, int, int]], seed: int = 0) -> Any:
    """The layer's MatMuls as an ONNX graph: input ``x`` float32 [rows, hidden]; q, k, v, gate and
    up read ``x``, o reads q, down reads ``gate * up``; outputs o, k, v, down.  Weights N(0, 0.02)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    by = {name: (k, n) for name, k, n in shapes}
    inits = [numpy_helper.from_array((rng.standard_normal((k, n), dtype=np.float32) * 0.02), f"W_{name}")
             for name, k, n in shapes]
    src = {"q": "x", "k": "x", "v": "x", "gate": "x", "up": "x", "o": "y_q", "down": "h"}
    nodes = [helper.make_node("MatMul", [src[name], f"W_{name}"], [f"y_{name}"], name=f"mm_{name}") for name in by]
    nodes.insert(len(nodes) - 1, helper.make_node("Mul", ["y_gate", "y_up"], ["h"], name="act"))
    outs = [helper.make_tensor_value_info(f"y_{n}", TensorProto.FLOAT, ["rows", by[n][1]]) for n in ("o", "k", "v", "down")]
    graph = helper.make_graph(nodes, "decoder_layer_matmuls",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", by["q"][0]])], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@dataclass(frozen=True)
class Variant:
    """A parsed variant name: ``runtime`` (ort/ov), ``kind`` (fp32/int8/int4), int4 ``block``,
    ``level`` and ``symmetric``, OpenVINO ``group`` and extra ``properties``."""

    name: str
    runtime: str
    kind: str
    block: int = 0
    level: int = 0
    symmetric: bool = True
    properties: tuple[tuple[str, str], ...] = ()


def parse_variant(name: str) -> Variant:
    """``fp32``, ``int8``, ``int4_b<block>_l<level>[_asym]``, ``ov_fp32``, ``ov_int8_sym`` or
    ``ov_int4_sym_g<group>[_<suffix>]`` (suffix a key of :data:`OV_SUFFIXES`); InputError otherwise."""
    from higgs_pack.errors import InputError

    parts = name.split("_")
    try:
        if parts[0] == "ov":
            props = tuple(OV_SUFFIXES[parts[-1]].items()) if parts[-1] in OV_SUFFIXES else ()
            core = parts[1:-1] if props else parts[1:]
            if core == ["fp32"]:
                return Variant(name, "ov", "fp32", properties=props)
            if core == ["int8", "sym"]:
                return Variant(name, "ov", "int8", properties=props)
            if core[:2] == ["int4", "sym"] and len(core) == 3 and core[2].startswith("g"):
                return Variant(name, "ov", "int4", block=int(core[2][1:]), properties=props)
        elif name in ("fp32", "int8"):
            return Variant(name, "ort", name)
        elif parts[0] == "int4" and parts[1].startswith("b") and parts[2].startswith("l") and parts[3:] in ([], ["asym"]):
            return Variant(name, "ort", "int4", block=int(parts[1][1:]), level=int(parts[2][1:]), symmetric=not parts[3:])
    except (ValueError, IndexError):
        pass
    raise InputError(f"unknown GEMM variant {name!r}: fp32, int8, int4_b<block>_l<level>[_asym] (e.g. "
                     f"{AB_VARIANTS[2]}), ov_fp32, ov_int8_sym or ov_int4_sym_g<group>[_{'|_'.join(k for k in OV_SUFFIXES if k)}]")


def ort_model(model: Any, variant: Variant) -> Any:
    """``model`` (:func:`float_layer`) in ``variant``'s ONNX Runtime arithmetic, as a new model:
    ``model`` is left as it was (ONNX Runtime's ``MatMulNBitsQuantizer`` rewrites the model it is
    given, so each variant quantizes a copy)."""
    if variant.kind == "fp32":
        return model
    if variant.kind == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with tempfile.TemporaryDirectory(prefix="higgs-pack-gemm-") as tmp:
            src, dst = Path(tmp) / "f.onnx", Path(tmp) / "q.onnx"
            import onnx

            onnx.save_model(model, str(src))
            quantize_dynamic(src, dst, weight_type=QuantType.QInt8, per_channel=True)
            return onnx.load(str(dst))
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    quantizer = MatMulNBitsQuantizer(copy, bits=4, block_size=variant.block, is_symmetric=variant.symmetric,
                                     accuracy_level=variant.level)
    quantizer.process()
    return quantizer.model.model


def ort_runner(model: Any, session_options: Mapping[str, Any] | None, profile: str | None = None
               ) -> Callable[[np.ndarray], Any]:
    """An ONNX Runtime CPU session of ``model`` made as the runtime makes its decoder's
    (``session_options_for('cpu', {**DECODER_THREAD_POOL, **session_options})``; None: plain
    ``SessionOptions()``), ``profile``: a profile file prefix."""
    import onnxruntime as ort

    from higgs_pack.runtime.backends.onnxruntime.sessions import (
        DECODER_THREAD_POOL,
        session_options_for,
    )

    so = (ort.SessionOptions() if session_options is None else
          session_options_for("cpu", {**DECODER_THREAD_POOL, **session_options}))
    if profile:
        so.enable_profiling, so.profile_file_prefix = True, profile
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    run = lambda x: session.run(None, {"x": x})  # noqa: E731
    run.session = session  # type: ignore[attr-defined]
    return run


def ov_runner(model: Any, variant: Variant, threads: int | None = None) -> Callable[[np.ndarray], Any]:
    """``model`` read by OpenVINO, NNCF-compressed as ``variant`` says (``int4_sym`` group
    ``block``, or ``int8_sym`` per channel) and compiled for the CPU with the runtime's int4 decoder
    properties (``precision_config`` + ``decoder_compile_properties``, fp32's for ``ov_fp32``) and
    the variant's own; ``threads``: ``INFERENCE_NUM_THREADS``."""
    import openvino as ov

    from higgs_pack.runtime.backends.openvino.devices import (
        decoder_compile_properties,
        precision_config,
    )

    precision = "fp32" if variant.kind == "fp32" else "int4"
    props = {**precision_config("CPU", precision), **decoder_compile_properties(precision, stateful=False)["CPU"],
             **dict(variant.properties), **({"INFERENCE_NUM_THREADS": str(threads)} if threads else {})}
    with tempfile.TemporaryDirectory(prefix="higgs-pack-gemm-") as tmp:
        import onnx

        onnx.save_model(model, str(Path(tmp) / "f.onnx"))
        ov_model = ov.Core().read_model(str(Path(tmp) / "f.onnx"))
    if variant.kind != "fp32":
        import nncf

        kwargs: dict[str, Any] = ({"mode": nncf.CompressWeightsMode.INT8_SYM} if variant.kind == "int8" else
                                  {"mode": nncf.CompressWeightsMode.INT4_SYM, "group_size": variant.block,
                                   "ratio": 1.0, "all_layers": True})
        ov_model = nncf.compress_weights(ov_model, **kwargs)
    compiled = ov.Core().compile_model(ov_model, "CPU", props)
    request = compiled.create_infer_request()
    run = lambda x: request.infer({0: x}, share_inputs=True, share_outputs=True)  # noqa: E731
    run.compiled = compiled  # type: ignore[attr-defined]
    return run


def runner(model: Any, name: str, session_options: Mapping[str, Any] | None = None,
           threads: int | None = None) -> Callable[[np.ndarray], Any]:
    """A callable ``run(x float32 [M, hidden])`` of variant ``name`` of ``model``; ``threads``: each
    runtime's thread count (ONNX Runtime ``intra_op_num_threads``, OpenVINO ``INFERENCE_NUM_THREADS``)."""
    variant = parse_variant(name)
    if variant.runtime == "ov":
        return ov_runner(model, variant, threads)
    if threads:
        session_options = {**(session_options or {}), "intra_op_num_threads": threads}
    return ort_runner(ort_model(model, variant), session_options)


def time_runners(runners: Mapping[str, Callable[[np.ndarray], Any]], hidden: int, rows: Sequence[int], *,
                 rounds: int = 3, min_seconds: float = 0.3, seed: int = 0) -> dict[str, dict[int, float]]:
    """Per runner and row count, the best seconds of one call over ``rounds`` (each round: every
    runner in turn, rotated, each call repeated until ``min_seconds``; one untimed call first)."""
    rng = np.random.default_rng(seed)
    inputs = {m: rng.standard_normal((m, hidden), dtype=np.float32) for m in rows}
    best: dict[str, dict[int, float]] = {n: {} for n in runners}
    names = list(runners)
    for m in rows:
        for name in names:
            runners[name](inputs[m])  # untimed: a new shape
        for r in range(max(1, rounds)):
            for name in names[r % len(names):] + names[: r % len(names)]:
                calls, t0 = 0, time.perf_counter()
                while True:
                    runners[name](inputs[m])
                    calls += 1
                    elapsed = time.perf_counter() - t0
                    if elapsed >= min_seconds:
                        break
                best[name][m] = min(best[name].get(m, np.inf), elapsed / calls)
    return best


def rates(seconds: Mapping[int, float], ops: int) -> dict[int, dict[str, float]]:
    """Row count -> ``{ms, positions_per_s, gops}`` (one layer's MatMuls; ``ops`` per row)."""
    return {m: {"ms": round(s * 1e3, 3), "positions_per_s": round(m / s, 1), "gops": round(ops * m / s / 1e9, 2)}
            for m, s in seconds.items()}


def measure(config: Mapping[str, Any], variants: Sequence[str], rows: Sequence[int], *, rounds: int = 3,
            session_options: Mapping[str, Any] | None = None, min_seconds: float = 0.3, seed: int = 0,
            threads: int | None = None) -> dict[str, Any]:
    """Every variant of the layer of ``config`` at every row count (``threads``: as :func:`runner`):
    ``{shapes, ops_per_row, results: {variant: {rows: {ms, positions_per_s, gops}}}, build_s}``."""
    shapes = layer_shapes(config)
    model = float_layer(shapes, seed)
    t = time.perf_counter()
    runners = {name: runner(model, name, session_options, threads) for name in variants}
    build_s = time.perf_counter() - t
    del model
    timed = time_runners(runners, int(config["hidden_size"]), rows, rounds=rounds, min_seconds=min_seconds, seed=seed)
    ops = ops_per_row(shapes)
    return {"shapes": shapes, "ops_per_row": ops, "build_s": round(build_s, 1),
            "results": {name: rates(s, ops) for name, s in timed.items()}}


def gemm_peak(config: Mapping[str, Any], rows: Sequence[int] = PREFILL_LENGTHS, rounds: int = 2) -> dict[str, Any]:
    """The bench's ``gemm_peak_gops``: ``{"float32": GOP/s, "int8": GOP/s}``, the best of ``rows``
    through ONNX Runtime's float MatMul and int8 ``DynamicQuantizeMatMul`` on the decoder layer's
    shapes (runtime session options), with the per-row figures in ``gemm_peak_rows``."""
    got = measure(config, PEAK_VARIANTS, rows, rounds=rounds, session_options={}, min_seconds=0.2)
    res = got["results"]
    return {"gemm_peak_gops": {"float32": max(r["gops"] for r in res["fp32"].values()),
                               "int8": max(r["gops"] for r in res["int8"].values())},
            "gemm_peak_rows": {"float32": res["fp32"], "int8": res["int8"]},
            "gemm_shapes": [list(s) for s in got["shapes"]], "gemm_runtime": "onnxruntime"}


def worker_gemm_peak(spec: dict[str, Any]) -> dict[str, Any]:
    """The bench's ``gemm_peak`` worker: :func:`gemm_peak` of ``spec["config"]`` at ``spec["rows"]``."""
    from bench.common.systems import peak_rss_mb

    out = gemm_peak(spec["config"], spec.get("rows", PREFILL_LENGTHS), spec.get("rounds", 2))
    return {**out, "gemm_peak_rss_mb": round(peak_rss_mb(), 1)}


def profile_ops(model: Any, name: str, rows: int, session_options: Mapping[str, Any] | None = None,
                calls: int = 3) -> dict[str, Any]:
    """ONNX Runtime's profiler on variant ``name`` at ``rows`` rows: per op type the kernel's
    total ``dur`` (us, over ``calls`` runs) and the thread-pool facts it records."""
    import json
    import os

    with tempfile.TemporaryDirectory(prefix="higgs-pack-gemm-prof-") as tmp:
        variant = parse_variant(name)
        run = ort_runner(ort_model(model, variant), session_options, profile=str(Path(tmp) / "p"))
        x = np.random.default_rng(0).standard_normal((rows, model.graph.input[0].type.tensor_type.shape.dim[1].dim_value),
                                                     dtype=np.float32)
        for _ in range(calls):
            run(x)
        path = run.session.end_profiling()  # type: ignore[attr-defined]
        events = json.loads(Path(path).read_text())
        os.unlink(path)
    ops: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            ops[op] = ops.get(op, 0) + e["dur"]
    return {"rows": rows, "kernel_us": {k: round(v / calls, 1) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])}}


def table(report: Mapping[str, Any]) -> str:
    """Markdown: a row per variant, per row count ``positions/s (GOP/s)`` and its ratio to fp32; then
    the ``profile``'s kernel time per op type."""
    res = report["results"]
    rows = sorted({m for r in res.values() for m in r}, key=int)  # int keys, or str ones read back from JSON
    ref = res.get("fp32", {})
    lines = ["| variant | " + " | ".join(f"M={m} pos/s (GOP/s)" for m in rows) + " | " +
             " | ".join(f"M={m} vs fp32" for m in rows) + " |", "|---" * (1 + 2 * len(rows)) + "|"]
    for name, by in res.items():
        cells = [f"{by[m]['positions_per_s']:.0f} ({by[m]['gops']:.0f})" if m in by else "-" for m in rows]
        ratio = [f"{by[m]['positions_per_s'] / ref[m]['positions_per_s']:.2f}x" if m in by and m in ref else "-"
                 for m in rows]
        lines.append(f"| {name} | " + " | ".join(cells + ratio) + " |")
    text = "\n".join(lines)
    for name, prof in report.get("profile", {}).items():
        text += f"\n\n{name} at M={prof['rows']}, kernel us per call: " + ", ".join(
            f"{op} {us:.0f}" for op, us in prof["kernel_us"].items())
    return text


HELP = "one decoder layer's MatMuls per arithmetic and row count (bench/decoder/gemm.py; no checkpoint)"


def add_arguments(parser: Any) -> None:
    """The ``python -m bench.ab gemm-peak`` flags."""
    parser.add_argument("--variants", default=",".join(AB_VARIANTS),
                        help="comma-separated: fp32, int8, int4_b<block>_l<level>[_asym], ov_fp32, ov_int8_sym, "
                             "ov_int4_sym_g<group>[_bf16|_dq0|_dq32]")
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=list(AB_ROWS),
                        help="row counts M (prompt positions)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the variants interleaved (best kept)")
    parser.add_argument("--plain-session", action="store_true",
                        help="ONNX Runtime sessions with plain SessionOptions() (default: the runtime's)")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads per runtime (0: its default; 1 reads per-core speed on a loaded machine)")
    parser.add_argument("--min-seconds", type=float, default=0.3, help="each timing repeats a call this long")
    parser.add_argument("--profile", type=int, default=0, metavar="M",
                        help="also profile the ONNX Runtime variants at M rows (kernel time per op type)")
    parser.add_argument("--out", type=Path, help="write the JSON report here")


def command(args: Any) -> int:
    """``gemm-peak``: :func:`measure` at Qwen3-4B's layer shapes (:data:`QWEN3_4B`) and with
    ``--profile`` the kernels per op type of every ONNX Runtime variant, printed and written; 2 on a
    bad variant."""
    import onnxruntime
    import openvino

    from bench.common.systems import loadavg, machine_facts, print_report
    from higgs_pack.errors import InputError

    machine, variants = machine_facts(), [v for v in args.variants.split(",") if v.strip()]
    options = None if args.plain_session else {}
    try:
        for name in variants:
            parse_variant(name)
        report = {"dims": QWEN3_4B, "session_options": "plain" if options is None else "runtime",
                  "machine": dict(machine), "threads": args.threads or "default",
                  **measure(QWEN3_4B, variants, args.rows, rounds=args.rounds, session_options=options,
                            min_seconds=args.min_seconds, threads=args.threads or None)}
        if args.profile:
            model = float_layer(layer_shapes(QWEN3_4B))
            report["profile"] = {name: profile_ops(model, name, args.profile, options)
                                 for name in variants if parse_variant(name).runtime == "ort"}
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report.update(command="gemm-peak", onnxruntime=onnxruntime.__version__, openvino=openvino.__version__,
                  load=loadavg())
    return print_report(report, f"{machine['cpu']}, onnxruntime {report['onnxruntime']}, openvino "
                        f"{report['openvino']}, {report['session_options']} session options, threads "
                        f"{report['threads']}, {args.rounds} rounds, load {report['load']}", table(report), args.out)
