"""The built-in targets.  Adding a target = adding one ``builtin(Target(...))`` here (the registry,
:mod:`higgs_pack.targets.registry`, checks each when it takes it).

Sub-part tools per target follow DESIGN.md's table: ModelBuilder for the ONNX
decoders, Olive for the other ONNX sub-parts, optimum-intel + NNCF and Olive's
OpenVINO passes for the native OpenVINO target; codec sub-parts always fp32.
"""

from __future__ import annotations

from higgs_pack.exporters.catalog import MODELBUILDER, OLIVE_ONNX, OLIVE_OPENVINO, OPTIMUM_OPENVINO
from higgs_pack.manifests.model import SubPart
from higgs_pack.manifests.providers import OPENVINO_REQUIREMENT
from higgs_pack.targets.base import Recipe, Target, Variant

#: The targets :func:`~higgs_pack.targets.registry.targets` registers, in declaration order.
BUILTIN: list[Target] = []


def builtin(target: Target) -> Target:
    """Declare ``target`` built in (:data:`BUILTIN`); the registry checks it when it takes it."""
    BUILTIN.append(target)
    return target


def _onnx_recipes(ep: str, *, decoder: dict | None = None, heads: dict | None = None) -> dict[SubPart, Recipe]:
    """ModelBuilder decoder for ``ep``, Olive for the rest; ``decoder``: ModelBuilder extra
    options of the decoder; ``heads``: extra audio_heads options."""
    module = Recipe(OLIVE_ONNX)
    extra = {"extra_options": dict(decoder)} if decoder else {}
    return {
        SubPart.LLM_DECODER: Recipe(MODELBUILDER, options={"execution_provider": ep, **extra}),
        SubPart.TEXT_EMBED: module,
        SubPart.AUDIO_EMBED: module,
        SubPart.AUDIO_HEADS: Recipe(OLIVE_ONNX, options=heads) if heads else module,
        SubPart.AUDIO_TOKENIZER: Recipe(OLIVE_ONNX, precision="fp32"),
        SubPart.AUDIO_ENCODER: Recipe(OLIVE_ONNX, precision="fp32"),
        SubPart.AUDIO_TOKENIZER_STREAM: Recipe(OLIVE_ONNX, precision="fp32"),
    }


#: ModelBuilder int4 options of the cpu decoder (int4 bundles; fp32 ignores them): block 128
#: (ModelBuilder's default is 32), int8 compute (accuracy_level 4, the cpu row's default).
#: Why, measured: docs/measurements.md, "cpu: ModelBuilder int4 decoder options".
CPU_DECODER_INT4 = {"block_size": 128}

#: The cpu decoder's KV cache choices (``--kv-cache``), the first the default: float.
#: int8 is ModelBuilder's ``kv_cache_quant_scheme=int8_per_channel`` with scales from its
#: ``kv_cache_calibration`` tool (:mod:`higgs_pack.exporters.onnx.kv_quantization`): 4x fewer KV bytes, but
#: its parity does not hold at audio-frame positions (docs/measurements.md, "cpu: float or
#: int8 KV cache").
CPU_KV_CACHES = ("float", "int8")

CPU = builtin(
    Target(
        name="cpu",
        description="ONNX Runtime on the CPU execution provider (x86-64 and ARM64)",
        backend="onnxruntime",
        execution_provider="cpu",
        # fp16 is not offered on cpu: ModelBuilder 0.18's cpu fp16 decoder fails in ONNX
        # Runtime 1.32's CPU provider (an inserted precision-free Cast in repeat_kv gets a
        # wrong buffer shape, measured 2026-11-30), and the CPU provider computes fp16 by
        # casting to fp32 anyway.  int4 (fast) and fp32 (exact) are the CPU choices.
        precisions=("int4", "fp32"),
        # int4 heads with int8 compute (MatMulNBits accuracy_level 4, as ModelBuilder's cpu
        # decoder): 1.30 -> 0.31 ms per frame on the bench preset; other providers keep the default.
        recipes=_onnx_recipes("cpu", decoder=CPU_DECODER_INT4, heads={"accuracy_level": 4}),
        kv_caches=CPU_KV_CACHES,
    )
)

CUDA = builtin(
    Target(
        name="cuda",
        description="ONNX Runtime on the CUDA execution provider (NVIDIA GPUs)",
        backend="onnxruntime",
        execution_provider="cuda",
        precisions=("fp16", "int4", "fp32"),
        recipes=_onnx_recipes("cuda"),
        provider_options={"device_id": 0},
        verify_on="cpu",
    )
)

DML = builtin(
    Target(
        name="dml",
        description="ONNX Runtime on the DirectML execution provider (Windows GPUs)",
        backend="onnxruntime",
        execution_provider="dml",
        precisions=("fp16", "int4"),
        recipes=_onnx_recipes("dml"),  # Windows only: the provider row's platform marker
        provider_options={"device_id": 0},
        verify_on="cpu",
    )
)

#: Windows ML: the dml graphs (the provider row's ModelBuilder ``-e dml``) in a wheel that needs
#: Windows ML's ONNX Runtime instead of onnxruntime-directml; which to pick: docs/windows.md.
WINML = builtin(
    Target(
        name="winml",
        description="ONNX Runtime of Windows ML on its DirectML execution provider (Windows 11 24H2+ GPUs)",
        backend="onnxruntime",
        execution_provider="winml",
        precisions=("fp16", "int4"),
        recipes=_onnx_recipes("winml"),  # x64 Windows only: the provider row's platform marker
        provider_options={"device_id": 0},
        verify_on="cpu",
    )
)

#: NPU variant: static lengths in positions. The prompt (text tokens, or for a voice
#: clone its transcript + ~25 reference frames per second + the text) fits in
#: NPU_MAX_PROMPT; the decoder's KV window holds prompt + generated frames (the TTS
#: loop splits longer texts into sentences to fit it).
NPU_MAX_PROMPT = 512
NPU_KV_LENGTH = 1024
#: Codec decoder chunk in frames (5.12 s at 25 fps); the context around each chunk is
#: the decoder's receptive field, measured at build time (about 11 frames).
NPU_CODEC_CHUNK = 128

NPU = Variant(
    "npu",
    description="static shapes for Intel NPUs",
    options={
        # Stateless decoder with fixed-size KV buffers (why: convert_static_decoder's docstring).
        # int4 weights symmetric (INT4_SYM): what the NPU plugin wants (OpenVINO GenAI NPU guide).
        # Group 128 on the NPU (its plugin's group-quantized path), not the CPU decoder's 64.
        SubPart.LLM_DECODER: {"static_kv_length": NPU_KV_LENGTH, "static_step": 1, "symmetric": True,
                              "group_size": 128},
        SubPart.TEXT_EMBED: {"static_axes": {"batch": 1, "sequence": NPU_MAX_PROMPT}, "allow_chunks": False,
                             "symmetric": True},
        SubPart.AUDIO_EMBED: {"static_axes": {"batch": 1, "frames": 1}, "symmetric": True},
        SubPart.AUDIO_HEADS: {"static_axes": {"batch": 1, "frames": 1}, "symmetric": True, "group_size": 128},
        SubPart.AUDIO_TOKENIZER: {"static_axes": {"batch": 1, "frames": NPU_CODEC_CHUNK},
                                  "chunk_context": "auto", "pad_mask": True},
        # The codec encoder runs once per voice clone, outside the loop. A padded static
        # chunk changes its codes (HuBERT's attention and GroupNorm see the padding:
        # 0.10 code agreement on the tiny model for a 30-frame probe in a 250-frame
        # chunk), so it stays dynamic and runs on the CPU when the bundle runs on the NPU.
        SubPart.AUDIO_ENCODER: {"device_overrides": {"NPU": "CPU"}},
        # The stateful streaming codec is not made static for the NPU: its state size (S floats a
        # row) is the codec's, known only once the checkpoint is read, and the NPU variant already
        # decodes in static 128-frame chunks with a valid_frames mask; it runs on the CPU.
        SubPart.AUDIO_TOKENIZER_STREAM: {
            "device_overrides": {"NPU": "CPU"},
            "device_override_reason": "the stateful streaming codec is not compiled static for the NPU (its "
                                      "state size is the codec's); it runs on the CPU beside the NPU's static "
                                      "128-frame window codec"},
    },
    manifest={"device": "NPU", "generation": {"max_prompt_length": NPU_MAX_PROMPT}},
    verify_on="CPU",
)

#: NNCF int4 settings of the openvino decoder (int4 bundles; other precisions ignore them):
#: INT4_SYM, group 64; why, measured: docs/measurements.md, "openvino: NNCF int4 decoder weights".
OPENVINO_DECODER_INT4 = {"symmetric": True, "group_size": 64}

#: NNCF int4 settings of the openvino audio heads (one [hidden, 8 x 1026] MatMul run every
#: frame): the decoder's INT4_SYM g64 (docs/measurements.md, "openvino: NNCF int4 audio heads").
OPENVINO_HEADS_INT4 = {"symmetric": True, "group_size": 64}

OPENVINO = builtin(
    Target(
        name="openvino",
        description="Native OpenVINO IR for Intel CPUs, iGPUs and NPUs (NNCF weight compression)",
        backend="openvino",
        device="CPU",
        precisions=("int4", "int8", "fp16", "fp32"),
        recipes={
            SubPart.LLM_DECODER: Recipe(OPTIMUM_OPENVINO, options=OPENVINO_DECODER_INT4),
            SubPart.TEXT_EMBED: Recipe(OLIVE_OPENVINO),
            SubPart.AUDIO_EMBED: Recipe(OLIVE_OPENVINO),
            SubPart.AUDIO_HEADS: Recipe(OLIVE_OPENVINO, options=OPENVINO_HEADS_INT4),
            SubPart.AUDIO_TOKENIZER: Recipe(OLIVE_OPENVINO, precision="fp32"),
            SubPart.AUDIO_ENCODER: Recipe(OLIVE_OPENVINO, precision="fp32"),
            SubPart.AUDIO_TOKENIZER_STREAM: Recipe(OLIVE_OPENVINO, precision="fp32"),
        },
        extra="openvino",
        runtime_requirements=(OPENVINO_REQUIREMENT,),
        variants=(NPU,),
        # The OpenVINO CPU plugin picks the KV cache precision when it compiles (u8 by default
        # on x86 after NNCF: MODEL.md): not a build choice, the manifest records null.
        kv_caches=(),
    )
)
