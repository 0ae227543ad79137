"""What an exporter hands back to the build loop.

Every exporter (ModelBuilder, Olive, OpenVINO) returns one :class:`ExportResult`
per sub-part.  The build loop turns it, plus file sizes and sha256 digests it
computes itself, into that sub-part's entry in ``manifest.json``.  Nothing here
imports torch or an exporter: it is plain data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, Literal

from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.backends import registered

#: Formats an exporter may write: those of the runtime backends.
FORMATS = tuple(b.format for b in registered().values())


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output, as the graph itself declares it.

    Attributes:
        name: Tensor name in the graph, for example ``"inputs_embeds"``.
        dtype: numpy name of the element type: ``"float32"``, ``"float16"``,
            ``"int64"``, ``"int32"``, ``"uint8"``, ``"bool"``...
        shape: One entry per axis: an ``int`` for a fixed size, a ``str`` for a
            symbolic one (``"batch_size"``, ``"sequence_length"``...).  An axis
            the graph leaves fully unknown is written ``"?"``.
    """

    name: str
    dtype: str
    shape: list[int | str]

    def to_dict(self) -> dict[str, Any]:
        """Return ``{"name", "dtype", "shape"}`` (JSON-ready)."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(name=data["name"], dtype=data["dtype"], shape=list(data["shape"]))


@dataclass(frozen=True)
class ExportResult:
    """One exported sub-part: its files, how it was made, and its I/O signature.

    Attributes:
        subpart: The sub-part name (a :class:`~higgs_pack.manifests.model.SubPart`
            value such as ``"llm_decoder"``); stored as the plain string.
        format: ``"onnx"`` or ``"openvino"``.
        files: Every file of the sub-part, as POSIX paths relative to the bundle
            directory, the entry file first (for ONNX: the model, then its
            external data, then side files such as ``genai_config.json``).
        entry: The file a runtime opens (``"llm_decoder/model.onnx"``), relative
            to the bundle directory; always one of ``files``.
        exporter: The catalogue name of the exporter that made it
            (:data:`~higgs_pack.exporters.catalog.EXPORTERS`: ``"modelbuilder"``,
            ``"olive-onnx"``, ``"optimum-openvino"``, ``"olive-openvino"``).
        passes: The steps applied in order, by their tool's names (Olive pass class
            names such as ``"OnnxConversion"``, or ``"ModelBuilder"``).
        tool_versions: Distribution name -> version of every tool that touched the
            files, for example ``{"onnxruntime-genai": "0.18.0"}``.
        precision: ``"fp32"``, ``"fp16"``, ``"int8"`` or ``"int4"``.
        quantization: Settings actually used (bits, block size, accuracy level,
            symmetric, quantized op types and counts); empty for fp32.
        inputs: Graph inputs in graph order.
        outputs: Graph outputs in graph order.
        options: Exporter options that shaped the graph (execution provider,
            opset, extra options...).
    """

    subpart: str
    format: Literal["onnx", "openvino"]
    files: list[str]
    entry: str
    exporter: str
    passes: list[str]
    tool_versions: dict[str, str]
    precision: str
    quantization: dict[str, Any] = field(default_factory=dict)
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Accept the enum but store the plain value, so to_dict() is JSON-ready.
        if isinstance(self.subpart, SubPart):
            object.__setattr__(self, "subpart", self.subpart.value)
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.entry not in self.files:
            raise ValueError(f"entry {self.entry!r} is not among files {self.files}")

    @property
    def input_names(self) -> list[str]:
        """Names of :attr:`inputs`, in graph order."""
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        """Names of :attr:`outputs`, in graph order."""
        return [t.name for t in self.outputs]

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict with the same keys as the attributes."""
        data = asdict(self)
        data["inputs"] = [t.to_dict() for t in self.inputs]
        data["outputs"] = [t.to_dict() for t in self.outputs]
        return data


def installed_version(distribution: str) -> str:
    """Version of an installed distribution (PyPI name), or ``"not installed"``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def tool_versions(*distributions: str) -> dict[str, str]:
    """name -> version of those ``distributions`` that are installed (others are left out)."""
    versions = {name: installed_version(name) for name in distributions}
    return {name: v for name, v in versions.items() if v != "not installed"}


#: Characters of a tool's log quoted in a BuildError.
LOG_TAIL_CHARS = 4000


def log_tail(log_path: Any, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of a tool's log file for an error message ("" when there is no log).

    Progress bars redraw with carriage returns: only the last state of each line is kept.
    """
    from pathlib import Path

    path = Path(log_path)
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(lines)[-chars:]
