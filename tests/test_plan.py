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
    assert rows[SubPart.LLM_DECODER].options == {"execution_provider": "cpu", "extra_options": {"block_size": 128}}
    assert rows[SubPart.AUDIO_HEADS].passes == ("OnnxConversion", "OnnxBlockWiseRtnQuantization")
    assert rows[SubPart.AUDIO_TOKENIZER].precision == "fp32"
    assert rows[SubPart.AUDIO_ENCODER].precision == "fp32"
    assert make_plan("cuda", "fp16").rows[0].passes == ("OnnxConversion",)  # cast by torch_dtype


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


# ----------------------------------------------------------------------------- option validation


@pytest.fixture
def registry(monkeypatch):
    """The target registry, restored after the test."""
    from higgs_pack.targets import base

    targets()
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    return base._REGISTRY


def _recipes(**decoder_options) -> dict[SubPart, Recipe]:
    module = Recipe("olive-onnx")
    return {SubPart.LLM_DECODER: Recipe("modelbuilder", options={"execution_provider": "cpu", **decoder_options}),
            SubPart.TEXT_EMBED: module, SubPart.AUDIO_EMBED: module, SubPart.AUDIO_HEADS: module,
            SubPart.AUDIO_TOKENIZER: Recipe("olive-onnx", precision="fp32"),
            SubPart.AUDIO_ENCODER: Recipe("olive-onnx", precision="fp32")}


def _target(recipes, **kw) -> Target:
    return Target(name="typo", description="", backend="onnxruntime", execution_provider="cpu",
                  precisions=("fp32",), recipes=recipes, **kw)


def test_an_unknown_recipe_option_is_named_with_the_allowed_ones(registry):
    with pytest.raises(BuildPlanError, match=r"target 'typo', llm_decoder recipe: unknown option of exporter "
                                             r"'modelbuilder' 'extra_option' \(did you mean 'extra_options'\?\); "
                                             r"known: execution_provider, extra_options, timeout_s"):
        register(_target(_recipes(extra_option={"a": 1})))


def test_a_recipe_option_of_the_wrong_type_is_refused(registry):
    with pytest.raises(BuildPlanError, match=r"option timeout_s='10' of exporter 'modelbuilder' must be int or float"):
        register(_target(_recipes(timeout_s="10")))


def test_a_variant_option_is_checked_at_register(registry):
    from higgs_pack.targets.base import Variant

    bad = Variant("npu", options={SubPart.AUDIO_HEADS: {"static_axis": {"batch": 1}}})
    with pytest.raises(BuildPlanError, match=r"variant 'npu', audio_heads: unknown option of exporter 'olive-onnx' "
                                             r"'static_axis'"):
        register(_target(_recipes(), variants=(bad,)))


def test_an_exporter_must_write_the_backends_format(registry):
    recipes = {**_recipes(), SubPart.TEXT_EMBED: Recipe("olive-openvino")}
    with pytest.raises(BuildPlanError, match=r"exporter 'olive-openvino' of text_embed writes openvino, but the "
                                             r"onnxruntime backend runs onnx"):
        register(_target(recipes))


def test_catalogue_options_are_the_exporters_keywords():
    """Each row's options are keyword parameters of its function (checked on the real signatures)."""
    import inspect

    for info in EXPORTERS.values():
        params = inspect.signature(info.load()).parameters
        assert set(info.options) <= set(params), (info.name, set(info.options) - set(params))
        assert info.scratch in params, info.name


def test_npu_plan_says_static_decoder_and_symmetric_int4():
    rows = {r.subpart: r for r in make_plan("openvino", variant="npu").rows}
    dec = rows[SubPart.LLM_DECODER]
    assert dec.passes == ("convert_model(static KV-window decoder)", "nncf.compress_weights(INT4_SYM)")
    assert dec.quantization["mode"] == "int4_sym"
    assert rows[SubPart.AUDIO_HEADS].passes == ("OpenVINOConversion", "OpenVINOWeightCompression(INT4_SYM)")
    plain = {r.subpart: r for r in make_plan("openvino").rows}[SubPart.LLM_DECODER]
    # The CPU decoder is INT4_SYM too, at group 64 (measured faster and closer to fp32 than
    # INT4_ASYM g128 on an AVX2 CPU: targets/declarations.py); the npu variant keeps group 128.
    assert plain.passes == ("optimum-intel stateful export (inputs_embeds)", "nncf.compress_weights(INT4_SYM)")
    assert plain.options["group_size"] == 64 and dec.options["group_size"] == 128
    heads = {r.subpart: r for r in make_plan("openvino").rows}[SubPart.AUDIO_HEADS]
    assert heads.passes == ("OpenVINOConversion", "OpenVINOWeightCompression(INT4_SYM)")
    assert heads.options["group_size"] == 64 and rows[SubPart.AUDIO_HEADS].options["group_size"] == 128


# ----------------------------------------------------------------------------- bundle names


def _printed_path(*args: str, cwd: Path) -> Path:
    """What ``higgs-pack build ... --print-path`` prints (the noxfile's only source of bundle paths)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "build", *args, "--print-path"],
                         capture_output=True, text=True, cwd=cwd, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return Path(out.stdout.strip())


def test_print_path_names_the_variant_precision_model_and_out(tmp_path):
    """``nox -s build-openvino -- --npu`` builds ``…-int4-npu``: the path the noxfile then speaks
    with and verifies comes from the build (it once dropped the variant and spoke with ``…-int4``)."""
    from higgs_pack.targets.plan import DEFAULT_MODEL_SLUG

    assert _printed_path("--target", "openvino", "--npu", cwd=tmp_path) == (
        tmp_path / "dist" / f"{DEFAULT_MODEL_SLUG}-openvino-{get_target('openvino').default_precision}-npu")
    assert _printed_path("-t", "cpu", "-p", "fp32", cwd=tmp_path).name == f"{DEFAULT_MODEL_SLUG}-cpu-fp32"
    assert _printed_path("-t", "cpu", "-m", "/models/Higgs_Audio-V3", cwd=tmp_path).name == "higgs-audio-v3-cpu-int4"
    assert _printed_path("-t", "cpu", "-o", "elsewhere/b", cwd=tmp_path) == tmp_path / "elsewhere" / "b"
    assert not (tmp_path / "dist").exists()  # nothing is built


def test_noxfile_names_no_bundle_itself():
    """Every bundle path in noxfile.py is asked from ``higgs-pack build --print-path``."""
    from higgs_pack.targets.plan import DEFAULT_MODEL_SLUG

    text = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("#", '"""')))
    assert "--print-path" in text and f'"{DEFAULT_MODEL_SLUG}' not in code and "default_precision" not in code


def _declared_options(row) -> dict:
    """A plan row's options with ModelBuilder's extra options flattened in (its int4 settings)."""
    options = dict(row.options)
    options.update(options.pop("extra_options", None) or {})
    return options


def test_plan_records_every_declared_quantization_setting():
    """Each quantization setting a recipe or variant declares (block size, accuracy level, group
    size, symmetry…) is in the plan's record, which the build compares with what it built."""
    checked = set()
    for name, target in targets().items():
        for variant in (None, *(v.name for v in target.variants)):
            for precision in target.precisions:
                for row in make_plan(name, precision, variant).rows:
                    q = row.quantization
                    if "bits" not in q and not str(q.get("mode", "")).startswith("int4"):
                        continue
                    for key, value in _declared_options(row).items():
                        if key in q:
                            assert q[key] == value, (name, variant, precision, row.subpart, key)
                            checked.add((row.exporter.name, key))
                        elif key == "symmetric":
                            assert q["mode"] == ("int4_sym" if value else "int4_asym"), (name, row.subpart)
                            checked.add((row.exporter.name, key))
    # The cpu decoder's block size and heads' accuracy level, openvino's group sizes and symmetry.
    assert {("modelbuilder", "block_size"), ("olive-onnx", "accuracy_level"), ("optimum-openvino", "group_size"),
            ("optimum-openvino", "symmetric"), ("olive-openvino", "group_size")} <= checked
    # What no recipe declares is the exporter's default, recorded too (ModelBuilder's accuracy level
    # comes from the provider row).
    from higgs_pack.manifests.constants import EXECUTION_PROVIDERS

    decoder = {r.subpart: r for r in make_plan("cuda", "int4").rows}[SubPart.LLM_DECODER].quantization
    assert decoder["accuracy_level"] == EXECUTION_PROVIDERS["cuda"].modelbuilder.accuracy_level
