"""Streamed against plain aggregate frames/s with the stateful streaming codec (issue 31 item 1).

``python -m bench.decoder.stream_codec BUNDLE [--batch 1,4] [--frames 100] [--repeats 2]``: per batch
size, rounds of **plain**, **stateful** (each request streamed on its own thread, the B streams'
codec steps batched), **stateful-alone** (one stream step per codec run) and **windows** (the
streaming codec hidden: the window codec).  Rates as ``bench.decoder.batch``'s; ratios to plain within a
round, medians over rounds (``over_plain``, ``delivered_over_plain``).  Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from bench.common.systems import load_1m, peak_rss_mb
from bench.decoder.batch import engine_run, probe

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."
MODES = ("plain", "stateful", "stateful-alone", "windows")


def _run(tts: Any, batch: int, spec: dict[str, Any], marks: list, mode: str) -> dict[str, Any]:
    """One :data:`MODES` run of ``batch`` requests: ``engine_run``'s figures, ``wall_s`` and the codec's."""
    pipeline, stream_codec, engine_of = tts.pipeline, tts.pipeline.stream_codec, tts.engine
    if mode == "windows":
        pipeline.stream_codec = None
    if mode == "stateful-alone":  # one stream step per codec run
        def alone(**kw: Any) -> Any:
            engine = engine_of(**kw)
            engine.codec.batch_streams = False
            return engine

        tts.engine = alone
    try:
        t0 = time.perf_counter()
        out, engine, _ = engine_run(tts, batch, spec, marks, streamed=mode != "plain")
        out["wall_s"] = time.perf_counter() - t0
        cs = engine.codec.stats
        out["codec"] = {"runs": cs.runs, "rows_per_run": cs.windows / cs.runs if cs.runs else None,
                        "frames": cs.frames, "seconds": round(cs.seconds, 3)}
    finally:
        pipeline.stream_codec = stream_codec
        vars(tts).pop("engine", None)
    return out


def main(argv: list[str] | None = None) -> int:
    import higgs_pack

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle")
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    tts = higgs_pack.load(args.bundle)
    pipeline = tts.pipeline
    if pipeline.stream_codec is None:
        print(f"{args.bundle} has no audio_tokenizer_stream (built before manifest format 2)", file=sys.stderr)
        return 2
    marks = probe(tts)
    spec = {"text": TEXT, "frames": args.frames, "seed": 1, "temperature": 0.8, "top_k": 50}
    sizes = [int(b) for b in args.batch.split(",")]
    before = load_1m()
    for batch in sizes:  # warm-up
        for mode in MODES:
            _run(tts, batch, {**spec, "frames": 20}, marks, mode)
    rows = []
    for batch in sizes:
        rounds = []
        for _ in range(args.repeats):
            r = {mode: _run(tts, batch, spec, marks, mode) for mode in MODES}
            plain = r["plain"]["aggregate_frames_per_s"]
            for mode in MODES[1:]:
                rate = r[mode]["aggregate_frames_per_s"]
                r[mode]["over_plain"] = rate / plain if rate and plain else None
                r[mode]["delivered_over_plain"] = (r[mode]["delivered_frames_per_s"]
                                                   / r["plain"]["delivered_frames_per_s"])
            rounds.append(r)
        keys = ("aggregate_frames_per_s", "delivered_frames_per_s", "over_plain", "delivered_over_plain")
        summary = {mode: {key: statistics.median(x[mode][key] or 0 for x in rounds)
                          for key in keys[:2 if mode == "plain" else 4]} for mode in MODES}
        rows.append({"batch": batch, "median": summary, "rounds": rounds})
    print(json.dumps({"bundle": str(args.bundle), "frames": args.frames, "lookahead_frames":
                      pipeline.stream_codec.lookahead_frames, "window_context_frames": pipeline.codec_context_frames,
                      "rows": rows, "loadavg_1m": [before, load_1m()], "peak_rss_mb": peak_rss_mb()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
