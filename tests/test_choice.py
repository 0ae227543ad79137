"""Hardware-aware choice: the pure function on synthetic inventories, then the real machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from higgs_pack.errors import BundleError
from higgs_pack.runtime.machine.choice import candidate_of, choose, require
from higgs_pack.runtime.machine.facts import Candidate, Inventory

SLUG = "higgs-audio-v3-tiny"


def bundle(target: str, precision: str, variant: str | None = None, name: str | None = None) -> Candidate:
    backend = "openvino" if target == "openvino" else "onnxruntime"
    built_for = ("NPU" if variant == "npu" else "CPU") if backend == "openvino" else target
    suffix = f"-{variant}" if variant else ""
    return Candidate(name or f"{SLUG}-{target}-{precision}{suffix}", f"/bundles/{target}-{precision}{suffix}", SLUG,
                     target, precision, variant, backend, built_for)


ALL = [bundle("cpu", "int4"), bundle("cpu", "fp32"), bundle("cuda", "fp16"), bundle("dml", "fp16"),
       bundle("openvino", "int4"), bundle("openvino", "int4", "npu")]
CPU_ONLY = Inventory(ort_providers={"cpu": None}, ort_distributions=("onnxruntime",), openvino="2026.4.1",
                     openvino_devices={"CPU": "Intel(R) Core(TM) Ultra 7 155H"}, cpu="Intel(R) Core(TM) Ultra 7 155H",
                     cpu_vendor="intel")


def with_(inv: Inventory, **changes) -> Inventory:
    from dataclasses import replace

    return replace(inv, **changes)


def test_preference_order_walks_down_as_devices_disappear():
    full = with_(CPU_ONLY, ort_providers={"cpu": None, "cuda": None},
                 openvino_devices={"CPU": "Intel CPU", "GPU.0": "Intel(R) Arc(TM) Graphics (iGPU)",
                                   "NPU": "Intel(R) AI Boost"},
                 hardware={"nvidia-gpu": ["0000:01:00.0 (driver nvidia)"]})
    picks = []
    inv = full
    for drop in ("NPU", "cuda", "GPU.0", None):
        choice = choose(ALL, inv, model=SLUG)
        picks.append((choice.chosen.candidate.name, choice.chosen.device))
        if drop == "cuda":
            inv = with_(inv, ort_providers={"cpu": None}, hardware={})
        elif drop:
            inv = with_(inv, openvino_devices={k: v for k, v in inv.openvino_devices.items() if k != drop})
    assert picks == [(f"{SLUG}-openvino-int4-npu", "NPU"), (f"{SLUG}-cuda-fp16", "cuda"),
                     (f"{SLUG}-openvino-int4", "GPU.0"), (f"{SLUG}-openvino-int4", "CPU")]
    windows = with_(CPU_ONLY, platform="win32", ort_providers={"cpu": None, "dml": None})
    assert choose(ALL, windows).chosen.candidate.target == "dml"


def test_device_present_but_no_variant_is_reported():
    inv = with_(CPU_ONLY, openvino_devices={"CPU": "Intel CPU", "NPU": "Intel(R) AI Boost"})
    choice = choose([bundle("cpu", "int4"), bundle("openvino", "int8")], inv, model=SLUG)
    assert choice.chosen.candidate.name == f"{SLUG}-cpu-int4" and choice.chosen.device == "cpu"  # int4 beats int8
    assert any("NPU is present (Intel(R) AI Boost)" in n and "--npu" in n for n in choice.notes)
    assert "note: an NPU is present" in choice.render()


def test_variant_present_but_its_runtime_missing():
    inv = with_(CPU_ONLY, hardware={"nvidia-gpu": ["0000:01:00.0 (driver nvidia)"]}, openvino=None,
                openvino_devices={})
    choice = choose([bundle("cuda", "fp16"), bundle("cpu", "int4"), bundle("openvino", "int4")], inv)
    assert choice.chosen.candidate.name == f"{SLUG}-cpu-int4"
    assert "CUDAExecutionProvider unavailable" in choice.rejected[f"{SLUG}-cuda-fp16"]
    assert "install the [cuda] extra" in choice.rejected[f"{SLUG}-cuda-fp16"]
    assert "OpenVINO is not installed" in choice.rejected[f"{SLUG}-openvino-int4"]
    assert any("NVIDIA GPU is present" in n and "cannot run" in n for n in choice.notes)


def test_two_variants_tying_are_broken_by_name_and_said():
    a, b = bundle("cpu", "int4", name="b-cpu-int4"), bundle("cpu", "int4", name="a-cpu-int4")
    choice = choose([a, b], CPU_ONLY)
    assert choice.chosen.candidate.name == "a-cpu-int4"
    assert "tied with b-cpu-int4 (/bundles/cpu-int4), first by name" in choice.reason  # where each one is
    assert choice.rejected["b-cpu-int4"] == "tied, later by name"


def test_npu_present_but_driver_missing():
    inv = with_(CPU_ONLY, hardware={"intel-npu": ["0000:00:0b.0 (driver no driver)"]}, npu_driver=False)
    choice = choose([bundle("openvino", "int4", "npu"), bundle("cpu", "fp32")], inv, model=SLUG)
    # The NPU variant still runs on the CPU, but below a real CPU bundle; the missing driver is said.
    assert choice.chosen.candidate.name == f"{SLUG}-cpu-fp32"
    assert any("Intel NPU is present" in n and "driver is not loaded" in n for n in choice.notes)
    only_npu = choose([bundle("openvino", "int4", "npu")], inv)
    assert only_npu.chosen.device == "CPU" and "preference 6 of 6" in only_npu.reason


def test_cpu_speed_class_uses_measurements_then_precision_then_vendor():
    pool = [bundle("cpu", "int4"), bundle("openvino", "int4"), bundle("openvino", "fp32")]
    intel = choose(pool, CPU_ONLY)
    assert intel.chosen.candidate.target == "openvino"
    amd = with_(CPU_ONLY, cpu="AMD EPYC", cpu_vendor="amd")
    assert choose(pool, amd).chosen.candidate.target == "cpu"
    measured = choose(pool, amd, bench={"openvino-int4": 120.0, "cpu-int4": 80.0})
    assert measured.chosen.candidate.target == "openvino" and "measured 120 frames/s" in measured.reason


def test_bench_speeds_read_this_machines_cpu_records(tmp_path):
    from higgs_pack.runtime.machine.inventory import bench_speeds

    def rec(system, precision, fps, cpu, preset="bench", **extra):
        return {"system": system, "precision": precision, "frames_per_s": fps, "device": "cpu" if system == "cpu"
                else "CPU", "preset": preset, "machine": {"cpu": cpu}, **extra}

    path = tmp_path / "bench.json"
    path.write_text(json.dumps([
        rec("cpu", "int4", 80.0, "AMD EPYC"), rec("openvino", "int4", 120.0, "AMD EPYC"),
        rec("openvino", "int4", 999.0, "Intel Xeon"),                    # another machine
        rec("cpu", "int4", 5.0, "AMD EPYC", preset="tiny"),              # a smaller preset
        rec("openvino", "int4", 7.0, "AMD EPYC", variant="npu"),         # a variant
        rec("pytorch", "fp32", 10.0, "AMD EPYC"),
    ]))
    assert bench_speeds(path, cpu="AMD EPYC") == {"cpu-int4": 80.0, "openvino-int4": 120.0}
    assert bench_speeds(path, cpu="Intel Xeon") == {"openvino-int4": 999.0}
    assert bench_speeds(tmp_path / "missing.json") == {}


def test_nothing_runs_raises_with_every_reason():
    inv = Inventory()  # no runtime at all
    choice = choose([bundle("cpu", "int4"), bundle("openvino", "int4")], inv, model=SLUG)
    assert choice.chosen is None and "none of the 2 visible bundles" in choice.reason
    with pytest.raises(BundleError, match=r"onnxruntime is not installed.*OpenVINO is not installed"):
        require(choice, SLUG)
    with pytest.raises(BundleError, match="no bundles of other-model visible"):
        require(choose([bundle("cpu", "int4")], inv, model="other-model"), "other-model")


@pytest.mark.slow
def test_real_inventory_and_devices_command(cpu_int4_bundle, tmp_path):
    from higgs_pack.runtime.machine.inventory import inventory

    inv = inventory()
    assert inv.ort_providers.get("cpu") is None and "cpu" in inv.ort_providers  # a real session was created
    if inv.openvino is not None:
        assert inv.openvino_devices.get("CPU")
    out = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "devices", "--bundles",
                          str(cpu_int4_bundle.parent), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["inventory"]["ort_providers"]["cpu"] is None
    verdict = data["bundles"][cpu_int4_bundle.name]
    assert verdict["runs"] and verdict["placements"] == ["cpu"]
    assert data["choices"][SLUG]["chosen"] == cpu_int4_bundle.name
    text = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "devices", "--bundles",
                           str(cpu_int4_bundle.parent)], capture_output=True, text=True, timeout=300).stdout
    assert "CPUExecutionProvider        creates sessions" in text and f"Model {SLUG}: chose" in text


@pytest.mark.slow
def test_synthesize_by_model_slug_picks_among_installed_wheels(cpu_int4_bundle, cpu_fp32_bundle, tmp_path):
    import os

    from higgs_pack.targets.packaging import package_bundle

    wheels = [package_bundle(b, formats="wheel", out_dir=tmp_path / "dist")[0] for b in (cpu_fp32_bundle,
                                                                                          cpu_int4_bundle)]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    *map(str, wheels)], check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_CACHE": str(tmp_path / "hf")}
    env.pop("HIGGS_PACK_BUNDLES", None)
    out = subprocess.run([sys.executable, "-m", "higgs_pack.runtime.cli", "synthesize", SLUG, "-t", "Hello.",
                          "-o", str(tmp_path / "x.wav"), "--max-frames", "6", "--no-progress"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert f"chose {SLUG}-cpu-int4 on CPUExecutionProvider, int4 speed class: preference 5 of 6" in out.stderr
    assert f"not chosen: {SLUG}-cpu-fp32: ranked lower" in out.stderr
    assert (tmp_path / "x.wav").is_file()
    # The Python API makes the same choice and keeps it in tts.info.
    code = (f"import higgs_pack; t = higgs_pack.load({SLUG!r}); "
            "print(t.info.bundle, t.info.device, sorted(t.info.not_chosen))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"{SLUG}-cpu-int4", "CPUExecutionProvider", f"['{SLUG}-cpu-fp32']"]


def test_a_damaged_bundle_is_not_chosen(cpu_int4_bundle, tmp_path):
    """A bundle folder with a file missing is reported as damaged and the healthy one is chosen."""
    import shutil

    from higgs_pack.manifests.manifest import read_manifest
    from higgs_pack.runtime.machine.choice import Inventory as Inv

    broken = shutil.copytree(cpu_int4_bundle, tmp_path / "a-broken")
    (broken / "audio_heads.onnx").unlink()
    good = candidate_of(read_manifest(cpu_int4_bundle), cpu_int4_bundle)
    bad = candidate_of(read_manifest(broken), broken)
    assert good.damaged is None and bad.damaged == "audio_heads.onnx is missing"
    inv = Inv(ort_providers={"cpu": None})
    choice = choose([bad, good], inv, model=SLUG)
    assert choice.chosen.candidate.source == str(cpu_int4_bundle)
    assert "damaged bundle" in choice.rejected[bad.name] or "damaged bundle" in " ".join(choice.rejected.values())
