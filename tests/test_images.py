"""Container images (``higgs-pack package --format image``): the build context, and the tiny cpu and
openvino images built with podman, run on 127.0.0.1 with a voices volume, spoken to with the
official ``openai`` client, given a voice, stopped with SIGTERM while speaking, restarted, and
removed.

The image tests need podman (and, where no registry is reachable, mmdebstrap for a local base:
targets/packaging/local_base.py); without podman they skip naming it, unless
``HIGGS_PACK_REQUIRE_IMAGES=1`` (CI: .ci/run) makes that a failure.  A machine whose podman needs
other settings points ``CONTAINERS_CONF`` at them (.ci/containers.conf).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner
from conftest import slow_fixture

from higgs_pack.errors import PackagingError
from higgs_pack.manifests.manifest import sha256_file
from higgs_pack.targets.packaging import image

openai = pytest.importorskip("openai", reason="the official openai client is a dev dependency")

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "higgs-audio-v3-tiny"
#: Largest image accepted, bytes (the sizes measured are in docs/bundle/images.md): the measured size
#: and some 5% (PyAV, FFmpeg's encoders for OpenAI's streamed formats, is about 100 MiB of it).
MAX_IMAGE_BYTES = {"cpu": 650 * 2**20, "openvino": 720 * 2**20}
#: What each image's runtime imports.
RUNTIME_MODULE = {"cpu": "onnxruntime", "openvino": "openvino"}


def test_serve_settings_are_named_from_the_serve_commands_options():
    found = image.serve_settings(host="0.0.0.0", voices_dir="/voices", max_batch=2, model_name="a b", api_key="k")
    assert found == {"HIGGS_PACK_SERVE_HOST": "0.0.0.0", "HIGGS_PACK_SERVE_VOICES_DIR": "/voices",
                     "HIGGS_PACK_SERVE_MAX_BATCH": "2", "HIGGS_PACK_SERVE_MODEL_NAME": "a b",
                     "HIGGS_PACK_API_KEY": "k"}
    with pytest.raises(PackagingError, match="no option 'voice_dir'"):
        image.serve_settings(voice_dir="/voices")


def test_serve_reads_its_options_from_the_environment():
    """An environment variable reaches the option it is named after (a bad value is refused naming
    the option), and the command line wins over it."""
    from higgs_pack.runtime.cli import main

    runner = CliRunner()
    bad = runner.invoke(main, ["serve", "nowhere"], env={"HIGGS_PACK_SERVE_MAX_QUEUE": "-3"})
    assert bad.exit_code == 2 and "--max-queue" in bad.output and "-3" in bad.output
    origin = runner.invoke(main, ["serve", "nowhere"], env={"HIGGS_PACK_SERVE_ALLOW_ORIGIN": "http://a.example/x"})
    assert origin.exit_code == 2 and "--allow-origin 'http://a.example/x'" in origin.output
    wins = runner.invoke(main, ["serve", "nowhere", "--max-queue", "3"], env={"HIGGS_PACK_SERVE_MAX_QUEUE": "-3"})
    assert "--max-queue" not in wins.output  # it got past the options, to the missing bundle


def test_build_command_refuses_what_cannot_build(tmp_path):
    linux = image.ImageContext(tmp_path, "x:1", False, {f"{image.LABEL_PREFIX}.target": "cpu"})
    argv = image.build_command(linux, engine="/usr/bin/podman", pip_cert=None)
    assert argv[:2] == ["/usr/bin/podman", "build"] and "--format" in argv and argv[-1] == str(tmp_path)
    with pytest.raises(PackagingError, match=r"--pip-cert .* is not a file"):
        image.build_command(linux, engine="podman", pip_cert=tmp_path / "none.crt")
    cert = tmp_path / "ca.crt"
    cert.write_text("x")
    for engine in ("podman", "docker"):
        argv = image.build_command(linux, engine=engine, pip_cert=cert)
        assert argv[argv.index("--secret") + 1] == f"id={image.PIP_CERT_SECRET},src={cert}"
    windows = image.ImageContext(tmp_path, "x:1", True, {f"{image.LABEL_PREFIX}.target": "dml"})
    if os.name != "nt":
        with pytest.raises(PackagingError, match=r"Windows container .*dml.*--no-build"):
            image.build_command(windows, engine="docker")


def test_image_options_are_refused_without_format_image(tmp_path):
    """An image's options without --format image are a usage error; $PIP_CERT (read as --pip-cert)
    naming no file matters to an image's build alone."""
    from higgs_pack.runtime.cli import main

    done = CliRunner().invoke(main, ["package", str(tmp_path), "--format", "wheel", "--tag", "x:1"])
    assert done.exit_code == 2 and "--tag" in done.output and "--format image" in done.output
    other = CliRunner().invoke(main, ["package", str(tmp_path), "--format", "zip"], env={"PIP_CERT": "/no/such.crt"})
    assert other.exit_code == 2 and "pip-cert" not in other.output and "is not a bundle" in other.output


def test_the_kubernetes_example_fits_the_image():
    """serve/kubernetes.example.yaml names the image's port, user and voices folder, settings that
    ``higgs-pack serve`` has, and routes the server answers."""
    import yaml

    from higgs_pack.serve.app import _ROUTES

    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO_ROOT / "serve" / "kubernetes.example.yaml").read_text())}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["ports"][0]["containerPort"] == image.PORT and pod["securityContext"]["runAsUser"] == image.UID
    assert container["volumeMounts"][0]["mountPath"] == image.VOICES
    assert container["volumeMounts"][1]["mountPath"] == image.STATE  # the prefix key, a secret apart from the voices
    options = ("max_batch", "max_queue", "grace_seconds", "api_key")
    assert {e["name"] for e in container["env"]} == set(image.serve_settings(**dict.fromkeys(options, "1")))
    assert grace_of(container) < pod["terminationGracePeriodSeconds"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in _ROUTES


def grace_of(container: dict) -> float:
    return float(next(e["value"] for e in container["env"] if e["name"] == "HIGGS_PACK_SERVE_GRACE_SECONDS"))


@slow_fixture(scope="session")
def runtime_wheel(tmp_path_factory) -> Path:
    """higgs-pack's wheel built once from this checkout."""
    return image._runtime_wheel(None, tmp_path_factory.mktemp("runtime-wheel"))


def test_the_build_context_holds_the_wheels_it_names(cpu_int4_bundle, runtime_wheel, tmp_path):
    context = image.write_image_context(cpu_int4_bundle, out_dir=tmp_path, runtime=runtime_wheel)
    text = (context.path / "Containerfile").read_text()
    bundle_wheel = next((context.path / "wheels" / "bundle").glob("*.whl"))
    assert f"{sha256_file(bundle_wheel)}  /wheels/bundle/{bundle_wheel.name}" in text
    assert f"{sha256_file(runtime_wheel)}  /wheels/{runtime_wheel.name}" in text
    assert f"ARG BASE_IMAGE={image.LINUX_BASE}\n" in text and "COPY" not in text  # mounted, not copied
    assert 'ENTRYPOINT ["higgs-pack", "serve", "higgs-audio-v3-tiny-cpu-int4"]' in text
    assert 'HIGGS_PACK_SERVE_HOST="0.0.0.0"' in text and 'HIGGS_PACK_SERVE_VOICES_DIR="/voices"' in text
    assert context.labels[f"{image.LABEL_PREFIX}.content-sha256"] == sha256_file(cpu_int4_bundle / "manifest.json")
    assert context.tag == "higgs-audio-v3-tiny-cpu-int4:" + context.labels["org.opencontainers.image.version"]
    with pytest.raises(PackagingError, match="already exists; pass --force"):
        image.write_image_context(cpu_int4_bundle, out_dir=tmp_path, runtime=runtime_wheel)
    with pytest.raises(PackagingError, match="neither a higgs-pack wheel"):
        image.write_image_context(cpu_int4_bundle, out_dir=tmp_path, runtime=tmp_path, force=True)
    assert f'"/wheels/{runtime_wheel.name}[serve]"' in text
    ray = image.write_image_context(cpu_int4_bundle, out_dir=tmp_path / "ray", runtime=runtime_wheel, extras=("ray",))
    assert f'"/wheels/{runtime_wheel.name}[serve,ray]"' in (ray.path / "Containerfile").read_text()
    with pytest.raises(PackagingError, match="--extra build: an image takes the server's extras only"):
        image.write_image_context(cpu_int4_bundle, out_dir=tmp_path, runtime=runtime_wheel, extras=("build",),
                                  force=True)


def test_gpu_targets_get_their_base_and_windows_targets_a_windows_containerfile(cpu_int4_bundle, runtime_wheel):
    """cuda builds on NVIDIA's CUDA image; dml and winml get a Windows Containerfile (PowerShell, the
    wheels copied in, Windows paths), filled in from the same facts as the Linux one."""
    from higgs_pack.targets.registry import targets

    known = targets()
    assert image.base_image(known["cuda"]) == image.CUDA_BASE and image.base_image(known["cpu"]) == image.LINUX_BASE
    manifest = json.loads((cpu_int4_bundle / "manifest.json").read_text())
    found = image.labels(manifest, "0" * 64, "0.1.0")
    for name in ("dml", "winml"):
        assert image.base_image(known[name]) == image.WINDOWS_BASE
        text = image.containerfile(manifest, known[name], base=image.WINDOWS_BASE, extras=(), tag="x:1", labels=found,
                                   runtime_wheel=runtime_wheel, bundle_wheel=runtime_wheel)
        assert text.startswith("# escape=`\n") and "--mount" not in text and "COPY wheels C:/wheels" in text
        assert 'HIGGS_PACK_SERVE_VOICES_DIR="C:/voices"' in text and "USER ContainerUser" in text
        assert f'io.github.higgs-pack.bundle.content-sha256="{"0" * 64}" `\n' in text
        assert text.rstrip().endswith('"serve", "higgs-audio-v3-tiny-cpu-int4"]')


# ----------------------------------------------------------------------------- the images, with podman

def _podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: {done.stderr[-3000:]}")
    return done


@slow_fixture(scope="module")
def podman() -> str:
    """podman's path; the test skips without it (fails under HIGGS_PACK_REQUIRE_IMAGES=1)."""
    found = shutil.which("podman")
    if found is None:
        if os.environ.get("HIGGS_PACK_REQUIRE_IMAGES") == "1":
            pytest.fail("podman is not installed, and HIGGS_PACK_REQUIRE_IMAGES=1 asks for the image tests")
        pytest.skip("podman is not installed (apt-get install podman runc mmdebstrap)")
    return found


@slow_fixture(scope="module")
def base(podman):
    """The base image: made here with mmdebstrap where it is installed (no registry needed), else the
    default (pulled)."""
    if shutil.which("mmdebstrap") is None:
        yield None
        return
    from higgs_pack.targets.packaging import local_base

    name = local_base.base_image(Path(os.environ.get("HIGGS_PACK_CACHE", ".nox/cache")))
    yield name
    _podman("rmi", name, check=False)  # the tarball stays cached; importing it again takes seconds


#: The tiny bundle fixture each image is made of.
BUNDLES = {"cpu": "cpu_int4_bundle", "openvino": "ov_int4_bundle"}


@slow_fixture(scope="module")
def images(podman, base, runtime_wheel, tmp_path_factory, request):
    """``images[target]``: (tag, ImageContext) of the target's image, built on first use; all removed after."""
    made: dict[str, tuple[str, image.ImageContext]] = {}
    run = uuid.uuid4().hex[:8]

    class Images(dict):
        def __missing__(self, target: str) -> tuple[str, image.ImageContext]:
            bundle = request.getfixturevalue(BUNDLES[target])
            context = image.write_image_context(bundle, out_dir=tmp_path_factory.mktemp(f"image-{target}"),
                                                base=base, runtime=runtime_wheel)
            tag = f"localhost/higgs-pack-test-{target}:{run}"
            start = time.monotonic()
            made[target] = (tag, context)
            image.build_image(context, tag=tag, engine=podman, pip_cert=os.environ.get("PIP_CERT"))
            print(f"built {tag} in {time.monotonic() - start:.1f} s")
            self[target] = made[target]
            return made[target]

    try:
        yield Images()
    finally:
        for tag, _ in made.values():
            _podman("rmi", "--force", tag, check=False)


class Container:
    """A container of an image on 127.0.0.1 (a free port) with a named voices volume."""

    def __init__(self, tag: str, *env: str):
        self.name = f"higgs-pack-test-{uuid.uuid4().hex[:8]}"
        self.volume = f"{self.name}-voices"
        env_args = [a for pair in (("-e", e) for e in env) for a in pair]
        start = time.monotonic()
        try:
            _podman("run", "-d", "--name", self.name, "-p", "127.0.0.1::8000", "-v", f"{self.volume}:/voices",
                    "--stop-timeout", "60", *env_args, tag)
            self.wait_ready()
        except BaseException:
            self.remove()  # a container that did not start leaves its volume (podman made it first)
            raise
        print(f"{tag}: ready {time.monotonic() - start:.1f} s after podman run")

    def wait_ready(self, timeout: float = 120.0) -> None:
        port = _podman("port", self.name, "8000/tcp").stdout.strip().rsplit(":", 1)[1]
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.name} not ready in {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        done = _podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def remove(self) -> None:
        _podman("rm", "--force", "--volumes", "--time", "0", self.name, check=False)  # and its anonymous /state volume
        _podman("volume", "rm", "--force", self.volume, check=False)


def _wav(data: bytes) -> np.ndarray:
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000 and samples.ndim == 1
    return samples


def _inspect(tag: str) -> dict:
    return json.loads(_podman("image", "inspect", tag).stdout)[0]


@pytest.mark.parametrize("target", ["cpu", "openvino"])
def test_the_image_is_small_labelled_and_holds_no_build_tools(images, target, record_property):
    tag, context = images[target]
    found = _inspect(tag)
    config = found["Config"]
    size = int(found["Size"])
    record_property("image_bytes", size)  # in the JUnit report (--junitxml)
    print(f"{tag}: {size / 2**20:.0f} MiB")
    assert size <= MAX_IMAGE_BYTES[target], f"{tag} is {size / 2**20:.0f} MiB"
    assert {k: config["Labels"][k] for k in context.labels} == context.labels
    assert config["User"] == f"{image.UID}:{image.UID}" and "/voices" in config["Volumes"] and "/state" in config["Volumes"]
    assert config["Entrypoint"][:2] == ["higgs-pack", "serve"] and "/ready" in " ".join(found["Healthcheck"]["Test"])
    assert "HIGGS_PACK_SERVE_HOST=0.0.0.0" in config["Env"]
    assert not any(e.startswith("PIP_CERT=") for e in config["Env"])  # a build secret, not kept
    probe = ("import importlib.util as u, os, shutil, sys; "
             f"assert u.find_spec({RUNTIME_MODULE[target]!r}), 'no runtime'; "
             "found = [m for m in ('torch', 'transformers', 'optimum', 'setuptools') if u.find_spec(m)]; "
             "found += [t for t in ('gcc', 'cc', 'c++', 'make', 'ld') if shutil.which(t)]; "
             "found += [p for p in ('/root/.cache/pip', '/home/higgs/.cache/pip', '/run/secrets/pip-cert', '/wheels') "
             "if os.path.exists(p)]; sys.exit(f'in the image: {found}' if found else 0)")
    done = _podman("run", "--rm", "--entrypoint", "python", tag, "-c", probe, check=False)
    assert done.returncode == 0, done.stderr + done.stdout


@pytest.mark.parametrize("target", ["cpu", "openvino"])
def test_the_image_serves_keeps_voices_across_a_restart_and_drains_on_sigterm(images, target, cases_dir):
    tag, _ = images[target]
    box = Container(tag, "HIGGS_PACK_SERVE_MAX_BATCH=2", "HIGGS_PACK_SERVE_GRACE_SECONDS=60")
    try:
        assert "max_batch 2" in box.logs(), box.logs()  # a setting from the environment
        assert _podman("healthcheck", "run", box.name, check=False).returncode == 0, box.logs()
        _speak_whole_and_streamed(box)
        _upload_and_use_a_voice(box, cases_dir)
        _drain_on_sigterm(box)
        _podman("start", box.name)
        box.wait_ready()
        _the_voice_and_its_prefix_are_still_there(box)
    finally:
        box.remove()


def _speak_whole_and_streamed(box: Container) -> None:
    client = box.client()
    body = {"seed": 5, "max_new_tokens": 60}
    whole = _wav(client.audio.speech.create(model=MODEL, voice="default", input="Hello from a container.",
                                            response_format="wav", extra_body=body).content)
    assert whole.size >= 960 * 8 and float(np.abs(whole).max()) > 0
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="default", input="Hello from a container.", response_format="wav",
            stream_format="audio", extra_body=body) as response:
        pieces = list(response.iter_bytes())
    assert len(pieces) > 1, "the stream came in one piece"
    streamed = _wav(b"".join(pieces))
    assert streamed.shape == whole.shape and float(np.abs(streamed - whole).max()) <= 2 / 32768


def _upload_and_use_a_voice(box: Container, cases_dir: Path) -> None:
    clip = (cases_dir / "ref_en_16k.wav").read_bytes()
    made = httpx.post(box.url + "/v1/audio/voices", files={"audio": ("ref.wav", clip, "audio/wav")},
                      data={"name": "alice", "transcript": (cases_dir / "ref_en_16k.txt").read_text().strip()},
                      timeout=120)
    assert made.status_code == 201, made.text
    said = box.client().audio.speech.create(model=MODEL, voice="alice", input="Alice speaks.",
                                            response_format="wav", extra_body={"seed": 1, "max_new_tokens": 20})
    assert _wav(said.content).size > 0
    deadline = time.monotonic() + 30
    while "alice.safetensors" not in _podman("exec", box.name, "ls", "/voices/.prefix-kv", check=False).stdout:
        assert time.monotonic() < deadline, "the voice's prompt prefix was not persisted in the volume"
        time.sleep(0.5)


def _drain_on_sigterm(box: Container) -> None:
    """A stream in flight when SIGTERM comes finishes whole; the server then exits by the signal."""
    body = {"model": MODEL, "voice": "default", "input": "A long answer, spoken while the server stops.",
            "response_format": "pcm", "stream_format": "audio", "seed": 3, "max_new_tokens": 500}
    whole = {k: v for k, v in body.items() if k != "stream_format"}
    expected = len(httpx.post(box.url + "/v1/audio/speech", json=whole, timeout=300).content)
    received = bytearray()
    with httpx.stream("POST", box.url + "/v1/audio/speech", json=body, timeout=300) as response:
        chunks = response.iter_bytes()
        received += next(chunks)
        _podman("kill", "--signal", "TERM", box.name)
        at_signal = len(received)
        _wait_taking_nothing_new(box)
        for chunk in chunks:
            received += chunk
    assert len(received) == expected, f"the stream was cut: {len(received)} of {expected} bytes"
    assert len(received) > at_signal, "the answer was over before SIGTERM came: nothing was drained"
    status = int(_podman("wait", box.name, timeout=120).stdout.strip())
    # 143: it ended by the signal, as `higgs-pack serve` does; 0 where it is the container's process 1,
    # which the kernel does not let a signal of its own end (without --init)
    assert status in (0, 143), f"exit status {status} after SIGTERM:\n{box.logs()}"
    assert "Finished server process" in box.logs()


def _wait_taking_nothing_new(box: Container, timeout: float = 5.0) -> None:
    """Within ``timeout`` s of SIGTERM (podman kill returns before the server has handled it), /ready
    answers 503 or its socket is closed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(box.url + "/ready", timeout=timeout).status_code == 503:
                return
        except httpx.TransportError:
            return
        assert time.monotonic() < deadline, f"/ready still answers 200 {timeout} s after SIGTERM"
        time.sleep(0.05)


def _the_voice_and_its_prefix_are_still_there(box: Container) -> None:
    names = [v["name"] for v in httpx.get(box.url + "/v1/audio/voices", timeout=30).json()["voices"]]
    assert "alice" in names, names
    said = box.client().audio.speech.create(model=MODEL, voice="alice", input="Alice again.",
                                            response_format="wav", extra_body={"seed": 1, "max_new_tokens": 20})
    assert _wav(said.content).size > 0
    metrics = httpx.get(box.url + "/metrics", timeout=30).text
    assert "higgs_pack_prefix_cache_hits_total 1.0" in metrics, "the persisted prefix was not read back"
    assert "higgs_pack_prefix_cache_misses_total 0.0" in metrics


def test_a_docker_without_buildkit_refusing_the_pip_cert_secret_is_said_and_leaves_nothing(cpu_int4_bundle,
                                                                                           tmp_path, monkeypatch):
    """Issue 37 pass 3 item 10: a fake docker (it only refuses --secret as docker's legacy builder does)
    tests our handling: the path is not printed as a result, the failure says what to do, and nothing
    is left behind, so a rerun needs no --force."""
    from higgs_pack.targets.cli import package

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text("#!/bin/sh\necho 'DEPRECATED: The legacy builder is deprecated' >&2\n"
                    "echo 'unknown flag: --secret' >&2\nexit 125\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    cert = tmp_path / "ca.crt"
    cert.write_text("not a real CA\n")
    monkeypatch.setenv("PIP_CERT", str(cert))
    wheel = tmp_path / "higgs_pack-0.0.0-py3-none-any.whl"  # copied into the context, never installed here
    wheel.write_bytes(b"")
    out = tmp_path / "dist"
    args = [str(cpu_int4_bundle), "--format", "image", "--out-dir", str(out), "--runtime", str(wheel)]
    for _ in range(2):  # the second run fails the same way: no "already exists; pass --force"
        result = CliRunner().invoke(package, args)
        assert isinstance(result.exception, PackagingError), (result.output, result.exception)
        message = str(result.exception)
        assert "docker build of" in message and "failed (exit 125)" in message, message
        assert "no BuildKit" in message and "DOCKER_BUILDKIT=1" in message and "podman" in message, message
        assert "already exists" not in message and "its output above says why" not in message, message
        assert str(out / "image") not in result.stdout, result.stdout
        assert not (out / "image").exists()
    fake.write_text("#!/bin/sh\necho 'some other failure' >&2\nexit 1\n")
    result = CliRunner().invoke(package, args)
    assert "failed (exit 1); its output above says why" in str(result.exception), result.exception
    assert not (out / "image").exists()
