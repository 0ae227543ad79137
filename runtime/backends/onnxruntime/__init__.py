"""The ONNX Runtime backend: ONNX bundles on an execution provider (cpu, cuda, dml, openvino).

:data:`BACKEND` opens a bundle's sub-parts as ONNX Runtime sessions on the provider the
manifest names (:mod:`.sessions`), says which provider ran each node (:mod:`.placement`),
and ranks its bundles by their provider row's rung in the bundle choice.  onnxruntime is
imported only when a bundle is opened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from higgs_pack.errors import (
    ExecutionProviderUnavailable,
    InputError,
    Problem,
    install_extra,
)
from higgs_pack.manifests.model import SubPart
from higgs_pack.manifests.providers import CPU_PROVIDER, CPU_RUNG, EXECUTION_PROVIDERS
from higgs_pack.runtime.backends import Backend, OpenedParts, OpenOptions, register

if TYPE_CHECKING:  # pragma: no cover - types only
    from higgs_pack.runtime.machine.facts import Candidate, Inventory, Placement
    from higgs_pack.runtime.sources.opened import Bundle

#: Precisions whose ONNX Runtime decoder holds float weights (read in place with ``low_memory``).
FLOAT_DECODER_PRECISIONS = ("fp32", "fp16")


class OnnxRuntimeBackend(Backend):
    """ONNX bundles on ONNX Runtime; where they run is the manifest's ``execution_provider``."""

    name = "onnxruntime"
    format = "onnx"
    placement = "execution_provider"
    label = "ONNX Runtime"
    modules = ("onnxruntime", "higgs_pack.runtime.backends.onnxruntime.runners")
    preferred_on_cpus = ("amd", "arm", "other")
    install_hint = install_extra("cpu") + " (or [cuda], [dml], [winml])"

    def open(self, bundle: Bundle, options: OpenOptions) -> OpenedParts:
        """Create one session per sub-part on the provider asked for (default: the manifest's).

        ``options.execution_provider`` ``cpu`` on a bundle built for another provider is a
        fallback the caller asked for: every sub-part's ``where`` says so.  With
        ``options.low_memory`` a float decoder on the CPU provider reads its weights in place
        from the mapped file and gives the pages back after every step (the 4B fp32 decoder
        is 14.5 GB).  A GPU provider's float16 graph on the CPU casts per node instead of
        holding a float32 copy of every weight (4B dims, dml fp16 verification: 15.7 -> 9.0 GB).

        Raises:
            ExecutionProviderUnavailable: ``--device`` given, or the provider is missing
                (and no fallback asked).
            SignatureMismatch: a graph's I/O differs from the manifest.
        """
        from higgs_pack.runtime.backends.onnxruntime.runners import OrtDecoder, OrtSubPart
        from higgs_pack.runtime.backends.onnxruntime.sessions import (
            DECODER_THREAD_POOL,
            check_signature,
            create_session,
            stream_codec_thread_pool,
        )
        from higgs_pack.runtime.loop.pipeline import ModelConstants, step_input_shapes

        self.refuse_foreign_options(bundle, options)
        m = bundle.manifest
        ep = options.execution_provider or m["execution_provider"]
        cpu = CPU_PROVIDER.name
        override = "" if ep != cpu or m["execution_provider"] == cpu else (
            f" (explicit --execution-provider {cpu}; bundle built for {m['execution_provider']})")
        opened = OpenedParts()
        constants = ModelConstants.from_dict(m["constants"])
        for part, spec in m["subparts"].items():
            decoder = part == SubPart.LLM_DECODER
            lean = options.low_memory and decoder and ep == cpu and m["precision"] in FLOAT_DECODER_PRECISIONS
            # the decoder's and (on the CPU) the streaming codec's thread pools: sessions.py says why
            own = DECODER_THREAD_POOL if decoder else (
                stream_codec_thread_pool() if part == SubPart.AUDIO_TOKENIZER_STREAM and ep == cpu else {})
            session, used = create_session(
                bundle.file(spec["entry"]), ep,
                provider_options=m["provider_options"] if ep == m["execution_provider"] else {},
                session_options={**own, **m["session_options"]},
                allow_fallback=options.allow_fallback,
                float16_weights=m["precision"] == "fp16", prepacking=not lean,
            )
            check_signature(session, part, spec)
            if decoder:
                c = m["constants"]
                # the graph's external data: every listed file but the graph and ModelBuilder's JSON
                weights = tuple(bundle.file(f) for f in spec["files"]
                                if f != spec["entry"] and not f.endswith(".json")) if lean else ()
                runner = OrtDecoder(session, max_length=c["max_position_embeddings"],
                                    kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                                    page_out_weights=weights)
            else:
                runner = OrtSubPart(session, part, step_input_shapes(part, constants))
            opened.add(part, runner, used + override)
        return opened

    def batched_decoder(self, pipeline, max_batch: int, max_length: int):
        """A :class:`~higgs_pack.runtime.backends.onnxruntime.batched.BatchedOrtDecoder` on the
        decoder's session when that decoder shares its KV buffers (a GroupQueryAttention graph
        on the CPU or CUDA provider; on CUDA the buffers are in the GPU's memory);
        ``max_batch=1`` elsewhere.

        Raises:
            InputError: ``max_batch > 1`` for a decoder that copies its cache every step (a
                graph with ``position_ids``: ModelBuilder's MultiHeadAttention, as in dml and
                fp32 cuda bundles) or runs on a provider without shared KV buffers (DirectML).
        """
        from higgs_pack.runtime.backends.onnxruntime.batched import BatchedOrtDecoder
        from higgs_pack.runtime.backends.onnxruntime.runners import OrtDecoder

        decoder = pipeline.decoder
        provider = (decoder.session.get_providers() or ["?"])[0] if isinstance(decoder, OrtDecoder) else "?"
        if max_batch > 1 and isinstance(decoder, OrtDecoder) and decoder.shared_kv:
            c = pipeline.constants
            return BatchedOrtDecoder(decoder.session, max_batch=max_batch, max_length=max_length,
                                     kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
        if max_batch > 1:
            raise InputError.of(
                Problem.said(f"ONNX Runtime batches requests with a GroupQueryAttention decoder on the CPU or CUDA execution "
                             f"provider, which shares one KV buffer per layer between past and present; this decoder runs on "
                             f"{provider} and copies its cache every step (a graph with position_ids, as ModelBuilder writes "
                             "for dml and fp32 cuda bundles): use engine(max_batch=1) (the CLI's --batch 1), or a cpu bundle "
                             "or a cuda fp16/int4 one", code="unsupported_value"))
        return super().batched_decoder(pipeline, max_batch, max_length)

    def structure_checks(self):
        """onnx.checker, dtypes, kernel coverage, decoder I/O (:mod:`~higgs_pack.runtime.verification.static_checks`)."""
        from higgs_pack.runtime.verification.static_checks import static_checks

        return (static_checks,)

    def runtime_checks(self):
        """A quantized KV cache against the oracle's K/V
        (:func:`~higgs_pack.runtime.verification.kv_parity.check_kv_cache`; nothing for a float one),
        and node placement on the provider
        (:func:`~higgs_pack.runtime.verification.backend_checks.check_node_placement`)."""
        from higgs_pack.runtime.verification.backend_checks import check_node_placement
        from higgs_pack.runtime.verification.kv_parity import check_kv_cache

        return (check_kv_cache, check_node_placement)

    def placements(self, candidate: Candidate, inventory: Inventory, bench: Mapping[str, float]
                   ) -> tuple[list[Placement], str | None]:
        """The rung of the bundle's execution-provider row, where that provider creates sessions."""
        from higgs_pack.runtime.machine.facts import Placement, speed_key, speed_words

        row = EXECUTION_PROVIDERS.get(candidate.built_for)
        if row is None:
            return [], f"unknown execution provider {candidate.built_for!r}"
        reason = inventory.ort_providers.get(candidate.built_for, "not installed")
        if not inventory.ort_providers:
            reason = "onnxruntime is not installed"
        if reason is not None:
            return [], f"{row.ort_provider} unavailable ({reason}); {install_extra(row.packaging.extra)}"
        rung = row.rung.name
        what = f"the {row.label} execution provider" if row.gpu else row.ort_provider
        if rung == CPU_RUNG.name:
            what += f", {speed_words(candidate, bench)}"
        key = speed_key(candidate, inventory, bench, self.preferred_on_cpus)
        return [Placement(candidate, rung, candidate.built_for, key, what)], None

    def notes(self, candidates: list[Candidate], inventory: Inventory, runnable: set[str], of: str) -> list[str]:
        """A GPU provider's hardware present (seen on the bus, or its provider works) with no
        runnable bundle for it."""
        notes = []
        for row in EXECUTION_PROVIDERS.values():
            if not row.gpu:
                continue
            seen = inventory.hardware.get(row.hardware.kind) if row.hardware.kind else None
            if row.rung.name in runnable or not (seen or inventory.ort_ok(row.name)):
                continue
            has = any(c.backend == self.name and c.built_for == row.name for c in candidates)
            what = seen[0] if seen else f"{row.ort_provider} creates sessions"
            notes.append(f"{row.hardware.short} is present ({what}) but " + (
                f"the {row.name} bundle cannot run (see below)" if has else
                f"no {row.name} bundle{of} is visible; build one with `higgs-pack build --target {row.name}`"))
        return notes

    def load_keywords(self, bundle: Bundle, device: str) -> dict[str, str]:
        """``device="cuda"`` -> ``execution_provider="cuda"`` (a bundle EP name).

        Raises:
            ExecutionProviderUnavailable: not an execution provider name (lists them).
        """
        from higgs_pack.runtime.backends.onnxruntime.sessions import unknown_provider

        ep = str(device).lower()
        if ep not in EXECUTION_PROVIDERS:
            raise ExecutionProviderUnavailable(
                f"{bundle.name} is an ONNX Runtime bundle: "
                + unknown_provider(ep, "device= / --device"))
        return {"execution_provider": ep}


BACKEND = register(OnnxRuntimeBackend())
