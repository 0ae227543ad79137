"""The OpenVINO settings measurement (``python -m higgs_pack.targets.bench.ov_properties``) on the
tiny preset: it exports every weight variant through the openvino target's decoder step, runs
every setting and reports each with the CPU, its ISA and parity against the fp32 IR.  No timing
is asserted (the shared test machine cannot give stable numbers)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from higgs_pack.targets.bench import ov_properties as ovp

pytestmark = pytest.mark.slow


def test_measures_and_reports_every_setting(tmp_path, capsys):
    scratch = set(Path(tempfile.gettempdir()).glob("higgs-pack-ov-properties-*"))
    out = tmp_path / "ov.json"
    assert ovp.main(["--preset", "tiny", "--contexts", "8", "--steps", "2", "--repeats", "2",
                     "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [s.name for s in ovp.settings()]
    assert [r["setting"] for r in report["results"]] == names
    assert {"kv_f16", "kv_f32", "hint_throughput", "infer_bf16", "share_off", "int4_asym_g128", "fp32"} <= set(names)
    for row in report["results"]:
        assert row["step_ms_best"] > 0 and len(row["rounds_ms"]) == 2 and row["context"] == 8
        assert row["cpu"] == report["machine"]["model"] and isinstance(row["vnni"], bool) and row["isa"]
        assert 0.99 < row["cosine"] <= 1.0 + 1e-9 and math.isfinite(row["rel_l2"])
    rows = {r["setting"]: r for r in report["results"]}
    assert rows["fp32"]["rel_l2"] == 0.0 and rows["default"]["weights"] == "int4_sym_g64"
    assert rows["kv_f32"]["properties"]["KV_CACHE_PRECISION"] == "f32" and rows["share_off"]["share"] is False
    # Every weight variant was built as asked (NNCF's own record of what it did).
    weights = report["weights"]
    for name, options in ovp.WEIGHT_VARIANTS.items():
        q = weights[name]["quantization"]
        assert q["mode"] == ("int4_sym" if options["symmetric"] else "int4_asym")
        assert q["group_size"] == options["group_size"] and weights[name]["weights_mb"] > 0
    assert weights["fp32"]["quantization"] == {}
    printed = capsys.readouterr().out
    assert report["machine"]["cpu"] in printed and all(n in printed for n in names)
    assert set(Path(tempfile.gettempdir()).glob("higgs-pack-ov-properties-*")) <= scratch  # IRs removed
