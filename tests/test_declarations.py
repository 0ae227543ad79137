"""A target or an execution provider is one declaration.

A fifth target on an existing ONNX Runtime provider is registered under a new name
and planned, built (tiny), verified and packaged; a new provider row flows into every
place that needs it (extra, marker, session rules, hardware, classifiers, ModelBuilder,
nox session table) with no other file changed.  The registry and the provider table
are restored after each test (pytest's monkeypatch on our own tables, no tool mocked).
"""

from __future__ import annotations

import json
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
import tomllib

from higgs_pack.errors import BuildPlanError
from higgs_pack.manifests import providers
from higgs_pack.manifests.model import SubPart
from higgs_pack.manifests.providers import (
    EXECUTION_PROVIDERS,
    ChoiceRung,
    ExecutionProvider,
    Hardware,
    ModelBuilderSupport,
    Packaging,
    SessionSupport,
)
from higgs_pack.targets import base
from higgs_pack.targets import registry as registry_module
from higgs_pack.targets.base import Recipe, Target
from higgs_pack.targets.plan import make_plan
from higgs_pack.targets.registry import get_target, register, targets

ROOT = Path(__file__).resolve().parents[1]


def onnx_recipes(ep: str) -> dict[SubPart, Recipe]:
    module = Recipe("olive-onnx")
    return {SubPart.LLM_DECODER: Recipe("modelbuilder", options={"execution_provider": ep}),
            SubPart.TEXT_EMBED: module, SubPart.AUDIO_EMBED: module, SubPart.AUDIO_HEADS: module,
            SubPart.AUDIO_TOKENIZER: Recipe("olive-onnx", precision="fp32"),
            SubPart.AUDIO_ENCODER: Recipe("olive-onnx", precision="fp32"),
            SubPart.AUDIO_TOKENIZER_STREAM: Recipe("olive-onnx", precision="fp32")}


@pytest.fixture
def registry(monkeypatch):
    """The target registry, restored after the test (declarations loaded first)."""
    targets()
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))
    return registry_module._REGISTRY


@pytest.fixture
def exact_cpu(registry) -> Target:
    """A fifth target: the cpu provider under another name, fp32 only."""
    return register(Target(name="cpu-exact", description="ONNX Runtime CPU, fp32 only (declaration test)",
                           backend="onnxruntime", execution_provider="cpu", precisions=("fp32",),
                           recipes=onnx_recipes("cpu")))


def test_fifth_target_plans_from_its_declaration_alone(exact_cpu):
    assert get_target("cpu-exact") is exact_cpu
    assert (exact_cpu.extra, exact_cpu.platform_marker) == ("cpu", None)
    assert exact_cpu.runtime_requirements == (EXECUTION_PROVIDERS["cpu"].packaging.requirement, base.ONNX_REQUIREMENT)
    plan = make_plan("cpu-exact")
    assert plan.precision == "fp32" and {r.subpart for r in plan.rows} == set(SubPart)
    with pytest.raises(BuildPlanError, match="target 'cpu-exact' does not support precision 'int4'"):
        make_plan("cpu-exact", "int4")
    from higgs_pack.targets.nox_sessions import session_table

    assert session_table()["targets"]["cpu-exact"] == {
        "gpu": None, "runs_anywhere": True, "runtime_extra": "cpu"}


@pytest.mark.slow
def test_fifth_target_builds_verifies_and_packages(exact_cpu, tiny_checkpoint, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from higgs_pack.manifests.manifest import read_manifest
    from higgs_pack.runtime.verification.verify import verify_bundle
    from higgs_pack.targets.build import build
    from higgs_pack.targets.cli import build as build_command
    from higgs_pack.targets.packaging import package_bundle
    from higgs_pack.targets.packaging.install_check import (
        Results,
        check_metadata,
        check_plan,
        read_wheel,
    )

    monkeypatch.chdir(tmp_path)
    bundle = build("cpu-exact", model=tiny_checkpoint)  # the default out: dist/<slug>-cpu-exact-fp32
    # The path the noxfile asks for (`higgs-pack build --print-path`) is the one the build wrote.
    printed = CliRunner().invoke(build_command, ["-t", "cpu-exact", "-m", str(tiny_checkpoint), "--print-path"])
    assert printed.exit_code == 0 and Path(printed.output.strip()) == bundle.absolute(), printed.output
    m = read_manifest(bundle)
    assert m["name"] == bundle.name
    # Each sub-part records the catalogue name its recipe gave (one name per exporter).
    assert {p: s["exporter"] for p, s in m["subparts"].items()} == {
        p.value: r.exporter for p, r in exact_cpu.recipes.items()}
    # The generation defaults a bundle records are the runtime's own (every sampling option but the seed).
    from dataclasses import fields

    from higgs_pack.runtime.loop.text_chunks import FRAMES_PER_TEXT_TOKEN, MIN_MAX_FRAMES
    from higgs_pack.runtime.options import SamplingOptions

    sampling = {f.name for f in fields(SamplingOptions)} - {"seed"}
    gen = m["generation"]
    assert SamplingOptions(**{k: gen[k] for k in sampling}) == SamplingOptions()
    assert (gen["frames_per_text_token"], gen["min_max_frames"]) == (FRAMES_PER_TEXT_TOKEN, MIN_MAX_FRAMES)
    assert (m["target"], m["execution_provider"], m["precision"]) == ("cpu-exact", "cpu", "fp32")
    assert m["verification"]["build_time"]["ok"] is True
    report = verify_bundle(bundle, synthesize_cases=False)
    assert report.ok, report.render()
    whl, tgz = package_bundle(bundle, formats="all", out_dir=tmp_path / "dist")
    assert tgz.name == f"{bundle.name}.tar.gz"
    wheel = read_wheel(whl)
    results = Results()
    check_metadata(wheel, exact_cpu, results)
    assert not results.failed, results.lines
    assert check_plan(exact_cpu).runs_here
    with zipfile.ZipFile(whl) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = HeaderParser().parsestr(zf.read(meta_name).decode())
    assert meta.get_all("Requires-Dist")[0].startswith("higgs-pack[cpu]>=")


@pytest.fixture
def qnn(monkeypatch, registry) -> ExecutionProvider:
    """A new provider row (Qualcomm's QNN EP), declared in the provider table only."""
    row = ExecutionProvider(
        "qnn", "QNNExecutionProvider", label="QNN",
        packaging=Packaging("onnxruntime-qnn", "onnxruntime-qnn>=1.22", "qnn",
                            platform_marker="sys_platform == 'win32' and platform_machine == 'ARM64'",
                            wheel_platforms=("win_amd64",), classifiers=("Operating System :: Microsoft :: Windows",)),
        hardware=Hardware(needs="a Snapdragon NPU (Windows on ARM)", missing="no Qualcomm NPU",
                          short="a Qualcomm NPU", kind="qualcomm-npu", probe="platform:win32"),
        sessions=SessionSupport(rules={"enable_mem_pattern": False}),
        modelbuilder=ModelBuilderSupport("cpu", accuracy_level=4),
        rung=ChoiceRung("qnn", 15, "qnn bundle on a Qualcomm NPU"),
    )
    monkeypatch.setitem(providers.EXECUTION_PROVIDERS, "qnn", row)
    return row


def test_new_provider_row_is_the_only_declaration(qnn, tmp_path):
    target = register(Target(name="qnn", description="ONNX Runtime on Qualcomm's QNN provider",
                             backend="onnxruntime", execution_provider="qnn", precisions=("int4",),
                             recipes=onnx_recipes("qnn"), verify_on="cpu"))
    # Everything the target needs comes from the row.
    assert (target.extra, target.platform_marker, target.classifiers) == (qnn.packaging.extra, qnn.packaging.platform_marker,
                                                                           qnn.packaging.classifiers)
    assert all(qnn.packaging.platform_marker in r for r in target.runtime_requirements)
    assert make_plan("qnn").rows[1].options == {"execution_provider": "qnn"}
    # The runtime: session rules forced, distribution known, install hint names the extra.
    from higgs_pack.runtime.backends.onnxruntime import distributions, runners
    from higgs_pack.runtime.backends.onnxruntime import sessions as ort_backend

    assert ort_backend.session_options_for("qnn", {"enable_mem_pattern": True}).enable_mem_pattern is False
    assert "onnxruntime-qnn" in distributions.ort_distributions()
    assert distributions.install_hint(qnn) == ("To have it, install the [qnn] extra: pip install '.[qnn]' in a clone "
                                                "of higgs-pack (onnxruntime-qnn>=1.22)")
    # Packaging, install check and nox read the same row.
    from higgs_pack.targets.nox_sessions import session_table
    from higgs_pack.targets.packaging import requires_dist
    from higgs_pack.targets.packaging.install_check import check_plan

    plan = check_plan(target)
    assert not plan.runs_here and plan.needs == qnn.hardware.needs and [p.label for p in plan.platforms] == ["Windows x86-64"]
    reqs = requires_dist({"runtime_requirements": list(target.runtime_requirements)}, target, "0.1.0")
    assert reqs[0].startswith("higgs-pack[qnn]>=0.1.0; ")
    assert session_table()["targets"]["qnn"]["gpu"] == {"extra": "qnn", "probe": "platform:win32"}
    # ModelBuilder builds for it (its -e name and int4 accuracy level come from the row).
    from higgs_pack.exporters.onnx import modelbuilder

    assert modelbuilder.modelbuilder_providers() == ("cpu", "cuda", "dml", "winml", "qnn")
    # The bundle choice ranks it by its row's rung and names its hardware when no bundle runs.
    from higgs_pack.runtime.machine.choice import choose, preference
    from higgs_pack.runtime.machine.facts import Candidate, Inventory

    assert list(preference()).index("qnn") == 1  # after the NPU rung, before cuda
    bundles = [Candidate(f"m-{t}-int4", f"/b/{t}", "m", t, "int4", None, "onnxruntime", t) for t in ("cpu", "qnn")]
    inv = Inventory(ort_providers={"cpu": None, "qnn": None}, platform="win32")
    choice = choose(bundles, inv)
    assert choice.chosen.candidate.name == "m-qnn-int4" and choice.chosen.rung == "qnn"
    assert "the QNN execution provider: preference 2 of 7 (qnn bundle on a Qualcomm NPU)" in choice.reason
    only_cpu = choose(bundles[:1], Inventory(ort_providers={"cpu": None}, hardware={"qualcomm-npu": ["Hexagon"]}))
    assert any(n.startswith("a Qualcomm NPU is present (Hexagon) but no qnn bundle") for n in only_cpu.notes)
    # The decoder copies its KV cache there (the row declares no shared IOBinding device).
    assert runners.shared_kv_device("QNNExecutionProvider") is None
    assert runners.shared_kv_device("CUDAExecutionProvider") == "cuda"


def test_winml_is_a_provider_row_and_a_target(registry):
    """Windows ML: one provider row (its distributions, marker, hardware) and one target; the rest
    (the dml graphs, DirectML's session rules and kernel table, its rung) is DirectML's own."""
    row, dml = EXECUTION_PROVIDERS["winml"], EXECUTION_PROVIDERS["dml"]
    target = get_target("winml")
    x64 = "sys_platform == 'win32' and platform_machine == 'AMD64'"
    assert (target.extra, target.platform_marker, target.verify_on) == ("winml", x64, "cpu")
    assert target.runtime_requirements == (f"onnxruntime-windowsml>=1.30,<1.33; {x64}",
                                           f"onnxruntime-genai-winml>=0.18,<0.19; {x64}", f"onnx>=1.17; {x64}")
    assert "Operating System :: Microsoft :: Windows :: Windows 11" in target.classifiers
    # The same provider, graphs, session rules, kernel table and rung as dml.
    assert row.ort_provider == dml.ort_provider == "DmlExecutionProvider"
    assert (row.modelbuilder, row.sessions, row.rung) == (dml.modelbuilder, dml.sessions, dml.rung)
    assert row.modelbuilder.ep == "dml"
    decoder = {r.subpart: r for r in make_plan("winml", "int4").rows}[SubPart.LLM_DECODER]
    assert decoder.options == {"execution_provider": "winml"}
    assert (decoder.passes, decoder.quantization) == (
        {r.subpart: r for r in make_plan("dml", "int4").rows}[SubPart.LLM_DECODER].passes,
        {r.subpart: r for r in make_plan("dml", "int4").rows}[SubPart.LLM_DECODER].quantization)
    from higgs_pack.runtime.backends.onnxruntime.sessions import session_options_for
    from higgs_pack.runtime.verification.kernels import load_kernel_table

    so = session_options_for("winml", {"enable_mem_pattern": True})
    assert so.enable_mem_pattern is False and so.execution_mode.name == "ORT_SEQUENTIAL"
    assert load_kernel_table("winml").provider == "DmlExecutionProvider"
    # A DmlExecutionProvider that creates sessions runs both bundles (whichever distribution
    # ships it); the choice ranks them on DirectML's one rung.
    from higgs_pack.runtime.machine.choice import choose, preference
    from higgs_pack.runtime.machine.facts import Candidate, Inventory
    from higgs_pack.runtime.machine.inventory import rows_by_ort_provider

    assert rows_by_ort_provider()["DmlExecutionProvider"] == ("dml", "winml")
    assert list(preference()) == ["npu", "cuda", "igpu", "dml", "cpu", "npu-on-cpu"]
    bundles = [Candidate(f"m-{t}-int4", f"/b/{t}", "m", t, "int4", None, "onnxruntime", t) for t in ("cpu", "winml")]
    choice = choose(bundles, Inventory(ort_providers={"cpu": None, "dml": None, "winml": None}, platform="win32"))
    assert choice.chosen.candidate.name == "m-winml-int4" and choice.chosen.rung == "dml", choice.reason
    assert "the DirectML (Windows ML) execution provider: preference 4 of 6" in choice.reason
    only_cpu = choose(bundles[:1], Inventory(ort_providers={"cpu": None, "dml": None, "winml": None}))
    assert any(n.startswith("a DirectX 12 GPU (Windows ML) is present (DmlExecutionProvider creates sessions) "
                            "but no winml bundle") for n in only_cpu.notes), only_cpu.notes
    # The wheel is resolver-checked for x64 Windows, and nox finds it by platform.
    from higgs_pack.targets.nox_sessions import session_table
    from higgs_pack.targets.packaging.install_check import check_plan

    plan = check_plan(target)
    assert not plan.runs_here and [p.label for p in plan.platforms] == ["Windows x86-64"]
    assert "Windows 11 24H2" in plan.needs
    assert session_table()["targets"]["winml"] == {"gpu": {"extra": "winml", "probe": "platform:win32"},
                                                   "runs_anywhere": False, "runtime_extra": "cpu"}


def test_winml_requirements_hold_on_x64_windows_only():
    """Every runtime requirement of a winml bundle applies on x64 Windows and nowhere else."""
    from packaging.requirements import Requirement

    from higgs_pack.targets.packaging.install_check import LINUX_X86_64, WINDOWS_AMD64

    arm64 = {**WINDOWS_AMD64.markers, "platform_machine": "ARM64"}
    for raw in get_target("winml").runtime_requirements:
        marker = Requirement(raw).marker
        assert marker.evaluate(dict(WINDOWS_AMD64.markers)), raw
        assert not marker.evaluate(dict(LINUX_X86_64.markers)) and not marker.evaluate(arm64), raw


def test_no_requirement_names_the_unrelated_onnxruntime_winml():
    """`onnxruntime-winml` on the registry is not Microsoft's (reported as malware): no provider
    row, target or extra may name it; Windows ML's builds are onnxruntime-windowsml and
    onnxruntime-genai-winml."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    raw = [r for reqs in extras.values() for r in reqs]
    raw += [r for row in EXECUTION_PROVIDERS.values() for r in (row.packaging.requirement, *row.packaging.companions)]
    raw += [r for target in targets().values() for r in target.runtime_requirements]
    names = {canonicalize_name(Requirement(r).name) for r in raw}
    assert "onnxruntime-winml" not in names
    assert {"onnxruntime-windowsml", "onnxruntime-genai-winml"} <= names


def test_unknown_provider_in_a_target_is_refused(registry):
    with pytest.raises(BuildPlanError, match=r"unknown execution provider 'qnx'.*known: cpu, cuda, dml, openvino"):
        Target(name="x", description="", backend="onnxruntime", execution_provider="qnx", precisions=("fp32",),
               recipes=onnx_recipes("cpu"))


def test_every_provider_extra_is_declared_in_pyproject():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for row in EXECUTION_PROVIDERS.values():
        assert row.packaging.extra in extras, f"pyproject.toml has no [{row.packaging.extra}] extra for provider {row.name!r}"
        dists = [e.split(";")[0] for e in extras[row.packaging.extra]]
        assert any(d.startswith(row.packaging.distribution) for d in dists), (row.name, extras[row.packaging.extra])
        for requirement in (row.packaging.requirement, *row.packaging.companions):
            assert requirement.split(";")[0].strip() in dists, (row.name, requirement, dists)


def test_noxfile_session_table_is_current():
    from higgs_pack.targets.nox_sessions import SESSIONS_JSON, render

    assert SESSIONS_JSON.read_text(encoding="utf-8") == render(), (
        "targets/sessions.json is stale: python -m higgs_pack.targets.nox_sessions --write")
    assert set(json.loads(render())["targets"]) == set(targets())
