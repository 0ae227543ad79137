"""Target registry and build plans: data only, validated before anything heavy runs."""

import sys
from pathlib import Path

import pytest

from higgs_pack.errors import BuildPlanError
from higgs_pack.exporters.catalog import EXPORTERS
from higgs_pack.manifests.model import SubPart
from higgs_pack.targets.base import Recipe, Target
from higgs_pack.targets.plan import make_plan
from higgs_pack.targets.registry import get_target, register, targets

ROOT = Path(__file__).resolve().parents[1]


def test_plans_follow_the_declarations():
    """Each row is its recipe's exporter at the recipe's precision rule, with the recipe's options
    and the variant's on top (read from the declarations, not restated)."""
    from higgs_pack.manifests.model import FP32_ONLY

    for name, target in targets().items():
        for variant in (None, *target.variants):
            spec = variant.options if variant is not None else {}
            for precision in target.precisions:
                plan = make_plan(name, precision, variant.name if variant else None)
                assert plan.precision == precision and {r.subpart for r in plan.rows} == set(SubPart)
                for row in plan.rows:
                    recipe = target.recipes[row.subpart]
                    assert row.exporter is EXPORTERS[recipe.exporter]
                    assert row.options == {**recipe.options, **spec.get(row.subpart, {})}
                    assert row.variant_options == dict(spec.get(row.subpart, {}))
                    want = "fp32" if row.subpart in FP32_ONLY else precision if recipe.precision == "target" else recipe.precision
                    assert row.precision == want
                    assert (row.passes, row.quantization) == row.exporter.planned(row.precision, row.options)
    assert make_plan("cpu").precision == get_target("cpu").precisions[0]  # the first is the default


def test_olive_passes_per_precision():
    """int4 quantizes after the conversion; fp16 casts in the conversion (torch_dtype): one pass."""
    from higgs_pack.exporters.onnx.olive import CONVERSION_PASS, RTN_PASS

    rows = {r.subpart: r for r in make_plan("cpu", "int4").rows}
    assert rows[SubPart.AUDIO_HEADS].passes == (CONVERSION_PASS, RTN_PASS)
    assert rows[SubPart.AUDIO_TOKENIZER].passes == (CONVERSION_PASS,)  # codec: fp32 in an int4 bundle
    assert make_plan("cuda", "fp16").rows[0].passes == (CONVERSION_PASS,)


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
    from higgs_pack.targets import registry

    targets()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return registry._REGISTRY


def _recipes(**decoder_options) -> dict[SubPart, Recipe]:
    module = Recipe("olive-onnx")
    return {SubPart.LLM_DECODER: Recipe("modelbuilder", options={"execution_provider": "cpu", **decoder_options}),
            SubPart.TEXT_EMBED: module, SubPart.AUDIO_EMBED: module, SubPart.AUDIO_HEADS: module,
            SubPart.AUDIO_TOKENIZER: Recipe("olive-onnx", precision="fp32"),
            SubPart.AUDIO_ENCODER: Recipe("olive-onnx", precision="fp32"),
            SubPart.AUDIO_TOKENIZER_STREAM: Recipe("olive-onnx", precision="fp32")}


def _target(recipes, **kw) -> Target:
    return Target(name="typo", description="", backend="onnxruntime", execution_provider="cpu",
                  precisions=("fp32",), recipes=recipes, **kw)


def test_an_unknown_recipe_option_is_named_with_the_allowed_ones(registry):
    with pytest.raises(BuildPlanError, match=r"target 'typo', llm_decoder recipe: unknown option of exporter "
                                             r"'modelbuilder' 'extra_option' \(did you mean 'extra_options'\?\); "
                                             r"known: execution_provider, extra_options, kv_cache, timeout_s"):
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
    """The npu variant plans the static decoder and INT4_SYM, with its own group sizes over the
    target's (declared in targets/declarations.py)."""
    from higgs_pack.exporters.openvino.plan import (
        DECODER_EXPORT_PASS,
        STATIC_DECODER_PASS,
        SUBPART_COMPRESSION,
        SUBPART_CONVERSION,
    )
    from higgs_pack.targets.declarations import NPU, OPENVINO

    sym = "nncf.compress_weights(INT4_SYM)"
    heads_passes = (SUBPART_CONVERSION["olive"], SUBPART_COMPRESSION["olive"].format(mode="INT4_SYM"))
    npu = {r.subpart: r for r in make_plan("openvino", variant="npu").rows}
    plain = {r.subpart: r for r in make_plan("openvino").rows}
    assert npu[SubPart.LLM_DECODER].passes == (STATIC_DECODER_PASS, sym)
    assert npu[SubPart.LLM_DECODER].quantization["mode"] == "int4_sym"
    assert npu[SubPart.AUDIO_HEADS].passes == plain[SubPart.AUDIO_HEADS].passes == heads_passes
    # The plain decoder is INT4_SYM too (measured faster than INT4_ASYM: targets/declarations.py).
    assert plain[SubPart.LLM_DECODER].passes == (DECODER_EXPORT_PASS, sym)
    for part in (SubPart.LLM_DECODER, SubPart.AUDIO_HEADS):
        declared = OPENVINO.recipes[part].options["group_size"]
        assert plain[part].options["group_size"] == plain[part].quantization["group_size"] == declared
        assert npu[part].quantization["group_size"] == NPU.options[part]["group_size"] != declared

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
    from higgs_pack.manifests.providers import EXECUTION_PROVIDERS

    decoder = {r.subpart: r for r in make_plan("cuda", "int4").rows}[SubPart.LLM_DECODER].quantization
    assert decoder["accuracy_level"] == EXECUTION_PROVIDERS["cuda"].modelbuilder.accuracy_level
