"""The registered targets.  Adding a target = adding one ``register(Target(...))`` here.

Sub-part tools per target follow DESIGN.md's table: ModelBuilder for the ONNX
decoders, Olive for the other ONNX sub-parts, optimum-intel + NNCF and Olive's
OpenVINO passes for the native OpenVINO target; codec sub-parts always fp32.
"""

from __future__ import annotations

from higgs_pack.exporters.catalog import MODELBUILDER, OLIVE_ONNX, OLIVE_OPENVINO, OPTIMUM_OPENVINO
from higgs_pack.manifests.constants import OPENVINO_REQUIREMENT, SubPart
from higgs_pack.targets.base import Recipe, Target, Variant, register


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
    }


#: ModelBuilder int4 options of the cpu decoder (int4 bundles; fp32 ignores them): block 128
#: (ModelBuilder's default is 32), int8 compute (accuracy_level 4, the cpu row's default).
#: Measured with ``python -m higgs_pack.targets.bench.ort_int4_options`` on an Intel Xeon
#: with AVX-512 VNNI and AMX (2 vCPUs, ONNX Runtime 1.32), bare decoder with shared KV
#: buffers, best / median ms per step, interleaved; the bytes are the decoder's external data
#: (int4 nibbles + one float32 scale per block: MatMulNBits scales take the activations'
#: dtype, float32 on the CPU provider):
#:
#: ===================== ========= ============= ============= ===== =============== ===============
#: block, accuracy_level  full MB   full 64 pos.  full 900 pos. bench  bench 64 pos.   bench rel_l2
#: ===================== ========= ============= ============= ===== =============== ===============
#: 32, 4 (was)            2,296.1   181.8 / 188.9  222.7 / 228.9  65.2   6.16 / 7.44     0.116
#: 64, 4                  2,067.2   169.4 / 171.4  206.6 / 212.0  58.9   5.16 / 6.66     0.128
#: 128, 4                 1,954.1   150.4 / 152.0  185.2 / 191.5  56.7   4.19 / 5.41     0.140
#: 32, 1                  -         -              -              65.2   8.55 / 9.87     0.115
#: ===================== ========= ============= ============= ===== =============== ===============
#:
#: (full: 6 rounds of 4 steps; bench: 15 rounds of 8 steps beside the fp32 decoder, whose
#: 405 MB evict the others from the 300 MiB L3; rel_l2 of the hidden states against it.)
#: Block 128 reads 15% fewer bytes than 32, within 0.6% of the openvino int4 decoder's
#: 1,942 MB, and steps 16-20% faster at full size; its error against fp32 (0.140; cosine
#: 0.990) is that of NNCF's INT4_SYM g128 (0.139) and near the openvino default's (SYM g64,
#: 0.125), the group size int4 LLM deployments commonly use.  int8 compute stays: float
#: compute (accuracy_level 1) was 28-39% slower.
CPU_DECODER_INT4 = {"block_size": 128}

#: The cpu decoder's KV cache choices (``--kv-cache``), the first the default: float.
#: int8 is ModelBuilder's ``kv_cache_quant_scheme=int8_per_channel`` with scales from its
#: ``kv_cache_calibration`` tool (:mod:`higgs_pack.exporters.kv_cache`).  Measured with
#: ``python -m higgs_pack.targets.bench.ort_kv_cache`` (bench preset, 8 layers; bare decoder
#: with shared KV buffers, 25 interleaved rounds of 8 steps, best / median ms per step; AMD
#: EPYC family 26, AVX-512 + VNNI, 2 vCPUs, 32 MiB L3, ONNX Runtime 1.32, load average 7-10
#: from other jobs on the 2 cores; rel_l2 / cosine against the float KV cache of the same
#: weights; "loop": a case prompt then 400 teacher-forced audio frames, worst / median rel_l2,
#: worst cosine, greedy first-code and all-codebook agreement per frame):
#:
#: ========== ======== ============= ============= =============== ================================
#: decoder    KV B/pos 64 positions  900 positions rel_l2 64 / 900 loop
#: ========== ======== ============= ============= =============== ================================
#: int4 float   32,768 12.76 / 16.14 17.02 / 24.04 -               -
#: int4 int8     8,192 11.41 / 15.61 15.35 / 21.96 0.0155 / 0.0146 0.064 / 0.036, 0.99795, 97%, 83%
#: fp32 float   32,768 47.43 / 60.70 56.35 / 78.18 -               -
#: fp32 int8     8,192 41.39 / 55.27 50.17 / 64.48 0.0050 / 0.0016 0.042 / 0.026, 0.99913, 98%, 88%
#: ========== ======== ============= ============= =============== ================================
#:
#: int8 is not slower (3-10% faster, within this machine's noise: an earlier run at load 9-12
#: had fp32 int8 slower), but its parity does not hold under the decoder rule at audio-frame
#: positions, which the calibration (text only) never sees: the loop's worst rel_l2 exceeds
#: the bench preset's limits (int4: 0.03 * sqrt(8 / 2) = 0.06 against the oracle with the
#: bundle's weights; fp32: 0.02, cosine >= 0.9999), and 12-17% of the frames' greedy codes
#: differ.  (The golden check sees the text prompt and passes: tiny int4 0.0107 of 0.04, bench
#: int4 0.0421 of 0.08; the KV cache check 0.0133 of 0.03 and 0.0488 of 0.06.)  So
#: float stays the default; int8 is for memory-bound batching: 4x fewer KV bytes (full size:
#: 288 -> 72 KiB per position; the step's bytes at 900 positions are mostly the 1.95 GB of
#: int4 weights, so int8 KV saves at most ~9% of them).
#:
#: At full size (36 layers, random weights; the same tool with ``--preset full --precisions int4``,
#: 15 rounds, same machine kind, load 1.3-1.9, 2026-12-03):
#:
#: ========== ======== ============= ============= =============== ================================
#: decoder    KV B/pos 64 positions  900 positions rel_l2 64 / 900 loop (400 frames)
#: ========== ======== ============= ============= =============== ================================
#: int4 float  294,912 82.80 / 95.78 122.4 / 139.0 -               -
#: int4 int8    73,728 68.94 / 87.00 103.6 / 108.3 0.1002 / 0.0914 0.107 / 0.086, 0.99426, 87%, 30%
#: ========== ======== ============= ============= =============== ================================
#:
#: int8 is 15-22% faster there (best), but its hidden states part from the float cache's by
#: 0.09-0.11 relative L2 and 70% of the frames differ in some codebook: the default stays float.
CPU_KV_CACHES = ("float", "int8")

CPU = register(
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

CUDA = register(
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

DML = register(
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
WINML = register(
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
    },
    manifest={"device": "NPU", "generation": {"max_prompt_length": NPU_MAX_PROMPT}},
    verify_on="CPU",
)

#: NNCF int4 settings of the openvino decoder (int4 bundles; other precisions ignore them):
#: INT4_SYM, group 64.  Measured with ``python -m higgs_pack.targets.bench.ov_properties``
#: (bench preset, bare stateful decoder, CPU device, 15 interleaved rounds of 8 steps, best /
#: median ms per step, hidden-state rel_l2 vs the fp32 IR) on an AMD EPYC with AVX2 only (no
#: VNNI, so OpenVINO decompresses int4 weights to f32), load average 4.5-6 on 2 cores:
#:
#: ============== ======== ============= ============= =======
#: weights         .bin MB  64 positions  768 positions  rel_l2
#: ============== ======== ============= ============= =======
#: INT4_ASYM g128     53.8   19.7 / 24.1   22.5 / 26.5   0.135
#: INT4_ASYM g64      55.7   17.9 / 23.7   21.1 / 25.4   0.124
#: INT4_SYM g128      53.4   16.2 / 19.6   18.6 / 20.8   0.139
#: INT4_SYM g64       55.0   15.3 / 18.5   17.4 / 20.9   0.125
#: ============== ======== ============= ============= =======
#:
#: Symmetric weights (no zero point to subtract when decompressing) were the fastest in both
#: runs and at both contexts (an earlier, noisier run of 5 x 16 steps ranked them the same);
#: group 64 brings the error below ASYM g128's.  On VNNI CPUs (dynamic quantization) the
#: step is bound by the bytes read: SYM g64 reads 2% more than ASYM g128, so it costs at most
#: that there; NNCF documents INT4_SYM as the faster mode in general.  On an Intel Xeon with
#: AVX-512 VNNI and AMX (same tool and rounds, bf16 inference, load 1.6) SYM g64 stayed
#: ahead of ASYM: 8.67 / 9.91 vs ASYM g128 9.67 / 10.73 and ASYM g64 10.23 / 10.86 at 64
#: positions (SYM g128 8.06 / 9.20 with rel_l2 0.139 against g64's 0.125).
OPENVINO_DECODER_INT4 = {"symmetric": True, "group_size": 64}

#: NNCF int4 settings of the openvino audio heads (one [hidden, 8 x 1026] MatMul run every
#: frame): the decoder's INT4_SYM g64.  A [1, 1024] x [1024, 8208] MatMul alone on the CPU
#: device, median of 200 calls with the cache warm / 50 after reading 64 MiB, two interleaved
#: rounds on an AMD EPYC with AVX2 only (a full-size build shared the 2 cores):
#: INT4_ASYM g128 (before) 918-919 / 1024-1038 us, INT4_SYM g64 665-666 / 758-765 us, INT8_SYM
#: 494-495 / 745-802 us, INT8_ASYM 661-671 / 810-855 us, f32 1173-1276 / 1781-2104 us.
#: INT4_SYM g64 reads half of INT8's bytes, which decides at full size (21M weights).
OPENVINO_HEADS_INT4 = {"symmetric": True, "group_size": 64}

OPENVINO = register(
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
        },
        extra="openvino",
        runtime_requirements=(OPENVINO_REQUIREMENT,),
        variants=(NPU,),
        # The OpenVINO CPU plugin picks the KV cache precision when it compiles (u8 by default
        # on x86 after NNCF: MODEL.md): not a build choice, the manifest records null.
        kv_caches=(),
    )
)
