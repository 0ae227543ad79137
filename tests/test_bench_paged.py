"""bench/ab/paged.py: the paged engine's figures at two settings compared per batch size, and the
u8 KV parity measurement on the real tiny openvino bundle."""

from __future__ import annotations

import pytest

from bench.ab.paged import compare, engine_job, main, u8_parity
from bench.decoder.batch import open_engine
from higgs_pack.runtime.engine.engine import DEFAULT_JOIN_GAP_STEPS


def _result(rows):
    return {"rows": rows}


def test_compare_gives_both_figures_their_ratio_and_the_gap_in_steps():
    run = _result([{"batch": 1, "aggregate_frames_per_s": 10.0, "engine_step_ms": 100.0},
                   {"batch": 4, "aggregate_frames_per_s": 30.0, "engine_step_ms": 130.0,
                    "join_max_frame_gap_ms": 195.0}])
    base = _result([{"batch": 1, "aggregate_frames_per_s": 10.0, "engine_step_ms": 100.0},
                    {"batch": 4, "aggregate_frames_per_s": 24.0, "engine_step_ms": 160.0,
                     "join_max_frame_gap_ms": 1760.0},
                    {"batch": 8, "refused": "no"}])
    rows = compare(run, base, "paged:1.5", "paged")
    assert [r["batch"] for r in rows] == [1, 4], "only sizes both ran"
    four = rows[1]
    assert four["aggregate_frames_per_s"] == {"paged:1.5": 30.0, "paged": 24.0, "ratio": 1.25}
    assert four["engine_step_ms"] == {"paged:1.5": 130.0, "paged": 160.0, "ratio": 130.0 / 160.0}
    assert four["join_voice_gap_steps"] == {"paged:1.5": 1.5, "paged": 11.0}
    assert four["frames_per_s_over_batch1"] == {"paged:1.5": 3.0, "paged": 2.4}
    assert four["join_first_audio_ms"] == {"paged:1.5": None, "paged": None, "ratio": None}, "missing: None"
    assert compare(_result([]), base, "paged:2", "paged") == []


def test_engine_labels_give_the_worker_its_settings():
    assert engine_job("paged") == {"join_gap_steps": None}
    assert engine_job("paged:1.5") == {"join_gap_steps": 1.5}
    assert engine_job("paged:feed=none") == {"join_gap_steps": None, "codec_feed_frames": None}
    assert engine_job("paged:2:feed=1:first=3") == {"join_gap_steps": 2.0, "codec_feed_frames": 1,
                                                    "join_first_chunk_frames": 3}
    for bad, said in (("stateful", "does not start with paged"), ("stateful:2", "does not start with paged"),
                      ("paged:1", "must be > 1"), ("paged:x", "'x' is not a number of steps"),
                      ("spliced", "does not start"), ("paged:feed=0", "feed must be a whole number >= 1 or none"),
                      ("paged:first=none", "first must be a whole number >= 1, got 'none'"),
                      ("paged:depth=2", "unknown setting 'depth' (known: feed, first)")):
        with pytest.raises(ValueError, match="--engines") as caught:
            engine_job(bad)
        assert said in str(caught.value), (bad, str(caught.value))


def test_a_bad_engine_label_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--engines", "paged,stateful", "--out", str(tmp_path / "x.json")])
    assert "'stateful' does not start with paged" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_worker_opens_its_engines_with_the_jobs_join_gap(cpu_int4_bundle):
    import higgs_pack

    tts = higgs_pack.load(str(cpu_int4_bundle))
    with open_engine(tts, 2, {"join_gap_steps": 1.5}) as engine:
        assert engine.join_gap_steps == 1.5
    with open_engine(tts, 2, {"join_gap_steps": None}) as engine:
        assert engine.join_gap_steps == DEFAULT_JOIN_GAP_STEPS


def test_u8_parity_on_the_tiny_bundle(ov_int4_bundle):
    """The tiny bundle's own cache is u8: both decoders are a measurable distance from f32, and
    the figures are finite and small (a broken cache would be ~1)."""
    pytest.importorskip("openvino")
    out = u8_parity(str(ov_int4_bundle), "Hello there, a short prompt.", 4)
    assert out["own_config"]["KV_CACHE_PRECISION"] == "u8" and out["steps"] == 4
    for name in ("paged", "stateful"):
        figures = out[name]
        assert 0 < figures["rel_l2_steps_max"] < 0.2, (name, figures)
        assert 0 <= figures["rel_l2_prompt"] < 0.2


def test_rows_of_one_voice_and_the_2000_position_count_on_the_tiny_bundle(ov_int4_bundle, cpu_int4_bundle, cases_dir):
    """Three rows of one voice on the paged engine name its prefix blocks once (blocks in use =
    named - 2 x shared), and the count is the 4 GiB budget over whole blocks of 2,000 positions;
    an engine without blocks (ONNX Runtime's) counts by positions and says nothing of blocks."""
    pytest.importorskip("openvino")
    import higgs_pack
    from bench.decoder.batch import (
        COUNT_BUDGET_BYTES,
        positions_count,
        voice_rows,
    )
    from higgs_pack.runtime.engine.kv_blocks import blocks_for

    tts = higgs_pack.load(str(ov_int4_bundle), "cpu")
    clip = cases_dir / "ref_en_16k.wav"
    voice = tts.prepare_voice(clip, clip.with_suffix(".txt").read_text().strip(), "clip")
    spec = {"text": "The voice reads this line.", "seed": 0, "temperature": 0.8, "top_k": 50, "frames": 12,
            "join_gap_steps": None}
    got = voice_rows(tts, 3, spec, voice)
    assert got["voice_rows_batch"] == 3 and got["voice_rows_prefix_blocks_shared"] >= 1, got
    assert got["voice_rows_prefix_held_once"] is True, got
    assert got["voice_rows_blocks_in_use"] < got["voice_rows_blocks_named"], "shared blocks counted once"
    assert got["voice_rows_pool_bytes"] >= got["voice_rows_blocks_in_use"] * got["voice_rows_block_bytes"]
    assert got["voice_rows_rss_growth_mb"] is not None
    with open_engine(tts, 2, spec) as engine:
        count = positions_count(engine)
        block = engine.decoder.block_bytes
        want = blocks_for(2000, engine.decoder.block_size) * block
    assert count["count_request_bytes"] == want and count["count_requests"] == COUNT_BUDGET_BYTES // want
    ort = higgs_pack.load(str(cpu_int4_bundle))
    with open_engine(ort, 2, spec) as engine:
        count = positions_count(engine)
        assert not hasattr(engine.decoder, "pool")
        assert count["count_request_bytes"] == 2000 * engine.kv_bytes_per_position
    ort_voice = ort.prepare_voice(clip, clip.with_suffix(".txt").read_text().strip(), "clip")
    assert "voice_rows_blocks_in_use" not in voice_rows(ort, 2, spec, ort_voice)


def test_the_compile_worker_fills_the_model_cache_the_batch_workers_load(ov_int4_bundle, tmp_path):
    """Run before the rounds, the ``compile`` worker leaves OpenVINO's compiled models in the
    workers' cache (so no measured worker is the one that compiles)."""
    pytest.importorskip("openvino")
    from bench.common.systems import spawn

    job = {"bundle": str(ov_int4_bundle), "device": "CPU", "batch": [1, 2], "ov_cache": None}
    out = spawn("compile", job, cache=tmp_path / "cache", timeout=300)
    assert out["compile_s"] > 0
    blobs = sorted((tmp_path / "cache").rglob("*.blob"))
    assert len(blobs) >= 2, "the model cache holds the batch-1 and the paged decoder (and the sub-parts)"
    spawn("compile", job, cache=tmp_path / "cache", timeout=300)
    assert sorted((tmp_path / "cache").rglob("*.blob")) == blobs, "a second worker compiled nothing new"
