"""A quantized KV cache in an ONNX decoder: what the graph holds, and its check in ``verify``.

ModelBuilder 0.18 (``--extra_options kv_cache_quant_scheme=int8_per_channel
kv_cache_scale_file=...``) writes the decoder's ``past_key_values.*`` / ``present.*`` as
int8 [batch, kv_heads, positions, head_dim] and gives every ``GroupQueryAttention`` node
two float32 scale initializers as its inputs 12 and 13 (``k_scale``, ``v_scale``: a scalar
for ``per_tensor``, ``kv_heads * head_dim`` values for ``per_channel``) and the attributes
``kv_cache_bit_width`` (8) and ``k_quant_type`` / ``v_quant_type`` (``PER_TENSOR`` /
``PER_CHANNEL``).  Read in onnxruntime_genai/models/builders/base.py
(``make_kv_cache_init``, ``make_kv_cache_scale_initializers``, ``make_group_query_attention``).

The scales are symmetric (``scale = threshold / 128`` for int8, no zero point:
onnxruntime_genai/models/quantization/kv_cache_calibration.py), and the per-channel index
of a cached value is ``head * head_dim + d`` (the tool computes them on K/V transposed to
[positions, kv_heads * head_dim]).  So a cached value stands for ``q * scale``; measured on
the tiny and bench presets, that dequantization of ONNX Runtime 1.32's own int8 cache
matches the float graph's K/V within the int8 rounding (relative L2 0.007-0.014 per layer).

:func:`check_kv_cache` uses exactly that: it runs the bundle's decoder on the golden prompt,
dequantizes the int8 ``present.*`` its ONNX Runtime kernel wrote, and compares them with
the PyTorch oracle's K/V cache on the same prompt under the manifest's rule
(``parity.kv_cache`` of ``llm_decoder``) with :func:`~higgs_pack.runtime.verification.report.judge_parity`:
the KV cache's quantization is judged against the float reference like the weights' is
(against the oracle with the bundle's own weights where those are quantized).  Wrong
scales (a scale file x10, a tampered initializer) show up there, whatever the hidden
states do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.errors import BundleError
from higgs_pack.manifests.model import SubPart

#: ``GroupQueryAttention`` input positions of the KV scales (com.microsoft schema order, as
#: ModelBuilder 0.18 writes them: 12 k_scale, 13 v_scale, 14/15 q/k norm weights).
K_SCALE_INPUT, V_SCALE_INPUT = 12, 13
#: ``kv_cache_bit_width`` -> numpy dtype of the cache ModelBuilder declares (int4 is packed
#: two per uint8, which this runtime does not read).
CACHE_DTYPES = {8: "int8"}
#: Golden keys of the oracle's K/V cache after the golden prompt: the float oracle's, and the
#: oracle's with the bundle's own (read-back) weights where those were quantized.
GOLDEN_KV = "llm_decoder/kv/"
GOLDEN_KV_MATCHED = "llm_decoder/kv_matched/"


def graph_kv_cache(model_path: str | Path) -> dict[str, Any] | None:
    """What a decoder graph's quantized KV cache is, read from the graph itself.

    Args:
        model_path: the decoder's ``.onnx`` (external data next to it, for large scales).

    Returns:
        None for a float KV cache (no ``kv_cache_bit_width`` on its GroupQueryAttention nodes),
        else ``{"dtype": "int8", "bits": 8, "scheme": "int8_per_channel" | "int8_per_tensor",
        "scales": {"past_key_values.{i}.key" | ".value": float32 [1] or [kv_heads * head_dim]}}``.

    Raises:
        BundleError: the nodes disagree on the bit width or quantization type, a node has no
            scale input, or a bit width other than 8 (ModelBuilder's packed int4 cache).
    """
    import onnx
    from onnx import numpy_helper

    path = Path(model_path)
    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    bits = {int(a.get("kv_cache_bit_width", 0)) for a in attrs}
    if bits in (set(), {0}):
        return None
    kinds = {a.get("k_quant_type", b"NONE") for a in attrs} | {a.get("v_quant_type", b"NONE") for a in attrs}
    if len(bits) != 1 or len(kinds) != 1:
        raise BundleError(f"{path}: GroupQueryAttention nodes disagree on the KV cache quantization "
                          f"(kv_cache_bit_width {sorted(bits)}, k/v_quant_type {sorted(kinds)})")
    width = bits.pop()
    if width not in CACHE_DTYPES:
        raise BundleError(f"{path}: a {width}-bit KV cache; this runtime reads {sorted(CACHE_DTYPES)}-bit ones")
    mode = kinds.pop()
    mode = (mode.decode() if isinstance(mode, bytes) else str(mode)).lower()
    initializers = {i.name: i for i in model.graph.initializer}
    scales: dict[str, np.ndarray] = {}
    for node in nodes:
        inputs = list(node.input)
        for side, position in (("key", K_SCALE_INPUT), ("value", V_SCALE_INPUT)):
            name = inputs[position] if len(inputs) > position else ""
            if name not in initializers:
                raise BundleError(f"{path}: GroupQueryAttention {node.name} has no {side} scale initializer "
                                  f"(input {position}: {name!r})")
            past = inputs[3 if side == "key" else 4]
            scales[past] = numpy_helper.to_array(initializers[name], str(path.parent)).astype(np.float32).ravel()
    return {"dtype": CACHE_DTYPES[width], "bits": width, "scheme": f"int{width}_{mode}", "scales": scales}


def dequantize(cache: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 values of an int8 KV cache tensor: ``q * scale`` (symmetric, no zero point).

    Args:
        cache: int8 [batch, kv_heads, positions, head_dim] (a ``present.*`` output).
        scale: float32 [1] (per tensor) or [kv_heads * head_dim] (per channel; index
            ``head * head_dim + d``).

    Raises:
        BundleError: a scale of another size.
    """
    _, heads, _, dim = cache.shape
    if scale.size == 1:
        return cache.astype(np.float32) * np.float32(scale.ravel()[0])
    if scale.size != heads * dim:
        raise BundleError(f"a KV scale of {scale.size} values for a cache of {heads} heads x {dim}")
    return cache.astype(np.float32) * scale.reshape(1, heads, 1, dim)


def present_kv(session, inputs_embeds: np.ndarray, head_dim: int) -> dict[str, np.ndarray]:
    """The ``present.*`` K/V a decoder session writes for one prompt from an empty cache.

    Args:
        session: the decoder's ``InferenceSession`` (a ModelBuilder GroupQueryAttention graph).
        inputs_embeds: float32 [1, S, hidden].
        head_dim: the empty past's last dimension (ModelBuilder leaves it symbolic,
            ``kv_cache_dim``).

    Returns:
        ``past_key_values.{i}.key|value`` name -> the matching ``present.*`` output in the
        graph's KV dtype, [1, kv_heads, S, head_dim].
    """
    from higgs_pack.runtime.backends.onnxruntime.sessions import ORT_TYPES

    inputs = {i.name: i for i in session.get_inputs()}
    s = inputs_embeds.shape[1]
    feeds: dict[str, np.ndarray] = {
        "inputs_embeds": np.ascontiguousarray(inputs_embeds, dtype=ORT_TYPES[inputs["inputs_embeds"].type]),
        "attention_mask": np.ones((1, s), dtype=np.int64)}
    past = sorted(n for n in inputs if n.startswith("past_key_values."))
    for name in past:
        feeds[name] = np.zeros((1, inputs[name].shape[1], 0, head_dim), dtype=ORT_TYPES[inputs[name].type])
    if "position_ids" in inputs:
        feeds["position_ids"] = np.arange(s, dtype=np.int64)[None]
    present = [n.replace("past_key_values.", "present.") for n in past]
    return dict(zip(past, session.run(present, feeds), strict=True))


def kv_cache_errors(bundle: Any, session: Any, golden: dict[str, np.ndarray], reference: str
                    ) -> dict[str, float | None]:
    """The bundle's dequantized KV cache against the oracle's, on the golden prompt.

    Args:
        bundle: the opened bundle (its decoder graph holds the scales).
        session: the decoder's ``InferenceSession`` (the loaded pipeline's).
        golden: ``reference/golden.npz``: ``llm_decoder/in/inputs_embeds`` and the oracle's K/V
            after it under :data:`GOLDEN_KV` (float oracle) or :data:`GOLDEN_KV_MATCHED`.
        reference: ``"float"`` or ``"matched"``: which oracle's K/V.

    Returns:
        :func:`~higgs_pack.runtime.verification.report.output_errors` over every layer's key and
        value (``measured``: the worst cosine; ``measured_max_abs``; ``rel_l2``: the largest).

    Raises:
        BundleError: the decoder graph's KV cache is float, or the golden file lacks the
            oracle's K/V.
    """
    from higgs_pack.runtime.verification.report import output_errors

    spec = bundle.manifest["subparts"][SubPart.LLM_DECODER.value]
    info = graph_kv_cache(bundle.file(spec["entry"]))
    if info is None:
        raise BundleError("the manifest records a quantized KV cache, but the decoder graph's KV cache is float")
    prefix = GOLDEN_KV_MATCHED if reference == "matched" else GOLDEN_KV
    head_dim = int(bundle.manifest["constants"]["head_dim"])
    pairs = []
    for past, cache in present_kv(session, golden["llm_decoder/in/inputs_embeds"], head_dim).items():
        key = prefix + past.replace("past_key_values.", "present.")
        if key not in golden:
            raise BundleError(f"reference/golden.npz has no {key} (the oracle's K/V cache); rebuild the bundle")
        pairs.append((golden[key], dequantize(cache, info["scales"][past])))
    return output_errors(pairs, "cosine")


def check_kv_cache(bundle: Any, pipeline: Any, report: Any) -> None:
    """``verify``: a quantized KV cache judged against the oracle's (one "parity llm_decoder KV
    cache" line; nothing for a float KV cache).

    The rule is the manifest's ``subparts.llm_decoder.parity.kv_cache`` (``metric`` cosine,
    ``threshold``, ``max_rel_l2``, ``reference``), judged by
    :func:`~higgs_pack.runtime.verification.report.judge_parity`; the measured errors go to
    ``report.parity["llm_decoder"]["kv_cache"]`` (the build records them in the manifest).
    """
    from higgs_pack.errors import HiggsPackError
    from higgs_pack.runtime.verification.report import judge_parity, read_golden

    spec = bundle.manifest["subparts"].get(SubPart.LLM_DECODER.value, {})
    rule = spec.get("parity", {}).get("kv_cache")
    if not spec.get("quantization", {}).get("kv_cache"):
        return
    name = "parity llm_decoder KV cache"
    if rule is None:
        report.add(name, False, "the manifest records a quantized KV cache but no parity.kv_cache rule to judge it by")
        return
    session = getattr(pipeline.decoder, "session", None)
    if session is None:
        report.add(name, False, "the decoder is not an ONNX Runtime session")
        return
    try:
        errors = kv_cache_errors(bundle, session, read_golden(bundle), rule.get("reference", "float"))
    except HiggsPackError as exc:
        report.add(name, False, str(exc))
        return
    except Exception as exc:  # onnxruntime's own error types
        report.add(name, False, f"{type(exc).__name__}: {exc}")
        return
    ok, detail = judge_parity(rule, errors)
    measured = {k: (round(v, 9) if isinstance(v, float) else v) for k, v in errors.items()}
    report.parity.setdefault(SubPart.LLM_DECODER.value, {})["kv_cache"] = {**rule, **measured}
    scheme = spec["quantization"]["kv_cache"].get("scheme", "?")
    report.add(name, ok, f"{scheme}, dequantized vs the {rule.get('reference', 'float')} oracle's K/V: {detail}",
               errors["measured"])
