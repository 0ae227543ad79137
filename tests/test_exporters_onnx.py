"""The ONNX exporters on tiny real models: ModelBuilder (llm_decoder) and Olive passes.

No tool is mocked: a random 2-layer Qwen3 goes through onnxruntime-genai's
ModelBuilder CLI, and audio-head / audio-embedding modules at the real table
shape [8*1026, H] go through Olive's OnnxConversion, OnnxFloatToFloat16 and
OnnxBlockWiseRtnQuantization; every graph is run with ONNX Runtime (CPU) and
compared with PyTorch.  Each model is built once per module (about 40 s in all
on 2 cores, mostly ModelBuilder's interpreter start-up).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("olive")
pytest.importorskip("onnxruntime_genai")
transformers = pytest.importorskip("transformers")

from higgs_pack.errors import (  # noqa: E402
    BuildError,
    BuildPlanError,
    CheckpointError,
    InputError,
)
from higgs_pack.exporters.onnx import graphs  # noqa: E402
from higgs_pack.exporters.onnx.modelbuilder import build_llm_decoder, passes_for  # noqa: E402
from higgs_pack.exporters.onnx.olive import export_onnx, plan_passes  # noqa: E402
from higgs_pack.exporters.result import ExportResult, TensorSpec  # noqa: E402

HIDDEN = 64
LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 16
NUM_CODEBOOKS = 8
AUDIO_VOCAB = 1026

pytestmark = pytest.mark.slow


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# ----------------------------------------------------------------------------- ModelBuilder


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A random 2-layer Qwen3 (hidden 64, 4/2 heads, head_dim 16, vocab 1000) saved as HF."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=1000,
        max_position_embeddings=256,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    hf_dir = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(hf_dir)
    return hf_dir, model.model


@pytest.fixture(scope="module")
def decoders(tiny_qwen3, tmp_path_factory):
    """ModelBuilder cpu fp32 and int4 builds, each in its own bundle."""
    hf_dir, _ = tiny_qwen3
    cache = tmp_path_factory.mktemp("mb-cache")

    def build(precision):
        bundle = tmp_path_factory.mktemp(f"bundle-{precision}")
        result = build_llm_decoder(
            hf_dir,
            bundle / "llm_decoder",
            precision=precision,
            execution_provider="cpu",
            cache_dir=cache,
        )
        return precision, (result, bundle)

    # Each build is a ModelBuilder subprocess dominated by its imports: run both at once.
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(build, ("fp32", "int4")))


def run_decoder(path: Path, embeds: np.ndarray, prompt_len: int) -> np.ndarray:
    """Prompt of ``prompt_len`` embeddings, then one cached step per remaining embedding."""
    sess = session(path)
    empty = np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32)
    past = {f"past_key_values.{i}.{kv}": empty for i in range(LAYERS) for kv in ("key", "value")}
    hidden = []
    start = 0
    for stop in (prompt_len, *range(prompt_len + 1, embeds.shape[1] + 1)):
        feeds = {
            "inputs_embeds": embeds[:, start:stop],
            "attention_mask": np.ones((1, stop), np.int64),
            **past,
        }
        names = [o.name for o in sess.get_outputs()]
        out = dict(zip(names, sess.run(names, feeds), strict=True))
        hidden.append(out["hidden_states"])
        past = {
            f"past_key_values.{i}.{kv}": out[f"present.{i}.{kv}"]
            for i in range(LAYERS)
            for kv in ("key", "value")
        }
        start = stop
    return np.concatenate(hidden, axis=1)


@pytest.fixture(scope="module")
def decoder_reference(tiny_qwen3):
    """6 random embeddings and Qwen3Model's last_hidden_state for them."""
    _, body = tiny_qwen3
    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(1, 6, HIDDEN, generator=generator)
    with torch.no_grad():
        expected = body(inputs_embeds=embeds).last_hidden_state.numpy()
    return embeds.numpy(), expected


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_modelbuilder_io_names_and_files(decoders, precision):
    result, bundle = decoders[precision]
    assert isinstance(result, ExportResult)
    assert result.subpart == "llm_decoder"
    assert result.exporter == "modelbuilder"
    assert result.passes == list(passes_for(precision, "cpu"))
    if precision == "int4":  # a float graph quantized node by node, not ModelBuilder's in-memory int4
        assert result.passes[0].startswith("ModelBuilder(fp32,") and "MatMulNBits" in result.passes[1]
    assert result.precision == precision
    assert result.files == [
        "llm_decoder/model.onnx",
        "llm_decoder/model.onnx.data",
        "llm_decoder/genai_config.json",
    ]
    assert result.entry == "llm_decoder/model.onnx"
    assert sorted(p.name for p in (bundle / "llm_decoder").iterdir()) == [
        "genai_config.json",
        "model.onnx",
        "model.onnx.data",
    ]
    kv = [f"{i}.{x}" for i in range(LAYERS) for x in ("key", "value")]
    assert set(result.input_names) == {
        "inputs_embeds",
        "attention_mask",
        *(f"past_key_values.{k}" for k in kv),
    }
    assert set(result.output_names) == {"hidden_states", *(f"present.{k}" for k in kv)}
    specs = {t.name: t for t in result.inputs + result.outputs}
    assert specs["inputs_embeds"] == TensorSpec(
        "inputs_embeds", "float32", ["batch_size", "sequence_length", HIDDEN]
    )
    assert specs["attention_mask"].dtype == "int64"
    assert specs["hidden_states"].shape[-1] == HIDDEN
    assert set(result.tool_versions) >= {"onnxruntime-genai", "onnxruntime", "onnx"}
    assert result.options["execution_provider"] == "cpu"
    assert result.options["extra_options"]["exclude_embeds"] == "true"
    assert result.options["extra_options"]["exclude_lm_head"] == "true"
    assert "GroupQueryAttention" in result.options["op_types"]
    json.dumps(result.to_dict())  # the manifest entry is JSON-ready
    graphs.check_external_data(bundle / result.entry, bundle)


def test_modelbuilder_fp32_matches_pytorch(decoders, decoder_reference):
    result, bundle = decoders["fp32"]
    embeds, expected = decoder_reference
    got = run_decoder(bundle / result.entry, embeds, prompt_len=5)
    assert got.shape == expected.shape
    assert cosine(got[:, :5], expected[:, :5]) > 0.9999
    assert cosine(got[:, 5:], expected[:, 5:]) > 0.9999  # the cached step


def test_modelbuilder_int4(decoders, decoder_reference):
    result, bundle = decoders["int4"]
    embeds, expected = decoder_reference
    quant = result.quantization
    assert quant["bits"] == 4
    assert quant["block_size"] == 32  # ModelBuilder's default, read from the graph
    assert quant["accuracy_level"] == 4  # ModelBuilder's CPU default, read from the graph
    assert quant["quantized_ops"]["MatMulNBits"] == 5 * LAYERS  # qkv, o, gate, up, down
    got = run_decoder(bundle / result.entry, embeds, prompt_len=5)
    assert cosine(got[:, :5], expected[:, :5]) > 0.98
    assert cosine(got[:, 5:], expected[:, 5:]) > 0.98


def test_modelbuilder_plan_errors(tiny_qwen3, tmp_path):
    hf_dir, _ = tiny_qwen3
    common = {"cache_dir": tmp_path / "cache"}
    with pytest.raises(BuildPlanError, match="int3"):
        build_llm_decoder(
            hf_dir, tmp_path / "b/llm_decoder", precision="int3", execution_provider="cpu", **common
        )
    with pytest.raises(BuildPlanError, match=r"(?s)cdua.*did you mean 'cuda'"):
        build_llm_decoder(
            hf_dir,
            tmp_path / "b/llm_decoder",
            precision="fp32",
            execution_provider="cdua",
            **common,
        )
    with pytest.raises(BuildPlanError, match="exclude_embeds"):
        build_llm_decoder(
            hf_dir,
            tmp_path / "b/llm_decoder",
            precision="fp32",
            execution_provider="cpu",
            extra_options={"exclude_embeds": False},
            **common,
        )
    with pytest.raises(CheckpointError, match=r"config\.json"):
        build_llm_decoder(
            tmp_path,
            tmp_path / "b/llm_decoder",
            precision="fp32",
            execution_provider="cpu",
            **common,
        )
    busy = tmp_path / "busy" / "llm_decoder"
    busy.mkdir(parents=True)
    (busy / "old.onnx").write_bytes(b"")
    # Path problems are the caller's input, named by argument (issue 21: not plan errors).
    with pytest.raises(InputError, match=r"out_dir must be an empty or new folder.*overwrite=True") as busy_error:
        build_llm_decoder(hf_dir, busy, precision="fp32", execution_provider="cpu", **common)
    assert [p.field for p in busy_error.value.problems] == ["out_dir"]
    with pytest.raises(InputError, match="cache_dir must be a folder outside the bundle"):
        build_llm_decoder(
            hf_dir,
            tmp_path / "c/llm_decoder",
            precision="fp32",
            execution_provider="cpu",
            cache_dir=tmp_path / "c" / "cache",
        )


def test_modelbuilder_failure_quotes_its_log(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Nope"]})
    )
    with pytest.raises(BuildError, match=r"(?s)exit status.*log .*modelbuilder-cpu-fp32\.log"):
        build_llm_decoder(
            broken,
            tmp_path / "bundle" / "llm_decoder",
            precision="fp32",
            execution_provider="cpu",
            cache_dir=tmp_path / "cache",
        )


# ----------------------------------------------------------------------------- Olive


class AudioHeads(torch.nn.Module):
    """hidden_states [B, L, H] -> audio_logits [B, L, 8, 1026] (hidden @ W^T, W the fused table)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(table.clone())

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        return logits.reshape(
            hidden_states.shape[0], hidden_states.shape[1], NUM_CODEBOOKS, AUDIO_VOCAB
        )


class AudioEmbed(torch.nn.Module):
    """codes int64 [B, L, 8] -> sum over c of table[codes[..., c] + c*1026] -> [B, L, H]."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(table.clone())
        self.register_buffer("offsets", torch.arange(NUM_CODEBOOKS) * AUDIO_VOCAB, persistent=False)

    def forward(self, codes):
        return torch.nn.functional.embedding(codes + self.offsets, self.weight).sum(dim=2)


class TextEmbed(torch.nn.Module):
    """input_ids int64 [B, S] -> inputs_embeds [B, S, H]: a Gather that is the graph output."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(table.clone())

    def forward(self, input_ids):
        return torch.nn.functional.embedding(input_ids, self.weight)


@pytest.fixture(scope="module")
def audio_table():
    return (
        torch.randn(NUM_CODEBOOKS * AUDIO_VOCAB, HIDDEN, generator=torch.Generator().manual_seed(2))
        * 0.05
    )


SPECS = {
    "audio_heads": {
        "input_names": ["hidden_states"],
        "output_names": ["audio_logits"],
        "dynamic_axes": {
            "hidden_states": {0: "batch", 1: "frames"},
            "audio_logits": {0: "batch", 1: "frames"},
        },
    },
    "audio_embed": {
        "input_names": ["codes"],
        "output_names": ["audio_embeds"],
        "dynamic_axes": {
            "codes": {0: "batch", 1: "frames"},
            "audio_embeds": {0: "batch", 1: "frames"},
        },
    },
    "text_embed": {
        "input_names": ["input_ids"],
        "output_names": ["inputs_embeds"],
        "dynamic_axes": {
            "input_ids": {0: "batch", 1: "sequence"},
            "inputs_embeds": {0: "batch", 1: "sequence"},
        },
    },
}
#: Sub-part -> the op int4/int8 must produce.
QUANTIZED_OP = {
    "audio_heads": "MatMulNBits",
    "audio_embed": "GatherBlockQuantized",
    "text_embed": "GatherBlockQuantized",
}


def make_module(name: str, table: torch.Tensor):
    """The module and a [1, 3, ...] example (tests run at [2, 7, ...])."""
    if name == "audio_heads":
        return AudioHeads(table), (torch.randn(1, 3, HIDDEN),)
    if name == "text_embed":
        return TextEmbed(table[:1000]), (torch.randint(0, 1000, (1, 3)),)
    return AudioEmbed(table), (torch.randint(0, AUDIO_VOCAB, (1, 3, NUM_CODEBOOKS)),)


def sample_inputs(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    if name == "audio_heads":
        return torch.randn(2, 7, HIDDEN, generator=generator)
    if name == "text_embed":
        return torch.randint(0, 1000, (2, 7), generator=generator)
    return torch.randint(0, AUDIO_VOCAB, (2, 7, NUM_CODEBOOKS), generator=generator)


@pytest.fixture(scope="module")
def olive_exports(audio_table, tmp_path_factory):
    """(sub-part, precision) -> (ExportResult, bundle dir, module), built once."""
    bundle = tmp_path_factory.mktemp("olive-bundle")
    work = tmp_path_factory.mktemp("olive-work")
    exports = {}
    for name in SPECS:
        for precision in ("fp32", "fp16", "int8", "int4"):
            module, example = make_module(name, audio_table)
            result = export_onnx(
                module,
                example,
                **SPECS[name],
                out_dir=bundle / precision,
                name=name,
                precision=precision,
                work_dir=work,
                bundle_dir=bundle,
            )
            if precision == "fp16":  # cast in place by the export (torch_dtype): compare with float32
                assert next(module.parameters()).dtype == torch.float16
                module, _ = make_module(name, audio_table)
            exports[name, precision] = (result, bundle, module)
    assert list(work.iterdir()) == []  # Olive's scratch space is gone
    return exports


def _run_olive(result: ExportResult, bundle: Path, x: torch.Tensor) -> np.ndarray:
    sess = session(bundle / result.entry)
    feed = x.numpy()
    if result.inputs[0].dtype == "float16":
        feed = feed.astype(np.float16)
    (out,) = sess.run(None, {result.inputs[0].name: feed})
    return out.astype(np.float32)


@pytest.mark.parametrize("name", list(SPECS))
def test_olive_fp32_exact(olive_exports, name):
    result, bundle, module = olive_exports[name, "fp32"]
    assert result.exporter == "olive-onnx"  # the catalogue's name, what targets name it
    assert result.passes == ["OnnxConversion"]
    assert result.files == [f"fp32/{name}.onnx"]  # <= 2 MB of weights: one self-contained file
    assert result.subpart == name
    assert result.input_names == SPECS[name]["input_names"]
    assert result.output_names == SPECS[name]["output_names"]
    axes = SPECS[name]["dynamic_axes"][SPECS[name]["input_names"][0]]
    assert result.inputs[0].shape[:2] == [axes[0], axes[1]]
    assert result.outputs[0].shape[:2] == [axes[0], axes[1]]
    assert set(result.tool_versions) >= {"olive-ai", "onnx", "onnxruntime", "torch"}
    assert result.options["opset"] == 20
    x = sample_inputs(name)
    with torch.no_grad():
        expected = module(x).numpy()
    got = _run_olive(result, bundle, x)
    assert got.shape == expected.shape  # 2 x 7, not the example's 1 x 3
    assert np.abs(got - expected).max() < 1e-5
    json.dumps(result.to_dict())


@pytest.mark.parametrize("name", list(SPECS))
def test_olive_fp16(olive_exports, name):
    result, bundle, module = olive_exports[name, "fp16"]
    # Cast at conversion (torch_dtype), not by OnnxFloatToFloat16 after it: one float16 copy.
    assert result.passes == ["OnnxConversion"]
    assert result.quantization == {"method": "float16-cast", "cast_by": "OnnxConversion(torch_dtype=float16)",
                                   "keep_io_types": False}
    model = onnx.load(str(bundle / result.entry))
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
    weights = [i for i in model.graph.initializer if i.data_type in floats and int(np.prod(i.dims)) > 1]
    assert weights and {i.data_type for i in weights} == {onnx.TensorProto.FLOAT16}
    # The graph's declared dtypes are what the signature says: float I/O became float16.
    assert result.outputs[0].dtype == "float16"
    assert result.inputs[0].dtype == ("float16" if name == "audio_heads" else "int64")
    assert result.output_names == SPECS[name]["output_names"]
    x = sample_inputs(name)
    with torch.no_grad():
        expected = module(x).numpy()
    assert cosine(_run_olive(result, bundle, x), expected) > 0.98


@pytest.mark.parametrize("precision", ["int4", "int8"])
@pytest.mark.parametrize("name", list(SPECS))
def test_olive_rtn(olive_exports, name, precision):
    result, bundle, module = olive_exports[name, precision]
    assert result.passes == ["OnnxConversion", "OnnxBlockWiseRtnQuantization"]
    bits = int(precision[3:])
    op = QUANTIZED_OP[name]
    ops = result.options["op_types"]
    assert ops.get(op) == 1
    assert "MatMul" not in ops
    # No float copy of the table is left beside the quantized one.
    model = onnx.load(str(bundle / result.entry))
    floats = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert max((int(np.prod(i.dims)) for i in floats), default=0) < module.weight.numel()
    # The quantizer renames a quantized node's output; the declared names are restored.
    assert result.output_names == SPECS[name]["output_names"]
    if name == "text_embed":
        assert result.options["renamed_outputs"] == {f"inputs_embeds_Q{bits}": "inputs_embeds"}
    assert result.quantization["bits"] == bits
    assert result.quantization["block_size"] == 128
    assert result.quantization["quantized_ops"][op]["bits"] == [bits]
    assert result.inputs[0].dtype == ("float32" if name == "audio_heads" else "int64")
    assert result.outputs[0].dtype == "float32"
    x = sample_inputs(name)
    with torch.no_grad():
        expected = module(x).numpy()
    assert cosine(_run_olive(result, bundle, x), expected) > 0.98


def test_olive_external_data(audio_table, tmp_path):
    module, example = make_module("audio_heads", audio_table)
    bundle, work = tmp_path / "bundle", tmp_path / "work"
    result = export_onnx(
        module,
        example,
        **SPECS["audio_heads"],
        out_dir=bundle,
        name="audio_heads",
        precision="fp32",
        work_dir=work,
        external_data_threshold=1024 * 1024,  # the 2 MB table is now "large"
    )
    assert result.files == ["audio_heads.onnx", "audio_heads.onnx.data"]
    assert graphs.external_data_locations(bundle / "audio_heads.onnx") == [
        "audio_heads.onnx.data"
    ]
    assert sorted(p.name for p in bundle.iterdir()) == ["audio_heads.onnx", "audio_heads.onnx.data"]
    x = sample_inputs("audio_heads")
    with torch.no_grad():
        expected = module(x).numpy()
    assert np.abs(_run_olive(result, bundle, x) - expected).max() < 1e-5


def test_olive_plan_errors(audio_table, tmp_path):
    assert plan_passes("int4") == ["OnnxConversion", "OnnxBlockWiseRtnQuantization"]
    module, example = make_module("audio_heads", audio_table)
    kwargs = {
        **SPECS["audio_heads"],
        "out_dir": tmp_path / "b",
        "name": "audio_heads",
        "work_dir": tmp_path / "w",
    }
    with pytest.raises(BuildPlanError, match=r"Olive ONNX exporter.*'bf16'"):
        export_onnx(module, example, precision="bf16", **kwargs)
    with pytest.raises(InputError, match="work_dir must be a folder outside the bundle"):
        export_onnx(
            module, example, precision="fp32", **{**kwargs, "work_dir": tmp_path / "b" / "w"}
        )
    with pytest.raises(BuildPlanError, match="dynamic_axes"):
        export_onnx(
            module, example, precision="fp32", **{**kwargs, "dynamic_axes": {"nope": {0: "b"}}}
        )
    with pytest.raises(BuildPlanError, match="block_size"):
        export_onnx(module, example, precision="int4", block_size=100, **kwargs)


def test_olive_int4_without_weights_to_quantize(tmp_path):
    conv = torch.nn.Conv1d(1, 4, kernel_size=3, padding=1)
    with pytest.raises(BuildError, match="quantized nothing"):
        export_onnx(
            conv,
            (torch.randn(1, 1, 16),),
            input_names=["waveform"],
            output_names=["features"],
            dynamic_axes={"waveform": {2: "samples"}, "features": {2: "samples"}},
            out_dir=tmp_path / "b",
            name="conv",
            precision="int4",
            work_dir=tmp_path / "w",
        )
    assert list((tmp_path / "w").iterdir()) == []


# ----------------------------------------------------------------------------- graphs


def test_external_data_must_stay_inside_the_bundle(tmp_path):
    weight = onnx.numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 64])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 64])],
        [weight],
    )
    model = onnx.helper.make_model(graph)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    onnx.save_model(
        model, str(bundle / "m.onnx"), save_as_external_data=True, location="m.onnx.data"
    )
    assert graphs.onnx_files(bundle / "m.onnx", bundle) == ["m.onnx", "m.onnx.data"]
    inputs, outputs = graphs.onnx_io_signature(bundle / "m.onnx")
    assert inputs == [TensorSpec("x", "float32", ["n", 64])]
    assert outputs == [TensorSpec("y", "float32", ["n", 64])]

    for location in (str(tmp_path / "elsewhere.data"), "../outside.data"):
        bad = onnx.load(str(bundle / "m.onnx"), load_external_data=False)
        for entry in bad.graph.initializer[0].external_data:
            if entry.key == "location":
                entry.value = location
        onnx.save_model(bad, str(bundle / "bad.onnx"))
        with pytest.raises(BuildError, match="relative path"):
            graphs.check_external_data(bundle / "bad.onnx", bundle)
