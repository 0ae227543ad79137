"""Live sessions in the serve load test (``--live-sessions 1,8``): text arriving like an LLM's over
``/v1/audio/speech/stream`` (docs/serving/live.md, docs/benchmarks/serve-load.md).

Each session sends one text in pieces of :data:`TOKEN_CHARS` characters at ``tokens_per_s``, then
``input.done``, and reads everything back.  Per sentence (seconds since the session opened): when
its last piece was sent, its first audio and first speech (after the pause that opens every
sentence but the first), that speech after it was ready (its last piece sent and the sentence
before it done) and the server's ``first_audio_s``; per session the playback gaps of a player
starting at the first audio, and any audio lost or reordered.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from typing import Any

#: Characters per piece of text sent (about one English BPE token).
TOKEN_CHARS = 4
#: The server's rate and frame size (samples) and the pause before every sentence after the first.
RATE, FRAME_SAMPLES, PAUSE_S = 24000, 960, 0.2
#: A gap shorter than this is not counted (scheduling jitter of the measuring process).
GAP_S = 0.05


def pieces(text: str, chars: int = TOKEN_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``chars`` characters, each with the whitespace before it."""
    return re.findall(rf"\s*\S{{1,{chars}}}", text) + ([text[len(text.rstrip()):]] if text != text.rstrip() else [])


async def one_session(url: str, text: str, seed: int, tokens_per_s: float, timeout: float) -> dict[str, Any]:
    """One session's record: ``sentences`` (text, last piece sent and first audio, seconds since the
    session opened, ``first_audio_after_text_s``, the server's ``first_audio_s``, ``frames``,
    ``start``, ``end``), ``gaps_s`` of playback, ``problems`` (lost or reordered audio)."""
    import websockets

    sentences: list[dict[str, Any]] = []
    sent_at: list[tuple[int, float]] = []  # (characters sent so far, when)
    audio: dict[int, int] = {}
    arrived: dict[int, float] = {}  # a sentence's first binary message (after the first: its pause)
    speech: dict[int, float] = {}  # its first message of speech (the pause is a message of its own)
    done: dict[int, float] = {}  # its audio.done
    problems: list[str] = []
    t0 = time.perf_counter()
    async with websockets.connect(url, max_size=None, open_timeout=timeout) as ws:
        await ws.send(json.dumps({"type": "session.config", "seed": seed, "response_format": "pcm"}))

        async def send() -> None:
            chars = 0
            for piece in pieces(text):
                await ws.send(json.dumps({"type": "input.text", "text": piece}))
                chars += len(piece)
                sent_at.append((chars, time.perf_counter() - t0))
                await asyncio.sleep(1 / tokens_per_s)
            await ws.send(json.dumps({"type": "input.done"}))

        sender = asyncio.create_task(send())
        current = None
        async for message in ws:
            now = time.perf_counter() - t0
            if isinstance(message, bytes):
                pause = current and current not in arrived and message == bytes(len(message))
                audio[current] = audio.get(current, 0) + len(message)
                arrived.setdefault(current, now)
                if not pause:
                    speech.setdefault(current, now)
                continue
            event = json.loads(message)
            if event["type"] == "audio.start":
                current = event["sentence_index"]
                if current != len(sentences):
                    problems.append(f"sentence {current} started after {len(sentences)} sentences")
                sentences.append({"index": current, "text": event["sentence_text"]})
            elif event["type"] == "audio.done":
                sentences[-1].update({k: event.get(k) for k in ("frames", "start", "end", "first_audio_s",
                                                                 "prefill_s", "prefilled")})
                done[event["sentence_index"]] = now
            elif event["type"] == "error":
                problems.append(f"error event: {event.get('message')}")
        await sender
    return _session_record(text, sentences, sent_at, audio, arrived, speech, done, problems)


def _session_record(text: str, sentences: list[dict[str, Any]], sent_at: list[tuple[int, float]],
                    audio: dict[int, int], arrived: dict[int, float], speech: dict[int, float],
                    done: dict[int, float], problems: list[str]) -> dict[str, Any]:
    at, played_until, gaps = 0, None, []
    position = 0.0
    for s in sentences:
        i = s["index"]
        # the piece that completed this sentence: the first whose characters reach its end in the text
        end = text.find(s["text"], at) + len(s["text"]) if s["text"] in text[at:] else None
        at = end if end is not None else at
        last = next((t for chars, t in sent_at if end is not None and chars >= end), None)
        s["last_text_s"] = last
        s["first_audio_at_s"], s["first_speech_at_s"] = arrived.get(i), speech.get(i)
        s["first_audio_after_text_s"] = (speech[i] - last) if last is not None and i in speech else None
        ready = None if last is None else max(last, done.get(i - 1, 0.0))
        s["first_audio_after_ready_s"] = (speech[i] - ready) if ready is not None and i in speech else None
        # beyond its own prompt's prefill (the server's prefill_s: rolling context and text), which the goal allows
        s["first_audio_after_ready_less_prefill_s"] = (None if s["first_audio_after_ready_s"] is None
                                                       or s.get("prefill_s") is None
                                                       else s["first_audio_after_ready_s"] - s["prefill_s"])
        pause = PAUSE_S if i else 0.0
        want = 2 * (round(pause * RATE) + s.get("frames", 0) * FRAME_SAMPLES)
        if audio.get(i, 0) != want:
            problems.append(f"sentence {i}: {audio.get(i, 0)} bytes, its frames make {want}")
        if "start" in s and abs(s["start"] - (position + pause)) > 1e-3:
            problems.append(f"sentence {i} starts at {s['start']} s, after {position} s of audio and the pause")
        position = s.get("end", position)
        seconds = audio.get(i, 0) / 2 / RATE
        if i in arrived:  # a player starts at the first audio and plays on while audio is there
            if played_until is None:
                played_until = arrived[i]
            gap = arrived[i] - played_until
            if gap > GAP_S:
                gaps.append(round(gap, 4))
            played_until = max(played_until, arrived[i]) + seconds
    return {"sentences": sentences, "gaps_s": gaps, "problems": problems, "audio_s": position}


def run_live(url: str, texts: Sequence[str], sessions: int, tokens_per_s: float, timeout: float,
             first: int = 0) -> dict[str, Any]:
    """``sessions`` concurrent sessions (session ``i``: text ``(first + i) mod len(texts)``, seed
    ``first + i``) against the server at ``url`` (``http://host:port``); their records and a
    summary for the load test's JSON."""
    ws_url = "ws" + url.rstrip("/")[4:] + "/v1/audio/speech/stream"

    async def all_sessions() -> list[dict[str, Any]]:
        return await asyncio.gather(*(one_session(ws_url, texts[i % len(texts)], i, tokens_per_s, timeout)
                                      for i in range(first, first + sessions)))

    t0 = time.perf_counter()
    records = asyncio.run(all_sessions())
    after, ready, beyond = ([s[key] for r in records for s in r["sentences"] if s.get(key) is not None]
                            for key in ("first_audio_after_text_s", "first_audio_after_ready_s",
                                        "first_audio_after_ready_less_prefill_s"))
    return {"sessions": sessions, "tokens_per_s": tokens_per_s, "token_chars": TOKEN_CHARS,
            "seconds": time.perf_counter() - t0, "sentences": sum(len(r["sentences"]) for r in records),
            "audio_s": sum(r["audio_s"] for r in records),
            "first_audio_after_text_s": spread(after), "first_audio_after_ready_s": spread(ready),
            "first_audio_after_ready_less_prefill_s": spread(beyond),
            "prefill_s": spread([s["prefill_s"] for r in records for s in r["sentences"]
                                  if s.get("prefill_s") is not None]),
            "server_first_audio_s": spread([s["first_audio_s"] for r in records for s in r["sentences"]
                                             if s.get("first_audio_s") is not None]),
            "gaps": sum(len(r["gaps_s"]) for r in records),
            "max_gap_s": max((g for r in records for g in r["gaps_s"]), default=0.0),
            "problems": [p for r in records for p in r["problems"]], "session_records": records}


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """``n``, ``p50``, ``p90`` and ``max`` of ``values`` (None for none)."""
    if not values:
        return None
    ordered = sorted(values)
    return {"n": len(ordered), "p50": ordered[len(ordered) // 2], "p90": ordered[min(len(ordered) - 1,
                                                                                 int(0.9 * len(ordered)))],
            "max": ordered[-1]}
