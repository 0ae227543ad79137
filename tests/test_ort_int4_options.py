"""The ONNX Runtime int4 options measurement (``python -m bench.ab ort-int4``)
on the tiny preset: each option set is exported through the cpu target's decoder step with the
block size and accuracy level asked for (read back from the MatMulNBits nodes), timed on the CPU
provider and compared with the fp32 decoder.  No timing is asserted (the shared test machine
cannot give stable numbers)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from bench.ab import settings

pytestmark = pytest.mark.slow


def test_measures_each_option_set_against_fp32(tmp_path, capsys):
    scratch = set(Path(tempfile.gettempdir()).glob("higgs-pack-ort-int4-*"))
    out = tmp_path / "ort.json"
    asked = ["b32_l4", "b128_l1"]
    assert settings.main(["ort-int4", "--preset", "tiny", "--variants", ",".join(asked), "--contexts", "8", "12",
                     "--steps", "2", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["variant"], r["context"]) for r in report["results"]] == [
        (name, ctx) for ctx in (8, 12) for name in [*asked, "fp32"]]
    for row in report["results"]:
        assert row["step_ms_best"] > 0 and len(row["rounds_ms"]) == 2
        assert row["cpu"] == report["machine"]["model"] and isinstance(row["vnni"], bool) and row["isa"]
        assert 0.99 < row["cosine"] <= 1.0 + 1e-9 and math.isfinite(row["rel_l2"])
    rows = {(r["variant"], r["context"]): r for r in report["results"]}
    assert rows["fp32", 8]["rel_l2"] == 0.0 and rows["fp32", 8]["block_size"] is None
    # int4 is not the fp32 decoder: a variant that silently stayed float would read 0 here.
    assert rows["b32_l4", 8]["rel_l2"] > 1e-4 and rows["b128_l1", 12]["rel_l2"] > 1e-4
    # Each decoder was built as asked (the exporter reads these back from the MatMulNBits nodes).
    for name in asked:
        q = report["weights"][name]["quantization"]
        options = settings.ORT_INT4_VARIANTS[name]["extra_options"]
        assert (q["block_size"], q["accuracy_level"]) == (options["block_size"], options["accuracy_level"])
        assert q["quantized_ops"]["MatMulNBits"] > 0 and report["weights"][name]["weights_mb"] > 0
    assert report["weights"]["fp32"]["quantization"] == {}
    assert report["default"] == settings.default_int4_variant() == "b128_l4"  # targets/declarations.CPU_DECODER_INT4
    printed = capsys.readouterr().out
    assert report["machine"]["cpu"] in printed and all(n in printed for n in asked)
    assert set(Path(tempfile.gettempdir()).glob("higgs-pack-ort-int4-*")) <= scratch  # decoders removed


def test_unknown_variant_is_refused_before_any_export(capsys):
    with pytest.raises(SystemExit) as exc:
        settings.main(["ort-int4", "--preset", "tiny", "--variants", "b32_l4,b48_l4"])
    assert exc.value.code == 2
    assert "unknown variant(s) ['b48_l4']" in capsys.readouterr().err
