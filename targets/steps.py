"""The heavy steps of a build, each run in its own child process by :func:`run_step`.

Every function takes JSON-able keyword arguments (paths as strings) and returns a
JSON-able value; :mod:`higgs_pack.targets.build` calls them through
:func:`higgs_pack.exporters.process.run_step`, so the memory a step used (the decoder's
weights, the oracle, ONNX Runtime sessions) is returned to the system before the next
step starts.  A key ``_detail`` in a returned dict becomes the step record's breakdown.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from higgs_pack.errors import BuildError, HiggsPackError
from higgs_pack.exporters.process import StepRecord, TreeMemory, run_step
from higgs_pack.manifests.model import SUBPART_IO, SubPart

__all__ = ["StepRecord", "TreeMemory", "run_step"]


def write_hf_dir(checkpoint: str, out_dir: str) -> str:
    """The checkpoint's backbone as a standard Qwen3 HF directory (one tensor in memory at a time)."""
    from higgs_pack.exporters.checkpoint.models import write_qwen3_hf_dir
    from higgs_pack.exporters.checkpoint.reader import open_checkpoint

    with open_checkpoint(checkpoint) as ckpt:
        return str(write_qwen3_hf_dir(ckpt, Path(out_dir)))


def export_decoder(hf_dir: str, exporter: str, part: str, precision: str, bundle_dir: str,
                   work_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    """Run a ``decoder`` exporter (ModelBuilder, optimum-intel) on the Qwen3 directory."""
    from higgs_pack.exporters.catalog import get_exporter

    info = get_exporter(exporter)
    bundle = Path(bundle_dir)
    kwargs = {**options, info.scratch: Path(work_dir)}
    try:
        result = info.load()(Path(hf_dir), bundle / part, precision=precision, bundle_dir=bundle, **kwargs)
    except HiggsPackError:
        raise
    except Exception as exc:  # the tool's own failure: name the sub-part and tool
        raise BuildError(f"{exporter} failed on {part} ({precision}): {exc}") from exc
    return result.to_dict()


def export_modules(checkpoint: str, rows: list[dict[str, Any]], bundle_dir: str, work_dir: str) -> dict[str, Any]:
    """Run the ``module`` exporters (Olive) for ``rows`` (``{part, exporter, precision, options}``).

    Each sub-part's torch module is built from the checkpoint just before its export
    and dropped after it.
    """
    from higgs_pack.exporters.catalog import get_exporter
    from higgs_pack.exporters.checkpoint.reader import open_checkpoint
    from higgs_pack.exporters.pytorch.modules import DYNAMIC_AXES, build_modules, example_inputs

    bundle = Path(bundle_dir)
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    with open_checkpoint(checkpoint) as ckpt:
        for row in rows:
            part = SubPart(row["part"])
            info = get_exporter(row["exporter"])
            start = time.perf_counter()
            module = build_modules(ckpt, [part])[part]
            ckpt.close()
            if part == SubPart.AUDIO_TOKENIZER_STREAM:
                module = _measured_stream(module, ckpt.constants)
            inputs, outputs = SUBPART_IO[part]
            try:
                result = info.load()(
                    module, example_inputs(part, ckpt.constants, module=module), input_names=list(inputs),
                    output_names=list(outputs), dynamic_axes=DYNAMIC_AXES[part], out_dir=bundle,
                    name=part.value, precision=row["precision"], work_dir=Path(work_dir) / part.value,
                    subpart=part.value, bundle_dir=bundle, **row["options"],
                )
            except HiggsPackError:
                raise
            except Exception as exc:
                raise BuildError(f"{info.name} failed on {part.value} ({row['precision']}): {exc}") from exc
            if part == SubPart.AUDIO_TOKENIZER:
                result = _with_stream_context(result, module, ckpt.constants)
            if part == SubPart.AUDIO_TOKENIZER_STREAM:
                from dataclasses import replace

                result = replace(result, options={**result.options, **module.options()})
            del module
            results[part.value] = result.to_dict()
            seconds[part.value] = round(time.perf_counter() - start, 2)
    return {"results": results, "_detail": {"seconds": seconds}}


def _measured_stream(module, constants):
    """The streaming codec with the smallest lookahead inside the codec's parity limit (the fp32
    export limit, :data:`~higgs_pack.targets.base.EXPORT_REL_L2`), its table of lookaheads measured
    (:func:`~higgs_pack.exporters.pytorch.stream_codec.measured_stream`).

    Raises:
        BuildError: not even the exact stream matches one-shot decoding.
    """
    from higgs_pack.exporters.pytorch.stream_codec import measured_stream
    from higgs_pack.targets.base import EXPORT_REL_L2

    try:
        return measured_stream(module.one_shot, constants.num_codebooks, constants.codebook_size,
                               constants.hop_length, EXPORT_REL_L2["fp32"])
    except ValueError as exc:
        raise BuildError(f"audio_tokenizer_stream: {exc}") from exc


def _with_stream_context(result, module, constants):
    """Record the codec decoder's chunking context (``options.stream_context_frames``) that
    streaming synthesis reads; a static chunked codec (npu) already measured it."""
    from dataclasses import replace

    from higgs_pack.exporters.pytorch.modules import codec_stream_context

    measured = (result.options.get("chunking") or {}).get("context")
    entry = {"stream_context_frames": int(measured)} if measured else codec_stream_context(module, constants)
    return replace(result, options={**result.options, **entry})


def capture(checkpoint: str, out_path: str, bundle_dir: str | None = None,
            subparts: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Golden reference outputs of the PyTorch oracle, and the matched oracle's for the
    quantized sub-parts of ``bundle_dir`` (see :func:`~higgs_pack.exporters.pytorch.golden.capture_golden`)."""
    from higgs_pack.exporters.checkpoint.reader import open_checkpoint
    from higgs_pack.exporters.pytorch.golden import GREEDY_TEXT, capture_golden

    with open_checkpoint(checkpoint) as ckpt:
        captured = capture_golden(ckpt, Path(out_path), bundle_dir=Path(bundle_dir) if bundle_dir else None,
                                  subparts=subparts)
    return {**captured, "text": GREEDY_TEXT}


def verify(bundle_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    """Build-time verification of the staged bundle (no cases); the report as data."""
    from higgs_pack.runtime.verification.verify import verify_bundle

    report = verify_bundle(Path(bundle_dir), synthesize_cases=False, **options)
    failed = "; ".join(f"{c.name}: {c.detail}" for c in report.checks if c.ok is False)
    return {"ok": report.ok, "failed": failed, "parity": report.parity, "report": report.to_dict()}
