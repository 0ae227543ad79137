"""Bundles in the Hugging Face cache layout, resolved offline by huggingface_hub itself (no network, no mocks).

The cache is laid out as huggingface_hub lays it out: ``models--<org>--<repo>/``
(named by ``huggingface_hub.file_download.repo_folder_name``) with the file contents in
``blobs/<sha256>`` (the etag of an LFS file is its sha256), ``refs/main`` holding the
commit, and ``snapshots/<commit>/<path>`` relative symlinks into ``blobs/``;
``huggingface_hub.scan_cache_dir`` must read it back without warnings.  Resolution runs
in child processes with ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing at it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_pack.errors import BundleError, HubError
from higgs_pack.manifests.manifest import sha256_file

pytestmark = pytest.mark.slow

REPO = "test-org/higgs-bundles"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hf_cache(cache: Path, repo_id: str, commit: str, folders: dict[str, Path]) -> Path:
    """Write ``folders`` (repo path -> local folder) as one revision of ``repo_id``; return the snapshot."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    blobs = storage / "blobs"
    snapshot = storage / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes it
    for prefix, folder in folders.items():
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            blob = blobs / sha256_file(file)
            if not blob.exists():
                blob.write_bytes(file.read_bytes())
            link = snapshot / prefix / file.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))  # relative, as huggingface_hub links
    return snapshot


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory, cpu_fp32_bundle, cpu_int4_bundle) -> Path:
    cache = tmp_path_factory.mktemp("hf-cache")
    lay_out_hf_cache(cache, REPO, COMMIT, {b.name: b for b in (cpu_fp32_bundle, cpu_int4_bundle)})
    return cache


def offline(cache: Path, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home")}
    env.pop("HF_TOKEN", None)
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "higgs_pack.runtime.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_layout_is_what_huggingface_hub_reads(hf_cache):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hf_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (rev,) = repo.revisions
    assert rev.commit_hash == COMMIT and rev.refs == {"main"}
    assert all(f.file_path.is_symlink() for f in rev.files)


def test_pull_offline_chooses_a_variant_and_verifies(hf_cache):
    out = offline(hf_cache, "pull", REPO)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path == hf_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT / "higgs-audio-v3-tiny-cpu-int4"
    assert f"{REPO}@{COMMIT}" in out.stderr and "chose higgs-audio-v3-tiny-cpu-int4" in out.stderr
    assert "files verified" in out.stderr
    out = offline(hf_cache, "pull", f"{REPO}@{COMMIT}", "--variant", "higgs-audio-v3-tiny-cpu-fp32")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("higgs-audio-v3-tiny-cpu-fp32") and "as asked" in out.stderr
    out = offline(hf_cache, "pull", REPO, "--variant", "nope")
    assert out.returncode == 2 and "no variant 'nope'" in out.stderr and "higgs-audio-v3-tiny-cpu-fp32" in out.stderr


def test_load_hf_reference_offline_and_verify(hf_cache):
    code = ("import higgs_pack\n"
            f"tts = higgs_pack.load('hf://{REPO}@main/higgs-audio-v3-tiny-cpu-fp32')\n"
            "r = tts.synthesize('Hello.', max_frames=6)\n"
            "assert r.samples.dtype.name == 'float32' and r.codes.shape[1] == 8\n"
            "print(tts.info.reason)\n")
    out = offline(hf_cache, code=code)
    assert out.returncode == 0, out.stderr
    assert f"hub {REPO}@{COMMIT[:12]}" in out.stdout and "files verified" in out.stdout
    out = offline(hf_cache, "verify", f"hf://{REPO}/higgs-audio-v3-tiny-cpu-fp32")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "result: PASS" in out.stdout
    # onnx.checker refuses symlinked external data; it ran on copies that are gone again.
    assert "ok  onnx.checker llm_decoder" in out.stdout and "ok  onnx.checker text_embed" in out.stdout
    repo = hf_cache / f"models--{REPO.replace('/', '--')}"
    assert sorted(p.name for p in repo.iterdir()) == ["blobs", "refs", "snapshots"]


def test_offline_unknown_repo_says_how_to_fix(hf_cache):
    out = offline(hf_cache, "pull", "test-org/not-there@v2")
    assert out.returncode == 2
    assert "test-org/not-there@v2" in out.stderr and "HF_HUB_OFFLINE" in out.stderr
    assert "path/to/bundle" in out.stderr
    out = offline(hf_cache, code="import higgs_pack; higgs_pack.load('hf://test-org/not-there')")
    assert out.returncode != 0 and "HubError" in out.stderr and "HF_HUB_OFFLINE" in out.stderr


def test_cache_layout_hashes_are_checked_and_escapes_refused(tmp_path, cpu_fp32_bundle):
    from higgs_pack.runtime.sources.bundle import open_bundle

    snapshot = lay_out_hf_cache(tmp_path / "cache", REPO, COMMIT, {"b": cpu_fp32_bundle})
    bundle = open_bundle(snapshot / "b")  # symlinks into the repo's blobs/: accepted, hashes checked
    assert bundle.file("audio_heads.onnx") == snapshot / "b" / "audio_heads.onnx"
    # A blob changed after download: its sha256 no longer matches the manifest.
    heads = (snapshot / "b" / "audio_heads.onnx").resolve()
    heads.chmod(0o644)
    data = bytearray(heads.read_bytes())
    data[-1] ^= 0xFF
    heads.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256 differs"):
        open_bundle(snapshot / "b")
    # A link leaving both the bundle and its cache repository stays refused.
    outside = tmp_path / "elsewhere.onnx"
    outside.write_bytes(data)
    link = snapshot / "b" / "audio_heads.onnx"
    link.unlink()
    link.symlink_to(outside)
    with pytest.raises(BundleError, match="outside its Hugging Face cache repository"):
        open_bundle(snapshot / "b")


def test_parse_ref():
    from higgs_pack.runtime.sources.hub import HubRef, parse_ref

    assert parse_ref("hf://org/repo") == HubRef("org/repo")
    assert parse_ref("org/repo@v1.0") == HubRef("org/repo", "v1.0")
    assert parse_ref("hf://org/repo@abc123/variant-a") == HubRef("org/repo", "abc123", "variant-a")
    assert str(HubRef("org/repo", "main", "x")) == "hf://org/repo@main/x"
    with pytest.raises(HubError, match=r"\[hf://\]ORG/REPO\[@REVISION\]"):
        parse_ref("hf://just-a-name")


def test_package_hub_folder_is_a_pullable_repository(tmp_path, cpu_fp32_bundle, cpu_int4_bundle):
    from higgs_pack.targets.packaging import package_bundle

    for b in (cpu_fp32_bundle, cpu_int4_bundle):
        (folder,) = package_bundle(b, formats="hub", out_dir=tmp_path / "dist")
        assert folder == tmp_path / "dist" / "hub" / "higgs-audio-v3-tiny" / b.name
    repo = tmp_path / "dist" / "hub" / "higgs-audio-v3-tiny"
    card = (repo / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: higgs-pack\npipeline_tag: text-to-speech\n")
    for b in (cpu_fp32_bundle, cpu_int4_bundle):
        assert f"| `{b.name}` | cpu |" in card and f"### {b.name}" in card
    assert "`onnxruntime>=1.31,<1.33`" in card and "Boson AI Higgs Audio licence" in card
    assert "parity llm_decoder | ok |" in card
    # Uploaded as is, it is a repository `pull` understands (laid out as the HF cache stores it).
    cache = tmp_path / "cache"
    lay_out_hf_cache(cache, REPO, COMMIT, {".": repo})
    out = offline(cache, "pull", REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(cpu_int4_bundle.name)
    with pytest.raises(Exception, match="already exists"):
        package_bundle(cpu_int4_bundle, formats="hub", out_dir=tmp_path / "dist")


def test_a_hub_that_cannot_be_reached_is_said_once_without_naming_an_unset_offline_mode(tmp_path):
    """Issue 37 item 6: without a network, ``pull`` said the cache miss twice and told the user to
    unset HF_HUB_OFFLINE, which was not set.  The hub here is a closed port on this machine."""
    import socket

    with socket.socket() as s:  # a port nobody listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf-home"),
           "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    for key in ("HF_HUB_OFFLINE", "HF_TOKEN"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "pull", "my-org/x@v1.0"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "my-org/x@v1.0: not in the Hugging Face cache" in out.stderr
    assert "the hub could not be reached (no network?); connect to download it (higgs-pack pull my-org/x@v1.0)" \
        in out.stderr
    assert "HF_HUB_OFFLINE" not in out.stderr and "not in the local cache" not in out.stderr
