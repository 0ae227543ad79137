"""``python -m bench.ab.paged BUNDLE``: an openvino bundle's paged engine at two or more settings
side by side (issue 39: ``join_gap_steps``, the codec's feed, the joiner's first chunk), in one run,
and its u8 KV cache against an f32 one.

**engines** (``--engines paged,paged:feed=none``; ``paged`` is the engine's default, settings after it
as :func:`engine_job` reads them): the ``batch`` worker
(:func:`bench.decoder.batch.measure_batches`: plain, streamed, join and voice-join runs per batch
size) in fresh processes, each setting in turn for ``--rounds`` rounds, so all see the same machine
load; each size's medians and their ratios (each setting / the first) are in ``compare``.  The
spliced stateful engine this once compared the paged one with is gone (the paged engine was at
least as fast; the kept runs docs/benchmarks/runs/paged-vs-stateful-*.json hold that comparison).

**memory** (per setting, per round): the largest batch of rows of one voice, with the blocks they
hold and the RSS they add, and how many requests of 2,000 positions the engine admits in a 4 GiB
KV budget.  **u8 parity** (``--parity-steps``): the decoder's hidden states over a bench prompt and
``--parity-steps`` steps, paged with the bundle's own cache (u8 on the CPU) against paged with an
f32 cache (f32 inference both), and the same for the bundle's batch-1 stateful decoder, as
relative L2 distances (the measure of ``python -m bench.ab ov-properties``).

The JSON (``--out``) keeps the machine (CPU model and ISA), OpenVINO's version and every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.systems import machine, spawn
from bench.decoder.run import BENCH_TEXT, DEFAULT_VOICE_CLIP, voice_job

#: Figures compared per batch size, each setting / the first (lower is better for the times).
COMPARED = ("aggregate_frames_per_s", "engine_step_ms", "bare_step_ms", "join_first_audio_ms",
            "join_voice_first_audio_ms", "join_max_frame_gap_ms", "join_voice_running_step_ms", "join_voice_codec_ms",
            "join_voice_max_codec_run_ms",
            "join_voice_cold_first_audio_ms", "join_cold_max_frame_gap_ms", "join_text_max_frame_gap_ms",
            "stream_engine_step_ms", "stream_delivered_frames_per_s", "max_kv_bytes_in_use")


def _rows(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {row["batch"]: row for row in result.get("rows", []) if "refused" not in row}


def compare(run: dict[str, Any], base: dict[str, Any], name: str, base_name: str) -> list[dict[str, Any]]:
    """Per batch size both runs have: each of :data:`COMPARED` for both (keyed by ``name`` and
    ``base_name``) and ``ratio`` (``run`` / ``base``), the voice join's gap in steps of the running
    rows (its ms over their step ms just before the join, ``join_voice_running_step_ms``; in runs
    without it, over the plain run's ``engine_step_ms``), and aggregate frames/s over batch 1's."""
    out = []
    a, b = _rows(run), _rows(base)
    names = (name, base_name)
    for batch in sorted(set(a) & set(b)):
        row: dict[str, Any] = {"batch": batch}
        for key in COMPARED:
            x, y = a[batch].get(key), b[batch].get(key)
            row[key] = {name: x, base_name: y, "ratio": x / y if x and y else None}
        for label, engine in zip(names, (a[batch], b[batch]), strict=True):
            gap = engine.get("join_max_frame_gap_ms")
            step = engine.get("join_voice_running_step_ms") or engine.get("engine_step_ms")
            row.setdefault("join_voice_gap_steps", {})[label] = gap / step if gap and step else None
        out.append(row)
    one = {label: rows.get(1, {}).get("aggregate_frames_per_s") for label, rows in zip(names, (a, b), strict=True)}
    for row in out:
        row["frames_per_s_over_batch1"] = {label: (row["aggregate_frames_per_s"][label] / one[label]
                                                   if one[label] and row["aggregate_frames_per_s"][label] else None)
                                           for label in names}
    return out


def memory(run: dict[str, Any]) -> dict[str, Any]:
    """One engine run's KV memory figures (issue 39): rows of one voice at the largest batch
    (:func:`bench.decoder.batch.voice_rows`) and requests of 2,000 positions in a 4 GiB budget
    (:func:`bench.decoder.batch.positions_count`), with the worker's peak RSS."""
    return {key: value for key, value in run.items()
            if key.startswith(("voice_rows_", "count_")) or key in ("peak_rss_mb", "kv_bytes_per_position")}


#: The ``--engines`` settings after ``paged``, ``:``-separated (:func:`engine_job`): the batch
#: worker's spec key each sets and how its value is read.
ENGINE_SETTINGS = {"feed": "codec_feed_frames", "first": "join_first_chunk_frames"}


def engine_job(label: str) -> dict[str, Any]:
    """The batch worker's settings for an ``--engines`` entry: ``paged`` (the engine's defaults),
    then ``:``-separated settings: a number X > 1 (``join_gap_steps``), ``feed=N`` or ``feed=none``
    (``Pipeline.codec_feed_frames``: frames a stream's codec is fed at a time before its chunk is
    due; none, one call per chunk), ``first=N`` (the joining request's ``first_chunk_frames``).
    E.g. ``paged:1.5``, ``paged:feed=none``, ``paged:2:first=1``.

    Raises:
        ValueError: any other entry, naming what is wrong."""
    engine, *settings = label.split(":")
    if engine != "paged":
        raise ValueError(f"--engines: {label!r} does not start with paged (paged[:JOIN_GAP_STEPS][:feed=N|none]"
                         "[:first=N])")
    job: dict[str, Any] = {"join_gap_steps": None}
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not eq:
            try:
                steps = float(setting)
            except ValueError:
                raise ValueError(f"--engines: {label!r}: {setting!r} is not a number of steps nor "
                                 f"{'=N, '.join(ENGINE_SETTINGS)}=N") from None
            if not steps > 1:
                raise ValueError(f"--engines: {label!r}: join_gap_steps must be > 1")
            job["join_gap_steps"] = steps
            continue
        if key not in ENGINE_SETTINGS:
            raise ValueError(f"--engines: {label!r}: unknown setting {key!r} (known: {', '.join(ENGINE_SETTINGS)})")
        if key == "feed" and value == "none":
            job[ENGINE_SETTINGS[key]] = None
            continue
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--engines: {label!r}: {key} must be a whole number >= 1"
                             f"{' or none' if key == 'feed' else ''}, got {value!r}")
        job[ENGINE_SETTINGS[key]] = int(value)
    return job


def measure_engines(job: dict[str, Any], rounds: int, cache: Path, timeout: float | None,
                    engines: tuple[str, ...] = ("paged",)) -> dict[str, Any]:
    """``rounds`` rounds of the ``batch`` worker, each of ``engines`` (:func:`engine_job`'s labels)
    in turn, in fresh processes, after a ``compile`` worker has filled the model cache
    (:func:`bench.decoder.batch.compile_engines`: else the first worker, which compiles, is slower
    than the rest, and it is always the first setting's)."""
    spawn("compile", job, cache=cache, timeout=timeout)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in engines}
    for _ in range(rounds):
        for label in runs:
            runs[label].append(spawn("batch", {**job, **engine_job(label)}, cache=cache, timeout=timeout))
    return runs


def _relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def u8_parity(bundle: str, text: str, steps: int) -> dict[str, Any]:
    """Hidden states of the bench prompt and ``steps`` steps (fixed inputs, :func:`bench.decoder.workers.
    fixed_inputs`) with the bundle's own KV cache against an f32 one, on the paged decoder and on the
    bundle's batch-1 stateful decoder."""
    import openvino as ov

    import higgs_pack
    from bench.decoder.workers import fixed_inputs
    from higgs_pack.runtime.backends.openvino.paged import OvPagedDecoder, compile_paged
    from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder

    tts = higgs_pack.load(bundle, "cpu", cache_dir=False)
    own = tts.pipeline.decoder
    prompt, step = fixed_inputs(tts.pipeline, text)
    f32 = {**own.config, "KV_CACHE_PRECISION": "f32", "INFERENCE_PRECISION_HINT": "f32"}
    out: dict[str, Any] = {"own_config": own.config, "steps": steps, "prompt_length": int(prompt.shape[1])}
    for name, make in (("stateful", lambda config: OvStatefulDecoder(ov.Core(), own.path, "CPU", None, config,
                                                                     max_length=own.max_length)),
                       ("paged", lambda config: OvPagedDecoder(
                           compile_paged(OvStatefulDecoder(ov.Core(), own.path, "CPU", None, config,
                                                           max_length=own.max_length), tts.pipeline.constants.num_layers),
                           max_batch=1, max_length=own.max_length, device="CPU"))):
        hidden = {}
        for label, config in (("own", own.config), ("f32", f32)):
            decoder = make(config)
            if name == "paged":
                states = [decoder.prefill(0, prompt)[0, -1]] + [decoder.step(np.array([0]), step)[0, 0]
                                                                 for _ in range(steps)]
            else:
                states = [decoder.forward(prompt)[0, -1]] + [decoder.forward(step)[0, -1] for _ in range(steps)]
            hidden[label] = np.stack(states)
        distance = [_relative_l2(a, b) for a, b in zip(hidden["own"], hidden["f32"], strict=True)]
        out[name] = {"rel_l2_prompt": distance[0], "rel_l2_steps_max": max(distance[1:]),
                     "rel_l2_steps_mean": float(np.mean(distance[1:]))}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab.paged", description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", help="an openvino bundle folder")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every setting in turn (default 2)")
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1, help="runs per size inside one worker (default 1)")
    parser.add_argument("--voice-clip", default=str(DEFAULT_VOICE_CLIP) if DEFAULT_VOICE_CLIP.is_file() else "")
    parser.add_argument("--engines", default="paged",
                        help="comma-separated: paged (the defaults), then :-separated settings: JOIN_GAP_STEPS, "
                             "feed=N|none, first=N (default paged); each is compared with the first")
    parser.add_argument("--parity-steps", type=int, default=0, help="also measure u8 parity over this many steps")
    parser.add_argument("--cache", default=None, help="HIGGS_PACK_CACHE of the workers (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--out", default="dist/paged-ab.json")
    options = parser.parse_args(argv)
    import openvino as ov

    job = {"bundle": str(Path(options.bundle).resolve()), "device": "CPU", "batch": options.batch, "ov_cache": None,
           "frames": options.frames, "seed": 0, "temperature": 0.8, "top_k": 50, "text": BENCH_TEXT, "warmup": 1,
           "repeats": options.repeats, "voice_rows": True, **voice_job(options.voice_clip)}
    cache = Path(options.cache or Path(options.out).with_suffix(".cache"))
    record: dict[str, Any] = {"machine": machine(), "openvino": ov.__version__, "job": {**job, "text": job["text"][:60]},
                              "rounds": options.rounds}
    engines = tuple(dict.fromkeys(label.strip() for label in options.engines.split(",") if label.strip()))
    try:
        for label in engines:
            engine_job(label)
    except ValueError as exc:
        parser.error(str(exc))
    runs = measure_engines(job, options.rounds, cache, options.timeout, engines)
    record["runs"] = runs
    # per setting after the first, per round: its figures against the first's of the same round
    base = engines[0]
    record["compare"] = {label: [compare(r, b, label, base) for r, b in zip(runs[label], runs[base], strict=True)]
                         for label in engines[1:]}
    record["memory"] = {label: [memory(run) for run in runs[label]] for label in engines}
    if options.parity_steps:
        record["u8_parity"] = u8_parity(job["bundle"], BENCH_TEXT, options.parity_steps)
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(record, indent=1, default=str))
    for rows in record["compare"].values():
        for row in rows[-1]:
            print(json.dumps(row), file=sys.stderr)
    if not record["compare"]:
        for row in runs[base][-1].get("rows", []):
            print(json.dumps({k: v for k, v in row.items() if k in ("batch", *COMPARED)}), file=sys.stderr)
    print(json.dumps(record["memory"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
