"""What a long text's rolling context costs per chunk (issue 30 item 1): ``python -m bench.ab
rolling-context BUNDLE [--text-file F] [--k 0,1,2,3] [--keep-frames all,50]``.

For each ``K`` (``context_chunks``) and kept-frames choice (``context_frames``; ``all``: whole
chunks; K = 0 once), one multi-chunk text in a voice (the cases' 7-second clip by default) is
generated chunk by chunk as ``run_plan`` does, without the codec.  The voice's prefix KV is
computed once first, so every chunk restores it and prefills only its rolling context and text.
Per chunk: prompt positions, positions prefilled, prefill and generation ms, frames, and the
prefill share; per run the totals and ms per prefilled position and per frame.  The defaults (the
cases' two English sentences said twice: four chunks, 150 frames each at most) keep a full-size
cpu int4 run of K = 0..3 to about 6 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.systems import loadavg, machine_facts, markdown, print_report

#: The cases folder beside the repository (a reference clip with its .txt transcript, texts).
CASES = Path(__file__).resolve().parents[3] / "shared" / "cases"
DEFAULT_CLIP = CASES / "ref_en_16k.wav"
DEFAULT_TEXT = CASES / "text_en_basic.txt"
DEFAULT_WORDS = 12
#: The cases' English text is two sentences: said twice it makes four chunks, enough for K = 3.
DEFAULT_REPEAT = 2
DEFAULT_MAX_FRAMES = 150
HELP = "a long text's rolling context per chunk: prefill against generation per K (bench/ab/rolling.py)"
HEADERS = ["K", "keep", "chunk", "prompt", "prefilled", "prefill ms", "gen ms", "frames", "share"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``rolling-context`` flags."""
    parser.add_argument("bundle", type=Path, help="a built bundle (folder or archive)")
    parser.add_argument("--text-file", type=Path, default=DEFAULT_TEXT, help="the text (default: the cases' English)")
    parser.add_argument("--voice-clip", type=Path, default=DEFAULT_CLIP,
                        help="reference clip, its transcript beside it as .txt (default: the cases' 7-second clip)")
    parser.add_argument("--k", default="0,1,2,3", help="comma-separated context_chunks values")
    parser.add_argument("--keep-frames", default="all,50",
                        help="comma-separated context_frames values (all: whole chunks)")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="the text said this many times over")
    parser.add_argument("--words", type=int, default=DEFAULT_WORDS, help="most words per text chunk")
    parser.add_argument("--max-frames", type=int, default=DEFAULT_MAX_FRAMES, help="frame cap per text chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the JSON report here")


def _whole_list(value: str, flag: str, *, least: int, all_ok: bool = False) -> list[int | None]:
    from higgs_pack.errors import InputError

    out: list[int | None] = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        if all_ok and item == "all":
            out.append(None)
        elif item.isdigit() and int(item) >= least:
            out.append(int(item))
        else:
            raise InputError(f"{flag} {value!r}: {item!r} is not a whole number >= {least}"
                             + (" or 'all'" if all_ok else ""))
    if not out:
        raise InputError(f"{flag} is empty; give comma-separated values")
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The runs of ``args`` on the loaded bundle: ``{"voice_prefix": {...}, "runs": [{"k",
    "keep_frames", "chunks": [...], totals}]}``.

    Raises:
        InputError: a bad flag value, a missing clip or transcript, an unreadable text.
    """
    import higgs_pack
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.loop.decode import generate_codes
    from higgs_pack.runtime.loop.plan import chunk_prompt, most_positions, plan_request
    from higgs_pack.runtime.loop.prompt import prompt_of
    from higgs_pack.runtime.loop.text_chunks import plan_chunks
    from higgs_pack.runtime.request import SynthesisRequest

    ks = _whole_list(args.k, "--k", least=0)
    keeps = _whole_list(args.keep_frames, "--keep-frames", least=1, all_ok=True)
    transcript = args.voice_clip.with_suffix(".txt")
    if not args.voice_clip.is_file() or not transcript.is_file():
        raise InputError(f"--voice-clip {args.voice_clip}: needs the clip and its transcript {transcript.name} beside it")
    if args.repeat < 1 or args.words < 1 or args.max_frames < 1:
        raise InputError(f"--repeat {args.repeat}, --words {args.words}, --max-frames {args.max_frames}: each must be >= 1")
    text = " ".join([args.text_file.read_text(encoding="utf-8").strip()] * args.repeat)
    with higgs_pack.load(args.bundle) as tts:
        pipeline = tts.pipeline
        voice = tts.prepare_voice(args.voice_clip, transcript.read_text(encoding="utf-8").strip(), "bench")
        if tts.prefix_cache is None:
            raise InputError(f"{args.bundle}: its decoder keeps no voice prefix cache; nothing to measure here")
        warm = generate_codes(pipeline, prompt_of(pipeline, "Hi.", voice.codes, voice.transcript),
                              plan_request(pipeline, SynthesisRequest("Hi.", voice)).options, 1)
        prefix = {"positions": prompt_of(pipeline, "Hi.", voice.codes, voice.transcript).prefix_length,
                  "prefill_ms": round(1e3 * warm.prefill_s, 1)}
        chunks = tuple(plan_chunks(pipeline, text, voice.codes, voice.transcript, args.max_frames, args.words))
        runs = []
        for k in ks:
            for keep in keeps if k else keeps[:1]:
                request = SynthesisRequest.create(text, voice=voice, seed=args.seed, max_frames=args.max_frames,
                                                  context_chunks=k, context_frames=keep)
                plan = dataclasses.replace(plan_request(pipeline, request), chunks=chunks)
                plan = dataclasses.replace(plan, positions=most_positions(pipeline, plan))
                results, rows, before = [], [], loadavg()
                for index, (_, cap) in enumerate(plan.chunks):
                    prompt = chunk_prompt(pipeline, plan, index, results)
                    result = generate_codes(pipeline, prompt, plan.options, cap)
                    results.append(result)
                    generation = result.seconds - result.prefill_s
                    rows.append({"chunk": index, "prompt_positions": result.prompt_length,
                                 "prefilled": result.prefilled, "prefill_ms": round(1e3 * result.prefill_s, 1),
                                 "generation_ms": round(1e3 * generation, 1), "frames": len(result.codes),
                                 "stop_reason": result.stop_reason,
                                 "prefill_share": round(result.prefill_s / max(result.seconds, 1e-9), 4)})
                runs.append({"k": k, "keep_frames": keep, "chunks": rows, **_totals(rows),
                             "load_before": before, "load_after": loadavg()})
        return {"bundle": str(args.bundle), "backend": tts.bundle.manifest.get("backend"),
                "precision": tts.bundle.manifest.get("precision"),
                "decoder": pipeline.description.get("llm_decoder"), "words": args.words,
                "max_frames": args.max_frames, "chunk_words": [len(c.split()) for c, _ in chunks],
                "voice_prefix": prefix, "runs": runs}


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's sums over its chunks after the first (the first has no context), and its costs."""
    later = rows[1:] or rows
    prefill, generation = sum(r["prefill_ms"] for r in later), sum(r["generation_ms"] for r in later)
    return {"later_prefill_share": round(prefill / max(prefill + generation, 1e-9), 4),
            "ms_per_prefilled_position": round(sum(r["prefill_ms"] for r in rows)
                                               / max(sum(r["prefilled"] for r in rows), 1), 3),
            "ms_per_frame": round(sum(r["generation_ms"] for r in rows) / max(sum(r["frames"] for r in rows), 1), 3)}


def table(report: dict[str, Any]) -> str:
    """The runs as a Markdown table, a row per chunk, then a row per run's totals."""
    rows = [[run["k"], run["keep_frames"] or "all", row["chunk"], row["prompt_positions"], row["prefilled"],
             row["prefill_ms"], row["generation_ms"], row["frames"], f"{100 * row['prefill_share']:.1f}%"]
            for run in report["runs"] for row in run["chunks"]]
    totals = [[run["k"], run["keep_frames"] or "all", f"{100 * run['later_prefill_share']:.1f}%",
               run["ms_per_prefilled_position"], run["ms_per_frame"]] for run in report["runs"]]
    voice = report["voice_prefix"]
    return (f"voice prefix: {voice['positions']} positions, prefilled once in {voice['prefill_ms']} ms "
            f"(restored from the cache for every chunk below)\n\n{markdown(HEADERS, rows)}\n\n"
            f"{markdown(['K', 'keep', 'prefill share, chunks after the first', 'ms / prefilled position', 'ms / frame'], totals)}")


def command(args: argparse.Namespace) -> int:
    """``rolling-context``: measure, print, write ``--out``; 2 with the message on a bad input."""
    from higgs_pack.errors import InputError

    machine = machine_facts()
    started = time.perf_counter()
    try:
        report = measure(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {"command": "rolling-context", "machine": machine, "seconds": round(time.perf_counter() - started, 1),
              **report}
    return print_report(report, f"{machine['cpu']}, {report['backend']} {report['precision']} ({report['decoder']}), "
                        f"chunks of {report['chunk_words']} words, cap {report['max_frames']} frames", table(report),
                        args.out)
