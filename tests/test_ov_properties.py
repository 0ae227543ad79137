"""The OpenVINO settings measurement (``python -m bench.ab ov-properties``) on the
tiny preset: it exports every weight variant through the openvino target's decoder step, runs
every setting and reports each with the CPU, its ISA and parity against the fp32 IR.  No timing
is asserted (the shared test machine cannot give stable numbers)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from bench.ab import settings

pytestmark = pytest.mark.slow


def test_measures_and_reports_every_setting(tmp_path, capsys):
    scratch = set(Path(tempfile.gettempdir()).glob("higgs-pack-ov-properties-*"))
    out = tmp_path / "ov.json"
    assert settings.main(["ov-properties", "--preset", "tiny", "--contexts", "8", "--steps", "2", "--repeats", "2",
                     "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [s.name for s in settings.ov_settings()]
    assert [r["setting"] for r in report["results"]] == names
    assert {"kv_u4", "kv_key_u8_value_u4", "kv_f16", "kv_f32", "hint_throughput", "infer_bf16", "share_off", "int4_asym_g128", "fp32"} <= set(names)
    for row in report["results"]:
        assert row["step_ms_best"] > 0 and len(row["rounds_ms"]) == 2 and row["context"] == 8
        assert row["cpu"] == report["machine"]["model"] and isinstance(row["vnni"], bool) and row["isa"]
        assert 0.99 < row["cosine"] <= 1.0 + 1e-9 and math.isfinite(row["rel_l2"])
    rows = {r["setting"]: r for r in report["results"]}
    assert rows["fp32"]["rel_l2"] == 0.0 and rows["default"]["weights"] == "int4_sym_g64"
    assert rows["kv_f32"]["properties"]["KV_CACHE_PRECISION"] == "f32" and rows["share_off"]["share"] is False
    # KV settings are also judged against the same IR with an f32 cache, and what the plugin
    # compiled is read back (it may not honour a precision).
    assert rows["kv_f32"]["rel_l2_vs_kv_f32"] == 0.0 and rows["kv_f32"]["compiled"]["KV_CACHE_PRECISION"] == "f32"
    for name in ("default", "kv_u4", "kv_key_u8_value_u4", "kv_f16"):
        assert 0.99 < rows[name]["cosine_vs_kv_f32"] <= 1.0 + 1e-9, name
    assert rows["kv_key_u8_value_u4"]["properties"]["VALUE_CACHE_PRECISION"] == "u4"
    assert {"KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION"} <= set(rows["default"]["compiled"])
    # Every weight variant was built as asked (NNCF's own record of what it did).
    weights = report["weights"]
    for name, options in settings.OV_WEIGHT_VARIANTS.items():
        q = weights[name]["quantization"]
        assert q["mode"] == ("int4_sym" if options["symmetric"] else "int4_asym")
        assert q["group_size"] == options["group_size"] and weights[name]["weights_mb"] > 0
    assert weights["fp32"]["quantization"] == {}
    printed = capsys.readouterr().out
    assert report["machine"]["cpu"] in printed and all(n in printed for n in names)
    assert set(Path(tempfile.gettempdir()).glob("higgs-pack-ov-properties-*")) <= scratch  # IRs removed


def test_settings_filter_keeps_the_references_and_refuses_unknown_names(tmp_path, capsys):
    out = tmp_path / "ov.json"
    assert settings.main(["ov-properties", "--preset", "tiny", "--contexts", "8", "--steps", "1", "--repeats", "1",
                     "--settings", "kv_u4", "--out", str(out)]) == 0
    assert [r["setting"] for r in json.loads(out.read_text())["results"]] == ["default", "kv_u4", "kv_f32", "fp32"]
    with pytest.raises(SystemExit):
        settings.main(["ov-properties", "--preset", "tiny", "--settings", "kv_u3"])
    assert "unknown settings ['kv_u3']" in capsys.readouterr().err
