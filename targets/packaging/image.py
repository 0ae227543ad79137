"""A bundle and its speech server as one container image (``higgs-pack package --format image``).

:func:`write_image_context` writes a build context, ``<out_dir>/image/<bundle-name>/``:

* ``Containerfile``: a slim Python base (the build argument ``BASE_IMAGE``), a venv at
  ``/opt/higgs-pack`` holding the runtime with ``[serve]`` and the bundle's own wheel (which pulls
  the target's extra: onnxruntime, onnxruntime-gpu, openvino...), no torch, no compiler, no pip
  cache; a non-root user ``higgs`` (uid 10001); ``higgs-pack serve <bundle-name>`` as the entry
  point, listening on 0.0.0.0:8000; a voices volume at ``/voices``; a ``HEALTHCHECK`` on ``/ready``;
  OCI labels naming the bundle, its target, precision and content hash.
* ``wheels/runtime/``: higgs-pack itself as a wheel (built from a checkout, or a wheel given).
* ``wheels/bundle/``: the bundle's wheel (``--format wheel``).

:func:`build_image` builds it with podman (else docker).  Linux images mount the wheels at build time
(``RUN --mount=type=bind``: BuildKit, podman >= 4), so a bundle of gigabytes is in the image once, in
site-packages, and each wheel's sha256 is checked in the step that installs it (which also makes
the step's cache key follow the wheel).  podman builds in the ``docker`` image format: the OCI
image format has no ``HEALTHCHECK`` (podman drops it with a warning).

Settings reach the server from the environment under the names ``higgs-pack serve`` derives from
its options (``HIGGS_PACK_SERVE_<OPTION>``: serve/cli.py); the image sets the host, port and
voices folder that way, and a user overrides any of them with ``-e``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from higgs_pack.errors import HiggsPackError, PackagingError
from higgs_pack.manifests.manifest import MANIFEST_NAME, read_manifest, sha256_file

log = logging.getLogger(__name__)

#: The base image a user would pull: the official slim Python image (Debian 12), for targets that
#: run on a plain Linux machine.  Overridden per build with ``--base-image`` / ``BASE_IMAGE``.
LINUX_BASE = "docker.io/library/python:3.12-slim-bookworm"
#: onnxruntime-gpu 1.31 and 1.32 run on CUDA 12 with cuDNN 9 (onnxruntime.ai, "CUDA Execution
#: Provider", requirements table); NVIDIA's runtime image with cuDNN carries both.
CUDA_BASE = "docker.io/nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
#: DirectX in a Windows container needs the full Windows Server image: Server Core and Nano Server
#: have no GPU access (learn.microsoft.com, "GPU acceleration in Windows containers").
WINDOWS_BASE = "mcr.microsoft.com/windows/server:ltsc2022"
#: Python put into the Windows image (python.org's installer).
WINDOWS_PYTHON = "3.12.10"
#: Where the server keeps uploaded voices in the container (a volume).
VOICES = "/voices"
#: Where it keeps the secret that signs the voices' persisted prompt prefixes (``--prefix-key-file``):
#: a volume of its own, outside the voices folder (a Kubernetes Secret mounted there), so a new
#: container of the image finds the key the voices' prefixes were signed with.
STATE = "/state"
PREFIX_KEY_FILE = "voice-prefix.key"
#: The port the server listens on in the container.
PORT = 8000
#: The unprivileged user the server runs as.
USER, UID = "higgs", 10001
#: higgs-pack's extras an image may add beside the bundle's runtime (pyproject.toml): the server, Ray
#: Serve (for KubeRay) and subtitles; never one that brings torch or build tools.
SERVER_EXTRAS = ("serve", "ray", "subtitles")
#: Label namespace of the bundle's facts (beside the standard org.opencontainers.image.* keys).
LABEL_PREFIX = "io.github.higgs-pack.bundle"


@dataclass(frozen=True)
class ImageContext:
    """A written build context.

    Attributes:
        path: the context folder (holds ``Containerfile``).
        tag: the image reference it is built as by default (``<bundle-name>:<version>``).
        windows: a Windows container (dml, winml): built on Windows only.
        labels: the image's labels.
    """

    path: Path
    tag: str
    windows: bool
    labels: dict[str, str]


def base_image(target: Any) -> str:
    """The default base image of a target: Windows Server for a Windows-only target, NVIDIA's CUDA
    image for an extra that needs CUDA, else the slim Python image."""
    if _windows(target):
        return WINDOWS_BASE
    return CUDA_BASE if target.extra == "cuda" else LINUX_BASE


def _windows(target: Any) -> bool:
    return "win32" in (target.platform_marker or "")


def serve_settings(**values: str | int) -> dict[str, str]:
    """Environment variables that set ``higgs-pack serve`` options, named as the command declares
    them: ``serve_settings(host="0.0.0.0")`` -> ``{"HIGGS_PACK_SERVE_HOST": "0.0.0.0"}``.

    Raises:
        PackagingError: ``serve`` takes no option of that name.
    """
    import click

    from higgs_pack.runtime.cli import main

    with click.Context(main, info_name="higgs-pack") as ctx:
        command = main.get_command(ctx, "serve")
    prefix = command.context_settings["auto_envvar_prefix"]
    params = {p.name: p for p in command.params if isinstance(p, click.Option)}
    out = {}
    for name, value in values.items():
        if name not in params:
            raise PackagingError(f"higgs-pack serve has no option {name!r} (known: {', '.join(params)})")
        envvar = params[name].envvar or f"{prefix}_{name.upper()}"
        out[envvar if isinstance(envvar, str) else envvar[0]] = str(value)
    return out


def labels(manifest: dict[str, Any], content_sha256: str, version: str) -> dict[str, str]:
    """The image's labels: the OCI annotation keys (github.com/opencontainers/image-spec,
    annotations.md) and the bundle's facts under :data:`LABEL_PREFIX`.  ``content-sha256`` is the
    sha256 of the bundle's ``manifest.json``, which lists every file's sha256.  The model's licence is
    a label of ours: ``org.opencontainers.image.licenses`` takes an SPDX expression, which it is not."""
    m = manifest
    return {
        "org.opencontainers.image.title": m["name"],
        "org.opencontainers.image.description": f"higgs-pack serve: {m['model']['id']} for {m['target']}, "
                                                f"{m['precision']}, over the OpenAI speech API",
        "org.opencontainers.image.version": version,
        f"{LABEL_PREFIX}.name": m["name"],
        f"{LABEL_PREFIX}.target": m["target"],
        f"{LABEL_PREFIX}.precision": m["precision"],
        f"{LABEL_PREFIX}.backend": m["backend"],
        f"{LABEL_PREFIX}.content-sha256": content_sha256,
        f"{LABEL_PREFIX}.checkpoint-sha256": m["model"]["checkpoint_sha256"],
        f"{LABEL_PREFIX}.model-license": m["model"]["license"],
    }


#: The Linux Containerfile (``string.Template``: ``$$`` is a literal ``$``).
LINUX_CONTAINERFILE = """\
# syntax=docker/dockerfile:1
# Written by higgs-pack $version for the bundle $name (target $target, $precision).
# Build:  podman build --format docker -t $tag .     (or: docker build -t $tag .)
# --build-arg BASE_IMAGE=... picks another base: any Debian or Ubuntu image (python3 and
# python3-venv are installed with apt where the base lacks them).
ARG BASE_IMAGE=$base
FROM $${BASE_IMAGE}
# Where the network needs pip to trust a CA of its own, give the CA bundle as a build secret
# (--secret id=$secret,src=/etc/ssl/certs/ca-certificates.crt): mounted read-only for pip's steps alone,
# it leaves nothing in the image.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN set -eu; \\
    if ! python3 -c "import venv, ensurepip" 2>/dev/null; then \\
        apt-get update; \\
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \\
        rm -rf /var/lib/apt/lists/*; \\
    fi; \\
    python3 -m venv /opt/higgs-pack; \\
    useradd --uid $uid --user-group --create-home --home-dir /home/$user --shell /usr/sbin/nologin $user; \\
    install -d -o $user -g $user $voices $state
# The runtime with the server, then the bundle's wheel (its requirement higgs-pack[$extra] adds the
# target's runtime); each wheel's sha256 is checked first; setuptools, a build tool, goes.
RUN --mount=type=bind,source=wheels/runtime,target=/wheels --mount=type=secret,id=$secret \\
    set -eu; [ ! -s /run/secrets/$secret ] || export PIP_CERT=/run/secrets/$secret; \\
    echo "$runtime_sha256  /wheels/$runtime_wheel" | sha256sum -c --quiet; \\
    /opt/higgs-pack/bin/pip install "/wheels/$runtime_wheel[$extras]"
RUN --mount=type=bind,source=wheels,target=/wheels --mount=type=secret,id=$secret \\
    set -eu; [ ! -s /run/secrets/$secret ] || export PIP_CERT=/run/secrets/$secret; \\
    echo "$bundle_sha256  /wheels/bundle/$bundle_wheel" | sha256sum -c --quiet; \\
    /opt/higgs-pack/bin/pip install --find-links /wheels/runtime "/wheels/bundle/$bundle_wheel"; \\
    /opt/higgs-pack/bin/pip uninstall -y -q setuptools wheel 2>/dev/null || true; \\
    /opt/higgs-pack/bin/higgs-pack list | grep -q "$name"
ENV PATH=/opt/higgs-pack/bin:$${PATH} HOME=/home/$user $env
USER $uid:$uid
WORKDIR /home/$user
VOLUME ["$voices", "$state"]
EXPOSE $port
$labels
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \\
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ['$port_env'], timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["higgs-pack", "serve", "$name"]
"""

#: The Windows Containerfile (dml, winml): docker on Windows, which has no BuildKit, so the wheels are
#: copied in and deleted (their layer stays).
WINDOWS_CONTAINERFILE = """\
# escape=`
# Written by higgs-pack $version for the bundle $name (target $target, $precision).
# A Windows container: build it with docker on Windows (process isolation, a DirectX 12 GPU passed
# with --device class/5B45201D-F2F2-4F3B-85BB-30FF1F953599):  docker build -t $tag .
ARG BASE_IMAGE=$base
FROM $${BASE_IMAGE}
SHELL ["powershell", "-NoProfile", "-Command", "$$ErrorActionPreference = 'Stop';"]
RUN Invoke-WebRequest https://www.python.org/ftp/python/$python/python-$python-amd64.exe -OutFile python.exe; `
    Start-Process python.exe -Wait -ArgumentList '/quiet', 'InstallAllUsers=1', 'Include_test=0', 'TargetDir=C:\\Python'; `
    Remove-Item python.exe; `
    C:\\Python\\python.exe -m venv C:\\higgs-pack; `
    New-Item -ItemType Directory C:\\voices, C:\\state | Out-Null; `
    icacls C:\\voices /grant 'BUILTIN\\Users:(OI)(CI)M' | Out-Null; `
    icacls C:\\state /grant 'BUILTIN\\Users:(OI)(CI)M' | Out-Null
COPY wheels C:/wheels
RUN C:\\higgs-pack\\Scripts\\pip.exe install --no-cache-dir "C:\\wheels\\runtime\\$runtime_wheel[$extras]" "C:\\wheels\\bundle\\$bundle_wheel"; `
    Remove-Item -Recurse C:\\wheels
ENV $env
USER ContainerUser
VOLUME C:/voices C:/state
EXPOSE $port
$labels
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 `
    CMD ["C:\\\\higgs-pack\\\\Scripts\\\\python.exe", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ['$port_env'], timeout=4)"]
ENTRYPOINT ["C:\\\\higgs-pack\\\\Scripts\\\\higgs-pack.exe", "serve", "$name"]
"""


def write_image_context(bundle: str | Path, *, out_dir: str | Path = "dist", base: str | None = None,
                        runtime: str | Path | None = None, extras: tuple[str, ...] = ("serve",),
                        force: bool = False) -> ImageContext:
    """Write the build context of a bundle's image into ``<out_dir>/image/<bundle-name>/``.

    Args:
        bundle: the bundle folder (or an installed bundle's name).
        out_dir: where ``image/<bundle-name>/`` goes.
        base: the default of the ``BASE_IMAGE`` build argument (None: :func:`base_image`).
        runtime: higgs-pack itself: a ``.whl``, or a checkout built into one with ``pip wheel``
            (None: the checkout this higgs-pack runs from).
        extras: higgs-pack's extras installed beside the bundle's: ``serve`` (the server), or ``ray``
            (the server and Ray Serve, for KubeRay); ``serve`` is always among them.
        force: replace an existing context folder.

    Raises:
        PackagingError: the bundle is not valid, its target unknown, the folder exists without
            ``force``, no runtime can be found, or its wheel cannot be built.
    """
    from higgs_pack.runtime.sources.bundle import find_bundle
    from higgs_pack.targets.packaging import package_bundle
    from higgs_pack.targets.packaging.wheel import _target_of, wheel_version

    try:
        path = find_bundle(bundle).resolve()
        manifest = read_manifest(path)
    except HiggsPackError as exc:
        raise PackagingError(f"cannot package {bundle} as an image: {exc}") from exc
    target = _target_of(manifest, path)
    unknown = sorted(set(extras) - set(SERVER_EXTRAS))
    if unknown:
        raise PackagingError(f"--extra {', '.join(unknown)}: an image takes the server's extras only "
                             f"({', '.join(SERVER_EXTRAS)}); the bundle's wheel brings its runtime's")
    context = Path(out_dir).resolve() / "image" / manifest["name"]
    if context.exists():
        if not force:
            raise PackagingError(f"{context} already exists; pass --force (force=True) to replace it, or choose "
                                 "another --out-dir (out_dir=)")
        shutil.rmtree(context)
    (context / "wheels").mkdir(parents=True)
    bundle_wheel = package_bundle(path, formats="wheel", out_dir=context / "wheels" / "bundle")[0]
    runtime_wheel = _runtime_wheel(runtime, context / "wheels" / "runtime")
    version = wheel_version(manifest)
    tag = f"{manifest['name']}:{version}"
    found = labels(manifest, sha256_file(path / MANIFEST_NAME), version)
    text = containerfile(manifest, target, base=base or base_image(target), extras=extras, tag=tag, labels=found,
                         runtime_wheel=runtime_wheel, bundle_wheel=bundle_wheel)
    (context / "Containerfile").write_text(text, encoding="utf-8")
    log.info("wrote the build context %s (image %s)", context, tag)
    return ImageContext(context, tag, _windows(target), found)


def remove_context(context: ImageContext) -> None:
    """Remove ``context``'s folder (and ``image/`` above it when that leaves it empty): what
    ``package --format image`` wrote, when its build failed."""
    shutil.rmtree(context.path, ignore_errors=True)
    with contextlib.suppress(OSError):
        context.path.parent.rmdir()  # image/, only if empty


def containerfile(manifest: dict[str, Any], target: Any, *, base: str, extras: tuple[str, ...], tag: str,
                  labels: dict[str, str], runtime_wheel: Path, bundle_wheel: Path) -> str:
    """The Containerfile of a bundle's image: :data:`WINDOWS_CONTAINERFILE` for a Windows-only
    target, else :data:`LINUX_CONTAINERFILE`, filled in (the wheels' names and sha256, the labels,
    the server's settings)."""
    from string import Template

    windows = _windows(target)
    env = serve_settings(host="0.0.0.0", port=PORT, voices_dir="C:/voices" if windows else VOICES,
                         prefix_key_file=f"C:/state/{PREFIX_KEY_FILE}" if windows else f"{STATE}/{PREFIX_KEY_FILE}")
    return Template(WINDOWS_CONTAINERFILE if windows else LINUX_CONTAINERFILE).substitute(
        version=labels["org.opencontainers.image.version"], name=manifest["name"], target=manifest["target"],
        precision=manifest["precision"], tag=tag, base=base, extra=target.extra, uid=UID, user=USER,
        voices=VOICES, state=STATE, port=PORT, python=WINDOWS_PYTHON, secret=PIP_CERT_SECRET,
        extras=",".join(dict.fromkeys(("serve", *extras))), port_env=next(k for k, v in env.items() if v == str(PORT)),
        runtime_wheel=runtime_wheel.name, runtime_sha256=sha256_file(runtime_wheel),
        bundle_wheel=bundle_wheel.name, bundle_sha256=sha256_file(bundle_wheel),
        env=" ".join(f"{k}={_quoted(v)}" for k, v in env.items()),
        labels="LABEL " + f" {'`' if windows else chr(92)}\n      ".join(f"{k}={_quoted(v)}" for k, v in labels.items()))


def _quoted(value: str) -> str:
    """A Containerfile ENV / LABEL value: a JSON string (double quotes, backslashes escaped)."""
    import json

    return json.dumps(value)


def _runtime_wheel(runtime: str | Path | None, dest: Path) -> Path:
    """higgs-pack's own wheel in ``dest``: ``runtime`` copied (a ``.whl``) or built from a checkout.

    Raises:
        PackagingError: no checkout found, not a wheel or checkout of higgs-pack, or pip failed.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if runtime is None:
        checkout = Path(__file__).resolve().parents[2]  # targets/packaging/ -> the checkout's root
        if not _is_checkout(checkout):
            raise PackagingError("this higgs-pack is not running from a checkout, so its wheel cannot be built "
                                 "for the image; give one with --runtime (a higgs-pack .whl or checkout)")
        runtime = checkout
    source = Path(runtime)
    if source.is_file() and source.suffix == ".whl" and source.name.startswith("higgs_pack-"):
        return Path(shutil.copy2(source, dest / source.name))
    if not _is_checkout(source):
        raise PackagingError(f"--runtime {source} is neither a higgs-pack wheel (higgs_pack-*.whl) nor a "
                             "higgs-pack checkout (a folder with its pyproject.toml)")
    with tempfile.TemporaryDirectory(prefix="higgs-pack-wheel-") as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, str(source)],
                              capture_output=True, text=True, check=False, env={**os.environ, "PIP_NO_INPUT": "1"})
        built = sorted(Path(tmp).glob("higgs_pack-*.whl"))
        if done.returncode or not built:
            raise PackagingError(f"pip wheel {source} failed (exit {done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip()[-2000:]}")
        return Path(shutil.move(str(built[0]), dest / built[0].name))


def _is_checkout(folder: Path) -> bool:
    project = folder / "pyproject.toml"
    return project.is_file() and 'name = "higgs-pack"' in project.read_text(encoding="utf-8")


def container_engine() -> str:
    """The container engine on PATH: podman, else docker.

    Raises:
        PackagingError: neither is installed.
    """
    for name in ("podman", "docker"):
        found = shutil.which(name)
        if found:
            return found
    raise PackagingError("building an image needs podman or docker, and neither is on PATH: install one "
                         "(apt-get install podman), or write the build context alone with --no-build")


#: The build secret that carries the CA bundle pip trusts (mounted read-only at /run/secrets/<id> in
#: the steps that run pip, and nowhere else).
PIP_CERT_SECRET = "pip-cert"


def build_command(context: ImageContext, *, tag: str | None = None, engine: str | None = None,
                  pip_cert: str | Path | None = None) -> list[str]:
    """The ``podman build`` (or ``docker build``) argv that builds ``context``.

    podman gets ``--format docker`` (the OCI format has no HEALTHCHECK); ``pip_cert`` is the build
    secret :data:`PIP_CERT_SECRET` (``--secret``: podman, and docker with BuildKit).

    Raises:
        PackagingError: no engine; ``pip_cert`` is not a file; a Windows context on a machine that
            is not Windows.
    """
    engine = engine or container_engine()
    podman = Path(engine).name.startswith("podman")
    if context.windows and sys.platform != "win32":
        raise PackagingError(f"{context.path} is a Windows container (target {context.labels[LABEL_PREFIX + '.target']}"
                             "): build it with docker on Windows, or write the context alone with --no-build")
    argv = [engine, "build", "-t", tag or context.tag, "-f", str(context.path / "Containerfile")]
    if podman:
        argv += ["--format", "docker"]
    if pip_cert:
        cert = Path(pip_cert).resolve()
        if not cert.is_file():
            raise PackagingError(f"--pip-cert {pip_cert} is not a file; give the CA bundle pip should trust "
                                 "(/etc/ssl/certs/ca-certificates.crt on Debian), or leave it out")
        argv += ["--secret", f"id={PIP_CERT_SECRET},src={cert}"]
    return [*argv, str(context.path)]


def build_image(context: ImageContext, *, tag: str | None = None, engine: str | None = None,
                pip_cert: str | Path | None = None) -> str:
    """Build ``context`` (its output goes to this process's stderr as it comes); return the image's tag.

    Raises:
        PackagingError: as :func:`build_command`, or the build failed: its exit status, and what to
            do where the engine refused the ``--pip-cert`` secret (:func:`secret_refused`).
    """
    argv = build_command(context, tag=tag, engine=engine, pip_cert=pip_cert)
    log.info("building %s: %s", context.path, " ".join(argv))
    tail: collections.deque[str] = collections.deque(maxlen=200)  # the end of the output, read for a refusal
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as build:
        for line in build.stdout or ():
            sys.stderr.write(line)
            tail.append(line)
    if build.returncode:
        engine_name = Path(argv[0]).name
        why = secret_refused("".join(tail)) if pip_cert else None
        raise PackagingError(f"{engine_name} build of {context.path} failed (exit {build.returncode}); "
                             + (why or "its output above says why"))
    return tag or context.tag


def secret_refused(output: str) -> str | None:
    """What to do when a build's ``output`` says the engine refused ``--secret`` (docker's legacy
    builder, without BuildKit: "unknown flag: --secret"), or None when it does not say so."""
    if "unknown flag: --secret" not in output and "requires BuildKit" not in output:
        return None
    return ("this docker has no BuildKit, which the build secret --secret needs (the CA bundle of --pip-cert, "
            "by default $PIP_CERT); install docker-buildx (docker buildx) and set DOCKER_BUILDKIT=1, or use "
            "podman, or leave --pip-cert and $PIP_CERT unset where pip needs no extra CA, or write the context "
            "alone with --no-build and build it elsewhere")
