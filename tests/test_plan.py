"""Target registry and build plans: data only, validated before anything heavy runs."""

import sys
from pathlib import Path

import pytest

from higgs_pack.exporters.catalog import EXPORTERS
from higgs_pack.manifests.constants import SubPart
from higgs_pack.manifests.errors import BuildPlanError
from higgs_pack.targets.base import Recipe, Target, get_target, register, targets
from higgs_pack.targets.plan import make_plan

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_plan_uses_the_declared_tools():
    plan = make_plan("cpu")
    assert plan.precision == "int4"
    rows = {r.subpart: r for r in plan.rows}
    assert rows[SubPart.LLM_DECODER].exporter.name == "modelbuilder"
    assert rows[SubPart.LLM_DECODER].options == {"execution_provider": "cpu"}
    assert rows[SubPart.AUDIO_HEADS].passes == ("OnnxConversion", "OnnxBlockWiseRtnQuantization")
    assert rows[SubPart.AUDIO_TOKENIZER].precision == "fp32"
    assert rows[SubPart.AUDIO_ENCODER].precision == "fp32"
    assert make_plan("cuda", "fp16").rows[0].passes == ("OnnxConversion", "OnnxFloatToFloat16")


def test_unknown_target_lists_known_ones_with_a_suggestion():
    with pytest.raises(BuildPlanError, match=r"unknown target 'cpux' \(did you mean 'cpu'\?\); known: .*cpu"):
        make_plan("cpux")


def test_unsupported_precision_names_target_and_precision():
    with pytest.raises(BuildPlanError, match="target 'cpu' does not support precision 'int2'; it supports int4, fp32"):
        make_plan("cpu", "int2")


def test_registry_refuses_duplicates_and_incomplete_declarations():
    with pytest.raises(BuildPlanError, match="already registered"):
        register(get_target("cpu"))
    with pytest.raises(BuildPlanError, match="declares no recipe"):
        Target(name="x", description="", backend="onnxruntime", precisions=("fp32",),
               recipes={SubPart.TEXT_EMBED: Recipe("olive-onnx")}, extra="cpu", runtime_requirements=())


def test_every_target_precision_pair_plans():
    for name, target in targets().items():
        for precision in target.precisions:
            plan = make_plan(name, precision)
            assert {r.subpart for r in plan.rows} == set(SubPart)
            for row in plan.rows:
                assert row.exporter.name in EXPORTERS


def test_planning_imports_nothing_heavy():
    import subprocess

    code = ("import sys; from higgs_pack.targets.plan import make_plan; make_plan('cpu', 'fp32');"
            "heavy = [m for m in ('torch', 'onnxruntime', 'openvino', 'olive', 'transformers') if m in sys.modules];"
            "print(heavy); sys.exit(bool(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
