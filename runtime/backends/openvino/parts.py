"""OpenVINO runtime backend: opens every sub-part of an OpenVINO IR bundle on its device
(:func:`open_openvino_parts`, what ``runtime.bundle.load`` calls).

Runtime code: imports numpy, openvino and higgs-pack's manifests and pipeline
only (no torch, no exporters). The pieces it composes:

* :mod:`higgs_pack.runtime.backends.openvino.devices`: device strings, the device check (a missing
  device is an error unless ``allow_fallback=True``; then the fallback to CPU is logged and
  written into the runner's ``description``) and the compile properties;
* :mod:`higgs_pack.runtime.backends.openvino.runners`: the sub-part and stateful-decoder runners;
  a decoder whose weights the CPU plugin packs is compiled without the model cache and
  gives its mapped weights back during that packing (:mod:`higgs_pack.runtime.mapped_pages`);
* :mod:`higgs_pack.runtime.backends.openvino.static_runners`: the runners of static (NPU) bundles;
  a sub-part may be pinned to another device for a given bundle device
  (``device_overrides``, see :func:`~higgs_pack.runtime.backends.openvino.devices.subpart_device`);
* :mod:`higgs_pack.runtime.backends.openvino.ir_checks`: what ``verify`` reads from the IRs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import openvino as ov

from higgs_pack.runtime.backends.openvino.devices import (
    check_device,
    cpu_packs_weights,
    device_base,
    precision_config,
    subpart_device,
)
from higgs_pack.runtime.backends.openvino.runners import (
    OvStatefulDecoder,
    OvSubPart,
    check_signature,
)
from higgs_pack.runtime.backends.openvino.static_runners import OvStaticKVDecoder, OvStaticSubPart
from higgs_pack.runtime.loop.pipeline import ModelConstants, step_input_shapes


def open_openvino_parts(bundle: Any, *, device: str | None = None, allow_fallback: bool = False,
                        cache_dir: str | os.PathLike | Literal[False] | None = None) -> dict[str, Any]:
    """Compile every sub-part of an OpenVINO IR bundle (used by ``runtime.bundle.load``).

    fp32 sub-parts are compiled with :func:`precision_config` so that an fp32 bundle
    really computes in fp32 (OpenVINO's CPU plugin otherwise picks bf16 on AMX
    CPUs and a u8 KV cache; its GPU plugin f16).

    Args:
        bundle: an opened ``runtime.bundle.Bundle``.
        device: OpenVINO device overriding the manifest's (``CPU``, ``GPU``, ``NPU``, ``AUTO``, ``HETERO:…``).
        allow_fallback: compile on CPU when the device is missing (logged, described).
        cache_dir: model cache; default ``<cache root>/openvino/<bundle name>-<checkpoint digest>``;
            ``False``: no model cache (what build-time verification uses).

    Returns:
        ``{sub-part name: runner, "description": {sub-part: device description}}``.

    Raises:
        ExecutionProviderUnavailable: unknown or missing device (and no fallback asked).
        SignatureMismatch: an IR's I/O differs from the manifest, or the decoder is stateless.
    """
    from higgs_pack.runtime.paths import cache_root

    m = bundle.manifest
    core = ov.Core()
    wanted = device or m["device"] or "CPU"
    chosen, _ = check_device(core, wanted, allow_fallback=allow_fallback)
    if cache_dir is None:
        cache_dir = cache_root() / "openvino" / f"{m['name']}-{m['model']['checkpoint_sha256'][:12]}"
    if cache_dir is False:
        cache_dir = None
    else:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    parts: dict[str, Any] = {"description": {}}
    constants = ModelConstants.from_dict(m["constants"])
    for part, spec in m["subparts"].items():
        xml = bundle.file(spec["entry"])
        options = spec["options"]
        part_device = subpart_device(chosen, options)
        extra = dict(m["provider_options"].get(device_base(part_device), {}))
        recorded = dict((options.get("compile_properties") or {}).get(device_base(part_device), {}))
        stateful = bool(options.get("stateful", part == "llm_decoder"))
        config = {**precision_config(part_device, spec["precision"], stateful=stateful), **recorded, **extra}
        static = bool(options.get("static"))
        if part == "llm_decoder" and static:
            runner: Any = OvStaticKVDecoder(core, xml, part_device, cache_dir, config,
                                            max_prompt_length=m["generation"].get("max_prompt_length"),
                                            allow_fallback=allow_fallback)
        elif part == "llm_decoder":
            limit = m["generation"].get("max_prompt_length") or m["constants"]["max_position_embeddings"]
            packs = cpu_packs_weights(part_device, spec["precision"])
            runner = OvStatefulDecoder(core, xml, part_device, None if packs else cache_dir, config,
                                       max_length=limit, allow_fallback=allow_fallback, page_out_weights=packs)
        elif static and options.get("chunking"):
            runner = OvStaticSubPart(core, xml, part_device, cache_dir, config, chunking=options["chunking"],
                                     subpart=part, allow_fallback=allow_fallback)
        else:
            runner = OvSubPart(core, xml, part_device, cache_dir, config, allow_fallback=allow_fallback,
                               step_inputs=step_input_shapes(part, constants))
        check_signature(runner, part, spec)
        parts[part] = runner
        pinned = f" (pinned by the manifest instead of {chosen})" if part_device != chosen else ""
        parts["description"][part] = f"OpenVINO {runner.description}{pinned}"
    return parts
