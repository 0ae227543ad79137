"""Node placement on ONNX Runtime: which execution provider ran which graph node, read from
an ORT profile (:func:`parse_profile`), for one session (:func:`profile_node_placement`) or
every sub-part of an ONNX bundle run on its golden inputs (:func:`bundle_node_placement`).
What ``verify`` reports as the nodes a provider left on the CPU.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.runtime.backends.onnxruntime.runners import OrtDecoder, OrtSubPart
from higgs_pack.runtime.backends.onnxruntime.sessions import create_session
from higgs_pack.runtime.loop.stateful_codec import first_call_feeds


@dataclass(frozen=True)
class NodePlacement:
    """Which execution provider ran which graph node, read from an ORT profile.

    Attributes:
        nodes: provider name -> ``[(node name, op type), ...]`` in first-run order.
            A provider that compiles subgraphs (OpenVINO, TensorRT) shows one node
            per fused subgraph (op type ``OpenVINO-EP-subgraph_<n>``).
    """

    nodes: dict[str, list[tuple[str, str]]]

    def on(self, provider: str) -> list[tuple[str, str]]:
        """Nodes that ran on ``provider`` (e.g. ``"CPUExecutionProvider"``)."""
        return list(self.nodes.get(provider, []))

    def op_counts(self, provider: str) -> dict[str, int]:
        """Op type -> node count on ``provider``."""
        return dict(Counter(op for _, op in self.on(provider)))


def parse_profile(path: str | Path) -> NodePlacement:
    """Read which provider ran each node from an ONNX Runtime profile (``enable_profiling``).

    Uses the ``"cat": "Node"`` events named ``<node>_kernel_time``, whose ``args`` carry
    ``provider`` and ``op_name``; each node is counted once however often it ran.

    Args:
        path: The JSON file ``session.end_profiling()`` returned.

    Raises:
        ValueError: The file is not an ORT profile (not a JSON list of events).
    """
    events = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(events, list):
        raise ValueError(f"{path} is not an ONNX Runtime profile (expected a JSON list of events)")
    seen: set[str] = set()
    nodes: dict[str, list[tuple[str, str]]] = {}
    for event in events:
        name = event.get("name", "") if isinstance(event, dict) else ""
        if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        node = name[: -len("_kernel_time")]
        args = event.get("args") or {}
        if node in seen or "provider" not in args:
            continue
        seen.add(node)
        nodes.setdefault(args["provider"], []).append((node, args.get("op_name", "?")))
    return NodePlacement(nodes)


def profile_node_placement(path: Path, ep: str, run: Callable[[Any], None], *,
                           provider_options: dict[str, Any] | None = None,
                           session_options: dict[str, Any] | None = None) -> NodePlacement:
    """Open ``path`` on ``ep`` with profiling on, call ``run(session)``, and parse the profile.

    The profile goes to a temporary directory that is removed afterwards.

    Raises:
        ExecutionProviderUnavailable: As :func:`create_session` (no fallback).
    """
    with tempfile.TemporaryDirectory(prefix="higgs-pack-ort-profile-") as tmp:
        options = {**(session_options or {}), "enable_profiling": True,
                   "profile_file_prefix": str(Path(tmp) / "profile")}
        session, _ = create_session(path, ep, provider_options=provider_options, session_options=options)
        run(session)
        return parse_profile(session.end_profiling())


def bundle_node_placement(bundle: Any, ep: str, golden: dict[str, np.ndarray]) -> dict[str, NodePlacement]:
    """Node placement of every sub-part of an ONNX bundle on ``ep``, each run once on its
    golden inputs (the decoder: its golden prefill).

    Args:
        bundle: an opened ``runtime.sources.opened.Bundle`` in ONNX format.
        ep: bundle EP name (``openvino``, ``cuda``…).
        golden: the bundle's ``reference/golden.npz`` arrays.

    Returns:
        sub-part -> :class:`NodePlacement`.
    """
    m = bundle.manifest
    c = m["constants"]
    provider_options = m["provider_options"] if ep == m["execution_provider"] else {}
    placements = {}
    for part, spec in m["subparts"].items():
        prefix = f"{part}/in/"
        feeds = {k[len(prefix):]: v for k, v in golden.items() if k.startswith(prefix)}
        if part == "audio_tokenizer_stream":  # one call of a new stream on its golden codes
            feeds = first_call_feeds(feeds["audio_codes"], spec["options"]["state_size"])

        def run(session, part=part, feeds=feeds):
            if part == "llm_decoder":
                decoder = OrtDecoder(session, max_length=c["max_position_embeddings"],
                                     kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"])
                decoder.forward(feeds["inputs_embeds"])
            else:
                OrtSubPart(session, part).run(feeds)

        placements[part] = profile_node_placement(
            bundle.file(spec["entry"]), ep, run, provider_options=provider_options,
            session_options=m["session_options"],
        )
    return placements
