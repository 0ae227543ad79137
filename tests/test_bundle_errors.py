"""Every bad bundle the runtime must refuse, each with its message, and builds that must not land."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from higgs_pack.errors import (
    BundleError,
    CheckpointError,
    ExecutionProviderUnavailable,
    ManifestError,
    SignatureMismatch,
    UnsupportedFormatVersion,
)
from higgs_pack.manifests.manifest import FORMAT_VERSION, file_entry, read_manifest, write_manifest
from higgs_pack.runtime.sources.bundle import load_pipeline as load


def _edit_manifest(bundle: Path, edit) -> None:
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _rehash(bundle: Path, relpath: str) -> None:
    m = read_manifest(bundle)
    m["files"] = [file_entry(bundle, relpath) if f["path"] == relpath else f for f in m["files"]]
    write_manifest(bundle, m)


def test_tampered_file_is_refused_before_any_session(bundle_copy):
    target = bundle_copy / "audio_heads.onnx"
    data = bytearray(target.read_bytes())
    data[-10] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"changed since build: audio_heads.onnx \(sha256 differs\)"):
        load(bundle_copy)


def test_truncated_file_is_refused(bundle_copy):
    target = bundle_copy / "llm_decoder" / "model.onnx.data"
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(BundleError, match=r"llm_decoder/model.onnx.data \(size 100 bytes, expected"):
        load(bundle_copy)


def test_missing_file_is_named(bundle_copy):
    (bundle_copy / "audio_encoder.onnx").unlink()
    with pytest.raises(BundleError, match=r"missing: audio_encoder.onnx"):
        load(bundle_copy)


def test_no_manifest_is_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match=r"not a bundle .manifest.json is missing"):
        load(tmp_path)


@pytest.mark.parametrize("path", ["../outside.onnx", "/etc/passwd", "a/../../b"])
def test_manifest_path_outside_the_bundle(bundle_copy, path):
    def edit(m):
        m["files"][0]["path"] = path

    _edit_manifest(bundle_copy, edit)
    with pytest.raises((ManifestError, BundleError), match=r"outside the bundle|invalid at files/0/path"):
        load(bundle_copy)


def test_symlink_leaving_the_bundle(bundle_copy, tmp_path):
    outside = tmp_path / "elsewhere.onnx"
    shutil.copyfile(bundle_copy / "audio_heads.onnx", outside)
    (bundle_copy / "audio_heads.onnx").unlink()
    (bundle_copy / "audio_heads.onnx").symlink_to(outside)
    with pytest.raises(BundleError, match=r"outside the bundle"):
        load(bundle_copy)


def test_external_data_location_outside_the_bundle(bundle_copy):
    import onnx

    model_path = bundle_copy / "text_embed.onnx"
    model = onnx.load(str(model_path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../../secret.data"
    onnx.save_model(model, str(model_path))
    _rehash(bundle_copy, "text_embed.onnx")
    with pytest.raises(BundleError, match=r"external data location '../../secret.data'"):
        load(bundle_copy)


def test_newer_format_version(bundle_copy):
    _edit_manifest(bundle_copy, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(UnsupportedFormatVersion, match=f"format_version {FORMAT_VERSION + 1} is newer .* upgrade higgs-pack"):
        load(bundle_copy)


def test_unknown_manifest_key(bundle_copy):
    _edit_manifest(bundle_copy, lambda m: m.update(unexpected=True))
    with pytest.raises(ManifestError, match=r"Additional properties are not allowed .'unexpected'"):
        load(bundle_copy)


def test_manifest_that_is_not_json(bundle_copy):
    (bundle_copy / "manifest.json").write_text("{ not json")
    with pytest.raises(ManifestError, match=r"not readable JSON"):
        load(bundle_copy)


def test_provider_not_installed(bundle_copy):
    _edit_manifest(bundle_copy, lambda m: m.update(execution_provider="cuda"))
    with pytest.raises(ExecutionProviderUnavailable,
                       match=r"CUDAExecutionProvider was asked for but is not available here \(installed providers: .*CPUExecutionProvider.*install the \[cuda\] extra: pip install .\.\[cuda\]..*--execution-provider cpu"):
        load(bundle_copy)


def test_explicit_fallback_is_recorded(bundle_copy):
    _edit_manifest(bundle_copy, lambda m: m.update(execution_provider="cuda"))
    pipe = load(bundle_copy, allow_fallback=True)
    assert pipe.description["llm_decoder"] == "CPUExecutionProvider (fallback from CUDAExecutionProvider)"
    pipe = load(bundle_copy, execution_provider="cpu")
    assert pipe.description["llm_decoder"] == "CPUExecutionProvider (explicit --execution-provider cpu; bundle built for cuda)"


def test_unknown_execution_provider(bundle_copy):
    with pytest.raises(ExecutionProviderUnavailable, match=r"unknown execution provider 'cpux' .did you mean 'cpu'"):
        load(bundle_copy, execution_provider="cpux")


def test_graph_io_differs_from_manifest(bundle_copy):
    def edit(m):
        m["subparts"]["audio_heads"]["inputs"][0]["name"] = "hidden"

    _edit_manifest(bundle_copy, edit)
    with pytest.raises(SignatureMismatch, match=r"audio_heads: graph inputs differ from the manifest"):
        load(bundle_copy)


def test_verify_reports_instead_of_raising(bundle_copy):
    from higgs_pack.runtime.verification.verify import verify_bundle

    (bundle_copy / "audio_encoder.onnx").write_bytes(b"garbage")
    report = verify_bundle(bundle_copy)
    assert not report.ok
    assert "audio_encoder.onnx" in report.render() and "FAIL" in report.render()


# --------------------------------------------------------------- builds that must not land


def test_failed_build_leaves_nothing_and_keeps_the_old_bundle(tmp_path, tiny_checkpoint, cpu_fp32_bundle):
    from higgs_pack.targets.build import build

    broken = Path(shutil.copytree(tiny_checkpoint, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(config))
    out = tmp_path / "dist" / "b"
    with pytest.raises(CheckpointError, match=r"model_type"):
        build("cpu", precision="fp32", model=broken, out=out)
    assert not out.exists()
    dist = tmp_path / "dist"
    assert not dist.exists() or list(dist.iterdir()) == []  # no staging directory left behind

    existing = Path(shutil.copytree(cpu_fp32_bundle, tmp_path / "good"))
    before = (existing / "manifest.json").read_bytes()
    with pytest.raises(BundleError, match=r"already holds a bundle; pass --force"):
        build("cpu", precision="fp32", model=tiny_checkpoint, out=existing)
    with pytest.raises(CheckpointError):
        build("cpu", precision="fp32", model=broken, out=existing, force=True)
    assert (existing / "manifest.json").read_bytes() == before
    load(existing)


@pytest.mark.slow
def test_failure_midway_through_export_leaves_nothing(tmp_path, tiny_checkpoint):
    """The codec state dict is damaged: the decoder exports, then the codec export fails."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from higgs_pack.errors import HiggsPackError
    from higgs_pack.targets.build import build

    broken = Path(shutil.copytree(tiny_checkpoint, tmp_path / "broken"))
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    codec_key = next(k for k in index["weight_map"] if ".model." in k and k.endswith("weight"))
    shard = broken / index["weight_map"][codec_key]
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors[codec_key] = tensors[codec_key].flatten()[:3].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    out = tmp_path / "dist" / "b"
    with pytest.raises(HiggsPackError):
        build("cpu", precision="fp32", model=broken, out=out)
    assert not out.exists()
    assert list((tmp_path / "dist").iterdir()) == []


def test_a_used_file_missing_from_the_files_list_is_refused(bundle_copy):
    """Dropping the decoder weights from ``files`` must not let them escape the hash check."""
    _edit_manifest(bundle_copy, lambda m: m.update(
        files=[f for f in m["files"] if f["path"] != "llm_decoder/model.onnx.data"]))
    with pytest.raises(BundleError, match=r"used but not listed \(so not hashed\): llm_decoder/model.onnx.data"):
        load(bundle_copy)


def test_path_error_message_is_readable(bundle_copy):
    def edit(m):
        m["files"][0]["path"] = "../x"

    _edit_manifest(bundle_copy, edit)
    with pytest.raises(ManifestError, match=r"'../x' is not a relative path inside the bundle"):
        load(bundle_copy)


def test_prompt_control_tokens_in_the_text_are_refused(cpu_int4_bundle):
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.loop.synthesis import synthesize

    with pytest.raises(InputError, match=r"prompt control token\(s\) <\|audio\|>"):
        synthesize(load(cpu_int4_bundle), "Say <|audio|> now.")


def test_openvino_bundle_without_openvino_names_the_extra(bundle_copy, monkeypatch):
    """The OpenVINO backend, asked to open a bundle where openvino cannot be imported, names the extra."""
    import sys

    from higgs_pack.manifests.manifest import read_manifest
    from higgs_pack.runtime.backends import OpenOptions, get_backend
    from higgs_pack.runtime.sources.bundle import Bundle

    manifest = {**read_manifest(bundle_copy), "backend": "openvino", "execution_provider": None, "device": "CPU"}
    monkeypatch.setitem(sys.modules, "higgs_pack.runtime.backends.openvino.parts", None)  # as if openvino were absent
    with pytest.raises(ExecutionProviderUnavailable, match=r"install the \[openvino\] extra: pip install '\.\[openvino\]'"):
        get_backend("openvino").open(Bundle(bundle_copy, manifest), OpenOptions())


def test_staging_left_by_a_killed_build_is_removed(tmp_path):
    from higgs_pack.targets.build import _staging

    out = tmp_path / "dist" / "b"
    out.parent.mkdir()
    dead = out.parent / ".b.building-999999999-abc"  # no such process
    (dead / "bundle").mkdir(parents=True)
    with _staging(out) as stage:
        assert stage.name.startswith(".b.building-")
        assert not dead.exists()
    assert list(out.parent.iterdir()) == []


# --------------------------------------------------------------- files that pass their hash but are not their kind

#: kind -> (what replaces the file, the message naming it); ``{rel}`` is the file.
_NOT_THEIR_KIND = {
    "onnx": (lambda data: np.random.default_rng(0).bytes(4096), r"{rel} is not an ONNX graph: "),
    "onnx-data": (lambda data: data[:100], r"{rel} is not ONNX external data of \S+: 100 bytes, but the graph "
                                           r"reads up to byte \d+"),
    "ir-xml": (lambda data: np.random.default_rng(0).bytes(4096), r"{rel} is not an OpenVINO IR \.xml: is not XML"),
    "ir-bin": (lambda data: data[:100], r"{rel} is not an OpenVINO IR \.bin of \S+\.xml: 100 bytes, but the graph "
                                        r"reads up to byte \d+"),
    "tokenizer": (lambda data: np.random.default_rng(0).bytes(4096),
                  r"{rel} is not a tokenizer\.json: does not open as a tokenizers tokenizer"),
    "golden": (lambda data: np.random.default_rng(0).bytes(4096),
               r"{rel} is not the golden outputs \(\.npz\): is not an \.npz archive"),
    "json": (lambda data: b"\xff" + data, r"{rel} is not a JSON file: is not UTF-8 JSON"),
    # Weights of the right size but random bytes (issue 21's leftover: only parity caught them).
    "onnx-data-random": (lambda data: np.random.default_rng(0).bytes(len(data)),
                         r"\S+ is not an ONNX graph: its external data \S+: tensor \S+ at byte \d+ holds NaN values"),
    "ir-bin-random": (lambda data: np.random.default_rng(0).bytes(len(data)),
                      r"\S+ is not an OpenVINO IR \.xml: its weights \S+: tensor .+ at byte \d+ holds NaN values"),
}


def _replace_and_rehash(bundle: Path, rel: str, kind: str) -> str:
    """Replace one file by something that is not its kind, re-hash it: the message it must get."""
    path = bundle / rel
    replace, message = _NOT_THEIR_KIND[kind]
    path.write_bytes(replace(path.read_bytes()))
    _rehash(bundle, rel)
    return message.format(rel=re.escape(rel))


def _refused_by_load_and_verify(bundle: Path, rel: str, kind: str) -> None:
    from higgs_pack.runtime.verification.verify import verify_bundle

    message = _replace_and_rehash(bundle, rel, kind)
    with pytest.raises(BundleError, match=message + ".*rebuild it or re-download it"):
        load(bundle)
    report = verify_bundle(bundle, synthesize_cases=False)
    failed = [c for c in report.checks if c.ok is False]
    assert [c.name for c in failed] == ["files"], report.render()
    assert re.search(message, failed[0].detail), failed[0].detail


def _kinds(bundle: Path) -> dict[str, str]:
    """kind -> the first file of that kind in the bundle."""
    from higgs_pack.runtime.sources.file_kinds import file_kinds

    found: dict[str, str] = {}
    for rel, kind in file_kinds(read_manifest(bundle)).items():
        found.setdefault(kind, rel)
    return found


@pytest.mark.parametrize("kind", ["onnx", "onnx-data", "tokenizer", "golden", "json"])
def test_onnx_bundle_file_that_is_not_its_kind(bundle_copy, kind):
    kinds = _kinds(bundle_copy)
    assert set(kinds) == {"onnx", "onnx-data", "tokenizer", "golden", "json"}  # every kind an ONNX bundle holds
    _refused_by_load_and_verify(bundle_copy, kinds[kind], kind)


def test_onnx_weights_of_random_bytes_are_refused_by_load_and_verify(bundle_copy):
    _refused_by_load_and_verify(bundle_copy, _kinds(bundle_copy)["onnx-data"], "onnx-data-random")


@pytest.mark.slow
def test_openvino_weights_of_random_bytes_are_refused_by_load_and_verify(ov_int4_bundle, tmp_path):
    bundle = Path(shutil.copytree(ov_int4_bundle, tmp_path / ov_int4_bundle.name))
    _refused_by_load_and_verify(bundle, _kinds(bundle)["ir-bin"], "ir-bin-random")


def test_every_onnx_graph_and_json_file_is_checked(bundle_copy):
    """Not just the first of each kind: the decoder's graph and genai_config.json too."""
    _refused_by_load_and_verify(bundle_copy, "llm_decoder/model.onnx", "onnx")
    _refused_by_load_and_verify(bundle_copy, "llm_decoder/genai_config.json", "json")


def test_json_that_is_not_a_tokenizer(bundle_copy):
    (bundle_copy / "tokenizer.json").write_text('{"version": "1.0"}', encoding="utf-8")
    _rehash(bundle_copy, "tokenizer.json")
    with pytest.raises(BundleError, match=r"tokenizer\.json is not a tokenizer\.json: does not open as a tokenizers"):
        load(bundle_copy)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ir-xml", "ir-bin", "tokenizer", "golden", "json"])
def test_openvino_bundle_file_that_is_not_its_kind(ov_int4_bundle, kind, tmp_path):
    bundle = Path(shutil.copytree(ov_int4_bundle, tmp_path / ov_int4_bundle.name))
    kinds = _kinds(bundle)
    assert set(kinds) == {"ir-xml", "ir-bin", "tokenizer", "golden", "json"}  # every kind an IR bundle holds
    _refused_by_load_and_verify(bundle, kinds[kind], kind)


def _without_root_read_override() -> list[str] | None:
    """A command prefix that drops root's permission override (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH),
    so a mode-000 file is really unreadable; [] when not root; None when capsh is missing."""
    if os.geteuid() != 0:
        return []
    capsh = shutil.which("capsh")
    return [capsh, "--drop=cap_dac_override,cap_dac_read_search", "--"] if capsh else None


def test_unreadable_file_is_named_by_load_and_verify(bundle_copy):
    prefix = _without_root_read_override()
    if prefix is None:
        pytest.skip("running as root without capsh: no way to make a file unreadable to this process")
    target = bundle_copy / "tokenizer.json"
    target.chmod(0)
    code = ("import sys\nfrom higgs_pack.runtime.sources.bundle import load_pipeline as load\nfrom higgs_pack.errors import BundleError\n"
            "try:\n    load(sys.argv[1])\nexcept BundleError as exc:\n    print(exc)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, *args]
        if prefix:  # capsh runs its argument with /bin/sh -c
            command = [*prefix, "-c", " ".join(shlex.quote(a) for a in command)]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)

    try:
        probe = run("-c", f"open({str(target)!r}, 'rb')")
        if probe.returncode == 0:
            pytest.skip("the file stays readable to a process without CAP_DAC_OVERRIDE here")
        loaded = run("-c", code, str(bundle_copy))
        verified = run("-m", "higgs_pack.runtime.cli", "verify", str(bundle_copy))
    finally:
        target.chmod(0o644)
    message = r"cannot read tokenizer\.json \(Permission denied\)\. The process \(uid \d+\) needs read access"
    assert re.search(message, loaded.stdout), loaded.stdout + loaded.stderr
    assert verified.returncode == 1 and "Traceback" not in verified.stderr, verified.stderr
    assert re.search(r"FAIL +files +.*" + message, verified.stdout), verified.stdout


def test_a_load_parses_each_graph_and_the_tokenizer_once(cpu_int4_bundle, monkeypatch):
    """The file checks' parse is the one a load uses (issue 21's leftover: every ONNX proto and the
    tokenizer were parsed twice before the sessions were made)."""
    import onnx
    import tokenizers

    parses: list[str] = []
    onnx_load, from_file = onnx.load, tokenizers.Tokenizer.from_file
    monkeypatch.setattr(onnx, "load", lambda f, *a, **k: (parses.append(Path(f).name), onnx_load(f, *a, **k))[1])
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file",
                        staticmethod(lambda f, *a, **k: (parses.append(Path(f).name), from_file(f, *a, **k))[1]))
    load(cpu_int4_bundle)
    graphs = [spec["entry"] for spec in read_manifest(cpu_int4_bundle)["subparts"].values()]
    assert sorted(parses) == sorted([Path(g).name for g in graphs] + ["tokenizer.json"]), parses


def test_an_option_of_the_other_backend_is_named(ov_int4_bundle):
    """An OpenVINO bundle loaded with execution_provider= says it is an OpenVINO bundle and which
    option chooses where it runs (the message said 'a OpenVINO bundle')."""
    from higgs_pack.errors import ExecutionProviderUnavailable

    with pytest.raises(ExecutionProviderUnavailable, match=r"is an OpenVINO bundle; choose where it runs with "
                                                           r"--device \(device=\), not --execution-provider"):
        load(ov_int4_bundle, execution_provider="cpu")
