"""Packaging bundles as wheels and archives, and opening archives safely.

Real files throughout, no mocks: small hand-made bundles (tiny valid ONNX graphs
and a schema-valid manifest) for contents, reproducibility and every failure
mode; a real tiny cpu fp32 build (``slow``, about 1 min on 2 cores) for the
end-to-end round trip (package -> verify the archive -> pip install the wheel ->
found by name); and one ``slow`` bundle with a sparse 3 GiB file for zip64 and
constant memory.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("wheel")

import numpy as np  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402

from higgs_pack.errors import PackagingError  # noqa: E402
from higgs_pack.manifests.manifest import (  # noqa: E402
    MANIFEST_NAME,
    check_files,
    file_entry,
    read_manifest,
    write_manifest,
)
from higgs_pack.manifests.providers import EXECUTION_PROVIDERS  # noqa: E402
from higgs_pack.runtime.sources.archive import extracted_archive  # noqa: E402
from higgs_pack.runtime.sources.bundle import open_bundle  # noqa: E402
from higgs_pack.runtime.verification.verify import verify_any  # noqa: E402
from higgs_pack.targets.packaging import DEFAULT_EPOCH, package_bundle  # noqa: E402

SUBPARTS = ("text_embed", "llm_decoder", "audio_embed", "audio_heads", "audio_tokenizer", "audio_encoder")
NAME = "hand-made-cpu-fp32"
#: The higgs-pack version the hand-made manifests say built them (test data: the wheel's
#: version follows the manifest, not the installed higgs-pack).
BUILT_WITH = "0.1.0"
WHEEL = f"hand_made_cpu_fp32-{BUILT_WITH}-py3-none-any.whl"


# ----------------------------------------------------------------------------- helpers


def make_bundle(root: Path, *, name: str = NAME, target: str = "cpu") -> Path:
    """A small schema-valid bundle: one Identity ONNX graph per sub-part, a tokenizer, golden."""
    root.mkdir(parents=True)
    subparts = {}
    for part in SUBPARTS:
        (root / part).mkdir()
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])], part,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        )
        onnx.save(helper.make_model(graph), root / part / "model.onnx")
        subparts[part] = {
            "format": "onnx", "files": [f"{part}/model.onnx"], "entry": f"{part}/model.onnx",
            "exporter": "hand", "passes": [], "tool_versions": {}, "precision": "fp32", "quantization": {},
            "inputs": [{"name": "x", "dtype": "float32", "shape": ["n"]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": ["n"]}], "options": {},
            "parity": {"metric": "cosine", "threshold": 0.9999},
        }
    Tokenizer(WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(str(root / "tokenizer.json"))
    (root / "reference").mkdir()
    np.savez(root / "reference" / "golden.npz", x=np.random.default_rng(0).standard_normal(375))
    ints = ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "num_codebooks", "codebook_size", "audio_vocab_size", "boc", "eoc",
            "sample_rate", "frame_rate", "hop_length", "text_vocab_size")
    manifest = {
        "format_version": 1, "name": name,
        "model": {"id": "hand/made", "slug": "hand-made", "checkpoint_sha256": "0" * 64,
                  "license": "test licence: research only"},
        "target": target, "precision": "fp32", "variant": None, "backend": "onnxruntime",
        "execution_provider": target, "device": None, "provider_options": {}, "session_options": {},
        "runtime_requirements": [EXECUTION_PROVIDERS[target].packaging.requirement, "onnx>=1.17"],
        "tokenizer": {"file": "tokenizer.json"}, "files": [], "subparts": subparts,
        "constants": {**dict.fromkeys(ints, 1),
                      "special_tokens": {"tts": 1, "audio": 2, "text": 3, "ref_audio": 4, "ref_text": 5}},
        "generation": {},
        "build": {"higgs_pack_version": BUILT_WITH, "python": "3.11", "platform": "linux", "tool_versions": {}},
        "reference": {"file": "reference/golden.npz", "cases": ["hi"]}, "verification": {},
    }
    relist(root, manifest)
    return root


def relist(root: Path, manifest: dict | None = None) -> None:
    """Rewrite the manifest's file list (size + sha256) from what is on disk."""
    manifest = manifest or read_manifest(root)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    manifest["files"] = [file_entry(root, f) for f in files]
    write_manifest(root, manifest)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return make_bundle(tmp_path / "bundle")


def tar_member(name: str, data: bytes = b"", type_: bytes = tarfile.REGTYPE, linkname: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = type_, linkname
    info.size = len(data) if type_ == tarfile.REGTYPE else 0
    return info, (io.BytesIO(data) if type_ == tarfile.REGTYPE else None)


def write_tar(path: Path, members: list[tuple]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, data)
    return path


def sums(files: dict[str, bytes]) -> bytes:
    return "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(files.items())).encode()


# ----------------------------------------------------------------------------- contents and names


def test_archive_and_zip_contents(bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    tgz, = package_bundle(bundle, formats="archive", out_dir=out)
    zpath, = package_bundle(bundle, formats="zip", out_dir=out)
    assert (tgz.name, zpath.name) == (f"{NAME}.tar.gz", f"{NAME}.zip")

    raw = tgz.read_bytes()
    assert raw[3] == 0, "gzip header must carry no file name (FLG.FNAME)"
    assert struct.unpack("<I", raw[4:8])[0] == DEFAULT_EPOCH
    listed = sorted(e["path"] for e in read_manifest(bundle)["files"])
    with tarfile.open(tgz) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names, key=lambda n: n.split("/")), "members are sorted"
        assert names[0] == NAME and all(n == NAME or n.startswith(NAME + "/") for n in names)
        files = sorted(m.name[len(NAME) + 1:] for m in members if m.isfile())
        assert files == sorted([*listed, MANIFEST_NAME, "SHA256SUMS"])
        for m in members:
            assert (m.uid, m.gid, m.uname, m.gname, m.mtime) == (0, 0, "", "", DEFAULT_EPOCH)
            assert m.mode == (0o755 if m.isdir() else 0o644)
        checksums = tar.extractfile(f"{NAME}/SHA256SUMS").read().decode()
        for line in checksums.splitlines():
            digest, rel = line.split("  ")
            assert hashlib.sha256(tar.extractfile(f"{NAME}/{rel}").read()).hexdigest() == digest
        assert len(checksums.splitlines()) == len(listed) + 1
    with zipfile.ZipFile(zpath) as zf:
        assert [i.filename.rstrip("/") for i in zf.infolist()] == names
        for info in zf.infolist():
            assert info.date_time == (1980, 1, 1, 0, 0, 0) and info.create_system == 3
        assert zf.testzip() is None


def test_wheel_contents_and_metadata(bundle: Path, tmp_path: Path) -> None:
    from wheel.wheelfile import WheelFile

    whl, = package_bundle(bundle, formats="wheel", out_dir=tmp_path / "out")
    assert whl.name == WHEEL
    with WheelFile(whl) as wf:  # reading every member checks it against RECORD
        contents = {n: wf.read(n) for n in wf.namelist()}
    pkg, info = "hand_made_cpu_fp32", f"hand_made_cpu_fp32-{BUILT_WITH}.dist-info"
    listed = {e["path"] for e in read_manifest(bundle)["files"]}
    assert {n[len(pkg) + 1:] for n in contents if n.startswith(pkg + "/")} == listed | {MANIFEST_NAME, "__init__.py"}
    assert set(contents) - {n for n in contents if n.startswith(pkg + "/")} == {
        f"{info}/{n}" for n in ("METADATA", "WHEEL", "entry_points.txt", "RECORD")}
    assert contents[f"{pkg}/manifest.json"] == (bundle / MANIFEST_NAME).read_bytes()
    assert contents[f"{info}/entry_points.txt"].decode() == f"[higgs_pack.bundles]\n{NAME} = {pkg}\n"
    assert b"Root-Is-Purelib: true" in contents[f"{info}/WHEEL"]
    meta = HeaderParser().parsestr(contents[f"{info}/METADATA"].decode())
    assert (meta["Name"], meta["Version"]) == (NAME, BUILT_WITH)
    assert meta["Summary"] == "Higgs-Audio-v3 TTS bundle: hand/made for cpu (onnxruntime on cpu), fp32"
    assert meta["License"] == "test licence: research only"
    assert meta.get_all("Requires-Dist") == [f"higgs-pack[cpu]>={BUILT_WITH}", "onnxruntime<1.33,>=1.31", "onnx>=1.17"]
    assert "cpu" in meta["Keywords"].split(",") and "fp32" in meta["Keywords"].split(",")
    assert "Topic :: Multimedia :: Sound/Audio :: Speech" in meta.get_all("Classifier")
    assert "Project-URL" not in meta


def test_dml_wheel_carries_the_windows_marker(tmp_path: Path) -> None:
    src = make_bundle(tmp_path / "dml", name="hand-made-dml-fp32", target="dml")
    whl, = package_bundle(src, formats="wheel", out_dir=tmp_path / "out")
    with zipfile.ZipFile(whl) as zf:
        meta = HeaderParser().parsestr(zf.read(f"hand_made_dml_fp32-{BUILT_WITH}.dist-info/METADATA").decode())
    assert meta.get_all("Requires-Dist") == [
        f'higgs-pack[dml]>={BUILT_WITH}; sys_platform == "win32"',
        'onnxruntime-directml<1.33,>=1.24; sys_platform == "win32"',
        'onnx>=1.17; sys_platform == "win32"',
    ]
    assert "Operating System :: Microsoft :: Windows" in meta.get_all("Classifier")

    from higgs_pack.targets.packaging.install_check import Results, check_metadata, read_wheel
    from higgs_pack.targets.registry import get_target

    wheel = read_wheel(whl)
    assert (wheel.bundle_name, wheel.package) == ("hand-made-dml-fp32", "hand_made_dml_fp32")
    results = Results()
    check_metadata(wheel, get_target("dml"), results)
    assert not results.failed, results.lines
    results = Results()
    check_metadata(wheel, get_target("cuda"), results)
    assert [name for status, name, _ in results.lines if status == "FAIL"] == [
        "wheel names its bundle", "Requires-Dist higgs-pack extra and marker"]


def test_winml_wheel_needs_windows_ml_on_x64_windows_only(tmp_path: Path) -> None:
    """A winml wheel requires higgs-pack[winml], Windows ML's ONNX Runtime and GenAI builds, each
    on x64 Windows only (never the unrelated onnxruntime-winml)."""
    from higgs_pack.targets.packaging.install_check import Results, check_metadata, read_wheel
    from higgs_pack.targets.registry import get_target

    src = make_bundle(tmp_path / "winml", name="hand-made-winml-fp32", target="winml")
    manifest = read_manifest(src)
    manifest["runtime_requirements"] = list(get_target("winml").runtime_requirements)
    relist(src, manifest)
    whl, = package_bundle(src, formats="wheel", out_dir=tmp_path / "out")
    with zipfile.ZipFile(whl) as zf:
        meta = HeaderParser().parsestr(zf.read(f"hand_made_winml_fp32-{BUILT_WITH}.dist-info/METADATA").decode())
    x64 = 'sys_platform == "win32" and platform_machine == "AMD64"'
    assert meta.get_all("Requires-Dist") == [
        f"higgs-pack[winml]>={BUILT_WITH}; {x64}",
        f"onnxruntime-windowsml<1.33,>=1.30; {x64}",
        f"onnxruntime-genai-winml<0.19,>=0.18; {x64}",
        f"onnx>=1.17; {x64}",
    ]
    assert "Operating System :: Microsoft :: Windows :: Windows 11" in meta.get_all("Classifier")
    wheel = read_wheel(whl)
    results = Results()
    check_metadata(wheel, get_target("winml"), results)
    assert not results.failed, results.lines
    results = Results()
    check_metadata(wheel, get_target("dml"), results)
    assert [name for status, name, _ in results.lines if status == "FAIL"] == [
        "wheel names its bundle", "Requires-Dist higgs-pack extra and marker"]


def test_package_command(bundle: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from higgs_pack.runtime.cli import main

    args = ["package", str(bundle), "--format", "zip", "--out-dir", str(tmp_path / "out")]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert first.output.strip() == str(tmp_path / "out" / f"{NAME}.zip")
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2
    assert f"{NAME}.zip already exists; pass --force (force=True)" in again.output
    assert CliRunner().invoke(main, [*args, "--force"]).exit_code == 0


def test_only_listed_files_are_packaged(bundle: Path, tmp_path: Path) -> None:
    (bundle / ".ov_cache").mkdir()
    (bundle / ".ov_cache" / "blob").write_bytes(b"cache")
    tgz, = package_bundle(bundle, formats="archive", out_dir=tmp_path / "out")
    with tarfile.open(tgz) as tar:
        assert not [n for n in tar.getnames() if "ov_cache" in n]


# ----------------------------------------------------------------------------- reproducibility


def test_outputs_are_byte_identical(bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(out: str) -> dict[str, bytes]:
        paths = package_bundle(bundle, formats="all", out_dir=tmp_path / out)
        paths += package_bundle(bundle, formats="zip", out_dir=tmp_path / out)
        return {p.name: p.read_bytes() for p in paths}

    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    first = run("a")
    for path in bundle.rglob("*"):  # new mtimes and permissions must not leak into the outputs
        os.utime(path, (time.time() + 1000, time.time() + 1000))
    (bundle / "tokenizer.json").chmod(0o600)
    assert run("b") == first
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    epoch_one, epoch_two = run("c"), run("d")
    assert epoch_one == epoch_two
    assert all(epoch_one[name] != first[name] for name in first)
    with zipfile.ZipFile(tmp_path / "c" / WHEEL) as zf:
        assert {i.date_time for i in zf.infolist()} == {time.gmtime(1700000000)[:6]}
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(PackagingError, match="SOURCE_DATE_EPOCH='yesterday' is not an integer"):
        package_bundle(bundle, formats="archive", out_dir=tmp_path / "e")


# ----------------------------------------------------------------------------- bad inputs


def test_not_a_bundle(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackagingError, match=r"cannot package .*empty: .*not a bundle \(manifest.json is missing\)"):
        package_bundle(tmp_path / "empty", formats="all", out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wheel_needs_a_registered_target(tmp_path: Path) -> None:
    src = make_bundle(tmp_path / "tpu", name="hand-made-tpu-fp32", target="cpu")
    manifest = read_manifest(src)
    manifest["target"] = "tpu"
    write_manifest(src, manifest)
    with pytest.raises(PackagingError, match=r"cannot package .* as a wheel: its target 'tpu' is not a target of this higgs-pack \(known: cpu, cuda, dml, openvino, winml\)"):
        package_bundle(src, formats="all", out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    tgz, = package_bundle(src, formats="archive", out_dir=tmp_path / "out")  # archives need no target
    assert tgz.name == "hand-made-tpu-fp32.tar.gz"


def test_changed_file_is_named(bundle: Path, tmp_path: Path) -> None:
    path = bundle / "audio_heads" / "model.onnx"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(PackagingError, match=r"changed since build: audio_heads/model.onnx \(sha256 differs\)"):
        package_bundle(bundle, formats="wheel", out_dir=tmp_path / "out")
    (bundle / "tokenizer.json").unlink()
    with pytest.raises(PackagingError, match=r"missing: tokenizer.json"):
        package_bundle(bundle, formats="wheel", out_dir=tmp_path / "out")


def test_file_changing_during_packaging_aborts(bundle: Path, tmp_path: Path) -> None:
    from higgs_pack.targets.packaging import collect, write_tar_gz

    content = collect(bundle)
    (bundle / "tokenizer.json").write_text("changed")
    with pytest.raises(PackagingError, match=r"tokenizer.json changed while it was being packaged"):
        write_tar_gz(content, tmp_path / "x.tar.gz", DEFAULT_EPOCH)


def test_output_inside_the_bundle_is_refused(bundle: Path) -> None:
    for out in (bundle, bundle / "dist"):
        with pytest.raises(PackagingError, match=r"output folder .* is inside the bundle .*--out-dir"):
            package_bundle(bundle, formats="archive", out_dir=out)
    assert not (bundle / "dist").exists()
    assert check_files(bundle, read_manifest(bundle)).extra == []


def test_existing_output_needs_force(bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{NAME}.tar.gz").write_bytes(b"old")
    with pytest.raises(PackagingError, match=rf"{NAME}.tar.gz already exists; pass --force \(force=True\)"):
        package_bundle(bundle, formats="all", out_dir=out)
    assert sorted(p.name for p in out.iterdir()) == [f"{NAME}.tar.gz"], "nothing written when refusing"
    written = package_bundle(bundle, formats="all", out_dir=out, force=True)
    assert [p.name for p in written] == [WHEEL, f"{NAME}.tar.gz"]
    assert sorted(p.name for p in out.iterdir()) == sorted([WHEEL, f"{NAME}.tar.gz"]), "no temporary left"
    with pytest.raises(PackagingError, match=r"unknown package format 'whl' \(did you mean 'wheel'\?\)"):
        package_bundle(bundle, formats="whl", out_dir=out)


# ----------------------------------------------------------------------------- reading archives


def test_archives_round_trip_into_a_temporary_folder(bundle: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    outs = package_bundle(bundle, formats="all", out_dir=tmp_path / "out")
    outs += package_bundle(bundle, formats="zip", out_dir=tmp_path / "out")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for path in outs:
        with extracted_archive(path) as extracted:
            assert Path(tempfile.gettempdir()) in extracted.parents
            opened = open_bundle(extracted)
            assert opened.name == NAME
            report = check_files(extracted, opened.manifest)
            assert report.ok and report.checked == len(opened.manifest["files"])
        assert not extracted.exists()
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("suffix", [".tar.gz", ".zip"])
def test_truncated_archive(bundle: Path, tmp_path: Path, suffix: str) -> None:
    path, = package_bundle(bundle, formats="archive" if suffix == ".tar.gz" else "zip", out_dir=tmp_path / "out")
    data = path.read_bytes()
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackagingError, match=r"cut.* is truncated or not a bundle archive"):
        verify_any(cut)
    junk = tmp_path / f"junk{suffix}"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(PackagingError, match=r"junk.* is truncated or not a bundle archive"):
        verify_any(junk)


def test_archive_cut_at_a_member_boundary(tmp_path: Path) -> None:
    files = {"manifest.json": b"{}", "z.bin": b"z" * 10}
    members = [tar_member("b/SHA256SUMS", sums(files)), tar_member("b/manifest.json", b"{}")]
    path = write_tar(tmp_path / "short.tar.gz", members)  # z.bin never made it in
    with pytest.raises(PackagingError, match=r"truncated or not a bundle archive .*listed in SHA256SUMS are not in it"):
        verify_any(path)


def test_unknown_archive_suffix(tmp_path: Path) -> None:
    path = tmp_path / "bundle.rar"
    path.write_bytes(b"x")
    with pytest.raises(PackagingError, match=r"not a bundle archive \(expected .*\.tar\.gz, \.tgz"):
        verify_any(path)


UNSAFE_TAR = {
    "traversal": ([tar_member("b/../../evil", b"x")], r"'b/../../evil' has a '\.\.' component \(path traversal\)"),
    "absolute": ([tar_member("/tmp/evil", b"x")], r"'/tmp/evil' has an absolute path"),
    "symlink": ([tar_member("b/link", type_=tarfile.SYMTYPE, linkname="/etc/passwd")],
                r"'b/link' is a symbolic link \(to '/etc/passwd'\)"),
    "hardlink": ([tar_member("b/hard", type_=tarfile.LNKTYPE, linkname="/etc/passwd")], r"'b/hard' is a hard link"),
    "device": ([tar_member("b/dev", type_=tarfile.CHRTYPE)], r"'b/dev' is a device file"),
    "fifo": ([tar_member("b/pipe", type_=tarfile.FIFOTYPE)], r"'b/pipe' is a FIFO"),
    "duplicate": ([tar_member("b/manifest.json", b"{}")], r"'b/manifest.json' appears twice"),
    "case": ([tar_member("b/MANIFEST.json", b"{}")], r"clashes with 'b/manifest.json' \(names differ only in case\)"),
    "two tops": ([tar_member("c/x", b"x")], r"'c' is a second top-level entry \(top level: 'b', 'c'\)"),
    "backslash": ([tar_member("b\\..\\evil", b"x")], r"has a backslash"),
    "under a file": ([tar_member("b/manifest.json/x", b"x")], r"is inside 'b/manifest.json', which is a file"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE_TAR))
def test_unsafe_tar_members_are_refused_before_extraction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          case: str) -> None:
    extra, message = UNSAFE_TAR[case]
    good = {"manifest.json": b"{}"}
    members = [tar_member("b/SHA256SUMS", sums(good)), tar_member("b/manifest.json", b"{}"), *extra]
    path = write_tar(tmp_path / "bad.tar.gz", members)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(PackagingError, match=rf"bad.tar.gz: refusing to extract: member .*{message}"):
        verify_any(path)
    assert list(scratch.iterdir()) == [], "nothing may be extracted"
    assert not (tmp_path.parent / "evil").exists()


def test_unsafe_zip_members_are_refused(tmp_path: Path) -> None:
    def zip_with(extra: zipfile.ZipInfo, data: bytes) -> Path:
        path = tmp_path / "bad.zip"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("b/SHA256SUMS", sums({"manifest.json": b"{}"}))
            zf.writestr("b/manifest.json", b"{}")
            zf.writestr(extra, data)
        return path

    link = zipfile.ZipInfo("b/link")
    link.create_system, link.external_attr = 3, (stat.S_IFLNK | 0o777) << 16
    with pytest.raises(PackagingError, match=r"member 'b/link' is a symbolic link"):
        verify_any(zip_with(link, b"/etc/passwd"))
    with pytest.raises(PackagingError, match=r"member 'b/../evil' has a '\.\.' component"):
        verify_any(zip_with(zipfile.ZipInfo("b/../evil"), b"x"))


def test_checksum_mismatch_and_missing_sums(bundle: Path, tmp_path: Path) -> None:
    tgz, = package_bundle(bundle, formats="archive", out_dir=tmp_path / "out")
    with tarfile.open(tgz) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    tampered = [(m, (b"x" + d[1:]) if m.name.endswith("tokenizer.json") else d) for m, d in members]
    bad = write_tar(tmp_path / "tampered.tar.gz", [(m, io.BytesIO(d) if d is not None else None) for m, d in tampered])
    with pytest.raises(PackagingError, match=rf"sha256 of {NAME}/tokenizer.json differs from SHA256SUMS"):
        verify_any(bad)
    no_sums = [(m, io.BytesIO(d) if d is not None else None) for m, d in members if not m.name.endswith("SHA256SUMS")]
    with pytest.raises(PackagingError, match=r"truncated or not a bundle archive \(SHA256SUMS is missing"):
        verify_any(write_tar(tmp_path / "nosums.tar.gz", no_sums))
    extra = [*[(m, io.BytesIO(d) if d is not None else None) for m, d in members], tar_member(f"{NAME}/extra.bin", b"1")]
    with pytest.raises(PackagingError, match=rf"{NAME}/extra.bin is not listed in SHA256SUMS"):
        verify_any(write_tar(tmp_path / "extra.tar.gz", extra))


def test_installed_wheel_is_found_by_name(bundle: Path, tmp_path: Path) -> None:
    whl, = package_bundle(bundle, formats="wheel", out_dir=tmp_path / "out")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(whl)],
                   check=True)
    code = (
        "import json; from higgs_pack.runtime.sources.installed import installed_bundles;"
        "from higgs_pack.runtime.sources.bundle import open_bundle; from higgs_pack.manifests.manifest import check_files;"
        f"b = open_bundle({NAME!r}); r = check_files(b.path, b.manifest);"
        "print(json.dumps({'found': {k: str(v) for k, v in installed_bundles().items()}, 'path': str(b.path),"
        " 'ok': r.ok, 'extra': r.extra}))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout)
    assert result["found"] == {NAME: str(site / "hand_made_cpu_fp32")}
    assert result["ok"] and "__init__.py" in result["extra"]
    with extracted_archive(whl) as extracted:  # a wheel is checked against its RECORD
        assert open_bundle(extracted).name == NAME


# ----------------------------------------------------------------------------- a real build


@pytest.fixture(scope="module")
def built_bundle(tmp_path_factory: pytest.TempPathFactory, cpu_fp32_bundle: Path) -> Path:
    """A private copy of the session's real cpu fp32 bundle (built once for all test files)."""
    import shutil

    return Path(shutil.copytree(cpu_fp32_bundle, tmp_path_factory.mktemp("built") / "bundle"))


@pytest.mark.slow
def test_real_bundle_end_to_end(built_bundle: Path, tmp_path: Path) -> None:
    name = read_manifest(built_bundle)["name"]
    assert name == "higgs-audio-v3-tiny-cpu-fp32"
    start = time.perf_counter()
    outs = package_bundle(built_bundle, formats="all", out_dir=tmp_path / "dist")
    seconds = time.perf_counter() - start
    from importlib.metadata import version

    wheel = f"higgs_audio_v3_tiny_cpu_fp32-{version('higgs-pack')}-py3-none-any.whl"  # the building higgs-pack's
    assert [p.name for p in outs] == [wheel, f"{name}.tar.gz"]
    print(f"packaged wheel + tar.gz in {seconds:.1f} s: " + ", ".join(f"{p.name} {p.stat().st_size} B" for p in outs))

    report = verify_any(outs[1], synthesize_cases=False)
    assert report.ok, report.render()

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(outs[0])],
                   check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    cli = [sys.executable, "-c", "from higgs_pack.runtime.cli import main; main()"]
    listed = subprocess.run([*cli, "list"], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert name in listed.stdout and "BROKEN" not in listed.stdout
    verified = subprocess.run([*cli, "verify", name], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "result: PASS" in verified.stdout


@pytest.mark.slow
def test_real_bundle_changed_after_build(built_bundle: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(built_bundle, copy)
    weights = next(p for p in sorted(copy.rglob("*.onnx.data")))
    with open(weights, "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 1]))
    rel = weights.relative_to(copy).as_posix()
    with pytest.raises(PackagingError, match=rf"changed since build: {rel} \(sha256 differs\)"):
        package_bundle(copy, formats="all", out_dir=tmp_path / "dist")
    assert not (tmp_path / "dist").exists()


# ----------------------------------------------------------------------------- multi-GB, constant memory

BIG = 3 << 30
MAX_RSS_BYTES = 500 << 20


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="peak RSS is read from /proc (Linux)")
def test_sparse_multi_gb_file_streams_with_zip64(tmp_path: Path) -> None:
    src = make_bundle(tmp_path / "big")
    member = "llm_decoder/model.onnx.data"
    with open(src / member, "wb") as handle:
        handle.truncate(BIG)  # sparse: 3 GiB of zeros, no disk used
    relist(src)
    expected = next(e["sha256"] for e in read_manifest(src)["files"] if e["path"] == member)
    # Peak RSS of the child since its exec: /proc's VmHWM (ru_maxrss would include the
    # pytest parent's peak, inherited through fork + exec).
    code = (
        "import json, re, sys, time\n"
        "from higgs_pack.targets.packaging import package_bundle\n"
        "t = time.perf_counter(); package_bundle(sys.argv[1], formats='all', out_dir=sys.argv[2])\n"
        "status = open('/proc/self/status').read()\n"
        "peak = int(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1)) * 1024\n"
        "print(json.dumps({'seconds': round(time.perf_counter() - t, 1), 'peak_rss': peak}))\n"
    )
    out = tmp_path / "out"
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stdout)
        sizes = {p.name: p.stat().st_size for p in out.iterdir()}
        print(f"3 GiB sparse member, wheel + tar.gz: {stats}, sizes {sizes}")
        assert stats["peak_rss"] < MAX_RSS_BYTES, stats
        with zipfile.ZipFile(out / WHEEL) as zf:
            info = zf.getinfo(f"hand_made_cpu_fp32/{member}")
            assert info.file_size == BIG and info.compress_type == zipfile.ZIP_STORED
            assert info.extra[:2] == b"\x01\x00", "central directory entry has a zip64 extra field"
            assert _has_zip64_local_header(out / WHEEL, info)
            digest = hashlib.sha256()
            with zf.open(info) as stream:  # read it all back: zipfile checks the CRC-32 at the end
                while data := stream.read(1 << 22):
                    digest.update(data)
            assert digest.hexdigest() == expected
        assert sizes[f"{NAME}.tar.gz"] < 64 << 20
    finally:
        shutil.rmtree(out, ignore_errors=True)  # 3 GiB of real (not sparse) bytes


def _has_zip64_local_header(path: Path, info: zipfile.ZipInfo) -> bool:
    """True when the member's local header carries a zip64 extra field (id 0x0001)."""
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        handle.seek(name_len, 1)
        extra = handle.read(extra_len)
    return extra[:2] == b"\x01\x00"


def test_a_wheel_without_the_wheel_package_is_refused_before_anything_is_written(bundle: Path, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    # A runtime-only install ('.[cpu]') has no `wheel` package; None in sys.modules makes its import fail.
    monkeypatch.setitem(sys.modules, "wheel", None)
    monkeypatch.setitem(sys.modules, "wheel.wheelfile", None)
    out = tmp_path / "out"
    with pytest.raises(PackagingError, match=r"writing a wheel needs the `wheel` package .*install the \[package\] "
                                             r"extra: pip install '\.\[package\]'.*--format archive"):
        package_bundle(bundle, formats="all", out_dir=out)
    assert not out.exists()  # refused before the archive too: nothing half done
    written = package_bundle(bundle, formats="archive", out_dir=out)  # the archive alone needs no `wheel`
    assert [p.suffixes[-2:] for p in written] == [[".tar", ".gz"]]
