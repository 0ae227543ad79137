"""The generic build loop: plan -> export every sub-part -> golden -> manifest -> verify -> move.

Nothing here knows a particular target: the :class:`~higgs_pack.targets.base.Target`
declaration says which exporter builds each sub-part.  The bundle is assembled
in a temporary sibling directory and moved into place only once it is complete
and its own verification passed; a failed or interrupted build leaves nothing
that loads and never touches an existing bundle.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from higgs_pack.exporters.result import installed_version
from higgs_pack.manifests.constants import FORMAT_VERSION, SUBPART_IO, SubPart
from higgs_pack.manifests.errors import BuildError, BundleError, HiggsPackError
from higgs_pack.manifests.manifest import MANIFEST_NAME, file_entry, read_manifest, write_manifest
from higgs_pack.runtime.paths import cache_root
from higgs_pack.targets.base import (
    CODE_AGREEMENT_THRESHOLD,
    COSINE_THRESHOLDS,
    DECODER_COSINE_THRESHOLDS,
)
from higgs_pack.targets.plan import BuildPlan, make_plan, plan_mismatches

log = logging.getLogger(__name__)

DEFAULT_MODEL_SLUG = "higgs-audio-v3-tiny"
DEFAULT_LICENSE = "research / non-commercial (Boson AI Higgs Audio licence; see the model card)"
REFERENCE_FILE = "reference/golden.npz"


def default_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """The embedded default checkpoint: generated once, deterministically, then reused.

    Written to a temporary directory and renamed, so a half-written checkpoint is
    never reused.
    """
    from higgs_pack.exporters.tiny import make_tiny_checkpoint

    path = cache_root() / "checkpoints" / f"{preset}-seed{seed}"
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        make_tiny_checkpoint(tmp, preset=preset, seed=seed)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def model_slug(model: str | None) -> str:
    """Bundle-name slug of a checkpoint: ``higgs-audio-v3-tiny`` for the default."""
    if model is None:
        return DEFAULT_MODEL_SLUG
    name = Path(str(model).rstrip("/")).name or str(model)
    slug = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-.")
    return slug or "model"


def bundle_name(slug: str, plan: BuildPlan) -> str:
    """``<model-slug>-<target>-<precision>[-<variant>]``."""
    parts = [slug, plan.target.name, plan.precision]
    if plan.variant:
        parts.append(plan.variant)
    return "-".join(parts)


def _remove_dead_stagings(out: Path) -> None:
    """Delete staging directories of builds of ``out`` whose process is gone (killed builds).

    Staging names carry the building process id; a live process's directory is left alone.
    """
    for stale in out.parent.glob(f".{out.name}.building-*"):
        pid = stale.name.split(".building-", 1)[1].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            log.warning("removing %s, left by an interrupted build", stale)
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:
            continue


@contextmanager
def _staging(out: Path):
    """A temporary directory beside ``out`` (same filesystem, so the final move is a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_stagings(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_good_bundle(path: Path) -> bool:
    try:
        read_manifest(path)
    except HiggsPackError:
        return False
    return True


def build(
    target: str,
    *,
    precision: str | None = None,
    model: str | Path | None = None,
    out: str | Path | None = None,
    variant: str | None = None,
    force: bool = False,
    dist_dir: str | Path = "dist",
    progress=None,
) -> Path:
    """Build one bundle.

    Args:
        target: registered target name (``cpu``, ``cuda``, ``dml``, ``openvino``).
        precision: bundle precision; default the target's default.
        model: checkpoint directory or Hugging Face repo id; default the
            embedded tiny checkpoint (generated from seed 0).
        out: bundle directory; default ``dist/<slug>-<target>-<precision>``.
        variant: target variant (``npu`` for openvino).
        force: replace an existing bundle at ``out`` (only after the new one passed).
        dist_dir: parent of the default ``out``.
        progress: optional ``callable(str)`` told about each step.

    Returns:
        The bundle directory.

    Raises:
        BuildPlanError: unknown target/precision/variant (before anything heavy runs).
        BundleError: ``out`` holds a bundle and ``force`` is False, or ``out`` is a
            non-empty directory that is not a bundle.
        CheckpointError: the checkpoint cannot be read.
        BuildError: an exporter failed or the bundle failed its own verification.
    """
    plan = make_plan(target, precision, variant)
    say = progress or (lambda msg: log.info(msg))
    slug = model_slug(None if model is None else str(model))
    out = Path(out) if out is not None else Path(dist_dir) / bundle_name(slug, plan)
    if out.exists():
        if _is_good_bundle(out):
            if not force:
                raise BundleError(
                    f"{out} already holds a bundle; pass --force (force=True) to replace it "
                    "once the new build has passed verification, or choose another --out"
                )
        elif not out.is_dir() or any(out.iterdir()):
            raise BundleError(f"{out} exists and is not a bundle; choose an empty or new --out")
    say(plan.render())
    start = time.perf_counter()

    from higgs_pack.exporters.checkpoint import open_checkpoint

    source = str(model) if model is not None else str(default_checkpoint())
    ckpt = open_checkpoint(source)
    with _staging(out) as stage, tempfile.TemporaryDirectory(prefix="higgs-pack-work-") as work:
        work_dir = Path(work)
        bundle_dir = stage / "bundle"
        bundle_dir.mkdir()
        results = _export_all(plan, ckpt, bundle_dir, work_dir, say)
        tokenizer_file = _copy_tokenizer(ckpt, bundle_dir)
        say("capturing golden reference outputs with the PyTorch oracle")
        from higgs_pack.exporters.golden import GREEDY_TEXT, capture_golden

        golden_frames = capture_golden(ckpt, bundle_dir / REFERENCE_FILE)
        manifest = _assemble(plan, ckpt, slug, source, bundle_dir, results, tokenizer_file,
                             golden_frames, GREEDY_TEXT, time.perf_counter() - start)
        write_manifest(bundle_dir, manifest)
        say("verifying the new bundle")
        _verify_and_record(plan, bundle_dir, manifest)
        _move_into_place(bundle_dir, out, stage)
    say(f"bundle ready: {out}")
    return out


def _export_all(plan: BuildPlan, ckpt, bundle_dir: Path, work_dir: Path, say) -> dict[SubPart, Any]:
    """Run every planned exporter; decoders get a standard Qwen3 HF dir, the rest torch modules."""
    from higgs_pack.exporters.torch_modules import DYNAMIC_AXES, build_modules, example_inputs

    results: dict[SubPart, Any] = {}
    hf_dir = None
    modules = None
    for row in plan.rows:
        fn = row.exporter.load()
        part = row.subpart
        say(f"exporting {part.value} ({row.precision}) with {row.exporter.name}")
        try:
            if row.exporter.kind == "decoder":
                if hf_dir is None:
                    hf_dir = ckpt.write_qwen3_hf_dir(work_dir / "qwen3-hf")
                kwargs = dict(row.options)
                kwargs.setdefault(row.exporter.scratch, work_dir / part.value)
                results[part] = fn(hf_dir, bundle_dir / part.value, precision=row.precision,
                                   bundle_dir=bundle_dir, **kwargs)
            else:
                if modules is None:
                    modules = build_modules(ckpt)
                inputs, outputs = SUBPART_IO[part]
                results[part] = fn(
                    modules[part], example_inputs(part, ckpt.constants), input_names=list(inputs),
                    output_names=list(outputs), dynamic_axes=DYNAMIC_AXES[part], out_dir=bundle_dir,
                    name=part.value, precision=row.precision, work_dir=work_dir / part.value,
                    subpart=part.value, bundle_dir=bundle_dir, **row.options,
                )
                if part == SubPart.AUDIO_TOKENIZER:
                    results[part] = _with_stream_context(results[part], modules[part], ckpt.constants)
        except HiggsPackError:
            raise
        except Exception as exc:  # an exporter's own failure: name the sub-part and tool
            raise BuildError(f"{row.exporter.name} failed on {part.value} ({row.precision}): {exc}") from exc
    differ = plan_mismatches(plan, {p.value: r.to_dict() for p, r in results.items()})
    if differ:
        raise BuildError("the exporters did not build what the plan says (the plan and the manifest must "
                         "agree; fix the exporter's planning function): " + "; ".join(differ))
    return results


def _with_stream_context(result, module, constants):
    """Record the codec decoder's chunking context (``options.stream_context_frames``) that
    streaming synthesis reads; a static chunked codec (npu) already measured it."""
    from dataclasses import replace

    from higgs_pack.exporters.torch_modules import codec_stream_context

    measured = (result.options.get("chunking") or {}).get("context")
    entry = {"stream_context_frames": int(measured)} if measured else codec_stream_context(module, constants)
    return replace(result, options={**result.options, **entry})


def _copy_tokenizer(ckpt, bundle_dir: Path) -> str:
    names = []
    for path in ckpt.tokenizer_files():
        shutil.copyfile(path, bundle_dir / path.name)
        names.append(path.name)
    if "tokenizer.json" not in names:
        raise BuildError("the checkpoint has no tokenizer.json; the runtime needs it")
    return "tokenizer.json"


def _parity_rule(part: SubPart, precision: str) -> dict[str, Any]:
    if part == SubPart.AUDIO_ENCODER:
        return {"metric": "code_agreement", "threshold": CODE_AGREEMENT_THRESHOLD}
    table = DECODER_COSINE_THRESHOLDS if part == SubPart.LLM_DECODER else COSINE_THRESHOLDS
    return {"metric": "cosine", "threshold": table[precision]}


def _assemble(plan: BuildPlan, ckpt, slug: str, source: str, bundle_dir: Path, results, tokenizer_file: str,
              greedy_frames: int, greedy_text: str, seconds: float) -> dict[str, Any]:
    t = plan.target
    subparts = {}
    tools: dict[str, str] = {}
    for part in SubPart:
        r = results[part]
        d = r.to_dict()
        tools.update(d["tool_versions"])
        subparts[part.value] = {
            "format": d["format"], "files": d["files"], "entry": d["entry"], "exporter": d["exporter"],
            "passes": d["passes"], "tool_versions": d["tool_versions"], "precision": d["precision"],
            "quantization": d["quantization"], "inputs": d["inputs"], "outputs": d["outputs"],
            "options": d["options"], "parity": _parity_rule(part, d["precision"]),
        }
    files = sorted(
        p.relative_to(bundle_dir).as_posix() for p in bundle_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME
    )
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": bundle_name(slug, plan),
        "model": {"id": ckpt.model_id, "slug": slug, "checkpoint_sha256": ckpt.digest(), "license": DEFAULT_LICENSE},
        "target": t.name,
        "precision": plan.precision,
        "variant": plan.variant,
        "backend": t.backend,
        "execution_provider": t.execution_provider,
        "device": t.device,
        "provider_options": dict(t.provider_options),
        "session_options": dict(t.session_options),
        "runtime_requirements": list(t.runtime_requirements),
        "tokenizer": {"file": tokenizer_file},
        "files": [file_entry(bundle_dir, f) for f in files],
        "subparts": subparts,
        "constants": ckpt.constants.to_dict(),
        "generation": {"temperature": 0.8, "top_k": 50, "top_p": 1.0, "repeat_guard_frames": 50,
                       "frames_per_text_token": 10.0, "min_max_frames": 50},
        "build": {
            "higgs_pack_version": installed_version("higgs-pack"),
            "python": platform.python_version(),
            "platform": f"{sys.platform}-{platform.machine()}",
            "tool_versions": dict(sorted(tools.items())),
            "seconds": round(seconds, 2),
            "checkpoint_source": source,
        },
        "reference": {"file": REFERENCE_FILE, "cases": [greedy_text], "greedy_frames": greedy_frames},
        "verification": {},
    }
    return _apply_variant(manifest, plan)


def _apply_variant(manifest: dict[str, Any], plan: BuildPlan) -> dict[str, Any]:
    """Lay the variant's manifest entries over the target's (dicts merged, others replaced)."""
    spec = plan.variant_spec
    for key, value in (spec.manifest.items() if spec is not None else ()):
        value = json.loads(json.dumps(value))  # plain JSON data, never shared with the declaration
        if isinstance(value, dict) and isinstance(manifest.get(key), dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    return manifest


def _verify_and_record(plan: BuildPlan, bundle_dir: Path, manifest: dict[str, Any]) -> None:
    from higgs_pack.runtime.verify import verify_bundle

    t = plan.target
    kwargs: dict[str, Any] = {}
    verify_on = (plan.variant_spec.verify_on if plan.variant_spec is not None else None) or t.verify_on
    if verify_on is not None:
        kwargs = {t.placement: verify_on}
    report = verify_bundle(bundle_dir, synthesize_cases=False, **kwargs)
    if not report.ok:
        failed = "; ".join(f"{c.name}: {c.detail}" for c in report.checks if c.ok is False)
        raise BuildError(f"the new bundle failed its own verification, so it was not kept: {failed}")
    for part, measured in report.parity.items():
        manifest["subparts"][part]["parity"].update(measured)
    manifest["verification"] = {"build_time": report.to_dict()}
    write_manifest(bundle_dir, manifest)


def _move_into_place(bundle_dir: Path, out: Path, stage: Path) -> None:
    """Swap the finished bundle into ``out``; the old one is removed only after the rename."""
    old = None
    if out.exists():
        old = stage / "previous"
        out.rename(old)
    try:
        bundle_dir.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
