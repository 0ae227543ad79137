"""llama.cpp as a bench peer (issue 19): system names, the step-timing protocol, round merging,
ratios and rendering (no llama.cpp needed), and, with the [llamacpp] extra, the tiny checkpoint
converted, quantized, loaded with its dims, compared with the fp32 oracle and timed."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import slow_fixture

from bench.common import systems
from bench.decoder import llama_cpp, report, run
from bench.decoder import records as bench_records
from bench.decoder import steps as decoder_steps
from higgs_pack.errors import BuildError, InputError

needs_llama = pytest.mark.skipif(llama_cpp.llama_cpp_missing() is not None,
                                 reason=llama_cpp.NOT_INSTALLED)


def test_llama_system_names():
    spec = systems.parse_system("llama.cpp-Q4_K_M")
    assert (spec.label, spec.target, spec.precision, spec.is_llama_cpp) == ("llama.cpp-q4_k_m", "llama.cpp", "q4_k_m", True)
    assert systems.parse_system("llama.cpp-q4_0").label == "llama.cpp-q4_0"
    assert not systems.parse_system("cpu-int4").is_llama_cpp
    with pytest.raises(InputError, match="known: q4_0, q4_k_m"):
        systems.parse_system("llama.cpp-q8_0")


def test_step_batch_flag_is_checked(capsys):
    with pytest.raises(SystemExit):
        run.main(["--step-batch", "1,x", "--systems", ""])
    assert "--step-batch" in capsys.readouterr().err


class _Rows:
    """A decoder stand-in that records what the protocol asks of it."""

    def __init__(self):
        self.lengths: dict[int, int] = {}
        self.calls: list[tuple[str, tuple]] = []

    def prefill(self, row, length):
        self.lengths[row] = length
        self.calls.append(("prefill", (row, length)))

    def step(self, rows, out):
        for r in rows:
            self.lengths[r] += 1
        self.calls.append(("step", (len(rows), out)))


def test_time_steps_protocol():
    d = _Rows()
    rows = decoder_steps.time_steps(prefill=d.prefill, step=d.step, batches=[4, 1], contexts=[5, 9], steps=3,
                                    no_output=True)
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 5), (4, 5), (1, 9), (4, 9)]
    assert all(r["step_ms"] >= 0 and r["step_ms_no_output"] >= 0 for r in rows)
    # every context prefills all 4 rows, each (B, pass) is 1 untimed + 3 timed steps
    assert [c for c in d.calls if c[0] == "prefill"] == [("prefill", (r, n)) for n in (5, 9) for r in range(4)]
    steps = [c[1] for c in d.calls if c[0] == "step"]
    assert steps.count((1, True)) == steps.count((1, False)) == 8 and steps.count((4, True)) == 8
    # row 0 ends at the most positions positions_needed allows for
    assert d.lengths[0] <= decoder_steps.positions_needed([5, 9], [1, 4], 3, 2)
    assert d.lengths[0] == 9 + 2 * 2 * 4


@pytest.mark.parametrize("kwargs", [{"batches": []}, {"contexts": [0]}, {"steps": 0}, {"batches": [0, 1]}])
def test_time_steps_rejects_bad_sizes(kwargs):
    d = _Rows()
    args = {"batches": [1], "contexts": [4], "steps": 2, **kwargs}
    with pytest.raises(InputError, match="positive"):
        decoder_steps.time_steps(prefill=d.prefill, step=d.step, **args)


def test_merge_rounds_keeps_the_fastest():
    a = {"rows": [{"batch": 1, "context": 64, "step_ms": 3.0, "step_ms_no_output": 2.0},
                  {"batch": 4, "context": 64, "refused": "no"}]}
    b = {"rows": [{"batch": 1, "context": 64, "step_ms": 2.5, "step_ms_no_output": 2.2},
                  {"batch": 4, "context": 64, "refused": "no"}]}
    rows = decoder_steps.merge_rounds([a, b])
    assert rows[0] == {"batch": 1, "context": 64, "step_ms": 2.5, "step_ms_rounds": [3.0, 2.5],
                       "step_ms_no_output": 2.0, "step_ms_no_output_rounds": [2.0, 2.2]}
    assert rows[1]["refused"] == "no"
    with pytest.raises(ValueError, match="different"):
        decoder_steps.merge_rounds([a, {"rows": a["rows"][:1]}])


def _records():
    ours = {"kind": "decoder_step", "label": "cpu-int4", "preset": "tiny", "backend": "onnxruntime",
            "decoder_weight_mb": 1.0, "kv_itemsize": 4, "loadavg": [1.0, 1.2],
            "rows": [{"batch": 1, "context": 64, "step_ms": 2.0}, {"batch": 4, "context": 64, "step_ms": 4.0}]}
    ov = {"kind": "decoder_step", "label": "openvino-int4", "preset": "tiny", "backend": "openvino", "loadavg": [],
          "rows": [{"batch": 1, "context": 64, "step_ms": 1.0}, {"batch": 4, "context": 64, "refused": "one row"}]}
    ll = {"kind": "decoder_step", "label": "llama.cpp-q4_0", "preset": "tiny", "backend": "llama.cpp",
          "llama_cpp_python": "0.3.36", "llama_cpp_commit": "abc", "threads": 2, "decoder_bytes": 1e6,
          "head_tensor": "token_embd.weight", "head_type": "Q6_K", "head_bytes": 8e6, "gguf_bytes": 1e7,
          "loadavg": [1.1], "rows": [{"batch": 1, "context": 64, "step_ms": 3.0, "step_ms_no_output": 1.0},
                                     {"batch": 4, "context": 64, "step_ms": 6.0, "step_ms_no_output": 5.0}]}
    failed = {"kind": "decoder_step", "label": "llama.cpp-q4_k_m", "preset": "tiny", "backend": "llama.cpp",
              "error": llama_cpp.NOT_INSTALLED}
    return [ours, ov, ll, failed]


def test_ratios_table_and_html():
    records = _records()
    decoder_steps.add_step_ratios(records)
    ll = records[2]
    assert ll["rows"][0]["over"] == {"cpu-int4": 1.5, "openvino-int4": 3.0}
    assert ll["rows"][0]["over_no_output"] == {"cpu-int4": 0.5, "openvino-int4": 1.0}
    assert ll["rows"][1]["over"] == {"cpu-int4": 1.5}  # openvino refused batch 4
    headers, rows = report.step_table_rows(records)
    assert headers[:4] == ["B", "ctx", "cpu-int4 ms", "openvino-int4 ms"]
    assert rows[1][:4] == ["4", "64", "4.00", "refused"] and rows[0][-2:] == ["1.50x", "3.00x"]
    text = report.render_steps(records)
    assert "llama.cpp-q4_k_m [tiny]: ERROR llama-cpp-python is not installed" in text
    assert "Q6_K 8.0 MB" in text
    html = report.steps_section(records)
    assert "<h2>Decoder step beside llama.cpp</h2>" in html and "refused" in html
    assert report.render_steps([]) == "" and report.steps_section([]) == ""


def test_records_go_to_json_and_html(tmp_path):
    pytest.importorskip("matplotlib")
    records = _records()
    decoder_steps.add_step_ratios(records)
    out = tmp_path / "bench.json"
    bench_records.write_records(records, out)
    written = json.loads(out.read_text())
    assert [r["label"] for r in written if r.get("kind") == "decoder_step"] == [r["label"] for r in records]
    assert "Decoder step beside llama.cpp" in report.write_html(out).read_text()


def test_converter_unpack_rejects_an_sdist_without_converter(tmp_path):
    sdist = tmp_path / "llama_cpp_python-0.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        data = b"# changelog\n"
        info = tarfile.TarInfo("llama_cpp_python-0.0.0/CHANGELOG.md")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BuildError, match=re.escape("no vendor/llama.cpp/convert_hf_to_gguf.py")):
        llama_cpp.unpack_converter(sdist, tmp_path / "src")


def test_llama_cpp_commit(tmp_path):
    (tmp_path / "CHANGELOG.md").write_text("## [0.3.36]\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e570\n"
                                           "- feat: update llama.cpp to ggml-org/llama.cpp@1111111\n")
    assert llama_cpp.llama_cpp_commit(tmp_path) == "0c1e570"
    assert llama_cpp.llama_cpp_commit(tmp_path / "missing") is None


def test_gguf_facts_split_decoder_and_head(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), np.float16))
    w.add_tensor("output_norm.weight", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    facts = llama_cpp.gguf_facts(path)
    assert facts["decoder_bytes"] == 8 * 8 * 2 + 8 * 4
    assert (facts["head_tensor"], facts["head_bytes"], facts["embed_bytes"]) == ("token_embd.weight", 320, 0)
    assert facts["weight_bytes"] == 320 + 128 + 32 and facts["tensor_types"] == {"F32": 2, "F16": 1}


@slow_fixture(scope="module")
def tiny_ggufs(tiny_checkpoint, tmp_path_factory):
    if llama_cpp.llama_cpp_missing():
        pytest.skip(llama_cpp.NOT_INSTALLED)
    import os

    cache = Path(os.environ.get("HIGGS_PACK_CACHE") or tmp_path_factory.mktemp("cache"))
    out = tmp_path_factory.mktemp("llama")
    return llama_cpp.ensure_ggufs(tiny_checkpoint, out, ["q4_0", "q4_k_m"], keep_float=True, converter_cache=cache)


@needs_llama
@pytest.mark.slow
def test_tiny_converts_and_loads_with_its_dims(tiny_ggufs):
    from higgs_pack.exporters.checkpoint.tiny import PRESETS

    p = PRESETS["tiny"]
    assert tiny_ggufs["float"]["convert_peak_rss_mb"] > 0 and tiny_ggufs["version"] == llama_cpp.llama_cpp_version()
    for quant in ("q4_0", "q4_k_m"):
        q = tiny_ggufs["quants"][quant]
        assert Path(q["path"]).is_file() and q["decoder_bytes"] > 0 and q["head_bytes"] > 0
        dec = llama_cpp.LlamaDecoder(Path(q["path"]), max_batch=1, max_length=16, threads=2)
        try:
            assert dec.dims() == {"hidden": p.hidden_size, "layers": p.num_layers, "heads": p.num_attention_heads,
                                  "kv_heads": p.num_key_value_heads, "head_dim": p.head_dim, "vocab": p.vocab_size}
        finally:
            dec.close()


def _oracle_logits(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    """float32 [vocab] logits of the last token from the fp32 oracle (TorchDecoder, tied head)."""
    import torch

    from higgs_pack.exporters.checkpoint.layout import TEXT_EMBEDDING
    from higgs_pack.exporters.checkpoint.models import qwen3_model
    from higgs_pack.exporters.checkpoint.reader import open_checkpoint
    from higgs_pack.exporters.pytorch.reference import TorchDecoder

    with open_checkpoint(checkpoint) as ckpt:
        table = ckpt.tensor(TEXT_EMBEDDING).float()
        decoder = TorchDecoder(qwen3_model(ckpt))
    hidden = decoder.forward(table[tokens][None].numpy())
    return (torch.from_numpy(hidden[0, -1]) @ table.T).numpy()


@needs_llama
@pytest.mark.slow
def test_tiny_logits_match_the_fp32_oracle(tiny_ggufs, tiny_checkpoint):
    tokens = [151644, 872, 198, 9707, 11, 1879, 0, 42, 77]
    want = _oracle_logits(tiny_checkpoint, tokens)
    cos = {}
    for name, path in [("float", tiny_ggufs["float"]["path"])] + [(q, v["path"]) for q, v in tiny_ggufs["quants"].items()]:
        dec = llama_cpp.LlamaDecoder(Path(path), max_batch=1, max_length=32, threads=2)
        try:
            dec.prefill(0, tokens)
            got = dec.logits(-1)
        finally:
            dec.close()
        assert np.isfinite(got).all(), name
        cos[name] = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
        if name == "float":  # the converter's float GGUF: the same greedy token as the oracle
            assert int(got.argmax()) == int(want.argmax())
    assert cos["float"] > 0.999, cos
    assert min(cos["q4_0"], cos["q4_k_m"]) > 0.9, cos


@needs_llama
@pytest.mark.slow
def test_tiny_steps_time_at_batch_1_and_4(tiny_ggufs):
    for quant, q in tiny_ggufs["quants"].items():
        got = decoder_steps.measure_llama_steps({"gguf": q["path"], "batches": [1, 4], "contexts": [8, 40], "steps": 2,
                                             "threads": 2})
        assert [(r["batch"], r["context"]) for r in got["rows"]] == [(1, 8), (4, 8), (1, 40), (4, 40)], quant
        assert all(r["step_ms"] > 0 and r["step_ms_no_output"] > 0 for r in got["rows"])
        assert "CPU" in got["system_info"] and got["threads"] == 2
        # llama.cpp's own prompt processing at the bench's lengths (the default 64, 256, 1024)
        assert set(got["prefill_positions_per_s"]) == {"64", "256", "1024"}, quant
        assert all(v > 0 for v in got["prefill_positions_per_s"].values())


def test_fastest_prefill_keeps_each_lengths_best_round():
    runs = [{"prefill_positions_per_s": {"64": 100.0, "256": 50.0}}, {"prefill_positions_per_s": {"64": 80.0,
                                                                                                  "256": 64.0}}]
    assert decoder_steps.fastest_prefill(runs) == {"prefill_positions_per_s": {"64": 100.0, "256": 64.0},
                                                   "prefill_ms_by_length": {"64": 640.0, "256": 4000.0}}
    assert decoder_steps.fastest_prefill([{"rows": []}]) == {}


@pytest.mark.slow
def test_our_steps_give_the_bundle_prefill_beside_llama_cpp(cpu_int4_bundle):
    """A steps-only run times our decoder's prefill too (the same lengths as llama.cpp's prompt
    processing), so both prefill rates come from one run; none without ``prefill_lengths``."""
    spec = {"bundle": str(cpu_int4_bundle), "batches": [1], "contexts": [8], "steps": 2,
            "text": "Hello there.", "prefill_rounds": 1}
    got = decoder_steps.measure_our_steps({**spec, "prefill_lengths": [8, 32]})
    assert [(r["batch"], r["context"]) for r in got["rows"]] == [(1, 8)]
    assert set(got["prefill_positions_per_s"]) == {"8", "32"}
    assert all(v > 0 for v in got["prefill_positions_per_s"].values())
    assert "prefill_positions_per_s" not in decoder_steps.measure_our_steps(spec)
