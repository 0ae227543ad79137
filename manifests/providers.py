"""The execution providers and runtimes a bundle can be built for (pure data): one row per
provider (:data:`EXECUTION_PROVIDERS`), each made of small records by concern (packaging,
hardware, session rules, ModelBuilder support, its rung in the choice); adding a provider is
adding a row."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelBuilderSupport:
    """How onnxruntime-genai's ModelBuilder builds the decoder for one provider.

    Attributes:
        ep: ModelBuilder's ``-e`` name for the provider.
        accuracy_level: MatMulNBits ``accuracy_level`` ModelBuilder writes at int4 when
            none is given (its ``--extra_options`` help, 0.18); recorded values are read
            back from the graph, this fills what the graph omits.
        no_packed_attention: precisions at which ModelBuilder 0.18's packed ``Attention``
            writes an invalid graph for this provider, so it is built with packed
            attention off (see ``higgs_pack.exporters.onnx.modelbuilder``).
        int4_float_base: precision of the float graph ModelBuilder's int4 build starts
            from for this provider (its I/O dtype: fp32 on cpu, fp16 on GPUs; read in
            builders/base.py, 0.18); higgs-pack writes it, then quantizes it node by node.
    """

    ep: str
    accuracy_level: int = 0
    no_packed_attention: tuple[str, ...] = ()
    int4_float_base: str = "fp32"


@dataclass(frozen=True)
class ChoiceRung:
    """One step of the runtime's preference ladder (``higgs_pack.runtime.machine.choice``).

    Attributes:
        name: the rung's name, shown in ``higgs-pack devices`` (``cuda``, ``cpu``, ``npu``).
        rank: its place in the ladder; lower wins (rungs of equal name share a rank).
        means: one phrase saying what runs on it, for the choice's reason.
    """

    name: str
    rank: int
    means: str


#: The rung every CPU placement shares (ONNX Runtime's CPU provider, OpenVINO's ``CPU``
#: device): ordered inside by speed class.
CPU_RUNG = ChoiceRung("cpu", 50, "CPU bundle (OpenVINO CPU or ONNX Runtime cpu), fastest speed class first")


@dataclass(frozen=True)
class Packaging:
    """How a provider's ONNX Runtime distribution is installed, and how wheels for it are marked.

    Attributes:
        distribution: the PyPI distribution that provides it (``onnxruntime-gpu``).
        requirement: the requirement string a bundle records for it.
        extra: the ``higgs-pack[extra]`` that installs it (pyproject.toml declares it;
            tests/test_declarations.py checks that it does).
        platform_marker: PEP 508 marker of the platforms it exists on (``None``: all).
            Targets on this provider put it on their wheel and on every requirement.
        companions: requirements the extra installs beside the distribution (Windows ML's
            GenAI build beside its ONNX Runtime); targets record them with ``requirement``.
        wheel_platforms: platforms its wheels are resolver-checked for where it cannot run
            (keys of ``higgs_pack.targets.packaging.install_check.PLATFORMS``).
        classifiers: trove classifiers of bundle wheels for it.
        own_venv: its distribution replaces onnxruntime (same module) and has no higgs-pack
            runtime extra of its own to add beside another one.
    """

    distribution: str
    requirement: str
    extra: str
    platform_marker: str | None = None
    companions: tuple[str, ...] = ()
    wheel_platforms: tuple[str, ...] = ()
    classifiers: tuple[str, ...] = ("Operating System :: OS Independent",)
    own_venv: bool = False


@dataclass(frozen=True)
class Hardware:
    """The hardware a provider needs beyond a CPU: what to say about it and how to find it.

    Attributes:
        needs: the hardware in a sentence ("the bundle needs …").
        missing: how a skipped check names it when absent ("no CUDA GPU").
        short: in a few words, for notes ("an NVIDIA GPU is present").
        kind: the ``Inventory.hardware`` key whose PCI devices prove it is here without its
            runtime (``nvidia-gpu``; ``None``: no such scan).
        probe: how a nox session finds it before installing anything: ``"command:<argv>"``
            (the command exits 0 only where it is) or ``"platform:<sys.platform>"`` (the
            platform only; not proof of a GPU).
    """

    needs: str
    missing: str
    short: str
    kind: str | None = None
    probe: str | None = None


@dataclass(frozen=True)
class SessionSupport:
    """What ONNX Runtime sessions on a provider need from higgs-pack.

    Attributes:
        rules: ``SessionOptions`` attributes forced on every session of this provider,
            whatever the manifest says (enum values by member name).
        kernel_table: file in ``runtime/verification/ops/`` listing the provider's kernels
            and their type constraints (kernel coverage is then checked statically).
        iobinding_device: the ``OrtValue``/IOBinding device name of its memory when its
            GroupQueryAttention shares bound past/present KV buffers (the decoder then keeps
            one preallocated cache there); ``None``: the decoder copies the cache each step.
    """

    rules: Mapping[str, Any] = field(default_factory=dict)
    kernel_table: str | None = None
    iobinding_device: str | None = None


@dataclass(frozen=True)
class ExecutionProvider:
    """One row of the execution-provider table, in records by concern.

    Attributes:
        name: the bundle's name for it (``cpu``, ``cuda``, ``dml``, ``openvino``).
        ort_provider: ONNX Runtime's provider name, for example ``CUDAExecutionProvider``.
        label: its short name in sentences ("the CUDA execution provider").
        packaging: how it is installed and how its wheels are marked.
        hardware: the hardware it needs beyond a CPU (``None``: runs on any machine with
            its distribution).
        sessions: what its sessions need (forced options, kernel table, IOBinding device).
        modelbuilder: how ModelBuilder builds the decoder for it (``None``: it cannot).
        rung: where its bundles stand in the runtime's preference ladder.
    """

    name: str
    ort_provider: str
    label: str
    packaging: Packaging
    hardware: Hardware | None = None
    sessions: SessionSupport = field(default_factory=SessionSupport)
    modelbuilder: ModelBuilderSupport | None = None
    rung: ChoiceRung = CPU_RUNG

    @property
    def gpu(self) -> bool:
        """Needs hardware beyond a CPU (its runs are checked where present, else skipped)."""
        return self.hardware is not None


#: DirectML runs on Windows only.
_WINDOWS = "sys_platform == 'win32'"
#: Windows ML's Python builds: x64 Windows only here (issue 28; its registry also has win_arm64
#: wheels, not checked by this project).
_WINDOWS_X64 = "sys_platform == 'win32' and platform_machine == 'AMD64'"

#: DirectML as ONNX Runtime's execution provider, whichever distribution ships it
#: (onnxruntime-directml, or Windows ML's onnxruntime-windowsml, which builds it in): memory
#: patterns off and sequential execution (ONNX Runtime's DirectML execution provider
#: documentation), its kernel table, ModelBuilder's ``-e dml`` graphs and one rung.
_DIRECTML_SESSIONS = SessionSupport(rules={"enable_mem_pattern": False, "execution_mode": "ORT_SEQUENTIAL"},
                                    kernel_table="dml.json")
_DIRECTML_MODELBUILDER = ModelBuilderSupport("dml", accuracy_level=0, no_packed_attention=("fp32",),
                                             int4_float_base="fp16")
_DIRECTML_RUNG = ChoiceRung("dml", 40, "dml or winml bundle on a Windows GPU (DirectML)")

#: Bundle EP name -> provider, package and extra (the one table; see STYLE.md #6).
#: Adding a provider is adding a row here (and its extra in pyproject.toml).
EXECUTION_PROVIDERS: dict[str, ExecutionProvider] = {
    ep.name: ep
    for ep in (
        ExecutionProvider(
            "cpu", "CPUExecutionProvider", label="CPU",
            packaging=Packaging("onnxruntime", "onnxruntime>=1.31,<1.33", "cpu"),
            sessions=SessionSupport(iobinding_device="cpu"),
            modelbuilder=ModelBuilderSupport("cpu", accuracy_level=4),
        ),
        ExecutionProvider(
            "cuda", "CUDAExecutionProvider", label="CUDA",
            packaging=Packaging(
                "onnxruntime-gpu", "onnxruntime-gpu>=1.31,<1.33", "cuda",
                wheel_platforms=("linux_x86_64", "win_amd64"),
                classifiers=("Environment :: GPU :: NVIDIA CUDA", "Operating System :: POSIX :: Linux",
                             "Operating System :: Microsoft :: Windows"),
            ),
            hardware=Hardware(
                needs="an NVIDIA GPU with the CUDA 12 / cuDNN 9 runtime (Linux or Windows)",
                missing="no CUDA GPU", short="an NVIDIA GPU", kind="nvidia-gpu", probe="command:nvidia-smi -L",
            ),
            sessions=SessionSupport(kernel_table="cuda.json", iobinding_device="cuda"),
            modelbuilder=ModelBuilderSupport("cuda", accuracy_level=0, no_packed_attention=("fp32",),
                                             int4_float_base="fp16"),
            rung=ChoiceRung("cuda", 20, "cuda bundle on an NVIDIA GPU"),
        ),
        ExecutionProvider(
            "dml", "DmlExecutionProvider", label="DirectML",
            packaging=Packaging(
                "onnxruntime-directml", f"onnxruntime-directml>=1.24,<1.33; {_WINDOWS}", "dml",
                platform_marker=_WINDOWS, wheel_platforms=("win_amd64",),
                classifiers=("Operating System :: Microsoft :: Windows",),
            ),
            hardware=Hardware(
                needs="Windows 10/11 with a DirectX 12 GPU (DirectML)",
                missing="no DirectML GPU (Windows 10/11 with DirectX 12)",
                short="a DirectX 12 GPU (DirectML)", probe="platform:win32",
            ),
            sessions=_DIRECTML_SESSIONS,
            modelbuilder=_DIRECTML_MODELBUILDER,
            rung=_DIRECTML_RUNG,
        ),
        # Windows ML (docs/windows.md): Microsoft's successor of DirectML on Windows 11 24H2 and
        # later.  Its ONNX Runtime (onnxruntime-windowsml 1.30, built with DirectML in) runs the
        # dml graphs on the same DmlExecutionProvider; the GenAI build comes with it.  Never the
        # registry's unrelated `onnxruntime-winml` (not Microsoft's; reported as malware).
        ExecutionProvider(
            "winml", "DmlExecutionProvider", label="DirectML (Windows ML)",
            packaging=Packaging(
                "onnxruntime-windowsml", f"onnxruntime-windowsml>=1.30,<1.33; {_WINDOWS_X64}", "winml",
                platform_marker=_WINDOWS_X64,
                companions=(f"onnxruntime-genai-winml>=0.18,<0.19; {_WINDOWS_X64}",),
                wheel_platforms=("win_amd64",),
                classifiers=("Operating System :: Microsoft :: Windows",
                             "Operating System :: Microsoft :: Windows :: Windows 11"),
            ),
            hardware=Hardware(
                needs="Windows 11 24H2 or later on x64 with a DirectX 12 GPU, and Python 3.11 or later (Windows ML)",
                missing="no DirectML GPU (Windows ML: Windows 11 24H2 or later, x64)",
                short="a DirectX 12 GPU (Windows ML)", probe="platform:win32",
            ),
            sessions=_DIRECTML_SESSIONS,
            modelbuilder=_DIRECTML_MODELBUILDER,
            rung=_DIRECTML_RUNG,
        ),
        ExecutionProvider(
            "openvino", "OpenVINOExecutionProvider", label="OpenVINO",
            packaging=Packaging("onnxruntime-openvino", "onnxruntime-openvino>=1.24", "openvino-ep", own_venv=True),
        ),
    )
}

#: The provider every ONNX Runtime install has: the explicit fallback and the
#: reference the other providers are compared with.
CPU_PROVIDER = EXECUTION_PROVIDERS["cpu"]

#: OpenVINO runtime requirement for bundles in OpenVINO IR.
OPENVINO_REQUIREMENT = "openvino>=2026.4,<2027"
