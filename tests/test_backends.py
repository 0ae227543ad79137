"""Runtime backends as objects: the registry, and a backend added as one new folder.

The toy backend below is written into a fresh folder by the test and imported from there,
as a plugin distribution would be: nothing else in the tree learns of it.  It must load,
verify and be chosen like the built-in backends.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest

from higgs_pack.errors import ManifestError
from higgs_pack.manifests.manifest import read_manifest
from higgs_pack.runtime.backends import get_backend, placement_of, registered, unregister

pytest.importorskip("onnxruntime")

#: A backend in one folder: ONNX files on onnxruntime's CPU provider through the ONNX
#: Runtime runners, its own rung above the CPU's, its own checks and placement.
TOY_BACKEND = '''
"""A toy runtime backend: a folder and its registration, nothing else."""

from higgs_pack.manifests.providers import ChoiceRung
from higgs_pack.runtime.backends import Backend, OpenedParts, register

TOY_RUNG = ChoiceRung("toy", 45, "toy backend on the CPU")


class ToyBackend(Backend):
    name = "toy"
    format = "onnx"
    placement = "device"
    label = "Toy"
    rungs = (TOY_RUNG,)

    def open(self, bundle, options):
        from higgs_pack.runtime.backends.onnxruntime.runners import OrtDecoder, OrtSubPart
        from higgs_pack.runtime.backends.onnxruntime.sessions import create_session
        from higgs_pack.runtime.loop.pipeline import ModelConstants, step_input_shapes

        self.refuse_foreign_options(bundle, options)
        if (options.device or bundle.manifest["device"]) != "CPU":
            raise ValueError("the toy backend runs on CPU only")
        m, opened = bundle.manifest, OpenedParts()
        constants = ModelConstants.from_dict(m["constants"])
        for part, spec in m["subparts"].items():
            session, _ = create_session(bundle.file(spec["entry"]), "cpu")
            if part == "llm_decoder":
                c = m["constants"]
                runner = OrtDecoder(session, max_length=c["max_position_embeddings"],
                                    kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"])
            else:
                runner = OrtSubPart(session, part, step_input_shapes(part, constants))
            opened.add(part, runner, "toy CPU")
        return opened

    def structure_checks(self):
        def toy_files(bundle, report):
            report.add("toy files", True, f"{len(bundle.manifest['subparts'])} sub-parts")
        return (toy_files,)

    def runtime_checks(self):
        def toy_runtime(bundle, pipeline, report):
            report.add("toy runtime", set(pipeline.description.values()) == {"toy CPU"}, "every sub-part on toy CPU")
        return (toy_runtime,)

    def placements(self, candidate, inventory, bench):
        from higgs_pack.runtime.machine.facts import Placement

        return [Placement(candidate, TOY_RUNG.name, "CPU", (), "toy CPU")], None


BACKEND = register(ToyBackend())
'''


@pytest.fixture
def toy_backend(tmp_path: Path):
    """The toy backend's folder written under ``tmp_path`` and imported from there (then removed)."""
    folder = tmp_path / "plugins" / "toy_backend"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(textwrap.dedent(TOY_BACKEND), encoding="utf-8")
    sys.path.insert(0, str(folder.parent))
    try:
        yield importlib.import_module("toy_backend").BACKEND
    finally:
        sys.path.remove(str(folder.parent))
        sys.modules.pop("toy_backend", None)
        unregister("toy")


def _rewrite(bundle: Path, **changes) -> None:
    """Change top-level manifest fields in place (the manifest is not among the hashed files)."""
    path = bundle / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def test_builtin_backends_are_registered_with_their_facts():
    backends = registered()
    assert {"onnxruntime", "openvino"} <= set(backends)
    assert backends["onnxruntime"].placement == "execution_provider"
    assert backends["openvino"].placement == "device"
    assert {b.format for b in backends.values()} >= {"onnx", "openvino"}
    assert placement_of({"backend": "openvino", "device": "NPU"}) == "NPU"
    with pytest.raises(ManifestError, match=r"unknown backend 'nope' \(known: onnxruntime, openvino"):
        get_backend("nope")


@pytest.mark.slow
def test_unknown_backend_and_foreign_format_are_refused_at_load(bundle_copy: Path):
    from higgs_pack.runtime.sources.bundle import open_bundle

    _rewrite(bundle_copy, backend="nope")
    with pytest.raises(ManifestError, match=r"unknown backend 'nope' \(known: onnxruntime, openvino.*rebuild"):
        open_bundle(bundle_copy)
    _rewrite(bundle_copy, backend="openvino", device="CPU")
    with pytest.raises(ManifestError, match=r"sub-part \w+ is in 'onnx' format, but its backend openvino reads 'openvino' files"):
        open_bundle(bundle_copy)


@pytest.mark.slow
def test_a_backend_in_one_new_folder_loads_verifies_and_is_chosen(toy_backend, bundle_copy: Path, cases_dir: Path):
    from higgs_pack.runtime.api import load
    from higgs_pack.runtime.machine.choice import CPU_RUNG, candidate_of, choose, preference
    from higgs_pack.runtime.machine.facts import Candidate, Inventory
    from higgs_pack.runtime.verification.verify import verify_bundle

    _rewrite(bundle_copy, backend="toy", device="CPU", execution_provider=None)
    manifest = read_manifest(bundle_copy)
    assert get_backend("toy") is toy_backend

    tts = load(bundle_copy)
    result = tts.synthesize("A toy backend speaks.", max_frames=8, seed=1)
    assert result.codes.shape[1] == 8 and result.samples.size > 0
    assert set(tts.pipeline.description.values()) == {"toy CPU"}

    report = verify_bundle(bundle_copy, cases_dir=cases_dir)
    lines = {check.name: check.ok for check in report.checks}
    assert lines["toy files"] is True and lines["toy runtime"] is True, report.render()
    assert report.ok, report.render()

    ladder = list(preference())
    assert ladder.index("toy") < ladder.index(CPU_RUNG.name)
    toy = candidate_of(manifest, bundle_copy)
    cpu = Candidate("higgs-audio-v3-tiny-cpu-int4", "/elsewhere", toy.model, "cpu", "int4", None, "onnxruntime", "cpu")
    choice = choose([cpu, toy], Inventory(ort_providers={"cpu": None}))
    assert choice.chosen.candidate.name == manifest["name"] and choice.chosen.rung == "toy", choice.render()
    assert choice.chosen.device == "CPU"
