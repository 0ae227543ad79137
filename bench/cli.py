"""Benchmark the PyTorch reference and built bundles side by side (``nox -s bench``).

``python -m bench [--preset tiny|bench|full] [--systems pytorch,cpu-int4,...] [--frames N]
[--batch 1,2,4,8] [--out dist/bench.json]``, from the repository root.

Every system speaks the same text for the same fixed frame count with the same sampling
(temperature 0.8, top-k 50, seed 0, repeat guard off, EOC suppressed), after a warm-up, each in
its own process (:mod:`bench.workers`); ``--batch`` adds the engine at several batch sizes
(:mod:`bench.batch`), llama.cpp systems the bare decoder step beside llama.cpp's
(:mod:`bench.decoder_steps`).  What each record field means, and the goals it is judged
against, is the README's benchmark section and :func:`bench.records.goal_checks`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.decoder_steps import KIND as STEP_KIND
from bench.decoder_steps import render_steps
from bench.records import (
    BUILD_MEMORY_BUDGET_MB,
    render_batch,
    render_builds,
    render_details,
    render_table,
    write_records,
)
from bench.report import write_html
from bench.run import BenchOptions, run_bench
from bench.systems import (
    BENCH_TEXT,
    DEFAULT_BANDWIDTH_MIB,
    DEFAULT_CONTEXTS,
    DEFAULT_FRAMES,
    DEFAULT_SYSTEMS,
    FIT_MEMORY_BYTES,
    PRESETS,
)
from bench.workers import run_worker


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="bench", help="checkpoint preset (default: bench)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated: pytorch, <target>-<precision>[-<variant>][@<device>] "
                        f"(default: {','.join(DEFAULT_SYSTEMS)}); empty for none")
    p.add_argument("--bundle", action="append", default=[], metavar="PATH[@DEVICE]",
                   help="also measure this built bundle (repeatable)")
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="audio frames per run (25 per second)")
    p.add_argument("--repeats", type=int, help="timed runs per system, median reported "
                                               "(default 3, 1 for --preset full)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure all systems this many times in turn and keep each one's fastest "
                        "round (for shared machines; default 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="checkpoint and sampling seed")
    p.add_argument("--text", default=BENCH_TEXT, help="text spoken by every system")
    p.add_argument("--checkpoint", help="use this checkpoint directory instead of the preset's")
    p.add_argument("--cache", help="cache directory (default $HIGGS_PACK_CACHE or ~/.cache/higgs-pack)")
    p.add_argument("--rebuild", action="store_true", help="rebuild cached bundles")
    p.add_argument("--bandwidth-mib", type=int, default=DEFAULT_BANDWIDTH_MIB,
                   help="buffer for the memory-bandwidth measurement (0 = skip)")
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                   help="context lengths at which the bare decoder's step is timed "
                        f"(default {','.join(map(str, DEFAULT_CONTEXTS))}; empty for none)")
    p.add_argument("--batch", default="", metavar="B,B,...",
                   help="also measure every bundle's engine (tts.engine(max_batch=B)) at these batch sizes, "
                        "e.g. 1,2,4,8 (default: none)")
    p.add_argument("--fit-memory-gib", type=float, default=FIT_MEMORY_BYTES / 2**30,
                   help="memory budget of the largest batch at 2,000 positions that --batch computes "
                        f"(default {FIT_MEMORY_BYTES / 2**30:g})")
    p.add_argument("--fit-run", action="store_true",
                   help="with --batch: also run that largest batch (every KV page written, a few steps) and "
                        "record its peak RSS against the budget; it commits the whole budget: run it alone")
    p.add_argument("--step-batch", default="1,4", metavar="B,B,...",
                   help="batch sizes of the decoder-step comparison with llama.cpp systems (default 1,4)")
    p.add_argument("--steps-only", action="store_true",
                   help="with llama.cpp-* systems: time only the bare decoder step of every system "
                        "side by side, not the generation loop")
    p.add_argument("--llama-threads", type=int, metavar="N",
                   help="llama.cpp threads (default: the CPUs this process may use, as ONNX Runtime's pool)")
    p.add_argument("--timeout", type=float, help="seconds allowed per measuring process")
    p.add_argument("--out", default="dist/bench.json",
                   help="JSON records file, charted into the same name with .html ('' = do not write)")
    p.add_argument("--append", action="store_true", help="keep records of other systems already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--build-only", action="store_true",
                   help="build (or reuse) the bundles, write their build records, measure nothing")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return run_worker(args.worker)
    if args.frames < 2:
        _parser().error("--frames must be at least 2")
    try:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    except ValueError:
        _parser().error(f"--contexts must be comma-separated positions, got {args.contexts!r}")
    if any(c < 1 for c in contexts):
        _parser().error(f"--contexts must be positive, got {args.contexts!r}")
    batch = parse_batch(args.batch)
    if isinstance(batch, str):
        _parser().error(batch)
    if not args.fit_memory_gib > 0:
        _parser().error(f"--fit-memory-gib must be positive, got {args.fit_memory_gib}")
    if args.fit_run and not batch:
        _parser().error("--fit-run needs --batch (it runs the batch --batch computes to fit)")
    if args.llama_threads is not None and args.llama_threads < 1:
        _parser().error(f"--llama-threads must be >= 1, got {args.llama_threads}")
    step_batch = parse_batch(args.step_batch)
    if isinstance(step_batch, str) or not step_batch:
        _parser().error(f"--step-batch: {step_batch or 'give at least one size'}".replace("--batch", "sizes"))
    options = BenchOptions(
        preset=args.preset, systems=tuple(s for s in args.systems.split(",") if s.strip()),
        bundles=tuple(args.bundle), frames=args.frames, repeats=args.repeats, rounds=args.rounds,
        warmup=args.warmup,
        seed=args.seed, text=args.text, checkpoint=args.checkpoint, cache=args.cache,
        rebuild=args.rebuild, bandwidth_mib=args.bandwidth_mib, contexts=contexts, out=args.out or None,
        append=args.append, timeout=args.timeout, quiet=args.quiet, build_only=args.build_only,
        batch=batch, fit_run=args.fit_run, fit_memory_bytes=int(args.fit_memory_gib * 2**30),
        step_batch=step_batch, steps_only=args.steps_only, llama_threads=args.llama_threads,
    )
    from higgs_pack.manifests.errors import HiggsPackError

    try:
        records = run_bench(options)
    except HiggsPackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    builds = [r for r in records if r.get("kind") == "build"]
    steps = [r for r in records if r.get("kind") == STEP_KIND]
    records = [r for r in records if r.get("kind") is None]
    print(render_builds(builds))
    if records:
        print(render_table(records))
        if options.batch:
            print(render_batch(records))
        print(render_details(records))
    if steps:
        print(render_steps(steps))
    if options.out:
        write_records(builds + records + steps, Path(options.out), options.append)
        print(f"wrote {options.out}")
        try:
            print(f"wrote {write_html(Path(options.out))}")
        except HiggsPackError as exc:
            print(f"note: no HTML report: {exc}", file=sys.stderr)
    over = [b["system"] for b in builds if (b.get("peak_rss_mb") or 0) > BUILD_MEMORY_BUDGET_MB]
    if over:
        print(f"builds over the {BUILD_MEMORY_BUDGET_MB} MB memory budget: {', '.join(over)}", file=sys.stderr)
    failed = any("error" in r or "error" in (r.get("batch") or {}) for r in builds + records + steps)
    return 1 if over or failed else 0


def parse_batch(text: str) -> tuple[int, ...] | str:
    """``--batch``'s sizes (``"1,2,4,8"`` -> ``(1, 2, 4, 8)``; empty: none), or the error message."""
    try:
        sizes = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        return f"--batch must be comma-separated batch sizes such as 1,2,4,8, got {text!r}"
    if any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        return f"--batch sizes must be distinct whole numbers >= 1, got {text!r}"
    return sizes
