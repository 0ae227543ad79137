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
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from higgs_pack.errors import BuildError, BundleError, HiggsPackError
from higgs_pack.exporters.result import installed_version
from higgs_pack.manifests.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    file_entry,
    read_manifest,
    write_manifest,
)
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.loop.text_chunks import FRAMES_PER_TEXT_TOKEN, MIN_MAX_FRAMES
from higgs_pack.runtime.machine.cpu import cpu_info
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.sources.paths import cache_root
from higgs_pack.targets.base import (
    CODE_AGREEMENT_THRESHOLD,
    COSINE_THRESHOLDS,
    DECODER_COSINE_THRESHOLDS,
    DECODER_EXPORT_REL_L2,
    DECODER_KV_CACHE_REL_L2,
    EXPORT_REL_L2,
    KV_CACHE_PARITY,
)
from higgs_pack.targets.plan import (
    BuildPlan,
    bundle_name,
    bundle_path,
    make_plan,
    model_slug,
    plan_mismatches,
)

log = logging.getLogger(__name__)

DEFAULT_LICENSE = "research / non-commercial (Boson AI Higgs Audio licence; see the model card)"
REFERENCE_FILE = "reference/golden.npz"


def default_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """The embedded default checkpoint: generated once, deterministically, then reused.

    Written to a temporary directory and renamed, so a half-written checkpoint is
    never reused.
    """
    from higgs_pack.exporters.checkpoint.tiny import make_tiny_checkpoint

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


@contextmanager
def _staging(out: Path):
    """A temporary directory beside ``out`` (same filesystem, so the final move is a rename)."""
    from higgs_pack.targets.workspace import remove_dead_scratch

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_scratch(out.parent, prefix=f".{out.name}.building-")
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
    work_dir: str | Path | None = None,
    progress=None,
    kv_cache: str | None = None,
) -> Path:
    """Build one bundle.

    Every heavy step (each exporter, golden capture, verification) runs in a child
    process that exits before the next starts (:mod:`higgs_pack.targets.steps`); the
    peak resident memory of the whole process tree, the peak scratch size and each
    step's time and memory are recorded in the manifest's ``build.resources``.

    Args:
        target: registered target name (``cpu``, ``cuda``, ``dml``, ``openvino``).
        precision: bundle precision; default the target's default.
        model: checkpoint directory or Hugging Face repo id; default the
            embedded tiny checkpoint (generated from seed 0).
        out: bundle directory; default ``dist/<slug>-<target>-<precision>``.
        variant: target variant (``npu`` for openvino).
        force: replace an existing bundle at ``out`` (only after the new one passed).
        dist_dir: parent of the default ``out``.
        work_dir: folder for the scratch folder (default ``$HIGGS_PACK_WORK_DIR``, else
            the system temp folder); scratch of killed builds there is removed first.
        progress: optional ``callable(str)`` told about each step.
        kv_cache: the decoder's KV cache precision (``--kv-cache``; one of the target's
            ``kv_caches``, default its first).  A quantized one is calibrated with ModelBuilder's
            tool during the decoder's export and recorded in the manifest (``kv_cache``, and the
            decoder's ``quantization.kv_cache`` and ``parity.kv_cache``).

    Returns:
        The bundle directory.

    Raises:
        BuildPlanError: unknown target/precision/variant, or a KV cache the target does not
            offer (before anything heavy runs).
        BundleError: ``out`` holds a bundle and ``force`` is False, or ``out`` is a
            non-empty directory that is not a bundle.
        InputError: ``work_dir`` (or ``$HIGGS_PACK_WORK_DIR``) does not exist or cannot be
            written (before the checkpoint is opened).
        CheckpointError: the checkpoint cannot be read.
        BuildError: not enough disk space (before anything heavy runs: the message names
            the folder, the space needed and free); an exporter failed, ran out of
            memory or disk; or the bundle failed its own verification.
    """
    from higgs_pack.exporters.checkpoint.reader import open_checkpoint
    from higgs_pack.exporters.process import TreeMemory
    from higgs_pack.targets.workspace import FolderPeak, check_space, usable_work_root, work_area

    plan = make_plan(target, precision, variant, kv_cache)
    say = progress or (lambda msg: log.info(msg))
    out = bundle_path(plan, model, out, dist_dir)
    _check_out(out, force)
    scratch_root = usable_work_root(work_dir)  # path problems before the checkpoint is opened or fetched
    say(plan.render())
    start = time.perf_counter()
    source = str(model) if model is not None else str(default_checkpoint())
    ckpt = open_checkpoint(source)
    say(check_space(estimate_space(plan, ckpt), scratch_root, out.absolute().parent))
    with (_staging(out) as stage, work_area(work_dir) as work, TreeMemory() as memory,
          FolderPeak(work, stage) as scratch):
        steps = _Steps(say, memory, work)
        bundle_dir = stage / "bundle"
        bundle_dir.mkdir()
        manifest = _staged_manifest(plan, steps, ckpt, model, source, bundle_dir, work, stage, start)
        _record_verification(manifest, _verify_staged(plan, steps, bundle_dir, manifest, stage))
        _record_resources(manifest, start, memory, scratch, steps)
        write_manifest(bundle_dir, manifest)  # the final manifest: what verification measured, resources
        _move_into_place(bundle_dir, out, stage)
    say(f"bundle ready: {out} (peak memory {memory.peak / 2**30:.2f} GiB, "
        f"{time.perf_counter() - start:.0f} s)")
    return out


def _staged_manifest(plan: BuildPlan, steps: _Steps, ckpt: Any, model: str | Path | None, source: str,
                     bundle_dir: Path, work: Path, stage: Path, start: float) -> dict[str, Any]:
    """Export every sub-part, copy the tokenizer and capture the golden outputs into ``bundle_dir``; the
    manifest of it all (before verification)."""
    results = _export_subparts(plan, steps, str(ckpt.root), bundle_dir, work, stage)
    tokenizer_file = _copy_tokenizer(ckpt, bundle_dir)
    golden = _capture_golden(steps, str(ckpt.root), bundle_dir, results, stage)
    return _assemble(plan, ckpt, model_slug(model), source, bundle_dir, results, tokenizer_file, golden,
                     time.perf_counter() - start)


def _capture_golden(steps: _Steps, checkpoint: str, bundle_dir: Path, results: dict[str, Any],
                    stage: Path) -> Any:
    """The golden step: the PyTorch oracle's reference outputs, matched against the exported sub-parts."""
    return steps("capturing golden reference outputs with the PyTorch oracle",
                 "higgs_pack.targets.steps:capture", [stage], checkpoint=checkpoint,
                 out_path=str(bundle_dir / REFERENCE_FILE), bundle_dir=str(bundle_dir),
                 subparts={p: {**{k: r[k] for k in ("format", "entry", "precision")},
                               "kv_cache": r["quantization"].get("kv_cache")} for p, r in results.items()})


def _record_resources(manifest: dict[str, Any], start: float, memory: Any, scratch: Any, steps: _Steps) -> None:
    """The manifest's ``build.seconds`` and ``build.resources``: peak memory and scratch, the CPU, each step."""
    scratch.sample()
    manifest["build"]["seconds"] = round(time.perf_counter() - start, 2)
    manifest["build"]["resources"] = {
        "peak_rss_mb": round(memory.peak / 2**20, 1),
        "peak_anon_mb": round(memory.peak_anon / 2**20, 1),
        "scratch_peak_mb": round(scratch.peak / 2**20, 1),
        "cpu": cpu_info().describe(),
        "phases": [p.to_dict() for p in steps.phases],
    }


def _check_out(out: Path, force: bool) -> None:
    """Refuse an ``out`` that holds a bundle (unless ``force``) or other files.

    Raises:
        BundleError: naming ``out`` and the flag or choice that fixes it.
    """
    if not out.exists():
        return
    if _is_good_bundle(out):
        if not force:
            raise BundleError(
                f"{out} already holds a bundle; pass --force (force=True) to replace it "
                "once the new build has passed verification, or choose another --out"
            )
    elif not out.is_dir() or any(out.iterdir()):
        raise BundleError(f"{out} exists and is not a bundle; choose an empty or new --out")


class _Steps:
    """Runs a build's heavy steps, each in its own child process, and keeps their records.

    Calling it as ``steps(name, "module:function", folders, **kwargs)`` tells ``say`` the step's
    name, runs it with :func:`~higgs_pack.exporters.process.run_step` (memory sampled by
    ``memory``, scratch in ``work``; ``folders`` are named when the disk fills up) and returns
    its value; :attr:`phases` holds every step's record, in order.
    """

    def __init__(self, say: Any, memory: Any, work: Path) -> None:
        self.say, self.memory, self.work = say, memory, work
        self.phases: list[Any] = []

    def __call__(self, name: str, entry: str, folders: list[Path], **kwargs: Any) -> Any:
        from higgs_pack.exporters.process import run_step

        self.say(name)
        value, record = run_step(entry, kwargs, name=name, folders=folders, memory=self.memory, work_dir=self.work)
        self.phases.append(record)
        log.info("%s: %.1f s, peak %.0f MiB", name, record.seconds, record.peak_rss_mb)
        return value


def _export_subparts(plan: BuildPlan, steps: _Steps, checkpoint_dir: str, bundle_dir: Path, work: Path,
                     stage: Path) -> dict[str, Any]:
    """Export every sub-part with its planned exporter: the decoders from the checkpoint
    remapped to a Qwen3 directory (refused at once if they differ from the plan), then the
    module sub-parts in one step.

    Returns:
        sub-part name -> its ``ExportResult.to_dict()``.

    Raises:
        BuildError: an exporter failed, or a sub-part's record differs from the plan.
    """
    results: dict[str, Any] = {}
    decoder_rows = [r for r in plan.rows if r.exporter.kind == "decoder"]
    module_rows = [r for r in plan.rows if r.exporter.kind != "decoder"]
    if decoder_rows:
        hf_dir = steps("remapping the checkpoint to a Qwen3 directory", "higgs_pack.targets.steps:write_hf_dir",
                       [work], checkpoint=checkpoint_dir, out_dir=str(work / "qwen3-hf"))
        for row in decoder_rows:
            results[row.subpart.value] = steps(
                f"exporting {row.subpart.value} ({row.precision}) with {row.exporter.name}",
                "higgs_pack.targets.steps:export_decoder", [work, stage], hf_dir=hf_dir,
                exporter=row.exporter.name, part=row.subpart.value, precision=row.precision,
                bundle_dir=str(bundle_dir), work_dir=str(work / row.subpart.value), options=dict(row.options))
        shutil.rmtree(hf_dir, ignore_errors=True)
        _refuse_mismatches(plan, results, [r.subpart for r in decoder_rows])
    if module_rows:
        modules = steps(
            "exporting " + ", ".join(f"{r.subpart.value} ({r.precision})" for r in module_rows),
            "higgs_pack.targets.steps:export_modules", [work, stage], checkpoint=checkpoint_dir,
            rows=[{"part": r.subpart.value, "exporter": r.exporter.name, "precision": r.precision,
                   "options": dict(r.options)} for r in module_rows],
            bundle_dir=str(bundle_dir), work_dir=str(work))
        results.update(modules["results"])
    _refuse_mismatches(plan, results)
    return results


def _verify_staged(plan: BuildPlan, steps: _Steps, bundle_dir: Path, manifest: dict[str, Any],
                   stage: Path) -> dict[str, Any]:
    """Verify the staged bundle as ``higgs-pack verify`` would (no cases): its manifest is written
    for that (verify reads the bundle from disk; the build writes it once more, completed).

    Raises:
        BuildError: it failed its own verification (naming the failed checks).
    """
    write_manifest(bundle_dir, manifest)
    verified = steps("verifying the new bundle", "higgs_pack.targets.steps:verify", [stage],
                     bundle_dir=str(bundle_dir),
                     options={**_verify_options(plan), "cache_dir": False, "low_memory": True})
    if not verified["ok"]:
        raise BuildError(f"the new bundle failed its own verification, so it was not kept: {verified['failed']}")
    return verified


def _record_verification(manifest: dict[str, Any], verified: dict[str, Any]) -> None:
    """Add what the build-time verification measured (parity per sub-part, its report)."""
    for part, measured in verified["parity"].items():
        manifest["subparts"][part]["parity"].update(measured)
    manifest["verification"] = {"build_time": verified["report"]}


def _refuse_mismatches(plan: BuildPlan, results: dict[str, Any], parts: list[SubPart] | None = None) -> None:
    """Raise :class:`BuildError` when a sub-part's record differs from the plan (see
    :func:`~higgs_pack.targets.plan.plan_mismatches`)."""
    differ = plan_mismatches(plan, results, parts)
    if differ:
        raise BuildError("the exporters did not build what the plan says, so nothing was kept (the plan and the "
                         "manifest must agree; fix the exporter or its planning function): " + "; ".join(differ))


def estimate_space(plan: BuildPlan, ckpt) -> Any:
    """Scratch and bundle bytes this build needs, from the checkpoint's tensor headers.

    Scratch: the remapped Qwen3 directory (the body and text embedding in their stored
    dtype) when a decoder exporter runs, plus every exporter's own scratch; the bundle:
    every sub-part at its precision.  Both get :data:`~higgs_pack.exporters.space.MARGIN`.
    """

    from higgs_pack.exporters.checkpoint.layout import (
        AUDIO_EMBEDDING,
        CODEC_PREFIX,
        TEXT_EMBEDDING,
        llm_tensor_shapes,
    )
    from higgs_pack.exporters.space import FIXED_MARGIN, MARGIN
    from higgs_pack.targets.workspace import SpaceNeed

    llm = llm_tensor_shapes(ckpt.text_config)
    itemsize = ckpt.tensor_dtype(TEXT_EMBEDDING).itemsize
    body = sum(math.prod(shape) for name, shape in llm.items() if name != TEXT_EMBEDDING)
    text = math.prod(llm[TEXT_EMBEDDING])
    audio = math.prod(ckpt.tensor_shape(AUDIO_EMBEDDING))
    codec = sum(math.prod(ckpt.tensor_shape(n)) for n in ckpt.tensor_names() if n.startswith(CODEC_PREFIX))
    params = {SubPart.LLM_DECODER: body, SubPart.TEXT_EMBED: text, SubPart.AUDIO_EMBED: audio,
              SubPart.AUDIO_HEADS: audio, SubPart.AUDIO_TOKENIZER: codec, SubPart.AUDIO_ENCODER: codec,
              SubPart.AUDIO_TOKENIZER_STREAM: codec}
    scratch = (body + text) * itemsize if any(r.exporter.kind == "decoder" for r in plan.rows) else 0
    bundle = 0
    for row in plan.rows:
        s, b = row.exporter.estimate_space(params[row.subpart], itemsize, row.precision, dict(row.options))
        scratch, bundle = scratch + s, bundle + b
    return SpaceNeed(int(scratch * (1 + MARGIN)) + FIXED_MARGIN, int(bundle * (1 + MARGIN)) + FIXED_MARGIN)


def _copy_tokenizer(ckpt, bundle_dir: Path) -> str:
    names = []
    for path in ckpt.tokenizer_files():
        shutil.copyfile(path, bundle_dir / path.name)
        names.append(path.name)
    if "tokenizer.json" not in names:
        raise BuildError("the checkpoint has no tokenizer.json; the runtime needs it")
    return "tokenizer.json"


def _parity_rule(part: SubPart, precision: str, layers: int, kv_cache: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The acceptance rule recorded for one sub-part (verify applies the bundle's own rule).

    The decoder's export-error limit grows with depth as independent per-layer compute
    noise adds up, like a random walk: ``DECODER_EXPORT_REL_L2 * sqrt(layers / 2)`` (the
    table is set on the 2-layer tiny model).  Measured export errors of cpu int4 against the
    matched oracle: 0.006 with 2 layers, 0.047 with 36 (limit 0.21); an export bug (swapped
    layers, a dropped norm) gives errors of order 1.

    A decoder with a quantized KV cache (``kv_cache``: its ``quantization["kv_cache"]``) also
    gets ``kv_cache``: the rule its dequantized cache is judged by against the oracle's K/V
    (:data:`~higgs_pack.targets.base.KV_CACHE_PARITY`, its limit grown with depth like the
    hidden states'; reference ``float``, made ``matched``
    with the golden capture's matched references where the weights are quantized).  Its
    hidden states keep the weights' rule, their limit raised by
    :data:`~higgs_pack.targets.base.DECODER_KV_CACHE_REL_L2` (no oracle quantizes K/V, so the
    cache's effect on the hidden states counts there).
    """
    if part == SubPart.AUDIO_ENCODER:
        return {"metric": "code_agreement", "threshold": CODE_AGREEMENT_THRESHOLD}
    decoder = part == SubPart.LLM_DECODER
    table = DECODER_COSINE_THRESHOLDS if decoder else COSINE_THRESHOLDS
    limit = (DECODER_EXPORT_REL_L2 if decoder else EXPORT_REL_L2)[precision]
    if decoder:
        limit += DECODER_KV_CACHE_REL_L2[kv_cache["precision"]] if kv_cache else 0.0
        limit = round(limit * math.sqrt(max(layers, 2) / 2), 6)
    rule: dict[str, Any] = {"metric": "cosine", "threshold": table[precision], "max_rel_l2": limit, "reference": "float"}
    if decoder and kv_cache:
        kv_rule = dict(KV_CACHE_PARITY[kv_cache["precision"]])
        kv_rule["max_rel_l2"] = round(kv_rule["max_rel_l2"] * math.sqrt(max(layers, 2) / 2), 6)
        rule["kv_cache"] = {"metric": "cosine", **kv_rule, "reference": "float"}
    return rule


def _assemble(plan: BuildPlan, ckpt, slug: str, source: str, bundle_dir: Path, results, tokenizer_file: str,
              golden: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The bundle's manifest from the plan, the checkpoint, the exporters' results and the golden
    capture (``frames``, ``text`` and the matched oracle's ``weights`` per quantized sub-part),
    with the variant's entries laid over it."""
    t = plan.target
    subparts = {}
    tools: dict[str, str] = {}
    for part in SubPart:
        d = results[part.value]
        tools.update(d["tool_versions"])
        subparts[part.value] = {
            "format": d["format"], "files": d["files"], "entry": d["entry"], "exporter": d["exporter"],
            "passes": d["passes"], "tool_versions": d["tool_versions"], "precision": d["precision"],
            "quantization": d["quantization"], "inputs": d["inputs"], "outputs": d["outputs"],
            "options": d["options"],
            "parity": _parity_rule(part, d["precision"], int(ckpt.text_config["num_hidden_layers"]),
                                   d["quantization"].get("kv_cache")),
        }
        if part.value in golden["weights"]:  # checked against the oracle with the bundle's own weights
            subparts[part.value]["parity"].update(
                reference="matched", weights_max_rel_l2=golden["weights"][part.value]["max_rel_l2"])
            if "kv_cache" in subparts[part.value]["parity"]:  # its K/V: the matched oracle's too
                subparts[part.value]["parity"]["kv_cache"]["reference"] = "matched"
    files = sorted(
        p.relative_to(bundle_dir).as_posix() for p in bundle_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME
    )
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": bundle_name(slug, plan),
        "model": {"id": ckpt.model_id, "slug": slug, "checkpoint_sha256": ckpt.digest(), "license": DEFAULT_LICENSE},
        "target": t.name,
        "precision": plan.precision,
        "kv_cache": plan.kv_cache,
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
        "generation": generation_defaults(),
        "build": {
            "higgs_pack_version": installed_version("higgs-pack"),
            "python": platform.python_version(),
            "platform": f"{sys.platform}-{platform.machine()}",
            "tool_versions": dict(sorted(tools.items())),
            "seconds": round(seconds, 2),
            "checkpoint_source": source,
        },
        "reference": {"file": REFERENCE_FILE, "cases": [golden["text"]], "greedy_frames": golden["frames"]},
        "verification": {},
    }
    return _apply_variant(manifest, plan)


def generation_defaults() -> dict[str, Any]:
    """The manifest's ``generation`` entry: the runtime's own defaults (the sampling options of
    :class:`~higgs_pack.runtime.options.SamplingOptions` but the per-call seed, and the frame
    cap of :mod:`higgs_pack.runtime.loop.text_chunks`), so a bundle never records other numbers."""
    sampling = {k: v for k, v in asdict(SamplingOptions()).items() if k != "seed"}
    return {**sampling, "frames_per_text_token": FRAMES_PER_TEXT_TOKEN, "min_max_frames": MIN_MAX_FRAMES}


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


def _verify_options(plan: BuildPlan) -> dict[str, Any]:
    """Where the build-time verification runs: the variant's or target's ``verify_on``, else its own."""
    t = plan.target
    verify_on = (plan.variant_spec.verify_on if plan.variant_spec is not None else None) or t.verify_on
    if verify_on is None:
        return {}
    return {t.placement: verify_on}


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
