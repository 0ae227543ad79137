"""OpenVINO runtime backend: opens every sub-part of an OpenVINO IR bundle on its device
(:func:`open_openvino_parts`, what the backend object in ``__init__.py`` calls).

Runtime code: imports numpy, openvino and higgs-pack's manifests and pipeline
only (no torch, no exporters). The pieces it composes:

* :mod:`higgs_pack.runtime.backends.openvino.devices`: device strings, the device check (a missing
  device is an error unless ``allow_fallback=True``; then the fallback to CPU is logged and
  written into the runner's ``description``) and the compile properties;
* :mod:`higgs_pack.runtime.backends.openvino.runners`: the sub-part and stateful-decoder runners;
  a decoder whose weights the CPU plugin packs is compiled without the model cache and
  gives its mapped weights back during that packing (:mod:`higgs_pack.runtime.machine.mapped_pages`);
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

from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.backends import OpenedParts
from higgs_pack.runtime.backends.openvino.devices import (
    check_device,
    cpu_packs_weights,
    device_base,
    precision_config,
    subpart_device,
    thread_config,
)
from higgs_pack.runtime.backends.openvino.runners import (
    OvStatefulDecoder,
    OvSubPart,
    check_signature,
)
from higgs_pack.runtime.backends.openvino.static_runners import OvStaticKVDecoder, OvStaticSubPart
from higgs_pack.runtime.loop.pipeline import ModelConstants, step_input_shapes


def open_openvino_parts(bundle: Any, *, device: str | None = None, allow_fallback: bool = False,
                        cache_dir: str | os.PathLike | Literal[False] | None = None) -> OpenedParts:
    """Compile every sub-part of an OpenVINO IR bundle (what the OpenVINO backend's ``open`` does).

    fp32 sub-parts are compiled with :func:`precision_config` so that an fp32 bundle
    really computes in fp32 (OpenVINO's CPU plugin otherwise picks bf16 on AMX
    CPUs and a u8 KV cache; its GPU plugin f16).

    Args:
        bundle: an opened ``runtime.sources.opened.Bundle``.
        device: OpenVINO device overriding the manifest's (``CPU``, ``GPU``, ``NPU``, ``AUTO``, ``HETERO:…``).
        allow_fallback: compile on CPU when the device is missing (logged, described).
        cache_dir: model cache; default ``<cache root>/openvino/<bundle name>-<checkpoint digest>``;
            ``False``: no model cache (what build-time verification uses).

    Returns:
        one runner per sub-part and the device each runs on (``OpenVINO CPU (f32)``).

    Raises:
        ExecutionProviderUnavailable: unknown or missing device (and no fallback asked).
        SignatureMismatch: an IR's I/O differs from the manifest, or the decoder is stateless.
    """
    m = bundle.manifest
    core = ov.Core()
    chosen, _ = check_device(core, device or m["device"] or "CPU", allow_fallback=allow_fallback)
    cache = _model_cache(m, cache_dir)
    opened = OpenedParts()
    constants = ModelConstants.from_dict(m["constants"])
    for part, spec in m["subparts"].items():
        options = spec["options"]
        part_device = subpart_device(chosen, options)
        extra = dict(m["provider_options"].get(device_base(part_device), {}))
        recorded = dict((options.get("compile_properties") or {}).get(device_base(part_device), {}))
        stateful = bool(options.get("stateful", part == SubPart.LLM_DECODER))
        config = {**thread_config(part_device), **precision_config(part_device, spec["precision"], stateful=stateful),
                  **recorded, **extra}
        runner = _runner(core, bundle, part, spec, part_device, cache, config, constants,
                         allow_fallback=allow_fallback)
        check_signature(runner, part, spec)
        pinned = f" (pinned by the manifest instead of {chosen})" if part_device != chosen else ""
        opened.add(part, runner, f"OpenVINO {runner.description}{pinned}")
    return opened


def _model_cache(manifest: dict, cache_dir: str | os.PathLike | Literal[False] | None) -> Path | None:
    """The model cache folder (created), or None for no cache (``cache_dir=False``)."""
    from higgs_pack.runtime.sources.paths import cache_root

    if cache_dir is False:
        return None
    if cache_dir is None:
        cache_dir = cache_root() / "openvino" / f"{manifest['name']}-{manifest['model']['checkpoint_sha256'][:12]}"
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    return Path(cache_dir)


def _runner(core: ov.Core, bundle: Any, part: str, spec: dict, device: str, cache: Path | None,
            config: dict, constants: ModelConstants, *, allow_fallback: bool) -> Any:
    """The runner one sub-part needs: the decoder (stateful, or static with its own KV window)
    or a sub-part (dynamic, or static in chunks), compiled on ``device``."""
    xml = bundle.file(spec["entry"])
    options = spec["options"]
    static = bool(options.get("static"))
    generation = bundle.manifest["generation"]
    if part == SubPart.LLM_DECODER:
        if static:
            return OvStaticKVDecoder(core, xml, device, cache, config, allow_fallback=allow_fallback,
                                     max_prompt_length=generation.get("max_prompt_length"))
        limit = generation.get("max_prompt_length") or constants.max_position_embeddings
        packs = cpu_packs_weights(device, spec["precision"])
        # a decoder whose weights the CPU plugin packs is compiled without the model cache
        return OvStatefulDecoder(core, xml, device, None if packs else cache, config, max_length=limit,
                                 allow_fallback=allow_fallback, page_out_weights=packs)
    if static and options.get("chunking"):
        return OvStaticSubPart(core, xml, device, cache, config, chunking=options["chunking"],
                               subpart=part, allow_fallback=allow_fallback)
    return OvSubPart(core, xml, device, cache, config, allow_fallback=allow_fallback,
                     step_inputs=step_input_shapes(part, constants))
