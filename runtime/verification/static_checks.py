"""Static checks of an ONNX Runtime bundle: what needs only the files, no session and no GPU.

Returned by the ``onnxruntime`` backend object's ``structure_checks()`` (runtime/backends/onnxruntime),
so ``higgs-pack verify`` runs them on every ONNX bundle before any session exists:

1. **onnx.checker** ``check_model(path, full_check=True)`` on every ONNX file, external
   data resolved inside the bundle.  ModelBuilder puts ONNX Runtime's own
   ``SimplifiedLayerNormalization`` in the default domain, which the onnx package does
   not know: its schema is taken from the installed onnxruntime and registered for the
   check (said in the report), so the node is still checked against a real schema.
2. **dtypes**: every node's inputs agree with the op's type constraints (schemas of the
   installed onnxruntime, contrib ops included), every declared tensor type equals the
   type its producer makes, and a ``Cast``'s ``to`` is what its consumers need: no
   fp32/fp16 mismatch at a Cast boundary.
3. **op coverage** (providers with a ``kernel_table``: the GPU providers): every node has
   a kernel on the bundle's provider for its opset and dtypes (:mod:`higgs_pack.runtime.verification.kernels`).
   Nodes that would fall back to the CPU provider are listed; on the decoder's data path
   that fails the check (it would defeat the target), elsewhere it is reported.  The CPU
   provider's own coverage is read from the installed onnxruntime's kernel registry.
4. **decoder I/O** against the manifest and the model constants.

Needs ``onnx`` (every ONNX Runtime extra installs it) and ``onnxruntime``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from higgs_pack.manifests.model import SubPart
from higgs_pack.manifests.providers import CPU_PROVIDER, EXECUTION_PROVIDERS
from higgs_pack.runtime.sources.bundle import Bundle, regular_files
from higgs_pack.runtime.verification.kernels import (
    Coverage,
    coverage,
    cpu_kernel_table,
    load_kernel_table,
)
from higgs_pack.runtime.verification.onnx_types import (
    FLOAT_TYPES,
    GraphTypes,
    TypedNode,
    _np_dtype,
    register_runtime_schemas,
    type_graph,
)
from higgs_pack.runtime.verification.report import VerifyReport

#: The sub-part whose fallbacks fail the coverage check (it runs once per generated frame
#: as one graph: a CPU node in it means device<->host copies inside every step).
STRICT_SUBPARTS = frozenset({SubPart.LLM_DECODER.value})


def _load_model(bundle: Bundle, spec: dict[str, Any]):
    import onnx

    return onnx.load(str(bundle.file(spec["entry"])), load_external_data=False)


def check_onnx_files(bundle: Bundle, report: VerifyReport) -> None:
    """onnx.checker (full check, external data inside the bundle) on every ONNX sub-part."""
    import onnx

    for part, spec in bundle.manifest["subparts"].items():
        if spec["format"] != "onnx":
            continue
        registered = register_runtime_schemas(_load_model(bundle, spec))
        try:
            # A path (not a proto): the checker resolves external data relative to the file,
            # and open_bundle() has proved every location stays inside the bundle (or, for a
            # Hugging Face cache snapshot, links into its repository's blobs/: regular_files).
            with regular_files(bundle, spec["files"]) as root:
                onnx.checker.check_model(str(root / spec["entry"]), full_check=True)
        except Exception as exc:
            report.add(f"onnx.checker {part}", False, f"{type(exc).__name__}: {str(exc).strip()[:400]}")
            continue
        note = (f"; schema of {', '.join(registered)} registered from onnxruntime (an ONNX Runtime op "
                "in the default domain)") if registered else ""
        report.add(f"onnx.checker {part}", True, f"{spec['entry']} passes full_check{note}")


def check_dtypes(bundle: Bundle, report: VerifyReport) -> dict[str, GraphTypes]:
    """Type consistency of every ONNX sub-part (no fp32/fp16 mismatch at Cast boundaries)."""
    typed: dict[str, GraphTypes] = {}
    for part, spec in bundle.manifest["subparts"].items():
        if spec["format"] != "onnx":
            continue
        model = _load_model(bundle, spec)
        types = type_graph(model)
        typed[part] = types
        casts = sum(1 for n in types.nodes if n.op_type == "Cast")
        floats = sorted({t for n in types.nodes for t in n.bindings.values() if t in FLOAT_TYPES})
        if types.issues:
            shown = "; ".join(types.issues[:4])
            more = f" (and {len(types.issues) - 4} more)" if len(types.issues) > 4 else ""
            report.add(f"dtypes {part}", False, f"{len(types.issues)} inconsistencies: {shown}{more}")
        else:
            report.add(f"dtypes {part}", True, f"{len(types.nodes)} nodes consistent ({casts} Cast, floating "
                       f"types {'/'.join(floats) or 'none'})")
    return typed


def check_op_coverage(bundle: Bundle, typed: dict[str, GraphTypes], report: VerifyReport,
                      ep: str | None = None) -> dict[str, Coverage]:
    """Every node has a kernel on the bundle's provider; fallbacks to the CPU provider listed."""
    ep = ep or bundle.manifest["execution_provider"]
    table = load_kernel_table(ep)
    results: dict[str, Coverage] = {}
    for part, types in typed.items():
        cov = coverage(types, table)
        results[part] = cov
        data = [(n, why) for n, why in cov.missing if n.data_path]
        if not cov.missing:
            report.add(f"ops {part}", True, f"all {cov.checked} nodes have {table.provider} kernels ({table.source})")
            continue
        notes = sorted({table.notes[n.op_type] for n, _ in cov.missing if n.op_type in table.notes})
        detail = (f"would fall back to {CPU_PROVIDER.ort_provider}: {cov.summary()}"
                  f"{' [' + ' '.join(notes) + ']' if notes else ''}")
        if data and part in STRICT_SUBPARTS:
            report.add(f"ops {part}", False, f"{len(data)} data-path nodes {detail}")
        else:
            kind = "data-path" if data else "int64 shape-arithmetic"
            report.add(f"ops {part}", True, f"{len(cov.missing)} {kind} nodes {detail} (reported, not failed: "
                       f"{'this sub-part runs outside the per-step decoder graph' if data else 'ONNX Runtime keeps shape subgraphs on the CPU anyway'})")
    return results


def check_cpu_coverage(bundle: Bundle, typed: dict[str, GraphTypes], report: VerifyReport) -> None:
    """Which sub-parts the installed CPU provider has kernels for (informational)."""
    try:
        table = cpu_kernel_table()
    except Exception as exc:  # an onnxruntime build without the registry API
        report.add("CPU kernels", None, f"not read from the installed onnxruntime: {type(exc).__name__}: {exc}")
        return
    upcast: Counter[str] = Counter()
    missing: dict[str, Coverage] = {}
    for part, types in typed.items():
        cov = coverage(types, table)
        for node, why in cov.missing:
            widened = TypedNode(node.name, node.domain, node.op_type, node.since_version,
                                {p: "float" if t == "float16" else t for p, t in node.bindings.items()})
            if widened.bindings != node.bindings and table.find(widened)[0]:
                # ONNX Runtime's CPU provider wraps such nodes in Casts (InsertedPrecisionFreeCast_*)
                # and runs them in float32: measured with onnxruntime 1.32's profiler.
                upcast[f"{node.op_type}"] += 1
            else:
                missing.setdefault(part, Coverage()).missing.append((node, why))
    lines = []
    if upcast:
        lines.append("float16 nodes the CPU provider runs in float32 through Casts it inserts: "
                     + ", ".join(f"{op} x{n}" for op, n in sorted(upcast.items())))
    if missing:
        lines.append("no CPU kernel: " + "; ".join(f"{part}: {cov.summary()}" for part, cov in missing.items()))
    report.add("CPU kernels", True, f"{table.source}: " + ("; ".join(lines) if lines else
               "a kernel for every node") + " (informational; limits inside a kernel show up in CPU parity)")


def check_decoder_io(bundle: Bundle, report: VerifyReport) -> None:
    """The decoder graph's I/O equals the manifest's and fits the model constants."""
    m = bundle.manifest
    spec = m["subparts"][SubPart.LLM_DECODER.value]
    if spec["format"] != "onnx":
        return
    model = _load_model(bundle, spec)
    problems: list[str] = []

    def sig(values):
        out = {}
        for v in values:
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in v.type.tensor_type.shape.dim]
            out[v.name] = (_np_dtype(v.type.tensor_type.elem_type), dims)
        return out

    inits = {i.name for i in model.graph.initializer}
    graph_in = sig(v for v in model.graph.input if v.name not in inits)
    graph_out = sig(model.graph.output)
    for kind, graph, listed in (("input", graph_in, spec["inputs"]), ("output", graph_out, spec["outputs"])):
        want = {t["name"]: (t["dtype"], t["shape"]) for t in listed}
        for name in sorted(set(graph) | set(want)):
            if name not in graph:
                problems.append(f"manifest {kind} {name!r} is not in the graph")
            elif name not in want:
                problems.append(f"graph {kind} {name!r} is not in the manifest")
            else:
                (gd, gs), (wd, ws) = graph[name], want[name]
                fixed_differ = len(gs) != len(ws) or any(isinstance(a, int) and isinstance(b, int) and a != b
                                                         for a, b in zip(gs, ws, strict=False))
                if gd != wd or fixed_differ:
                    problems.append(f"{kind} {name!r}: graph {gd}{gs}, manifest {wd}{ws}")
    c = m["constants"]
    past = sorted(n for n in graph_in if n.startswith("past_key_values."))
    present = sorted(n for n in graph_out if n.startswith("present."))
    if "inputs_embeds" not in graph_in or "hidden_states" not in graph_out:
        problems.append("the decoder must take inputs_embeds and return hidden_states (llm_decoder contract)")
    else:
        embed_dtype, embed_shape = graph_in["inputs_embeds"]
        if embed_shape[-1] != c["hidden_size"]:
            problems.append(f"inputs_embeds width {embed_shape[-1]} != hidden_size {c['hidden_size']}")
        if graph_out["hidden_states"][0] != embed_dtype:
            problems.append(f"hidden_states is {graph_out['hidden_states'][0]}, inputs_embeds {embed_dtype}")
        kv_record = spec.get("quantization", {}).get("kv_cache")
        kv_dtype = kv_record["dtype"] if kv_record else embed_dtype  # a quantized KV cache: its own dtype
        for name in past:
            dtype, shape = graph_in[name]
            if dtype != kv_dtype:
                problems.append(f"{name} is {dtype}, " + (f"the manifest's {kv_record['scheme']} KV cache {kv_dtype}"
                                                          if kv_record else f"inputs_embeds {embed_dtype}"))
            if len(shape) != 4 or shape[1] != c["num_key_value_heads"]:
                problems.append(f"{name} shape {shape}: expected [batch, {c['num_key_value_heads']}, past, head_dim]")
    if len(past) != 2 * c["num_layers"]:
        problems.append(f"{len(past)} past_key_values inputs for {c['num_layers']} layers (want key+value per layer)")
    if [p.replace("past_key_values.", "present.") for p in past] != present:
        problems.append("present.* outputs do not mirror past_key_values.* inputs")
    gpu = m["execution_provider"] in EXECUTION_PROVIDERS and EXECUTION_PROVIDERS[m["execution_provider"]].gpu
    if m["precision"] in ("fp16", "int4") and gpu and graph_in.get(
            "inputs_embeds", ("float16",))[0] != "float16":
        problems.append(f"a {m['execution_provider']} {m['precision']} decoder should take float16 embeddings "
                        f"(ModelBuilder's io dtype), found {graph_in['inputs_embeds'][0]}")
    if problems:
        report.add("decoder I/O", False, "; ".join(problems[:6]))
    else:
        dtype = graph_in["inputs_embeds"][0]
        extra = ", position_ids" if "position_ids" in graph_in else ""
        report.add("decoder I/O", True, f"matches the manifest: inputs_embeds {dtype}[..,{c['hidden_size']}], "
                   f"attention_mask{extra}, {len(past)} KV tensors {graph_in[past[0]][0] if past else dtype} "
                   f"for {c['num_layers']} layers, hidden_states {dtype}")


def static_checks(bundle: Bundle, report: VerifyReport, *, ep: str | None = None) -> dict[str, Any]:
    """Run the module docstring's checks on an opened ONNX bundle, adding to ``report``.

    Op coverage runs for a provider with a ``kernel_table`` (``ep``, default the
    bundle's own); the CPU provider's coverage is reported for a bundle built for
    another provider.
    """
    ep = ep or bundle.manifest["execution_provider"]
    row = EXECUTION_PROVIDERS.get(ep)
    check_onnx_files(bundle, report)
    typed = check_dtypes(bundle, report)
    cov = check_op_coverage(bundle, typed, report, ep) if row is not None and row.sessions.kernel_table else {}
    if row is not CPU_PROVIDER:
        check_cpu_coverage(bundle, typed, report)
    check_decoder_io(bundle, report)
    return {"types": typed, "coverage": cov}
