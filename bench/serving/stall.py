"""Event-loop stall of ``higgs-pack serve`` under CPU work a request brings
(``python -m bench.serving.load --stall``).

While ``clones`` cloning requests (each a ``ref_audio`` clip of ``clip_seconds``, base64 in the
JSON body) and one voice upload (``POST /v1/audio/voices``) run, ``/health`` is asked every
``probe_ms``: it does no work, so its latency is how long the server's event loop was held by
something else (a body parsed, a clip decoded, a whole answer encoded on the loop).  The same
probe runs on the idle server first; the record is each phase's latency percentiles (ms) and the
requests' statuses (a full queue answers 429 before decoding anything: issue 37 item 5).
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from typing import Any

import numpy as np

#: A cloning request's clip: long enough to cost a decode and an encode, under --max-ref-seconds.
CLIP_SECONDS = 10.0


def clip_wav(seconds: float = CLIP_SECONDS, rate: int = 16000, seed: int = 0) -> bytes:
    """A WAV of speech-like noise (float32 -> 16-bit PCM), ``seconds`` long at ``rate`` Hz."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.3 * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(t.size)
    out = io.BytesIO()
    sf.write(out, samples.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _latency(values_s: list[float]) -> dict[str, float] | None:
    if not values_s:
        return None
    ms = np.asarray(values_s) * 1000
    return {"n": int(ms.size), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max())}


async def _probe(client: Any, url: str, until: asyncio.Event, every_s: float, out: list[float]) -> None:
    while not until.is_set():
        t0 = time.perf_counter()
        await client.get(url + "/health")
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(every_s)


async def _stall(url: str, model: str, clones: int, clip: bytes, transcript: str, probe_ms: float,
                 idle_s: float, timeout: float) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=timeout) as client:
        idle: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe(client, url, stop, probe_ms / 1000, idle))
        await asyncio.sleep(idle_s)
        stop.set()
        await probe
        busy: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe(client, url, stop, probe_ms / 1000, busy))
        body = {"model": model, "input": "A short sentence in a cloned voice.", "ref_text": transcript,
                "ref_audio": "data:audio/wav;base64," + base64.b64encode(clip).decode("ascii"), "max_new_tokens": 8}
        t0 = time.perf_counter()
        requests = [client.post(url + "/v1/audio/speech", json={**body, "seed": i}) for i in range(clones)]
        name = f"stall-{int(time.time() * 1000) % 10**8}"
        upload = client.post(url + "/v1/audio/voices", files={"audio": ("clip.wav", clip, "audio/wav")},
                             data={"name": name, "transcript": transcript})
        answers = await asyncio.gather(*requests, upload, return_exceptions=True)
        seconds = time.perf_counter() - t0
        stop.set()
        await probe
        if not isinstance(answers[-1], BaseException) and answers[-1].status_code == 201:
            await client.delete(url + f"/v1/audio/voices/{name}")
    statuses: dict[str, int] = {}
    for answer in answers:
        key = type(answer).__name__ if isinstance(answer, BaseException) else str(answer.status_code)
        statuses[key] = statuses.get(key, 0) + 1
    return {"clones": clones, "clip_seconds": CLIP_SECONDS, "probe_ms": probe_ms, "busy_s": seconds,
            "idle": _latency(idle), "busy": _latency(busy), "statuses": statuses}


def run_stall(url: str, model: str, clones: int = 8, *, probe_ms: float = 10.0, idle_s: float = 2.0,
              timeout: float = 300.0) -> dict[str, Any]:
    """The stall record (module docstring) of the server at ``url`` serving ``model``.

    Returns:
        ``{"clones", "clip_seconds", "probe_ms", "busy_s", "idle": {...}, "busy": {"n", "p50_ms",
        "p99_ms", "max_ms"}, "statuses": {"200": n, "201": 1, "429": n}}``.
    """
    clip = clip_wav()
    return asyncio.run(_stall(url, model, clones, clip, "A steady hum for the stall test.", probe_ms, idle_s, timeout))
