"""The agent benchmark (issue 41 item 1): ``python -m bench.serving.agent``.

A voice agent is judged by the time from its LLM's first token to the first audio the user
hears (Picovoice's open TTS latency benchmark streams picoLLM's tokens into each engine and
measures exactly that; ../shared/AGENTS-AND-SHIPPING.md).  This drives ``higgs-pack serve``'s
live WebSocket the same way: each session sends one of the cases' English texts as the LLM's
token pieces (the bundle's own Qwen3 tokenizer cuts it; each piece carries the whitespace
before it, as an LLM emits it) at a set rate (20 and 40 tokens/s), then ``input.done``, and
records

- ``first_token_to_speech_s``: the first piece sent -> the first audio byte received;
- ``first_commit_text_s``: the first piece sent -> the last piece of the first committed part
  (the first ``audio.start``'s text) sent, and ``server_added_s``: that moment -> the first
  audio byte (what the server adds once it has the text it needs);
- ``sentence_gaps_s``: for each later part, how long a player that started at the first audio
  and played in real time waited for its first audio (0 when it was there in time);
- ``underruns``: gaps of more than :data:`~bench.serving.live.GAP_S` in that playback after the
  first audio, and ``underrun_s`` their total;
- ``audio_s``: seconds of audio made.

Per level (a commit rule, a rate, a number of sessions at once) the p50 and p90 over sessions and
``core_s_per_audio_s``: the server process's CPU time (user + system, all threads; psutil) over
the audio seconds made (its inverse is real-time streams per core).  Beside them, in the same
run, the **floor** of this machine: the first commit's prefill + (lookahead + 1 + 7) decoder steps
(the codec's lookahead and one frame, each whole 7 steps after its first codebook: the delay
pattern) + one call of the streaming codec on those frames, measured in this process on the same
bundle (:func:`measure_floor`).

Kept as JSON (``--out``, e.g. docs/benchmarks/runs/agent-bench-DATE.json) and rendered in the
docs by the docs hook (``<!-- bench-table NAME agent -->``, :func:`agent_table`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.serving.live import GAP_S, spread

#: The commit rules compared by default (session.config fields; docs/serving/live.md): whole
#: sentences, clauses, and the live route's default (clause+first3).
RULES = {
    "sentence": {"split_granularity": "sentence", "first_commit_words": 0},
    "clause": {"split_granularity": "clause", "first_commit_words": 0},
    "clause+first3": {"split_granularity": "clause", "first_commit_words": 3},
}


def commit_rule(name: str) -> dict[str, Any]:
    """The session.config fields of a ``--rules`` entry: a name of :data:`RULES`, or
    ``GRANULARITY+firstN`` (``clause+first3``: split at clauses, the first 3 words alone).

    Raises:
        ValueError: any other name."""
    if name in RULES:
        return RULES[name]
    from higgs_pack.runtime.loop.sentences import GRANULARITIES

    granularity, _, first = name.partition("+first")
    if granularity in GRANULARITIES and first.isdigit() and int(first) > 0:
        return {"split_granularity": granularity, "first_commit_words": int(first)}
    raise ValueError(f"--rules: {name!r} is not one of {', '.join(RULES)} or GRANULARITY+firstN (e.g. clause+first3)")


#: The LLM rates measured, tokens per second.
RATES = (20.0, 40.0)
#: The server's audio: 16-bit mono PCM at this rate.
RATE = 24000


def token_pieces(text: str, tokenizer: str | Path) -> list[str]:
    """``text`` cut where the tokenizer (a ``tokenizer.json``) cuts it, each piece with the
    whitespace before it; joined, the pieces are ``text``."""
    from tokenizers import Tokenizer

    ends = [end for _, end in Tokenizer.from_file(str(tokenizer)).encode(text, add_special_tokens=False).offsets]
    cuts = sorted({0, *(e for e in ends if 0 < e < len(text)), len(text)})
    return [text[a:b] for a, b in itertools.pairwise(cuts)]


async def agent_session(url: str, pieces: Sequence[str], rate: float, rule: dict[str, Any], seed: int,
                        timeout: float) -> dict[str, Any]:
    """One session: ``pieces`` sent at ``rate`` per second under commit ``rule``; its record (see
    the module docstring), with ``problems`` (error events)."""
    import websockets

    sent: list[tuple[int, float]] = []  # (characters sent so far, seconds after the first piece)
    messages: list[tuple[float, int, int]] = []  # (arrival, part index, samples)
    parts: list[str] = []
    problems: list[str] = []
    async with websockets.connect(url, max_size=None, open_timeout=timeout) as ws:
        await ws.send(json.dumps({"type": "session.config", "seed": seed, "response_format": "pcm", **rule}))
        t0 = time.perf_counter()

        async def send() -> None:
            chars = 0
            for i, piece in enumerate(pieces):
                await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
                await ws.send(json.dumps({"type": "input.text", "text": piece}))
                chars += len(piece)
                sent.append((chars, time.perf_counter() - t0))
            await ws.send(json.dumps({"type": "input.done"}))

        sender = asyncio.create_task(send())
        async for message in ws:
            now = time.perf_counter() - t0
            if isinstance(message, bytes):
                messages.append((now, len(parts) - 1, len(message) // 2))
                continue
            event = json.loads(message)
            if event["type"] == "audio.start":
                parts.append(event["sentence_text"])
            elif event["type"] == "error":
                problems.append(event.get("message", ""))
        await sender
    return session_record("".join(pieces), parts, sent, messages, problems)


def session_record(text: str, parts: list[str], sent: list[tuple[int, float]],
                   messages: list[tuple[float, int, int]], problems: list[str]) -> dict[str, Any]:
    """The figures of one session from what was sent and received (times in seconds after the
    first piece was sent): see the module docstring."""
    first_audio = messages[0][0] if messages else None
    first_end = text.find(parts[0]) + len(parts[0]) if parts and parts[0] in text else None
    committed = next((t for chars, t in sent if first_end is not None and chars >= first_end), None)
    played_until, gaps, underruns, seen = None, [], [], set()
    for arrival, part, samples in messages:
        if played_until is None:
            played_until = arrival
        wait = max(0.0, arrival - played_until)
        if part not in seen and part > 0:
            gaps.append(round(wait, 4))
        seen.add(part)
        if wait > GAP_S:
            underruns.append(wait)
        played_until = max(played_until, arrival) + samples / RATE
    return {"parts": parts, "first_token_to_speech_s": first_audio, "first_commit_text_s": committed,
            "server_added_s": None if first_audio is None or committed is None else first_audio - committed,
            "sentence_gaps_s": gaps, "underruns": len(underruns), "underrun_s": round(sum(underruns), 4),
            "audio_s": sum(m[2] for m in messages) / RATE, "problems": problems}


def run_level(url: str, pid: int, texts: Sequence[list[str]], rate: float, rule: str, sessions: int,
              timeout: float, repeats: int = 1) -> dict[str, Any]:
    """``sessions`` sessions at once (session ``i``: text ``i mod len(texts)``, seed ``i``) under
    commit ``rule`` at ``rate``, ``repeats`` times one after another (their sessions pooled, seeds
    going on); their records, p50/p90 and the server's core-seconds per audio-second."""
    import psutil

    ws_url = "ws" + url.rstrip("/")[4:] + "/v1/audio/speech/stream"
    server = psutil.Process(pid)
    before = sum(server.cpu_times()[:2])

    async def all_sessions(first: int) -> list[dict[str, Any]]:
        return await asyncio.gather(*(agent_session(ws_url, texts[i % len(texts)], rate, commit_rule(rule), i, timeout)
                                      for i in range(first, first + sessions)))

    records = [r for k in range(repeats) for r in asyncio.run(all_sessions(k * sessions))]
    core_s = sum(server.cpu_times()[:2]) - before
    audio_s = sum(r["audio_s"] for r in records)

    def over(key: str) -> dict[str, float] | None:
        return spread([r[key] for r in records if r[key] is not None])

    return {"rule": rule, **commit_rule(rule), "tokens_per_s": rate, "sessions": sessions, "repeats": repeats,
            "first_token_to_speech_s": over("first_token_to_speech_s"), "first_commit_text_s": over("first_commit_text_s"),
            "server_added_s": over("server_added_s"),
            "sentence_gap_s": spread([g for r in records for g in r["sentence_gaps_s"]]),
            "underruns": sum(r["underruns"] for r in records), "underrun_s": sum(r["underrun_s"] for r in records),
            "audio_s": audio_s, "core_s": core_s, "core_s_per_audio_s": core_s / audio_s if audio_s else None,
            "problems": [p for r in records for p in r["problems"]], "session_records": records}


def measure_floors(bundle: str, texts: Sequence[str], repeats: int = 5) -> dict[str, dict[str, Any]]:
    """:func:`measure_floor` of each of ``texts`` (the sessions' first commits) on one load of ``bundle``."""
    import higgs_pack

    tts = higgs_pack.load(bundle)
    return {text: measure_floor(tts, text, repeats) for text in texts}


def measure_floor(tts: Any, text: str, repeats: int = 5) -> dict[str, Any]:
    """The floor of first speech on this machine for ``text`` (a first commit), medians of
    ``repeats`` after a warm-up: its prompt's prefill, a decoder step (the loop's seconds less the
    prefill, over its steps), and one call of the codec the server streams with on the frames its
    first audio needs (the stateful streaming codec's first call, lookahead + 1 frames; a bundle
    without one: the one-shot codec on as many).

    ``floor_s`` = prefill + (lookahead + 1 + ramp) steps + codec call, where ``ramp`` is the delay
    pattern's (codebooks - 1 = 7): codebook c of a frame is drawn c steps after its codebook 0, so
    frame ``lookahead``, the last the first frame's audio needs, is whole only ``lookahead + 1 + ramp``
    steps after the prefill.  ``floor_without_ramp_s`` is the floor as the first runs counted it
    (lookahead + 1 steps: a time no server can reach), kept to compare with them."""
    from higgs_pack.runtime.loop.codec import decode_codes
    from higgs_pack.runtime.loop.stateful_codec import first_call_feeds

    pipeline = tts.pipeline
    lookahead = tts.stream(text, max_frames=1).lookahead_frames
    frames = lookahead + 1
    ramp = pipeline.constants.num_codebooks - 1
    spec, stream = pipeline.stream_codec, pipeline.audio_tokenizer_stream
    prefill, step, codec, prompt = [], [], [], None
    for i in range(repeats + 1):
        result = tts.synthesize(text, seed=i, max_frames=frames + ramp + 8)
        chunk = result.chunks[0]
        codes = result.codes[:frames]
        started = time.perf_counter()
        if spec is not None and stream is not None:  # the first call of a stream: lookahead + 1 frames
            stream.run(first_call_feeds(codes.T[None], spec.state_size))
        else:
            decode_codes(pipeline, codes)
        if i:  # the first is the warm-up
            prefill.append(chunk.prefill_s)
            step.append((chunk.seconds - chunk.prefill_s) / max(len(chunk.delayed), 1))
            codec.append(time.perf_counter() - started)
        prompt = chunk.prompt_length
    p, s, c = (statistics.median(v) for v in (prefill, step, codec))
    return {"text": text, "prompt_positions": prompt, "lookahead_frames": lookahead, "ramp_steps": ramp,
            "prefill_s": p, "step_s": s, "codec_call_s": c, "codec": "stream" if spec is not None else "one-shot",
            "floor_s": p + (frames + ramp) * s + c, "floor_without_ramp_s": p + frames * s + c, "repeats": repeats}


def agent_table(record: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """The docs' table of one run: a row per level (p50 / p90), and the floor and machine as facts."""
    def pair(level: dict[str, Any], key: str) -> str:
        s = level.get(key)
        return "-" if not s else f"{s['p50'] * 1000:.0f} / {s['p90'] * 1000:.0f}"

    rows = [[lv["rule"], f"{lv['tokens_per_s']:.0f}", str(lv["sessions"]), pair(lv, "first_token_to_speech_s"),
             pair(lv, "first_commit_text_s"), pair(lv, "server_added_s"), pair(lv, "sentence_gap_s"),
             "-" if not lv.get("server_added_over_floor") else f"{lv['server_added_over_floor']['p50']:.2f}",
             str(lv["underruns"]), "-" if lv["core_s_per_audio_s"] is None else f"{lv['core_s_per_audio_s']:.2f}"]
            for lv in record["levels"]]
    facts = [f"floor of the first commit {f['text']!r}: prefill {f['prefill_s'] * 1000:.0f} ms + "
             f"{f['lookahead_frames'] + 1 + f.get('ramp_steps', 0)} steps x {f['step_s'] * 1000:.1f} ms + codec call "
             f"{f['codec_call_s'] * 1000:.0f} ms = **{f['floor_s'] * 1000:.0f} ms**"
             + (f" (lookahead + 1 + the delay pattern's {f['ramp_steps']})" if f.get("ramp_steps") else "")
             for f in record["floors"].values()]
    facts += [f"preset {record['preset']}, bundle {record['model']}, {record.get('repeats', 1)} run(s) of each level "
              f"pooled; load average {record['loadavg'][0]:.1f} at the start, {record['loadavg_end'][0]:.1f} at the end; "
              f"{record['machine_line']}"]
    return (["rule", "tokens/s", "sessions", "first token to speech ms p50 / p90", "first commit's text ms",
             "server adds ms", "server adds / floor p50", "later part gaps ms", "underruns", "core-s per audio-s"], rows, facts)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.common.systems import machine, machine_line
    from bench.serving.checks import case_texts
    from bench.serving.load import _bundle_for_preset
    from bench.serving.workers import ServerProcess

    p = argparse.ArgumentParser(prog="python -m bench.serving.agent", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench", choices=("tiny", "bench", "full"))
    p.add_argument("--bundle", help="a bundle (default: the bench's cpu int4 bundle of --preset)")
    p.add_argument("--cases", default="../shared/cases")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    p.add_argument("--sessions", default="1,3", help="sessions at once, per level")
    p.add_argument("--repeats", type=int, default=3, help="runs of each level, one after another, pooled")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default="dist/agent-bench.json")
    args = p.parse_args(argv)
    try:  # every rule checked before a bundle is built or a server started
        for rule in args.rules.split(","):
            commit_rule(rule)
    except ValueError as exc:
        p.error(str(exc))
    bundle = args.bundle or _bundle_for_preset(args.preset, None, False)
    texts = [t for t in case_texts(Path(args.cases)) if t.isascii()]  # the English prose
    tokenizer = Path(bundle) / "tokenizer.json"
    pieces = [token_pieces(t, tokenizer) for t in texts]
    record: dict[str, Any] = {"kind": "agent-bench", "preset": args.preset, "model": Path(bundle).name,
                              "machine": machine(), "loadavg": os.getloadavg(), "texts": texts, "repeats": args.repeats,
                              "levels": []}
    record["machine_line"] = machine_line(record["machine"])
    with ServerProcess(bundle, ["--max-batch", "4", "--max-queue", "8"]) as server:
        record["server_pid"] = server.pid
        for rule in args.rules.split(","):
            for rate in (float(r) for r in args.rates.split(",")):
                for sessions in (int(n) for n in args.sessions.split(",")):
                    level = run_level(server.url, server.pid, pieces, rate, rule, sessions, args.timeout, args.repeats)
                    record["levels"].append(level)
                    print(json.dumps({k: v for k, v in level.items() if k != "session_records"}), file=sys.stderr)
    firsts = sorted({r["parts"][0] for lv in record["levels"] for r in lv["session_records"] if r["parts"]})
    record["floors"] = measure_floors(bundle, firsts or texts[:1])
    record["loadavg_end"] = os.getloadavg()
    for level in record["levels"]:  # the goal's ratio: what the server adds over its first commit's floor
        for key, floor in (("server_added_over_floor", "floor_s"),
                           ("server_added_over_floor_without_ramp", "floor_without_ramp_s")):
            level[key] = spread([r["server_added_s"] / record["floors"][r["parts"][0]][floor]
                                 for r in level["session_records"] if r["server_added_s"] is not None and r["parts"]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record["floors"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
