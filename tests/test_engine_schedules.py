"""Issue 30 item 5: random join and leave schedules through the engine, each request giving
exactly its codes alone.

A schedule (seeded, :func:`make_schedule`) picks an engine size (1 to 4 rows), how a prompt
joining decoding rows is prefilled (``prefill_chunk``: sized at run time, whole, or fixed
chunks), a handful of requests from :data:`POOL` (zero-shot, a reference clip, two prepared
voices reused across requests, so their prefixes' KV come from the pipeline's voice prefix cache
after the first, which ``synthesize`` shares; a text long enough for two text chunks with a
rolling context; the same request may run twice at once), the engine step at which each one is
submitted, whether it is read whole
(``result``) or streamed (iterated on its own thread), and for some the step at which it is
cancelled (while queued, mid-stream, or after it ended).  Every request that is not cancelled
must give the codes and samples of the same request run alone through ``TTS.synthesize`` (or
``TTS.stream`` for a streamed one) with the same seed, on the same loaded bundle, between the
schedules' engines; a cancelled one reads as cancelled (or gave its whole result before the
cancel came), and a cancelled stream's chunks are the first chunks of its stream alone.
Codes are compared exactly; samples within the codec batcher's
:data:`~higgs_pack.runtime.engine.codec_batch.BATCH_ATOL` (the engine's codec thread decodes
same-length windows of several readers in one run: OpenVINO's CPU convolutions then round a
row up to ~5e-7 apart from the window decoded alone; ONNX Runtime's are exact here).

Bundles whose batched rows are bit-identical to their runs alone: the cpu fp32 bundle on ONNX
Runtime, and the openvino int4 bundle on the paged engine with a bf16 KV cache (bf16 inference;
``tests/test_engine_paged.py``), against each request alone on the paged engine (its attention
kernel is not the stateful decoder's; one row runs the stateful decoder, against ``synthesize``).
Each schedule's events wait on ``engine.stats.steps``
(or on an idle engine), so the exact interleaving varies from run to run; the property holds
for any interleaving.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import skip_on_amx, slow_fixture
from test_engine import _wait_for

import higgs_pack
from higgs_pack.runtime.engine.codec_batch import BATCH_ATOL
from higgs_pack.runtime.engine.handle import RequestCancelled

#: Schedules run per backend (seeds 0..N-1); a handful, so each backend takes well under a minute.
SCHEDULES = 5

#: A text of two text chunks (over the 200-word chunk budget), each prompt after the first
#: carrying the previous chunk's text and codes.
TWO_CHUNKS = " ".join(f"Sentence {i} is spoken here, and then the next one follows." for i in range(21))


@dataclass(frozen=True)
class Spec:
    """One request of the pool: what to say, its seed and frame cap, and its voice
    (``None``, ``"clip"``: the reference clip with its transcript, ``"voice"``: the same clip
    prepared once with ``tts.prepare_voice`` and reused by every request naming it,
    ``"voice2"``: the same clip's codes prepared with only the transcript's first half, so a
    voice prefix that differs from ``"voice"``'s in its text alone: a KV cache of voice
    prefixes keyed by less than both must not serve one for the other)."""

    text: str
    seed: int
    max_frames: int
    voice: str | None = None


POOL = [
    Spec("Hello there.", 0, 60),
    Spec("A somewhat longer sentence to say, with more words in it than the others.", 1, 70),
    Spec("Short one.", 2, 25),
    Spec("Hello there.", 3, 45, "clip"),
    Spec("The voice of the clip reads this line.", 4, 50, "voice"),
    Spec("Another line in the same prepared voice.", 5, 35, "voice"),
    Spec(TWO_CHUNKS, 6, 20),
    Spec("Five.", 7, 30, "clip"),
    # Long enough to be on its row, or streaming, when a cancel 0-40 steps after it was
    # submitted comes.
    Spec("A long request, which a cancel is likely to stop halfway.", 8, 200),
    Spec("A long request in the prepared voice.", 9, 150, "voice"),
    Spec("The voice of the clip reads this line.", 4, 50, "voice2"),
]
#: ``prefill_chunk`` of the schedules' engines, by seed: the engine's sizing from measured costs,
#: whole prompts, and fixed chunks (2: the smallest, so a joining prompt spans many steps).
PREFILL_CHUNKS = ("auto", 0, 2, 8, 16)

#: The long requests of :data:`POOL`.
LONG = [i for i, spec in enumerate(POOL) if spec.max_frames >= 150]


@dataclass(frozen=True)
class Entry:
    """One request of a schedule: ``POOL[spec]``, submitted at engine step ``join``, read whole
    or streamed, cancelled at step ``cancel`` (None: never)."""

    spec: int
    join: int
    stream: bool
    cancel: int | None


@dataclass(frozen=True)
class Schedule:
    seed: int
    max_batch: int
    prefill_chunk: int | str
    entries: tuple[Entry, ...]

    def events(self) -> list[tuple[int, int, str, int]]:
        """(step, order, kind, entry index), in the order they are played (a join before a
        cancel of the same step)."""
        out = [(e.join, 0, "join", i) for i, e in enumerate(self.entries)]
        out += [(e.cancel, 1, "cancel", i) for i, e in enumerate(self.entries) if e.cancel is not None]
        return sorted(out)


def make_schedule(seed: int) -> Schedule:
    """A random schedule: ``1 + seed % 4`` rows (so a few seeds cover one row, where the engine
    drives the bundle's own batch-1 decoder, and several), 4-7 requests of :data:`POOL` (repeats
    allowed), joins over the first 60 engine steps (the first at 0), 40 % streamed, 30 %
    cancelled 0-40 steps after they are submitted, and one more: a :data:`LONG` request streamed
    and cancelled 20-60 steps after it is submitted."""
    rng = np.random.default_rng(seed)
    max_batch = 1 + seed % 4
    prefill_chunk = PREFILL_CHUNKS[seed % len(PREFILL_CHUNKS)]
    n = int(rng.integers(4, 8))
    joins = np.sort(rng.integers(0, 60, n))
    joins[0] = 0
    entries = []
    for join in joins:
        cancel = int(join + rng.integers(0, 41)) if rng.random() < 0.3 else None
        entries.append(Entry(int(rng.integers(len(POOL))), int(join), bool(rng.random() < 0.4), cancel))
    # And one long request streamed and cancelled 20-60 steps after it is submitted: mid-stream
    # when it got a row at once.
    join = int(rng.integers(0, 40))
    entries.append(Entry(int(rng.choice(LONG)), join, True, join + int(rng.integers(20, 61))))
    return Schedule(seed, max_batch, prefill_chunk, tuple(sorted(entries, key=lambda e: e.join)))


class Alone:
    """Each pool request run alone on one loaded bundle (``synthesize`` and ``stream``), computed
    when first asked, on the same object the engines run on."""

    def __init__(self, tts, cases_dir):
        self.tts = tts
        self.clip = cases_dir / "ref_en_16k.wav"
        self.transcript = (cases_dir / "ref_en_16k.txt").read_text().strip()
        self.voice = tts.prepare_voice(self.clip, self.transcript, "clip")
        words = self.transcript.split()
        self.voice2 = tts.prepare_voice(self.clip, " ".join(words[:len(words) // 2]), "clip, half its transcript")
        self._results: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray | list[np.ndarray]]] = {}

    def keywords(self, spec: Spec) -> dict:
        voice = {"clip": {"ref_audio": self.clip, "ref_text": self.transcript},
                 "voice": {"voice": self.voice}, "voice2": {"voice": self.voice2}}.get(spec.voice, {})
        return {"seed": spec.seed, "max_frames": spec.max_frames, **voice}

    def __call__(self, index: int, stream: bool):
        """(codes, samples) of ``synthesize``, or (codes, [chunk samples...]) of ``stream``."""
        key = (index, stream)
        if key not in self._results:
            spec = POOL[index]
            if stream:
                chunks = self.tts.stream(spec.text, **self.keywords(spec))
                pieces = [c.samples for c in chunks]
                self._results[key] = (chunks.codes, pieces)
            else:
                result = self.tts.synthesize(spec.text, **self.keywords(spec))
                self._results[key] = (result.codes, result.samples)
        return self._results[key]


def _read(handle, stream: bool, outcome: dict) -> None:
    """A reader thread: the whole result, or the streamed chunks as they come."""
    outcome["chunks"] = []
    try:
        if stream:
            chunks = iter(handle)
            for chunk in chunks:
                outcome["chunks"].append(chunk.samples)
            outcome["codes"] = chunks.codes
        else:
            result = handle.result(timeout=120)
            outcome["codes"], outcome["samples"] = result.codes, result.samples
        outcome["end"] = "done"
    except RequestCancelled:
        outcome["end"] = "cancelled"
    except BaseException as exc:  # reported by the checks
        outcome["end"] = exc


def run_schedule(tts, schedule: Schedule, alone: Alone, timeout: float = 120.0, whole_prompts: bool = False,
                 prefix_cache: bool = True) -> list[dict]:
    """Play ``schedule`` on ``tts.engine(max_batch=..., prefill_chunk=...)`` (``whole_prompts``:
    ``prefill_chunk=0`` whatever the schedule says; ``prefix_cache=False``: the engine keeps no
    voice prefix, so every prompt is prefilled whole): each event waits until the engine has taken
    its step (or has nothing left to do).  Returns each entry's outcome (``end``: "done",
    "cancelled" or the exception; ``codes``; ``samples`` or ``chunks``)."""
    outcomes: list[dict] = [{} for _ in schedule.entries]
    threads, handles = [], {}
    chunk = 0 if whole_prompts else schedule.prefill_chunk
    with tts.engine(max_batch=schedule.max_batch, prefill_chunk=chunk) as engine:
        if not prefix_cache:
            engine.prefix_cache = None
        for step, _, kind, i in schedule.events():
            _wait_for(lambda s=step: engine.stats.steps >= s or (engine.busy_rows == 0 and engine.waiting == 0),
                      f"engine step {step}", timeout)
            entry = schedule.entries[i]
            if kind == "join":
                spec = POOL[entry.spec]
                handles[i] = engine.submit(spec.text, **alone.keywords(spec))
                thread = threading.Thread(target=_read, args=(handles[i], entry.stream, outcomes[i]), daemon=True)
                thread.start()
                threads.append(thread)
            else:
                handles[i].cancel()
        for thread in threads:
            thread.join(timeout)
            assert not thread.is_alive(), f"schedule {schedule}: a reader is still waiting after {timeout} s"
        assert engine.busy_rows == 0 and engine.waiting == 0 and engine.kv_bytes_in_use == 0
        assert engine.stats.max_rows <= schedule.max_batch
    return outcomes


def check_schedule(tts, alone: Alone, seed: int, whole_prompts: bool = False, prefix_cache: bool = True) -> None:
    """:func:`run_schedule` of :func:`make_schedule` ``(seed)``, then every outcome against the
    runs alone (computed after the engine closed, on the same object)."""
    schedule = make_schedule(seed)
    outcomes = run_schedule(tts, schedule, alone, whole_prompts=whole_prompts, prefix_cache=prefix_cache)
    finished = 0
    for i, (entry, outcome) in enumerate(zip(schedule.entries, outcomes, strict=True)):
        where = f"schedule {seed} ({schedule.max_batch} rows), entry {i}: {entry}, {POOL[entry.spec]}"
        end = outcome.get("end")
        assert end in ("done", "cancelled"), f"{where}: ended with {end!r}"
        codes, want = alone(entry.spec, entry.stream)
        if end == "cancelled":
            assert entry.cancel is not None, f"{where}: cancelled without a cancel"
            # The chunks streamed before the cancel are the first chunks of the stream alone.
            for n, (got, expected) in enumerate(zip(outcome["chunks"], want if entry.stream else [], strict=False)):
                np.testing.assert_allclose(got, expected, rtol=0, atol=BATCH_ATOL, err_msg=f"{where}: streamed chunk {n}")
            continue
        finished += 1
        np.testing.assert_array_equal(outcome["codes"], codes, err_msg=f"{where}: codes")
        if entry.stream:
            assert len(outcome["chunks"]) == len(want), f"{where}: {len(outcome['chunks'])} chunks, alone {len(want)}"
            for n, (got, expected) in enumerate(zip(outcome["chunks"], want, strict=True)):
                np.testing.assert_allclose(got, expected, rtol=0, atol=BATCH_ATOL, err_msg=f"{where}: streamed chunk {n}")
        else:
            np.testing.assert_allclose(outcome["samples"], want, rtol=0, atol=BATCH_ATOL, err_msg=f"{where}: samples")
    assert finished or all(e.cancel is not None for e in schedule.entries)


def check_next_text_chunk_beside_a_decoding_row(tts, alone: Alone) -> None:
    """The order a schedule found: a long text's second text chunk starts on its row inside an
    engine step (its first chunk's last frame drawn, the next prompt prefilled on the row) while
    another row goes on decoding, so that step's decoder run does not name the new chunk's row.
    Both requests give their codes alone.  (ONNX Runtime's batched decoder wrote the scratch
    position of a row a step did not name at position 0, over the new prompt's first position:
    the second chunk's codes parted from frame 21 on.)"""
    two, long = POOL.index(Spec(TWO_CHUNKS, 6, 20)), LONG[0]
    with tts.engine(max_batch=2, prefill_chunk=0) as engine:  # the next prompt whole, inside the step
        handles = [engine.submit(POOL[i].text, **alone.keywords(POOL[i])) for i in (two, long)]
        results = [h.result(timeout=120) for h in handles]
        assert engine.stats.max_rows == 2
    for i, result in zip((two, long), results, strict=True):
        np.testing.assert_array_equal(result.codes, alone(i, False)[0], err_msg=POOL[i].text[:40])


def test_schedules_are_seeded_and_varied():
    """The same seed gives the same schedule; the seeds run here cover batching (several rows
    and one), every prefill chunking, cancels, streams, voices and the two-chunk text."""
    assert make_schedule(3) == make_schedule(3) and make_schedule(3) != make_schedule(4)
    schedules = [make_schedule(seed) for seed in range(SCHEDULES)]
    entries = [e for s in schedules for e in s.entries]
    assert {s.max_batch for s in schedules} == {1, 2, 3, 4} and any(e.cancel is not None for e in entries)
    assert {s.prefill_chunk for s in schedules} == set(PREFILL_CHUNKS)
    assert any(e.stream for e in entries) and any(not e.stream for e in entries)
    used = {POOL[e.spec].voice for e in entries} | {POOL[e.spec].text == TWO_CHUNKS for e in entries}
    assert {None, "clip", "voice", "voice2", True} <= used, used


@slow_fixture(scope="module")
def ort_tts(cpu_fp32_bundle):
    with higgs_pack.load(cpu_fp32_bundle) as loaded:
        yield loaded


@slow_fixture(scope="module")
def ov_tts(ov_int4_bundle):
    """The openvino int4 bundle with its decoder compiled with a bf16 KV cache (bf16 inference,
    this CPU's default): the paged engine's packed rows are then bit-identical to rows alone
    (tests/test_engine_paged.py; skipped where the CPU infers in f32)."""
    pytest.importorskip("openvino", reason="the OpenVINO schedules need the openvino package ([openvino] extra)",
                        exc_type=ImportError)
    import openvino as ov
    from test_engine_paged import exact_config

    from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder

    config = exact_config()
    with higgs_pack.load(ov_int4_bundle, "cpu", cache_dir=False) as loaded:
        old = loaded.pipeline.decoder
        loaded.pipeline.decoder = OvStatefulDecoder(ov.Core(), old.path, "CPU", None, config, max_length=old.max_length)
        yield loaded


@pytest.fixture(scope="module")
def ort_alone(ort_tts, cases_dir):
    return Alone(ort_tts, cases_dir)


class EngineAlone(Alone):
    """Each pool request run alone on an engine of two rows of its own: the paged decoder's
    attention kernel is not the stateful decoder's (hidden states ~5e-7 apart in f32), so a
    request's codes alone on the paged engine are the ones its runs beside others must give."""

    def __call__(self, index: int, stream: bool):
        key = (index, stream)
        if key not in self._results:
            spec, outcome = POOL[index], {}
            with self.tts.engine(max_batch=2) as engine:
                _read(engine.submit(spec.text, **self.keywords(spec)), stream, outcome)
            assert outcome["end"] == "done", outcome["end"]
            self._results[key] = (outcome["codes"], outcome["chunks"] if stream else outcome["samples"])
        return self._results[key]


@pytest.fixture(scope="module")
def ov_alone(ov_tts, cases_dir):
    """Runs alone for one row (``synthesize``: the bundle's stateful decoder) and for several
    (:class:`EngineAlone`: the paged decoder), by ``max_batch``."""
    alone, paged = Alone(ov_tts, cases_dir), EngineAlone(ov_tts, cases_dir)
    return lambda max_batch: alone if max_batch == 1 else paged


@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_random_schedules_on_onnxruntime(ort_tts, ort_alone, seed):
    check_schedule(ort_tts, ort_alone, seed)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["voice-prefix-blocks", "no-prefix-cache"])
@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_random_schedules_on_openvino(ov_tts, ov_alone, seed, prefix_cache):
    """The paged engine (issue 39): prompts prefilled in chunks riding in the decode rows'
    forwards, voice prefixes restored as shared blocks (or no prefix cache at all), every
    request giving exactly its codes alone."""
    skip_on_amx()
    max_batch = make_schedule(seed).max_batch
    if max_batch == 1 and not prefix_cache:
        pytest.skip("one row runs the stateful decoder, whose prompt prefilled whole is not bit-identical to the "
                    "prefix-then-rest of synthesize with its prefix cache")
    check_schedule(ov_tts, ov_alone(max_batch), seed, prefix_cache=prefix_cache)


def test_next_text_chunk_beside_a_decoding_row_on_onnxruntime(ort_tts, ort_alone):
    check_next_text_chunk_beside_a_decoding_row(ort_tts, ort_alone)


def test_next_text_chunk_beside_a_decoding_row_on_openvino(ov_tts, ov_alone):
    check_next_text_chunk_beside_a_decoding_row(ov_tts, ov_alone(2))
