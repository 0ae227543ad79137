"""Build-side commands (build, make-tiny-checkpoint, package), registered through
the ``higgs_pack.commands`` entry points and imported only when they run."""

from __future__ import annotations

from pathlib import Path

import click

#: Modules only the build extra installs; a runtime-only install lacks them.
_BUILD_MODULES = ("torch", "transformers", "safetensors", "onnxruntime_genai", "olive", "openvino", "nncf")


def _require_build_tools() -> None:
    """Stop with exit status 2 and the install line when the build extra is missing (a
    runtime-only install), as every other missing part of the environment does."""
    import importlib.util

    from higgs_pack.errors import install_extra
    from higgs_pack.runtime.cli import MissingExtra

    missing = [m for m in _BUILD_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(f"building needs the build tools ({', '.join(missing)} missing): "
                           f"{install_extra('build')}, or use `nox -s build-<target>`")


@click.command()
@click.option("--target", "-t", required=True, help="A registered target name; an unknown name lists the known ones.")
@click.option("--precision", "-p", help="int4, int8, fp16 or fp32 (default: the target's default).")
@click.option("--model", "-m", help="Checkpoint directory or Hugging Face repo id (default: the embedded tiny checkpoint).")
@click.option("--out", "-o", type=click.Path(path_type=Path, file_okay=False),
              help="Bundle directory (default: dist/<model-slug>-<target>-<precision>).")
@click.option("--kv-cache", "kv_cache", help="Decoder KV cache precision: float, or int8 (cpu: ModelBuilder's "
              "kv_cache_quant_scheme, scales from its kv_cache_calibration tool). Default: the target's.")
@click.option("--variant", help="Target variant, e.g. npu (openvino: static shapes for Intel NPUs).")
@click.option("--npu", is_flag=True, help="Shorthand for --variant npu.")
@click.option("--force", is_flag=True, help="Replace an existing bundle (only once the new one passed verification).")
@click.option("--work-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Where the build's scratch goes (default: $HIGGS_PACK_WORK_DIR, else the system temp "
                   "folder; the 4B model needs 20-40 GB there).")
@click.option("--plan", "plan_only", is_flag=True, help="Print the build plan and stop.")
@click.option("--print-path", is_flag=True, help="Print the bundle directory this build writes (absolute) and stop.")
def build(target, precision, model, out, kv_cache, variant, npu, force, work_dir, plan_only, print_path):
    """Build a bundle for one hardware target."""
    from higgs_pack.targets.plan import make_plan

    if npu:
        if variant not in (None, "npu"):
            raise click.UsageError(f"--npu conflicts with --variant {variant}")
        variant = "npu"
    plan = make_plan(target, precision, variant, kv_cache)
    if print_path:
        from higgs_pack.targets.plan import bundle_path

        click.echo(str(bundle_path(plan, model, out).absolute()))
        return
    if plan_only:
        click.echo(plan.render())
        return
    _require_build_tools()
    from higgs_pack.targets.build import build as run_build

    path = run_build(target, precision=precision, model=model, out=out, variant=variant, force=force,
                     work_dir=work_dir, progress=lambda msg: click.echo(msg, err=True), kv_cache=kv_cache)
    click.echo(str(path))


@click.command("make-tiny-checkpoint")
@click.argument("out", type=click.Path(path_type=Path, file_okay=False))
@click.option("--preset", default="tiny", show_default=True, help="tiny (tests), bench (benchmarks) or full (real size, ~8 GB).")
@click.option("--seed", default=0, show_default=True, type=int)
def make_tiny_checkpoint(out, preset, seed):
    """Write a random Higgs-Audio-v3 checkpoint in the real layout (deterministic per seed)."""
    _require_build_tools()
    from higgs_pack.exporters.checkpoint.tiny import make_tiny_checkpoint as make

    click.echo(str(make(out, preset=preset, seed=seed)))


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path, file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["wheel", "archive", "zip", "hub", "all", "image"]), default="all",
              show_default=True, help="wheel, archive (.tar.gz), zip, hub (a folder for huggingface-cli upload, "
              "with a model card), all (wheel + .tar.gz), or image (a container image of the speech server "
              "and the bundle, with its build context in OUT_DIR/image/<bundle>/).")
@click.option("--out-dir", "-o", type=click.Path(path_type=Path, file_okay=False), default=Path("dist"), show_default=True)
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@click.option("--base-image", metavar="IMAGE", help="image: the base image (default: the official slim Python "
              "image; NVIDIA's CUDA image for cuda; Windows Server for dml and winml).")
@click.option("--runtime", type=click.Path(exists=True, path_type=Path), help="image: higgs-pack itself, a "
              "higgs_pack-*.whl or a checkout built into one (default: the checkout this higgs-pack runs from).")
@click.option("--extra", "extras", multiple=True, default=("serve",), show_default=True, help="image: higgs-pack's "
              "extras installed beside the bundle's (repeatable): serve, or ray for Ray Serve on KubeRay.")
@click.option("--tag", metavar="NAME:TAG", help="image: the image's name (default: <bundle-name>:<version>).")
@click.option("--pip-cert", envvar="PIP_CERT", type=click.Path(path_type=Path),  # checked by an image's build only
              help="image: a CA bundle pip trusts during the build, mounted read-only as a build secret, never kept in "
              "the image (default: $PIP_CERT).")
@click.option("--no-build", is_flag=True, help="image: write the build context only (for docker build elsewhere).")
def package(bundle, fmt, out_dir, force, base_image, runtime, extras, tag, pip_cert, no_build):
    """Package BUNDLE as a per-hardware wheel, an archive, or a container image."""
    if fmt == "image":
        from higgs_pack.targets.packaging.image import (
            build_image,
            remove_context,
            write_image_context,
        )

        context = write_image_context(bundle, out_dir=out_dir, base=base_image, runtime=runtime, extras=extras,
                                      force=force)
        built = None
        if not no_build:
            try:
                built = build_image(context, tag=tag, pip_cert=pip_cert)
            except BaseException:  # a failed (or interrupted) build leaves nothing: a rerun needs no --force
                remove_context(context)
                raise
        click.echo(str(context.path))  # said once it is a result: the context, and the image built from it
        if built is not None:
            click.echo(built)
        return
    given = [name for name, value in (("--base-image", base_image), ("--runtime", runtime), ("--tag", tag),
                                      ("--extra", extras != ("serve",)), ("--no-build", no_build)) if value]
    if given:
        raise click.UsageError(f"{', '.join(given)} shape(s) an image; use with --format image, or leave out")
    from higgs_pack.targets.packaging import package_bundle

    for path in package_bundle(bundle, formats=fmt, out_dir=out_dir, force=force):
        click.echo(str(path))
