"""The benchmark (``python -m bench``): system names, records, ratios,
table, JSON, and the real measuring code path on the tiny checkpoint.

The end-to-end test runs the PyTorch reference in its worker subprocess on the tiny
checkpoint (seconds); the ``slow`` one also builds a tiny cpu fp32 bundle in a temporary
cache (about a minute on 2 cores) and checks it is reused on the next run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.common import systems
from bench.common.report import goal_state
from bench.decoder import records as bench_records
from bench.decoder import report, run, workers
from higgs_pack.errors import BuildPlanError

#: Keys every measured record carries, with their types.
RECORD_TYPES = {
    "system": str, "precision": str, "label": str, "preset": str,
    "frames_per_s": float, "first_frame_ms": float, "rtf": float, "peak_rss_mb": float,
    "bundle_mb": float, "outside_decoder_frac": float, "load_s": float, "step_ms": dict,
    "frames": int, "steps": int, "audio_s": float,
    "first_audio_ms": float, "stream_chunk_frames": int, "stream_context_frames": int, "first_audio_steps": int,
    "first_chunk_codec_ms": float, "first_audio_budget_ms": float, "stream_frames_per_s": float,
    "first_audio_prompt_embed_ms": float, "first_audio_prefill_ms": float, "first_audio_steps_ms": float,
    "decoder_only_frames_per_s": float, "loop_over_decoder": float, "step_ms_ctx64": float,
    "step_ms_ctx900": float, "kv_bytes_per_position": int,
}
POSITIVE = ("frames_per_s", "first_frame_ms", "rtf", "peak_rss_mb", "bundle_mb", "load_s", "audio_s",
            "first_audio_ms", "stream_frames_per_s", "decoder_only_frames_per_s", "step_ms_ctx64", "step_ms_ctx900")


def check_record(record: dict) -> None:
    assert "error" not in record, record.get("error")
    for key, kind in RECORD_TYPES.items():
        assert isinstance(record[key], kind), (key, record[key])
    for key in POSITIVE:
        assert record[key] > 0 and math.isfinite(record[key]), (key, record[key])
    assert 0 <= record["outside_decoder_frac"] < 1
    assert record["steps"] == record["frames"] + 7  # delay ramp of 8 codebooks
    assert record["frames_per_s_min"] <= record["frames_per_s"] <= record["frames_per_s_max"]
    assert set(record["step_ms"]) == {"decoder", "heads", "embed", "other"}
    assert sum(record["step_ms"].values()) == pytest.approx(1e3 / record["frames_per_s"], rel=0.25)
    assert record["audio_s"] == pytest.approx(record["frames"] / 25)
    # streaming: the same codes; first audio after the prefill, once the first chunk and its right
    # context (the stateful codec's lookahead, or the window codec's context) plus the 7-step delay
    # ramp exist
    from higgs_pack.runtime.loop.streaming import FIRST_CHUNK_FRAMES

    assert record["stream_codes_match"] is True
    assert record["stream_chunk_frames"] == FIRST_CHUNK_FRAMES
    # Each first audio includes a prefill, but the two figures are medians of separate runs: on a
    # loaded machine the first-audio median fell below the prefill median (57.6 vs 65.7 ms).
    assert record["first_audio_ms"] > 0 and record["prefill_ms"] > 0
    ready = FIRST_CHUNK_FRAMES + record["stream_lookahead_frames"] + 7
    assert record["first_audio_steps"] == min(ready, record["steps"])
    assert record["first_audio_budget_ms"] == pytest.approx(bench_records.first_audio_budget(record))
    # the budget's parts are disjoint pieces of the streamed run's first-audio interval
    assert record["first_audio_prefill_ms"] > 0 and record["first_audio_steps_ms"] >= 0
    assert record["first_audio_budget_ms"] <= record["first_audio_ms"] + 1e-6
    if record["stream_context_frames"] == 0:  # the stateful codec, fed 4 frames at a time between the steps
        assert 0 < record["first_chunk_codec_fed_ms"] < record["first_chunk_codec_ms"]
    # The bare decoder's rate beside the loop's is a timing, not a behaviour: on the loaded 2-core CI
    # machine the bare pytorch decoder's 14 steps measured 177 f/s against the loop's 472. What holds
    # on any machine: the ratio the record reports is these two figures' (positive, finite: POSITIVE).
    assert record["loop_over_decoder"] == pytest.approx(
        record["decoder_only_frames_per_s"] / record["frames_per_s"])
    assert record["loop_over_decoder"] == pytest.approx(record["decoder_only_frames_per_s"] / record["frames_per_s"])
    # the tiny decoder fits any last-level cache: no roofline fraction
    if record["machine"]["llc_bytes"]:
        assert record["cache_resident"] is True
        assert not any(k.startswith("roofline") for k in record), sorted(record)


# ----------------------------------------------------------------------------- fast, no models


@pytest.mark.parametrize(
    ("text", "label", "target", "precision", "variant", "device"),
    [
        ("pytorch", "pytorch", None, "fp32", None, None),
        ("cpu", "cpu-int4", "cpu", "int4", None, None),
        ("cpu-fp32", "cpu-fp32", "cpu", "fp32", None, None),
        ("openvino-int8@GPU", "openvino-int8@GPU", "openvino", "int8", None, "GPU"),
        ("openvino-int4-npu", "openvino-int4-npu", "openvino", "int4", "npu", None),
    ],
)
def test_parse_system(text, label, target, precision, variant, device):
    spec = systems.parse_system(text)
    assert (spec.label, spec.target, spec.precision, spec.variant, spec.device) == (
        label, target, precision, variant, device)
    assert spec.is_pytorch == (text == "pytorch")


@pytest.mark.parametrize(("text", "named"), [("cpu-int9", "int9"), ("openvno-int4", "openvno")])
def test_parse_system_rejects_unknown(text, named):
    with pytest.raises(BuildPlanError, match=named):
        systems.parse_system(text)


def _fake(label, system, precision, fps, **extra):
    return {"label": label, "system": system, "precision": precision, "preset": extra.pop("preset", "bench"),
            "frames_per_s": fps, "rtf": 10.0 / fps, "peak_rss_mb": 100.0, "first_frame_ms": 5.0,
            "bundle_mb": 10.0, "outside_decoder_frac": 0.1, "step_ms": {"decoder": 900 / fps, "other": 100 / fps},
            **extra}


def test_ratios_goals_and_table(tmp_path):
    records = [
        _fake("pytorch", "pytorch", "fp32", 10.0),
        _fake("cpu-int4", "cpu", "int4", 30.0, device="cpu"),
        _fake("openvino-int4", "openvino", "int4", 36.0, device="CPU", load_s=2.0, load_warm_s=0.5),
        _fake("openvino-int4", "openvino", "int4", 50.0, device="CPU", preset="tiny", load_warm_s=0.4),
        {"label": "cpu-fp16", "system": "cpu", "precision": "fp16", "preset": "bench", "error": "build: boom"},
    ]
    bench_records.add_ratios(records)
    assert records[1]["speedup_vs_pytorch"] == pytest.approx(3.0)
    assert records[2]["speedup_vs_cpu"] == pytest.approx(1.2) and records[2]["vs_cpu"] == "cpu-int4"
    assert "speedup_vs_cpu" not in records[0] and "speedup_vs_pytorch" not in records[0]
    assert "speedup_vs_pytorch" not in records[3]  # other preset, no PyTorch record there
    goals = {goal: (met, numbers) for goal, met, numbers in bench_records.goal_checks(records)}
    assert goals["[bench] cpu int4 >= 2x PyTorch frames/s"] == (True, "3.00x")
    assert goals["[bench] openvino int4 >= cpu int4 frames/s"][0] is True
    assert goals["openvino-int4 warm-cache load < 1 s (tiny)"][0] is True

    roof = records[1] | {"decoder_weight_mb": 300.0}
    bench_records.roofline(roof, {"bandwidth_gbps": 10.0})
    assert roof["roofline_min_frame_ms"] == pytest.approx(30.0)
    assert roof["roofline_frac"] == pytest.approx(0.9)
    assert roof["roofline_frac_decoder"] == pytest.approx(1.0)

    table = report.render_table(records)
    for text in ("pytorch", "cpu-int4", "3.00x", "1.20x", "error"):
        assert text in table
    details = report.render_details(records)
    assert "ERROR build: boom" in details and "met" in details and "not measured" in details

    out = tmp_path / "bench.json"
    bench_records.write_records(records[:2], out)
    bench_records.write_records([records[2]], out, append=True)
    *written, goals_record = json.loads(out.read_text())
    assert [r["label"] for r in written] == ["pytorch", "cpu-int4", "openvino-int4"]
    # the goals of everything in the file, recorded once at its end
    assert goals_record["kind"] == "goals"
    recorded = {g["goal"]: (g["met"], g["measured"]) for g in goals_record["goals"]}
    assert recorded["[bench] openvino int4 >= cpu int4 frames/s"] == (True, "1.20x")
    assert recorded["[full] cpu int4 decoder weight bytes <= openvino int4's"][0] is None
    bench_records.write_records([records[2]], out)
    assert [r.get("kind") for r in json.loads(out.read_text())] == [None, "goals"]


def _measured(label, system, fps, preset="bench", **extra):
    """A synthetic record with every field the goals read, all within their goals."""
    fields = {"device": "CPU" if system == "openvino" else "cpu", "outside_decoder_frac": 0.04,
              "loop_over_decoder": 1.05, "first_audio_ms": 500.0, "first_audio_budget_ms": 480.0,
              "decoder_weight_mb": 2000.0, "step_ms_ctx64": 100.0, "step_ms_ctx900": 110.0,
              "roofline_frac_decoder": 0.95, "cache_resident": False}
    return _fake(label, system, "int4" if system != "pytorch" else "fp32", fps, preset=preset,
                 **{**fields, **extra})


def _goals(records):
    return {goal: (met, numbers) for goal, met, numbers in bench_records.goal_checks(records)}


def test_goal_checks_met_missed_and_not_measured():
    both = [_measured("pytorch", "pytorch", 10.0), _measured("cpu-int4", "cpu", 30.0),
            _measured("openvino-int4", "openvino", 33.0)]
    full = [dict(r, preset="full") for r in both]
    full[2]["decoder_weight_mb"] = 1900.0  # openvino's decoder lighter than cpu's: a miss
    goals = _goals(both + full)
    # every goal judged on both sized presets, each one met except the weight bytes
    assert goals["[bench] cpu-int4: loop within 1.1x of its bare decoder"] == (True, "1.050x")
    assert goals["[bench] openvino-int4: outside-decoder time < 5% of a frame"] == (True, "4.0%")
    assert goals["[full] cpu-int4: first audio <= 1.1 x (prefill + first chunk)"][0] is True
    assert goals["[full] cpu int4 step at a 900-position context <= 1.15x its 64-position step"][0] is True
    assert goals["[full] openvino-int4: decoder >= 0.9 of its memory-bandwidth roofline"] == (True, "0.95")
    assert goals["[full] cpu int4 decoder weight bytes <= openvino int4's"] == (False, "2000 MB vs 1900 MB")
    assert [g for g, (met, _) in goals.items() if met is not True and "prefill at" not in g
            and "named voice" not in g] == ["[full] cpu int4 decoder weight bytes <= openvino int4's"]
    # records without prefill or voice figures: those goals read "not measured", never met
    assert goals["[full] cpu int4 prefill at 256 positions >= 3x before (21 positions/s)"] == (
        None, "no prefill_positions_per_s at 256")
    assert goals["[full] openvino int4: named voice's first audio (cached prefix) <= 1.15x zero-shot"] == (
        None, "no named_cached first audio")

    # each goal misses when its number is past the line
    worse = [_measured("cpu-int4", "cpu", 30.0, preset="full", outside_decoder_frac=0.06, loop_over_decoder=1.2,
                       first_audio_ms=530.0, step_ms_ctx900=116.0, roofline_frac_decoder=0.85,
                       heads_weight_mb=140.0),
             _measured("openvino-int4", "openvino", 20.0, preset="full")]
    goals = _goals(worse)
    for goal in ("[full] cpu-int4: outside-decoder time < 5% of a frame",
                 "[full] cpu-int4: loop within 1.1x of its bare decoder",
                 "[full] cpu-int4: first audio <= 1.1 x (prefill + first chunk)",
                 "[full] cpu int4 step at a 900-position context <= 1.15x its 64-position step",
                 "[full] cpu-int4: decoder >= 0.9 of its memory-bandwidth roofline",
                 "[full] openvino int4 >= cpu int4 frames/s"):
        assert goals[goal][0] is False, (goal, goals[goal])
    # the heads' share of the decoder's weight bytes is printed beside the outside-decoder time
    assert goals["[full] cpu-int4: outside-decoder time < 5% of a frame"][1] == \
        "6.0% (heads weights 7.0% of the decoder's)"

    # systems or presets missing, a cache-resident decoder, a field not measured: never met
    only_cpu = [_measured("cpu-int4", "cpu", 30.0, preset="full", cache_resident=True,
                          roofline_frac_decoder=None, step_ms_ctx900=None)]
    goals = _goals(only_cpu)
    for goal in ("[full] cpu int4 >= 2x PyTorch frames/s", "[full] openvino int4 >= cpu int4 frames/s",
                 "[full] openvino-int4: loop within 1.1x of its bare decoder",
                 "[full] openvino-int4: first audio <= 1.1 x (prefill + first chunk)",
                 "[full] cpu int4 decoder weight bytes <= openvino int4's",
                 "[full] cpu-int4: decoder >= 0.9 of its memory-bandwidth roofline",
                 "[full] openvino-int4: decoder >= 0.9 of its memory-bandwidth roofline",
                 "[full] cpu int4 step at a 900-position context <= 1.15x its 64-position step"):
        assert goals[goal][0] is None and goals[goal][1], (goal, goals[goal])
    assert "last-level cache" in goals["[full] cpu-int4: decoder >= 0.9 of its memory-bandwidth roofline"][1]
    assert "[bench] cpu int4 >= 2x PyTorch frames/s" not in goals  # only the presets run
    # a tiny-only run judges no speed goal: the sized ones read "not measured" for bench
    goals = _goals([_measured("cpu-int4", "cpu", 30.0, preset="tiny")])
    assert goals["[bench] cpu-int4: loop within 1.1x of its bare decoder"][0] is None
    assert goals["[full] cpu int4 decoder weight bytes <= openvino int4's"][0] is None
    assert all(met is None for met, _ in goals.values())
    assert goal_state(None) == "not measured" and goal_state(False) == "MISSED"


def test_roofline_cache_resident_and_kv_bytes():
    machine = {"llc_bytes": 32 * 2**20}
    small = {"frames_per_s": 100.0, "decoder_weight_mb": 20.0, "machine": machine, "step_ms": {"decoder": 5.0}}
    bench_records.roofline(small, {"bandwidth_gbps": 10.0})
    assert small["cache_resident"] is True and not any(k.startswith("roofline") for k in small)
    # 100 MB of weights + 10 kB per position over a mean of 100 + 50 positions, at 10 GB/s
    big = {"frames_per_s": 50.0, "decoder_only_frames_per_s": 80.0, "decoder_weight_mb": 100.0,
           "kv_bytes_per_position": 10_000, "prompt_length": 100, "steps": 100, "machine": machine,
           "step_ms_ctx900": 12.0}
    bench_records.roofline(big, {"bandwidth_gbps": 10.0})
    assert big["cache_resident"] is False and big["kv_read_mb_per_step"] == pytest.approx(1.5)
    assert big["roofline_min_frame_ms"] == pytest.approx(10.15)
    assert big["roofline_frac"] == pytest.approx(0.01015 * 50)
    assert big["roofline_frac_decoder"] == pytest.approx(0.01015 * 80)
    assert big["roofline_frac_ctx900"] == pytest.approx((100e6 + 9e6) / 10e9 * 1e3 / 12.0)
    unknown = dict(small, machine={"llc_bytes": None})
    del unknown["cache_resident"]
    bench_records.roofline(unknown, {"bandwidth_gbps": 10.0})
    assert unknown["cache_resident"] is None and unknown["roofline_frac"] > 0


def test_last_level_cache_reader(tmp_path):
    from higgs_pack.runtime.machine.cpu import cpu_info, last_level_cache, parse_cache_size

    for index, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"),
                                                 (2, "Unified", "512K"), (3, "Unified", "32768K")]):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert last_level_cache(tmp_path) == (3, 32 * 2**20)
    assert parse_cache_size("32 MiB") == 32 * 2**20 and parse_cache_size("1.5 MiB") == 3 * 2**19
    assert parse_cache_size("lots") is None
    info = cpu_info()
    assert info.llc_bytes is None or (info.llc_bytes >= 2**16 and info.llc_level >= 1)


def test_bandwidth_measurement():
    bw = workers.measure_bandwidth(mib=16, repeats=2, threads=2)
    assert bw["bandwidth_gbps"] > 0 and bw["bandwidth_copy_gbps"] > 0 and bw["bandwidth_read_1t_gbps"] > 0


def test_worker_failure_is_reported(tmp_path):
    with pytest.raises(systems.WorkerError, match="measure worker exited"):
        systems.spawn("measure", {"kind": "bundle", "bundle": str(tmp_path / "missing"), "backend": "onnxruntime"},
                     cache=tmp_path)


# ----------------------------------------------------------------------------- the real code path


@pytest.mark.slow
def test_bench_pytorch_on_tiny_checkpoint(tiny_checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    code = run.main(["--preset", "tiny", "--systems", "pytorch", "--checkpoint", str(tiny_checkpoint),
                       "--frames", "8", "--repeats", "1", "--bandwidth-mib", "32", "--cache",
                       str(tmp_path / "cache"), "--out", str(out), "--quiet"])
    assert code == 0
    record, goals = json.loads(out.read_text())
    assert goals["kind"] == "goals" and all(g["met"] is None for g in goals["goals"])  # tiny: no speed goal
    check_record(record)
    assert (record["system"], record["precision"], record["preset"]) == ("pytorch", "fp32", "tiny")
    assert record["bundle_mb"] == pytest.approx(
        sum(p.stat().st_size for p in Path(tiny_checkpoint).iterdir()) / 1e6)
    assert record["decoder_weight_mb"] > 0 and record["bandwidth_gbps"] > 0
    assert record["kv_itemsize"] == 4  # the reference runs its layers in float32


@pytest.mark.slow
def test_bench_cpu_bundle_built_then_reused(tiny_checkpoint, tmp_path):
    cache = tmp_path / "cache"
    options = run.BenchOptions(preset="tiny", systems=("pytorch", "cpu-fp32"), frames=8, repeats=1,
                                 checkpoint=str(tiny_checkpoint), cache=str(cache), bandwidth_mib=32,
                                 out=None, quiet=True)
    build_rec, torch_rec, cpu_rec = run.run_bench(options)
    for record in (torch_rec, cpu_rec):
        check_record(record)
    # the build record: the whole process tree's peak memory and every step, from the manifest
    assert build_rec["kind"] == "build" and build_rec["system"] == "cpu-fp32" and build_rec["preset"] == "tiny"
    assert build_rec["cached"] is False and build_rec["verified"] is True
    assert 0 < build_rec["peak_rss_mb"] < bench_records.BUILD_MEMORY_BUDGET_MB
    assert build_rec["build_s"] > 0 and build_rec["bundle_mb"] > 0 and build_rec["scratch_peak_mb"] > 0
    names = [p["name"] for p in build_rec["phases"]]
    assert any("llm_decoder" in n for n in names) and any("golden" in n for n in names) and names[-1].startswith("verif")
    assert all(p["peak_rss_mb"] <= build_rec["peak_rss_mb"] + 1 for p in build_rec["phases"])
    # anonymous memory is part of the resident set (file-backed pages are the rest)
    assert 0 < build_rec["peak_anon_mb"] <= build_rec["peak_rss_mb"]
    assert all(0 < p["peak_anon_mb"] <= p["peak_rss_mb"] for p in build_rec["phases"])
    assert (cpu_rec["system"], cpu_rec["precision"], cpu_rec["backend"]) == ("cpu", "fp32", "onnxruntime")
    assert cpu_rec["build_cached"] is False and cpu_rec["build_s"] > 0
    assert cpu_rec["speedup_vs_pytorch"] == pytest.approx(cpu_rec["frames_per_s"] / torch_rec["frames_per_s"])
    bundle = cache / "bundles" / f"{Path(tiny_checkpoint).name}-cpu-fp32"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert cpu_rec["bundle_mb"] == pytest.approx(sum(f["size"] for f in manifest["files"]) / 1e6)
    assert cpu_rec["decoder_weight_mb"] > 0 and cpu_rec["load_s"] > 0

    again = run.run_bench(run.BenchOptions(
        preset="tiny", systems=(), bundles=(str(bundle),), frames=8, repeats=1, warmup=0, rounds=2,
        bandwidth_mib=0, cache=str(cache), out=None, quiet=True))
    (rec,) = again
    check_record(rec)
    assert rec["label"] == "cpu-fp32" and "roofline_frac" not in rec
    assert len(rec["rounds_frames_per_s"]) == 2 and rec["frames_per_s"] == max(rec["rounds_frames_per_s"])
    (build2, rec2) = run.run_bench(run.BenchOptions(
        preset="tiny", systems=("cpu-fp32",), frames=8, repeats=1, warmup=0, bandwidth_mib=0,
        checkpoint=str(tiny_checkpoint), cache=str(cache), out=None, quiet=True))
    assert rec2["build_cached"] is True and build2["cached"] is True
    assert build2["peak_rss_mb"] == build_rec["peak_rss_mb"]  # the numbers of the build that made it
    (only,) = run.run_bench(run.BenchOptions(
        preset="tiny", systems=("cpu-fp32",), build_only=True, checkpoint=str(tiny_checkpoint),
        cache=str(cache), out=None, quiet=True))
    assert only["kind"] == "build" and "frames_per_s" not in only


def test_bench_streams_and_drives_the_bare_decoder(cpu_int4_bundle, tmp_path):
    """cpu int4 on the tiny checkpoint, long enough that the first chunk comes before the end."""
    (rec,) = run.run_bench(run.BenchOptions(
        preset="tiny", systems=(), bundles=(str(cpu_int4_bundle),), frames=40, repeats=2, warmup=1,
        bandwidth_mib=64, cache=str(tmp_path / "cache"), out=None, quiet=True))
    check_record(rec)
    assert rec["first_audio_steps"] < rec["steps"]  # audio before the loop ended
    assert rec["stream_frames_per_s"] > 0 and rec["kv_itemsize"] == 4  # ModelBuilder cpu: float32 KV
    assert rec["kv_bytes_per_position"] == 2 * 2 * 2 * 16 * 4  # tiny: 2 layers, 2 KV heads, head_dim 16
    from higgs_pack.runtime.machine.cpu import cpu_info

    assert rec["machine"]["llc_bytes"] == cpu_info().llc_bytes
    details = report.render_details([rec])
    assert "first audio" in details and "ctx 900" in details
    # prefill at the three lengths, the run's GEMM peak on the tiny layer's shapes, their ratio
    assert set(rec["prefill_positions_per_s"]) == {"64", "256", "1024"}
    assert all(v > 0 for v in rec["prefill_positions_per_s"].values())
    assert rec["gemm_peak_gops"]["int8"] > 0 and rec["gemm_peak_gops"]["float32"] > 0
    ops = rec["decoder_ops_per_position"]
    assert ops == 2 * 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)  # 2 layers of the tiny shapes
    assert rec["prefill_gops"]["256"] == pytest.approx(rec["prefill_positions_per_s"]["256"] * ops / 1e9, rel=1e-2)
    assert rec["prefill_vs_peak"]["int8"]["256"] == pytest.approx(
        rec["prefill_gops"]["256"] / rec["gemm_peak_gops"]["int8"], rel=1e-2)
    # first audio of zero-shot, the 7-second clip and the same voice prepared: the voice's prompt is longer
    if run.DEFAULT_VOICE_CLIP.is_file():
        voice, positions = rec["first_audio_ms_by_voice"], rec["voice_prompt_positions"]
        assert set(voice) <= set(workers.VOICE_KINDS) and rec["first_audio_vs_zero_shot"]["zero_shot"] == 1.0
        assert positions["clip"] == positions["named"] > positions["zero_shot"] + 150  # ~175 frames of codes
        if "named_cached" in voice:  # a warm prefix cache: only the prompt past the voice is prefilled
            assert positions["named_cached"] < positions["zero_shot"] and rec["voice_cache_stats"]["hits"] >= 2
        else:
            assert rec["voice_cache"]
    text = report.render_prefill([rec])
    assert "prefill 256 pos/s" in text and "GEMM peak" in text


def test_prefill_against_the_peak_table_and_goals():
    """prefill_vs_peak from the fields, the prefill table (ours and llama.cpp's) and issue 32's goals."""
    peak = {"gemm_peak_gops": {"int8": 400.0, "float32": 100.0}, "decoder_ops_per_position": 2e9}
    cpu = _measured("cpu-int4", "cpu", 12.0, preset="full", prefill_positions_per_s={"64": 40.0, "256": 70.0},
                    first_audio_ms_by_voice={"zero_shot": 800.0, "named": 4000.0},
                    first_audio_vs_zero_shot={"zero_shot": 1.0, "named": 5.0}, **peak)
    ov = _measured("openvino-int4", "openvino", 11.0, preset="full", prefill_positions_per_s={"256": 20.0},
                   first_audio_vs_zero_shot={"zero_shot": 1.0, "named_cached": 1.1}, **peak)
    llama = {"kind": systems.STEP_KIND, "label": "llama.cpp-q4_0", "preset": "full", "backend": "llama.cpp",
             "prefill_positions_per_s": {"256": 50.0}, **peak}
    for r in (cpu, ov, llama):
        bench_records.prefill_vs_peak(r)
    assert cpu["prefill_gops"] == {"64": 80.0, "256": 140.0}
    assert cpu["prefill_vs_peak"] == {"int8": {"64": 0.2, "256": 0.35}, "float32": {"64": 0.8, "256": 1.4}}
    goals = _goals([cpu, ov])
    assert goals["[full] cpu int4 prefill at 256 positions >= 3x before (21 positions/s)"][0] is True
    assert goals["[full] openvino int4 prefill at 256 positions >= 3x before (16 positions/s)"][0] is False
    assert goals["[full] openvino int4: named voice's first audio (cached prefix) <= 1.15x zero-shot"][0] is True
    named = goals["[full] cpu int4: named voice's first audio (cached prefix) <= 1.15x zero-shot"]
    assert named[0] is None and "without the cache 5.00x" in named[1]
    headers, rows, facts = report.prefill_table([cpu, ov, llama])
    assert [r[0] for r in rows] == ["cpu-int4", "openvino-int4", "llama.cpp-q4_0"]
    assert rows[0][headers.index("prefill 256 pos/s")] == "70.0" and rows[1][headers.index("prefill 64 pos/s")] == "-"
    assert rows[0][headers.index("256: GOP/s (int8 / fp32 peak)")] == "140 (35% / 140%)"
    assert rows[0][headers.index("1st audio named ms")] == "4000 (5.00x)"
    assert "int8 400 GOP/s, float32 100 GOP/s" in facts[0]
    bare = _measured("cpu-fp32", "cpu", 10.0)
    bench_records.prefill_vs_peak(bare)  # no prefill figures: nothing added, no row
    assert "prefill_gops" not in bare and report.render_prefill([bare]) == ""


def test_voice_clip_needs_its_transcript(tmp_path):
    from higgs_pack.errors import InputError

    assert run.voice_job(None) == {}
    clip = tmp_path / "v.wav"
    with pytest.raises(InputError, match=r"--voice-clip .*no clip"):
        run.voice_job(str(clip))
    clip.write_bytes(b"RIFF")
    with pytest.raises(InputError, match=r"v\.txt beside it .*no transcript"):
        run.voice_job(str(clip))
    (tmp_path / "v.txt").write_text(" Hello there. \n")
    assert run.voice_job(str(clip)) == {"voice_clip": str(clip), "voice_transcript": "Hello there."}


def test_cpu_isa_names_vnni_and_avx512():
    from higgs_pack.runtime.machine.cpu import cpu_isa

    amd = cpu_isa(["fpu", "sse4_2", "avx", "avx2", "fma", "f16c"])
    assert amd == {"flags": ["sse4_2", "avx", "avx2", "fma", "f16c"], "vnni": False, "avx512": False}
    xeon = cpu_isa(["avx2", "avx512f", "avx512bw", "avx512_vnni", "amx_tile"])
    assert xeon["vnni"] and xeon["avx512"] and xeon["flags"] == ["avx2", "avx512f", "avx512bw", "avx512_vnni",
                                                                 "amx_tile"]
    assert cpu_isa(["avx2", "avx_vnni"])["vnni"]
    machine = systems.machine()  # what every bench record carries
    assert set(machine["isa"]) == {"flags", "vnni", "avx512"}
    from higgs_pack.runtime.machine.cpu import cpu_info

    # One reader: the build record's line names the same CPU and ISA the bench records.
    line = cpu_info().describe()
    assert line.startswith(machine["cpu"] + " (") and f"{machine['cores']} logical CPUs" in line
    assert ("avx2" in line) == ("avx2" in machine["isa"]["flags"])


def test_context_steps_take_the_lengths_in_turn(cpu_int4_bundle):
    """The context-length steps alternate the lengths round by round (a machine that drifts
    weighs on both alike), on the real tiny decoder; each length gets rounds x steps timings."""
    import numpy as np

    from higgs_pack.runtime.sources.bundle import load_pipeline as load

    decoder = load(cpu_int4_bundle).decoder
    prefills: list[int] = []
    forward = decoder.forward

    def recording(x):
        if x.shape[1] > 1:
            prefills.append(x.shape[1])
        return forward(x)

    decoder.forward = recording
    h = decoder._hidden_size
    prompt = np.random.default_rng(0).standard_normal((1, 5, h)).astype(np.float32)
    step = np.zeros((1, 1, h), dtype=np.float32)
    too_long = decoder.max_length
    out = workers.context_steps(decoder, prompt, step, [8, 20, too_long], steps=3, rounds=2)
    assert prefills == [8, 20, 8, 20]
    assert set(out) == {"step_ms_ctx8", "step_ms_ctx20"} and all(v > 0 for v in out.values())


# ----------------------------------------------------------------------------- --batch


def test_parse_batch():
    assert run.parse_batch("1,2,4,8") == (1, 2, 4, 8) and run.parse_batch("") == ()
    for bad, named in (("1,x", "comma-separated"), ("0,2", ">= 1"), ("2,2", "distinct")):
        assert named in run.parse_batch(bad)
    with pytest.raises(SystemExit):
        run.main(["--batch", "1,1"])


def _row(size, agg, step, bare=None, stream=0.95):
    """A measured ``--batch`` row: aggregate frames/s, engine step ms, bare step ms, streamed/plain."""
    bare = bare or step / 1.05
    return {"batch": size, "aggregate_frames_per_s": agg, "per_request_frames_per_s": agg / size,
            "engine_step_ms": step, "bare_step_ms": bare, "engine_over_bare": step / bare,
            "stream_aggregate_frames_per_s": agg * stream, "stream_over_plain": stream,
            "join_first_audio_ms": 400.0 + 10 * size, "max_kv_bytes_in_use": size * 60 * 294912}


OV_REFUSAL = ("OpenVINO bundles do not decode several requests per step yet (one state length for all rows); "
              "use engine(max_batch=1) (the CLI's --batch 1), or a cpu ONNX Runtime bundle for batching")


def _batched(label, system, preset, rows):
    record = _measured(label, system, 30.0, preset=preset)
    record["batch"] = {"sizes": [r["batch"] for r in rows], "rows": rows, "kv_bytes_per_position": 294912,
                       "fit_max_batch": 18, "fit_memory_bytes": 12 * 2**30, "fit_positions": 2000,
                       "fit_weight_bytes": 2 * 2**30, "fit_kv_bytes_per_position": 294912,
                       "fit_kv_source": "engine", "loadavg_1m": [1.0, 1.2]}
    return record


def _good_rows():
    return [_row(1, 10.0, 100.0), _row(2, 19.0, 105.0), _row(4, 35.0, 114.0), _row(8, 60.0, 133.0)]


def test_batch_goals_judged_at_full_size_and_missed_when_a_figure_misses():
    ov_rows = [_row(1, 9.0, 110.0)] + [{"batch": b, "refused": OV_REFUSAL} for b in (2, 4, 8)]
    good = [_batched("cpu-int4", "cpu", "full", _good_rows()), _batched("openvino-int4", "openvino", "full", ov_rows)]
    goals = {g: v for g, v in _goals(good).items() if "batch" in g}
    cpu = {g: v for g, v in goals.items() if "cpu-int4" in g}
    assert len(cpu) == 5 and all(met is True for met, _ in cpu.values()), cpu
    assert cpu["[full] cpu-int4: aggregate frames/s at batch 4 >= 3x batch 1"] == (True, "35 / 10 = 3.50x")
    assert cpu["[full] cpu-int4: per-request step at batch 4 <= 1.35x batch 1"] == (True, "114 / 100 = 1.14x")
    assert "B=8 1.05x" in cpu["[full] cpu-int4: engine step within 1.1x of its bare batched decoder at every batch"][1]
    # openvino: the refused sizes say why and count as not measured; batch 1 alone is judged
    refused = goals["[full] openvino-int4: aggregate frames/s at batch 4 >= 3x batch 1"]
    assert refused[0] is None and "refused: OpenVINO bundles do not decode" in refused[1] and "use engine" not in refused[1]
    assert goals["[full] openvino-int4: streamed aggregate frames/s >= 0.9x plain at every batch"] == (True, "B=1 0.95x")

    # a record that misses: batch 8 only 4.5x batch 1, streaming at batch 4 0.85x plain, the
    # step at batch 4 1.5x, the engine 1.2x its bare decoder at batch 2
    rows = _good_rows()
    rows[1] = _row(2, 19.0, 105.0, bare=87.5)
    rows[2] = _row(4, 35.0, 150.0, bare=150 / 1.05, stream=0.85)
    rows[3] = _row(8, 45.0, 133.0)
    goals = _goals([_batched("cpu-int4", "cpu", "full", rows)])
    for goal in ("aggregate frames/s at batch 8 >= 5x batch 1", "per-request step at batch 4 <= 1.35x batch 1",
                 "engine step within 1.1x of its bare batched decoder at every batch",
                 "streamed aggregate frames/s >= 0.9x plain at every batch"):
        assert goals[f"[full] cpu-int4: {goal}"][0] is False, (goal, goals[f"[full] cpu-int4: {goal}"])
    assert goals["[full] cpu-int4: aggregate frames/s at batch 4 >= 3x batch 1"][0] is True
    assert goals["[full] openvino-int4: aggregate frames/s at batch 4 >= 3x batch 1"] == (None, "no --batch record")

    # at the bench preset the same figures are computed and printed, not judged
    bench_goals = _goals([_batched("cpu-int4", "cpu", "bench", rows)])
    missed = bench_goals["[bench] cpu-int4: aggregate frames/s at batch 8 >= 5x batch 1"]
    assert missed[0] is None and missed[1] == "45 / 10 = 4.50x: would be missed; judged at full size only"
    assert goal_state(*missed) == "not judged" and goal_state(None, "no --batch record") == "not measured"
    assert not any(g.startswith("[full]") and "batch" in g for g in bench_goals)  # only the presets run
    printed = _batched("cpu-int4", "cpu", "bench", rows)
    printed.update(first_audio_steps=28, stream_chunk_frames=10, stream_context_frames=11, stream_frames_per_s=28.0)
    details = report.render_details([printed])
    assert "would be missed; judged at full size only -> not judged" in details
    # no --batch run: no batch goals; a failed batch run: every batch goal not measured, saying so
    assert not any("batch" in g for g in _goals([_measured("cpu-int4", "cpu", 30.0, preset="full")]))
    failed = _measured("cpu-int4", "cpu", 30.0, preset="full")
    failed["batch"] = {"sizes": [1, 2], "error": "batch worker exited with 1:\nboom"}
    assert all(met is None and "the batch run failed: batch worker exited with 1" in numbers
               for g, (met, numbers) in _goals([failed]).items() if "cpu-int4" in g and "batch" in g)


def test_batch_memory_fit_table_and_html(tmp_path):
    manifest = {"files": [{"path": "llm_decoder/model.onnx", "size": 2**20},
                          {"path": "llm_decoder/model.onnx.data", "size": 2 * 2**30},
                          {"path": "audio_heads/model.onnx", "size": 2**20},
                          {"path": "golden/outputs.npz", "size": 2**30}],
                "subparts": {"llm_decoder": {"files": ["llm_decoder/model.onnx", "llm_decoder/model.onnx.data"]},
                             "audio_heads": {"files": ["audio_heads/model.onnx"]}}}
    fit = bench_records.batch_memory(manifest, 294912, 128)  # the 4B model's fp32 KV: 288 KiB per position
    # (12 GiB - 2 GiB of decoder weights - 1 MiB of heads) / (2000 x 288 KiB): 18 requests (computed)
    assert fit["fit_weight_bytes"] == 2 * 2**30 + 2**20 and fit["fit_max_batch"] == 18
    assert fit["fit_kv_source"] == "engine" and fit["fit_computed"] is True
    assert bench_records.batch_memory(manifest, None, 128)["fit_kv_source"] == "bench"
    assert bench_records.batch_memory(manifest, None, None)["fit_max_batch"] is None

    ov_rows = [_row(1, 9.0, 110.0)] + [{"batch": b, "refused": OV_REFUSAL} for b in (2, 4)]
    records = [_batched("cpu-int4", "cpu", "bench", _good_rows()[:3]),
               _batched("openvino-int4", "openvino", "bench", ov_rows)]
    text = report.render_batch(records)
    for part in ("3.50x", "1.14x", "refused", "largest batch in 12 GiB at 2000 positions: 18 (computed, not run",
                 "openvino-int4 [bench] batch 2 refused by the engine: OpenVINO bundles do not decode"):
        assert part in text, part
    assert report.render_batch([_measured("cpu-int4", "cpu", 30.0)]) == ""
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.json"
    bench_records.write_records(records, out)
    from bench.decoder.report import write_html

    page = write_html(out).read_text()
    section = page[page.index("Many requests at once (--batch)"):]
    assert section.count("<img") == 1 and "refused: OpenVINO bundles" in section and section.rstrip().endswith("</html>")


#: Keys and types of every measured ``--batch`` row.
BATCH_ROW_TYPES = {
    "batch": int, "aggregate_frames_per_s": float, "per_request_frames_per_s": float, "engine_step_ms": float,
    "bare_step_ms": float, "engine_over_bare": float, "stream_aggregate_frames_per_s": float,
    "stream_over_plain": float, "stream_engine_step_ms": float, "join_first_audio_ms": float,
    "max_kv_bytes_in_use": int, "wall_frames_per_s": float, "prefill_ms": float, "rounds": list,
    "delivered_frames_per_s": float, "stream_delivered_frames_per_s": float, "stream_delivered_over_plain": float,
}


def test_bench_batch_on_tiny_cpu_int4(cpu_int4_bundle, tmp_path):
    """``--batch 1,2`` on the tiny cpu int4 bundle: the record's structure, the JSON, the goals, the HTML."""
    out = tmp_path / "bench.json"
    code = run.main(["--preset", "tiny", "--systems", "", "--bundle", str(cpu_int4_bundle), "--batch", "1,2",
                       "--frames", "24", "--repeats", "1", "--warmup", "0", "--contexts", "", "--bandwidth-mib", "0",
                       "--cache", str(tmp_path / "cache"), "--out", str(out), "--quiet"])
    assert code == 0
    record, goals = json.loads(out.read_text())
    batch = record["batch"]
    assert batch["sizes"] == [1, 2] and [row["batch"] for row in batch["rows"]] == [1, 2]
    per_position = 2 * 2 * 2 * 16 * 4  # tiny: 2 layers, 2 KV heads, head_dim 16, float32
    assert batch["kv_bytes_per_position"] == per_position == batch["fit_kv_bytes_per_position"]
    positions = batch["prompt_length"] + 24 + 7  # prompt + frames + the delay ramp
    for row in batch["rows"]:
        for key, kind in BATCH_ROW_TYPES.items():
            assert isinstance(row[key], kind), (row["batch"], key, row.get(key))
        b = row["batch"]
        assert row["joined_together"] is True and row["join_rows"] == b and row["stream_codes_match"] is True
        assert row["engine_steps"] == 24 + 7 and row["full_batch_steps"] == 24 + 7
        assert row["per_request_frames_per_s"] == pytest.approx(row["aggregate_frames_per_s"] / b)
        assert row["engine_over_bare"] == pytest.approx(row["engine_step_ms"] / row["bare_step_ms"])
        assert row["stream_over_plain"] == pytest.approx(
            row["stream_aggregate_frames_per_s"] / row["aggregate_frames_per_s"])
        assert row["max_kv_bytes_in_use"] == b * positions * per_position
        for one_round in row["rounds"]:  # codec included: delivered after the run's generation
            assert one_round["stream_delivered_over_plain"] == pytest.approx(
                one_round["stream_delivered_frames_per_s"] / one_round["delivered_frames_per_s"])
            assert one_round["delivered_frames_per_s"] < one_round["wall_frames_per_s"]
        assert all(v > 0 and math.isfinite(v) for k, v in row.items() if k in BATCH_ROW_TYPES and
                   isinstance(v, float))
    assert batch["fit_max_batch"] == (12 * 2**30 - batch["fit_weight_bytes"]) // (2000 * per_position)
    assert len(batch["loadavg_1m"]) == 2 and batch["peak_rss_mb"] > 0
    if run.DEFAULT_VOICE_CLIP.is_file():  # a named 7-second voice joins: its prompt, the running row's longest wait
        assert batch["join_voice_prompt_length"] > batch["prompt_length"] + 150
        one, two = batch["rows"]
        assert one["join_voice_first_audio_ms"] > 0 and "join_max_frame_gap_ms" not in one
        assert two["join_voice_rows"] == 2 and two["join_max_frame_gap_ms"] > 0
        assert two["join_voice_running_step_ms"] > 0 and "join_voice_running_step_ms" not in one
        # the joiner's codec until its first audio: its first chunk (10 frames) and the lookahead, fed 4 at a time
        assert two["join_voice_codec_runs"] == 5 and 0 < two["join_voice_max_codec_run_ms"] < two["join_voice_codec_ms"]
        assert two["join_text_max_frame_gap_ms"] > 0
        # the voice joins cold first (its prefix cache emptied: the whole voice prompt prefilled), then cached
        assert two["join_voice_cold_rows"] == 2 and two["join_cold_max_frame_gap_ms"] > 0
        assert one["join_voice_cold_first_audio_ms"] > 0 and "join_cold_max_frame_gap_ms" not in one
    recorded = {g["goal"]: (g["met"], g["measured"]) for g in goals["goals"]}
    streamed = recorded["[tiny] cpu-int4: streamed aggregate frames/s >= 0.9x plain at every batch"]
    assert streamed[0] is None and streamed[1].startswith("B=1 ") and streamed[1].endswith("judged at full size only")
    assert recorded["[tiny] cpu-int4: aggregate frames/s at batch 4 >= 3x batch 1"] == (
        None, "batch 4 not measured (not in --batch)")
    assert recorded["[tiny] openvino-int4: aggregate frames/s at batch 4 >= 3x batch 1"] == (None, "no --batch record")
    if out.with_suffix(".html").is_file():  # matplotlib installed
        assert "Many requests at once (--batch)" in out.with_suffix(".html").read_text()


def test_bench_batch_on_tiny_openvino(ov_int4_bundle, tmp_path):
    """The OpenVINO engine runs batch 1 and 2 on the CPU: batch 2 (the paged engine) has its
    figures, its pool's peak blocks and blocks in use at the join, and KV bytes in use
    (its u8 blocks: 176 B per position on the tiny model; the batch-1 decoder states none)."""
    (rec,) = run.run_bench(run.BenchOptions(
        preset="tiny", systems=(), bundles=(str(ov_int4_bundle),), frames=24, repeats=1, warmup=0, contexts=(),
        bandwidth_mib=0, cache=str(tmp_path / "cache"), out=None, quiet=True, batch=(1, 2)))
    one, two = rec["batch"]["rows"]
    assert one["batch"] == 1 and one["aggregate_frames_per_s"] > 0 and one["max_kv_bytes_in_use"] is None
    assert two["batch"] == 2 and "refused" not in two and two["aggregate_frames_per_s"] > 0
    assert two["max_kv_bytes_in_use"] > 0
    assert two["kv_blocks_peak"] >= 2 and two["kv_block_bytes"] == 176 * 32 and two["join_kv_blocks_in_use"] >= 2
    assert one["kv_blocks_peak"] is None
    assert rec["batch"]["kv_bytes_per_position"] == 176 and rec["batch"]["fit_kv_source"] == "engine"


def test_bench_fit_run_on_tiny_cpu_int4(cpu_int4_bundle, tmp_path):
    """``--fit-run``: the computed largest batch is run with every KV page written; the record
    says how much the process really held against the budget (here a tiny one, which the
    process's own baseline exceeds: the computation counts weights and KV only)."""
    out = tmp_path / "bench.json"
    code = run.main(["--preset", "tiny", "--systems", "", "--bundle", str(cpu_int4_bundle), "--batch", "1",
                       "--fit-memory-gib", "0.05", "--fit-run", "--frames", "8", "--repeats", "1", "--warmup", "0",
                       "--contexts", "", "--bandwidth-mib", "0", "--cache", str(tmp_path / "cache"), "--out", str(out),
                       "--quiet"])
    assert code == 0
    batch = json.loads(out.read_text())[0]["batch"]
    per_position, budget = 2 * 2 * 2 * 16 * 4, int(0.05 * 2**30)
    assert batch["fit_memory_bytes"] == budget
    assert batch["fit_max_batch"] == (budget - batch["fit_weight_bytes"]) // (2000 * per_position) > 1
    assert batch["fit_run_batch"] == batch["fit_max_batch"] and batch["fit_run_positions"] == 2000
    # every row holds 2000 positions after the steps (1999 written, then the timed steps)
    assert batch["fit_run_kv_bytes"] >= batch["fit_max_batch"] * 1999 * per_position
    assert batch["fit_run_peak_rss_mb"] > batch["fit_run_load_rss_mb"] > 0 and batch["fit_run_step_ms"] > 0
    assert batch["fit_run_fits"] is False  # a Python process with ONNX Runtime alone exceeds 51 MiB
    assert "EXCEEDS the budget" in report.render_batch([json.loads(out.read_text())[0]])


def test_fill_kv_refuses_what_it_cannot_fill():
    from bench.decoder.batch import fill_kv

    with pytest.raises(ValueError, match="keeps no host KV buffers"):
        fill_kv(object(), 10)


def test_bundle_spec_labels_a_quantized_kv_cache(cpu_int4_bundle, tmp_path):
    """A ``--bundle`` with an int8 KV cache is its own system beside the float one of the same
    target and precision (both can run side by side in one bench)."""
    source = json.loads((cpu_int4_bundle / "manifest.json").read_text())
    for kv, label in (("float", "cpu-int4"), ("int8", "cpu-int4-kv-int8")):
        bundle = tmp_path / kv
        bundle.mkdir()
        (bundle / "manifest.json").write_text(json.dumps({**source, "kv_cache": kv}))
        assert systems.bundle_spec(bundle).label == label
