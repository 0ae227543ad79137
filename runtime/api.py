"""The one-import Python API: ``higgs_pack.load(source)`` -> :class:`TTS`.

``load`` accepts every way a bundle reaches a user (a directory, an archive, the
name of an installed bundle wheel, a model slug, a ``hf://`` hub reference),
validates the bundle before any session exists (see
:func:`higgs_pack.runtime.sources.bundle.load_pipeline`), and returns a :class:`TTS` that speaks
text with the bundle's defaults.  ``TTS.info`` says which bundle, target,
precision and provider/device are in use, and why.

Runtime code: no torch, no build tools.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

from higgs_pack.errors import InputError, Problem
from higgs_pack.manifests.manifest import MANIFEST_NAME
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.backends import backend_of
from higgs_pack.runtime.engine.engine import DEFAULT_MAX_LENGTH, Engine
from higgs_pack.runtime.engine.handle import EngineClosed
from higgs_pack.runtime.loop.codec import encode_reference
from higgs_pack.runtime.loop.decode import ProgressCallback
from higgs_pack.runtime.loop.dialogue import DialogueRequest
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.plan import plan_request
from higgs_pack.runtime.loop.prefix_cache import PrefixCache, bundle_identity, prefix_layout
from higgs_pack.runtime.loop.prompt import check_text_tokens
from higgs_pack.runtime.loop.streaming import SpeechStream, stream_plan
from higgs_pack.runtime.loop.synthesis import SynthesisResult, run_plan
from higgs_pack.runtime.loop.text_chunks import voice_room_problems
from higgs_pack.runtime.request import PreparedVoice, SynthesisRequest, Voice, plain_type, refuse
from higgs_pack.runtime.sources.bundle import Bundle, load_pipeline, open_bundle

log = logging.getLogger(__name__)

#: ``device=`` value that lets the bundle (or, for a model slug, the variant choice) decide.
AUTO = "auto"


@dataclass(frozen=True)
class TTSInfo:
    """What a :class:`TTS` runs and why.

    Attributes:
        source: what was passed to :func:`load`.
        bundle: the bundle's name (``higgs-audio-v3-tiny-cpu-int4``).
        path: the bundle directory in use (a temporary folder for an archive).
        model: the model slug (``higgs-audio-v3-tiny``).
        target: ``cpu``, ``cuda``, ``dml`` or ``openvino``.
        precision: ``int4``, ``int8``, ``fp16`` or ``fp32``.
        variant: ``None`` or the variant name (``npu``).
        backend: ``onnxruntime`` or ``openvino``.
        device: the execution provider(s) / OpenVINO device(s) the sub-parts actually
            run on, as the backend reported them (``CPUExecutionProvider``, ``CPU``).
        devices: sub-part -> provider/device actually in use.
        reason: why this bundle and this provider/device were chosen.
        sample_rate: output sample rate in Hz (24000).
        not_chosen: for a model slug, every other visible bundle -> why it was not taken.
        notes: preferred devices present without a runnable bundle for them.
    """

    source: str
    bundle: str
    path: Path
    model: str
    target: str
    precision: str
    variant: str | None
    backend: str
    device: str
    devices: dict[str, str]
    reason: str
    sample_rate: int
    not_chosen: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}

    def __str__(self) -> str:
        variant = f" variant {self.variant}" if self.variant else ""
        return (f"{self.bundle}: target {self.target} precision {self.precision}{variant}, "
                f"{self.backend} on {self.device} ({self.reason})")


@dataclass
class Resolved:
    """A source resolved to one bundle directory.

    Attributes:
        path: the bundle directory.
        reason: how it was found, and for a choice why this bundle.
        device: provider/device a choice placed it on (None: the bundle's own).
        notes: preferred devices present without a bundle for them (see ``choice.Choice.notes``).
        stack: cleanup of temporary folders (an extracted archive).
    """

    path: Path
    reason: str
    device: str | None = None
    notes: tuple[str, ...] = ()
    not_chosen: dict[str, str] = field(default_factory=dict)
    verified: bool = False
    """Every file's sha256 was already checked (a hub pull): not hashed again."""
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class TTS:
    """A loaded bundle, ready to speak.  Create it with :func:`higgs_pack.load`.

    Attributes:
        info: :class:`TTSInfo` (bundle, target, precision, provider/device in use, why).
        pipeline: the underlying :class:`~higgs_pack.runtime.loop.pipeline.Pipeline`
            (for the lower-level functions of :mod:`higgs_pack.runtime.loop.plan` and
            :mod:`~higgs_pack.runtime.loop.synthesis`).
        sample_rate: output sample rate in Hz (24000).

    A TTS loaded from an archive keeps the extracted bundle in a temporary folder
    until :meth:`close` (or the end of a ``with`` block, or garbage collection).
    """

    def __init__(self, pipeline: Pipeline, bundle: Bundle, info: TTSInfo,
                 stack: contextlib.ExitStack | None = None):
        self.pipeline = pipeline
        self.bundle = bundle
        self.info = info
        self._stack = stack or contextlib.ExitStack()
        if pipeline.prefix_cache is None and prefix_layout(pipeline.decoder) is None:
            log.info("voice prefix cache off for %s: %s", bundle.name,
                     getattr(pipeline.decoder, "prefix_refusal", "its decoder does not export its KV cache"))
        elif pipeline.prefix_cache is None:
            pipeline.prefix_cache = PrefixCache(
                bundle_identity(bundle.manifest, pipeline.description.get(SubPart.LLM_DECODER, "")))

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The KV cache of voice prompt prefixes that :meth:`synthesize`, :meth:`stream` and the
        engines of this object share (:mod:`~higgs_pack.runtime.loop.prefix_cache`: ``stats``
        with hits, misses and bytes; ``max_bytes``, default 512 MiB; ``clear()``).  Set it to None
        to prefill every prompt whole."""
        return self.pipeline.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        self.pipeline.prefix_cache = cache

    @property
    def sample_rate(self) -> int:
        return self.pipeline.constants.sample_rate

    def __repr__(self) -> str:
        return f"<higgs_pack.TTS {self.info}>"

    def __enter__(self) -> TTS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the temporary folder of an archive (no-op otherwise)."""
        self._stack.close()

    def __del__(self) -> None:  # pragma: no cover - depends on the garbage collector
        with contextlib.suppress(Exception):
            self._stack.close()

    def synthesize(self, text: str | SynthesisRequest, *, progress: ProgressCallback | None = None,
                   **options: Any) -> SynthesisResult:
        """Speak ``text``, optionally in the voice of a reference clip.

        Args:
            text: what to say (a long text is cut at sentence ends into chunks spoken as
                continuous speech with a rolling context), or a ready :class:`~higgs_pack.runtime.request.SynthesisRequest`
                (then no other options).
            progress: called as ``progress(frames_done, frame_cap)`` after every frame.
            options: the keywords of :meth:`SynthesisRequest.create
                <higgs_pack.runtime.request.SynthesisRequest.create>`, checked before anything runs:
                ``ref_audio`` (a file, or ``(samples, sample_rate)`` with float32 samples in
                [-1, 1] of shape [samples] or [samples, channels], rate in Hz) with
                ``ref_text`` (its exact transcript); ``seed`` (default 0; None: random);
                ``temperature`` (0 = greedy), ``top_k`` (0 = all), ``top_p`` (in (0, 1]), each
                None = the bundle's default (0.8, 50, 1.0); ``max_frames`` (frame cap per
                chunk at 25 per second; None: from the text length).

        Returns:
            :class:`~higgs_pack.runtime.loop.synthesis.SynthesisResult`: ``samples`` float32
            [samples] mono, nominally in [-1, 1]; ``sample_rate`` in Hz (24000);
            ``codes`` int64 [frames, 8] codec codes; ``chunks`` per-chunk details.
            The whole audio is held: 96 KB per second (an hour of speech is 346 MB of samples,
            more while they are joined).  For a long text use :meth:`stream` and write or play
            each chunk as it comes (:class:`~higgs_pack.runtime.audio.WavFileWriter` writes them
            to a file, as ``higgs-pack synthesize -o out.wav`` does, holding one chunk at a time).

        Raises:
            InputError: empty text, a special token of the tokenizer in the text, a bad or
                unknown option (every bad one named at once), a stream's chunk option
                (``first_chunk_frames``...), ``ref_audio`` without ``ref_text`` (or the reverse),
                an unusable clip, or a sentence too long for the decoder's context.
            NumericalError: a sub-part returned NaN/inf (run ``higgs-pack verify``).
        """
        shaping = [name for name in ("first_chunk_frames", "chunk_growth", "max_chunk_frames") if name in options]
        if shaping:  # never taken silently: the whole audio is returned at once
            problems = [Problem(name, options[name], message="{name} shapes the chunks of a stream; whole audio "
                                "has none: give it to tts.stream()") for name in shaping]
            raise InputError("; ".join(map(str, problems)), problems)
        return run_plan(self.pipeline, plan_request(self.pipeline, SynthesisRequest.of(text, options)), progress)

    def stream(self, text: str | SynthesisRequest, *, progress: ProgressCallback | None = None,
               **options: Any) -> SpeechStream:
        """Speak ``text`` as audio chunks that arrive while the frames are generated.

        Same arguments, same speech as :meth:`synthesize` (same codes for the same seed;
        the chunks joined equal its samples within float rounding); the work is done by
        :func:`higgs_pack.runtime.loop.streaming.stream`.

        Args:
            text, progress: as :meth:`synthesize`.
            options: as :meth:`synthesize`, and the chunk schedule (frames at 25 per second):
                ``first_chunk_frames`` (default 10 = 0.4 s), ``chunk_growth`` (each later
                chunk this many times the previous one, default 2), ``max_chunk_frames``
                (default 100 = 4 s, at least ``first_chunk_frames``).

        Returns:
            A :class:`~higgs_pack.runtime.loop.streaming.SpeechStream`: iterate it for
            :class:`~higgs_pack.runtime.loop.streaming.AudioChunk` (``samples`` float32 mono,
            nominally in [-1, 1]; ``offset`` in samples; ``sample_rate`` in Hz);
            ``close()`` stops the generation at the next frame.

        Raises:
            InputError: as :meth:`synthesize` (a bad chunk schedule too), before the first chunk.
            NumericalError: while iterating, as :meth:`synthesize`.
        """
        started = time.perf_counter()
        return stream_plan(self.pipeline, plan_request(self.pipeline, SynthesisRequest.of(text, options)), progress,
                           started)

    def dialogue(self, turns: Iterable[Any] | DialogueRequest, *, voices: dict[str, Any] | None = None,
                 progress: ProgressCallback | None = None, **options: Any) -> SynthesisResult:
        """Speak a dialogue: turns of several speakers, each in its speaker's voice, as one audio.

        Each turn is generated with its speaker's voice and that speaker's recent turns as the
        rolling context (:mod:`~higgs_pack.runtime.loop.dialogue`); the turns join as continuous
        speech, and the result has one segment per turn (``segments[i].speaker``, exact times).

        Args:
            turns: ``(speaker, text)`` pairs, :class:`~higgs_pack.runtime.loop.dialogue.Turn`
                items or ``{"speaker", "text"}`` mappings, in order (at most 1000); or a ready
                :class:`~higgs_pack.runtime.loop.dialogue.DialogueRequest` (then nothing else).
            voices: speaker -> a prepared voice (:meth:`prepare_voice`), an ``(audio, transcript)``
                pair (a file or ``(samples, sample_rate)``, and the clip's exact words), or None;
                a speaker left out (or None) speaks its first turn in a voice of the model's
                choosing, which then is its voice.
            progress: as :meth:`synthesize`.
            options: as :meth:`synthesize` but the voice's (``seed``, ``temperature``, ``top_k``,
                ``top_p``, ``max_frames`` per text chunk, ``context_chunks``: the speaker's
                earlier chunks in each prompt).

        Returns:
            A :class:`~higgs_pack.runtime.loop.synthesis.SynthesisResult`.

        Raises:
            InputError: before anything is generated: an empty turn, a bad speaker name, a voice
                for nobody, more than 1000 turns (each named by its turn number), a bad option,
                an unusable clip, a special token or a sentence too long (naming the turn).
        """
        return run_plan(self.pipeline, self._dialogue_plan(turns, voices, options), progress)

    def stream_dialogue(self, turns: Iterable[Any] | DialogueRequest, *, voices: dict[str, Any] | None = None,
                        progress: ProgressCallback | None = None, **options: Any) -> SpeechStream:
        """:meth:`dialogue` as a stream of audio chunks (as :meth:`stream`; the stream schedule
        keywords too); each turn's segment comes with the piece that completes its audio
        (``AudioChunk.segments``)."""
        started = time.perf_counter()
        return stream_plan(self.pipeline, self._dialogue_plan(turns, voices, options), progress, started=started)

    def _dialogue_plan(self, turns: Any, voices: dict[str, Any] | None, options: dict[str, Any]):
        if isinstance(turns, DialogueRequest):
            if voices is not None or options:
                raise InputError.of(Problem.said("a DialogueRequest carries its own voices and options; set them when making it", code="conflicting_fields"))
            return turns.plan(self.pipeline)
        return DialogueRequest.create(turns, voices, **options).plan(self.pipeline)

    def prepare_voice(self, ref_audio: Any, ref_text: str, name: str = "") -> PreparedVoice:
        """Encode a reference voice once, for many requests (``voice=`` of :meth:`synthesize`,
        :meth:`stream` and the engine; the server's voice store keeps these).

        Args:
            ref_audio: a file libsndfile reads, or ``(samples, sample_rate)`` (float32
                [samples] or [samples, channels] in [-1, 1], Hz); checked as ``ref_audio=``
                is (length, silence, format).
            ref_text: its exact transcript.
            name: a label kept with the voice.

        Returns:
            A :class:`~higgs_pack.runtime.request.PreparedVoice` (int64 [frames, 8] codes at
            25 frames per second).

        Raises:
            InputError: an unusable clip or transcript (the same messages as ``ref_audio=``),
                a voice whose prompt leaves no room for text in the decoder's context, or a
                bundle without an audio encoder.
        """
        voice = Voice(ref_audio, ref_text)
        c = self.pipeline.constants
        check_text_tokens(self.pipeline, ref_text, "ref_text")
        codes = encode_reference(self.pipeline, voice.prepared(c.sample_rate, c.hop_length))
        refuse(voice_room_problems(self.pipeline, codes, ref_text))
        return PreparedVoice(codes, ref_text, name)

    def engine(self, max_batch: int = 4, *, max_length: int | None = None,
               max_kv_bytes: int | None = None, prefill_chunk: int | str = "auto",
               join_gap_steps: float | None = None) -> Engine:
        """A continuous-batching engine over this bundle: requests submitted from any thread
        join and leave between decoder steps (:mod:`higgs_pack.runtime.engine`).

        Args:
            max_batch: requests decoded together (rows), >= 1.  More than 1 needs a decoder
                that batches: ONNX Runtime's on its CPU and CUDA providers, OpenVINO's on
                PagedAttention (any device; not the NPU variant's static decoder).
            max_length: most positions (prompt + frames) per request; default the decoder's
                context, at most :data:`~higgs_pack.runtime.engine.engine.DEFAULT_MAX_LENGTH`.
                Address space is reserved for ``max_batch * max_length`` positions; memory is
                committed as positions are written and given back when a request leaves.
            max_kv_bytes: most bytes of KV cache the admitted requests may reach together; a
                request waits (first in, first out) until its peak KV (its largest chunk's
                prompt + frame cap, times ``engine.kv_bytes_per_position``) fits what the
                others leave, and one larger than the whole budget is refused at submit.
                None (default): half the memory available when the engine starts
                (``MemAvailable`` on Linux), at most all rows full; no limit where the
                machine does not say (logged) or the cache is in GPU memory.
            prefill_chunk, join_gap_steps: how a prompt joining running requests is prefilled
                (in chunks between their steps, so they keep getting frames): see
                :class:`~higgs_pack.runtime.engine.engine.Engine`.

        Returns:
            An :class:`~higgs_pack.runtime.engine.engine.Engine` (``submit(text, **options)``
            -> handle; ``handle.result()`` or iterate it for chunks; ``kv_bytes_per_position``,
            ``kv_budget_bytes``, ``kv_bytes_in_use`` for figures); close it, or use ``with``.

        Raises:
            InputError: a bad size, ``max_batch > 1`` on a backend or device that cannot
                batch (the message says why).
        """
        for name, value in (("max_batch", max_batch), ("max_length", max_length), ("max_kv_bytes", max_kv_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral) or value < 1):
                raise InputError.of(Problem.said(f"{name} must be a whole number >= 1, got {value!r}"))
        limit = self.pipeline.decoder.max_length
        length = min(limit, DEFAULT_MAX_LENGTH) if max_length is None else max_length
        if length > limit:
            raise InputError.of(Problem.said(f"max_length={length} is more than the decoder's context of {limit} positions"))
        backend = backend_of(self.bundle.manifest)
        decoder = backend.batched_decoder(self.pipeline, int(max_batch), int(length))
        return Engine(self.pipeline, decoder, max_kv_bytes=max_kv_bytes, prefill_chunk=prefill_chunk,
                      join_gap_steps=join_gap_steps)

    def synthesize_many(self, texts: Iterable[str | SynthesisRequest], *, max_batch: int = 4,
                        in_order: bool = True, max_length: int | None = None, max_kv_bytes: int | None = None,
                        **options: Any) -> Iterator[tuple[int, SynthesisResult | Exception]]:
        """Speak many texts through one engine (:meth:`engine`), several decoded per step.

        Text ``i`` is spoken with seed ``seed + i`` (``seed`` defaults to 0; ``seed=None`` draws
        a fresh seed per text): on an fp32 bundle it gets exactly the codes of
        ``tts.synthesize(texts[i], seed=seed + i, **options)``, whatever runs beside it; int4
        kernels may round differently with more rows (on the tiny int4 bundle 978 of 1,770
        frames of eight 300-frame requests at batch 4 matched their runs alone).  A ready
        :class:`~higgs_pack.runtime.request.SynthesisRequest` in ``texts`` keeps its own seed
        and options.  A reference voice (``ref_audio`` with ``ref_text``) is encoded once.

        A text that fails (refused at submit: empty, a special token, too long; or failing
        while generated: non-finite output) is yielded as ``(i, exception)`` in its place and
        the others go on; check ``isinstance(result, Exception)``.  Only a failure of the
        engine itself (its thread stopped) is raised.  Leaving the loop early (``break``,
        Ctrl-C) closes the engine, dropping the texts not yet yielded.

        Args:
            texts: what to say, one item per utterance (str or ``SynthesisRequest``); read
                lazily, at most ``4 * max_batch`` ahead of what has been yielded.
            max_batch, max_length, max_kv_bytes: as :meth:`engine`.
            in_order: True (default): yield in the order of ``texts``; False: as each text
                finishes (what a writer of files wants; the indices say which).
            options: the keywords of :meth:`synthesize` (``seed``, ``temperature``, ``top_k``,
                ``top_p``, ``max_frames``, ``ref_audio`` with ``ref_text``, ``voice``), for
                every str item (``SynthesisRequest`` items keep their own).

        Returns:
            An iterator of ``(index, result)``: ``index`` into ``texts`` (0-based), ``result``
            a :class:`~higgs_pack.runtime.loop.synthesis.SynthesisResult` or the exception that
            text raised (:class:`InputError`, :class:`NumericalError`, …).
            ``list(tts.synthesize_many(texts))`` holds every pair, in order.

        Raises:
            InputError: here, at the call: one string instead of texts, a bad or unknown option (every bad one named), a
                bad ``max_batch`` / ``max_length`` / ``max_kv_bytes``, or an unusable voice.
            EngineClosed, or the error that stopped the engine: while iterating.
        """
        if isinstance(texts, (str, bytes)):
            raise InputError.of(Problem.said("synthesize_many takes a list (or any iterable) of texts, got one string; use "
                                             "tts.synthesize(text) for one text, or synthesize_many([text])"))
        template = SynthesisRequest.of("-", options)  # every option checked now, before any text
        if isinstance(template.voice, Voice):  # the clip is read and encoded once, for every text
            template = dataclasses.replace(template, voice=self.prepare_voice(template.voice.audio,
                                                                              template.voice.transcript))
        base_seed = template.seed
        engine_kwargs = {"max_length": max_length, "max_kv_bytes": max_kv_bytes}
        for name, value in (("max_batch", max_batch), *engine_kwargs.items()):
            if (value is not None or name == "max_batch") and (
                    isinstance(value, bool) or not isinstance(value, Integral) or value < 1):
                raise InputError.of(Problem.said(f"{name} must be a whole number >= 1, got {value!r}"))

        def request_of(index: int, item: str | SynthesisRequest) -> SynthesisRequest:
            if isinstance(item, SynthesisRequest):
                return item
            seed = None if base_seed is None else base_seed + index
            return dataclasses.replace(template, text=item, seed=seed)  # the text and seed checked again

        return _many(self, enumerate(texts), request_of, int(max_batch), in_order,
                     engine_kwargs)


def _many(tts: TTS, items: Iterator[tuple[int, Any]], request_of, max_batch: int, in_order: bool,
          engine_kwargs: dict[str, Any]) -> Iterator[tuple[int, SynthesisResult | Exception]]:
    """The generator behind :meth:`TTS.synthesize_many`: keeps up to ``4 * max_batch`` texts
    submitted ahead of what it has yielded; each text's failure is yielded in its place."""
    window = 4 * max_batch
    with tts.engine(max_batch, **engine_kwargs) as engine:
        pending: dict[int, Any] = {}  # index -> handle, or the exception its submit raised
        done: queue.SimpleQueue = queue.SimpleQueue()  # indices the engine is done with (in_order=False)
        order: collections.deque[int] = collections.deque()  # submitted indices, in input order
        more = True
        while more or pending:
            while more and len(pending) < window:
                try:
                    index, item = next(items)
                except StopIteration:
                    more = False
                    break
                order.append(index)
                try:
                    pending[index] = handle = engine.submit(request_of(index, item))
                except EngineClosed:
                    raise
                except Exception as exc:  # this text alone: reported in its place
                    pending[index] = exc
                    done.put(index)
                    continue
                handle.add_done_callback(lambda _handle, i=index: done.put(i))
            if not pending:
                break
            if in_order:
                index = order.popleft()
            else:
                index = done.get()
                order.remove(index)
            got = pending.pop(index)
            if isinstance(got, Exception):
                yield index, got
                continue
            try:
                result = got.result()
            except Exception as exc:
                if engine.crashed is not None or isinstance(exc, EngineClosed):
                    raise
                yield index, exc
                continue
            yield index, result


def _device_kwargs(bundle: Bundle, device: str | None, execution_provider: str | None = None
                   ) -> tuple[dict[str, str | None], str]:
    """Map ``device=`` onto the backend's keyword, with the reason for the info line.

    Raises:
        ExecutionProviderUnavailable: an ONNX Runtime bundle given an unknown provider name.
    """
    m = bundle.manifest
    backend = backend_of(m)
    placement = backend.placement
    own = m[placement]
    if execution_provider is not None:
        # The backend-specific keywords of higgs_pack.runtime.sources.bundle.load_pipeline (the CLI's flags).
        kwargs = {"execution_provider": execution_provider}
        if device is not None and str(device).lower() != AUTO:
            kwargs["device"] = device
        return kwargs, f"asked for with --execution-provider {execution_provider} (bundle built for {own})"
    if device is None or str(device).lower() == AUTO:
        return {}, f"the bundle's own {placement.replace('_', ' ')} {own}"
    return backend.load_keywords(bundle, str(device)), f"asked for with device={device!r} (bundle built for {own})"


def resolve(source: str | os.PathLike, *, bundle_dirs: tuple[str | os.PathLike, ...] = (),
            variant: str | None = None) -> Resolved:
    """Find the bundle directory a source names (see :func:`load` for the kinds of source).

    Order: ``hf://`` reference; an existing file (archive); an existing directory; an
    installed bundle name; a model slug (the best runnable variant among the visible
    bundles, :mod:`higgs_pack.runtime.machine.choice`).

    Raises:
        BundleError: nothing of that name (the message lists what was looked for),
            or a slug with no bundle that runs here (the message says why for each).
        InputError: a ``variant`` for a source that is not a hub reference.
        HubError: a hub reference that cannot be fetched.
        PackagingError: an archive that is damaged or unsafe.
    """
    from higgs_pack.runtime.sources.bundle import find_bundle
    from higgs_pack.runtime.sources.hub import is_hub_ref, pull

    text = os.fspath(source)
    if is_hub_ref(text):
        got = pull(text, variant=variant)
        return Resolved(got.path, f"hub {got.repo_id}@{got.commit[:12]}, {got.files_checked} files verified; "
                                  f"{got.reason}", got.device, verified=True)
    if variant is not None:  # never taken silently: only a hub repository of several bundles has folders to pick
        raise InputError.of(Problem.said(f"variant {variant!r} (--variant) picks the folder of a hub repository holding several "
                                         f"bundles (hf://ORG/REPO); {text[:80]!r} is not one: drop it"))
    path = Path(text)
    if path.is_file():
        from higgs_pack.runtime.sources.archive import extracted_archive

        stack = contextlib.ExitStack()
        try:
            bundle_dir = stack.enter_context(extracted_archive(path))
        except BaseException:
            stack.close()
            raise
        return Resolved(bundle_dir, f"archive {path.name}, extracted and checked", stack=stack)
    from higgs_pack.runtime.machine.choice import choose, require
    from higgs_pack.runtime.machine.inventory import (
        bench_speeds,
        bundles_in,
        inventory,
        visible_bundles,
    )

    if path.is_dir() and not (path / MANIFEST_NAME).is_file() and bundles_in(path):
        # A folder of bundles (dist/, a downloaded multi-variant repository): choose among them.
        candidates, _broken = visible_bundles([path], installed=False, hub_cache=False)
        inv = inventory()
        choice = choose(candidates, inv, bench=bench_speeds(cpu=inv.cpu))
        placement = require(choice, str(path))
        return Resolved(Path(placement.candidate.source), f"folder of bundles {path}: {choice.reason}",
                        placement.device, tuple(choice.notes), dict(choice.rejected))
    if path.exists():
        return Resolved(find_bundle(path), "bundle directory")
    from higgs_pack.runtime.sources.installed import installed_bundles

    installed = installed_bundles()
    if text in installed:
        return Resolved(installed[text], "installed bundle")
    candidates, _broken = visible_bundles(bundle_dirs)
    if any(c.model == text for c in candidates):
        inv = inventory()
        choice = choose(candidates, inv, model=text, bench=bench_speeds(cpu=inv.cpu))
        placement = require(choice, text)
        return Resolved(Path(placement.candidate.source), choice.reason, placement.device, tuple(choice.notes),
                        dict(choice.rejected))
    return Resolved(find_bundle(text), "installed bundle")  # raises, naming what is installed


def _check_source(source: Any) -> None:
    """Refuse a ``load`` source that is not a path or a name.

    Raises:
        InputError: None, a number, an empty string (a new user's findings).
    """
    if not isinstance(source, (str, os.PathLike)) or not os.fspath(source):
        raise InputError.of(Problem.said(f"load() takes a bundle folder, an archive, an installed bundle's name, a model slug or "
                                         f"hf://ORG/REPO; got {plain_type(source) if not isinstance(source, str) else 'an empty string'}"))


def load(
    source: str | os.PathLike,
    device: str | None = AUTO,
    *,
    allow_fallback: bool = False,
    check_hashes: bool = True,
    cache_dir: str | os.PathLike | None = None,
    execution_provider: str | None = None,
    bundle_dirs: tuple[str | os.PathLike, ...] | list[str | os.PathLike] = (),
    variant: str | None = None,
) -> TTS:
    """Load a bundle from wherever it is and return a :class:`TTS`.

    Args:
        source: a bundle directory, or a folder of bundle directories (the best for
            this machine is chosen, as for a model slug); an archive (``.tar.gz``, ``.zip``, ``.whl``,
            checked member by member and extracted to a temporary folder); the name of
            an installed bundle wheel (``higgs-pack list``); a model slug
            (``higgs-audio-v3-tiny``: the best variant that runs here among the installed
            bundles, ``bundle_dirs`` and pulled hub repositories, chosen by the order in
            :mod:`higgs_pack.runtime.machine.choice`); or ``hf://ORG/REPO[@REVISION][/VARIANT]``
            (downloaded with huggingface_hub, every file verified; offline with
            ``HF_HUB_OFFLINE=1`` when cached).
        device: ``"auto"`` (default): the provider/device the bundle was built for (for
            a model slug or a multi-variant hub repository, the one the choice placed it on).
            Otherwise, for ONNX Runtime bundles an execution provider (``cpu``, ``cuda``,
            ``dml``, ``openvino``), for OpenVINO bundles a device (``CPU``, ``GPU``,
            ``NPU``, ``AUTO``, ``HETERO:…``).
        allow_fallback: run elsewhere when the provider/device is missing (said in
            ``info.device``); default False: a missing one is an error.
        check_hashes: check every file's sha256 before opening (default True).
        cache_dir: OpenVINO compiled-model cache folder (default ``$HIGGS_PACK_CACHE/openvino``).
        execution_provider: the ONNX Runtime provider, named separately (as the CLI's
            ``--execution-provider``); with it, ``device`` is passed on as an OpenVINO device.
        bundle_dirs: more folders of bundles to choose from for a model slug
            (``$HIGGS_PACK_BUNDLES`` adds more).
        variant: for a hub repository holding several bundles, the folder to take.

    Returns:
        A :class:`TTS`; ``tts.info`` says what runs where and why.

    Raises:
        BundleError: no such bundle, no variant of a slug runs here, or the files
            disagree with the manifest.
        HubError: a hub repository that cannot be fetched (offline and not cached,
            unknown repository or revision, no access).
        ManifestError, UnsupportedFormatVersion: the manifest is invalid or too new.
        PackagingError: an archive is damaged or unsafe.
        ExecutionProviderUnavailable: the provider/device is missing (without
            ``allow_fallback``) or ``device`` is not a name the bundle's backend knows.
        SignatureMismatch: a graph's inputs/outputs differ from the manifest.
        InputError: ``source`` is not a path or a name (None, a number, an empty string).
    """
    _check_source(source)
    resolved = resolve(source, bundle_dirs=tuple(bundle_dirs), variant=variant)
    for note in resolved.notes:
        log.warning("%s", note)
    try:
        bundle = open_bundle(resolved.path, check_hashes=check_hashes and not resolved.verified)
        if resolved.device is not None and (device is None or str(device).lower() == AUTO) \
                and execution_provider is None:
            kwargs, why_device = _device_kwargs(bundle, resolved.device)
            why_device = f"placed on {resolved.device} by the choice"
        else:
            kwargs, why_device = _device_kwargs(bundle, device, execution_provider)
        pipeline = load_pipeline(bundle, allow_fallback=allow_fallback, check_hashes=False,
                                 cache_dir=cache_dir, **kwargs)
    except BaseException:
        resolved.stack.close()
        raise
    m = bundle.manifest
    devices = dict(pipeline.description)
    info = TTSInfo(
        source=os.fspath(source), bundle=m["name"], path=bundle.path, model=m["model"]["slug"],
        target=m["target"], precision=m["precision"], variant=m.get("variant"), backend=m["backend"],
        device=", ".join(dict.fromkeys(devices.values())), devices=devices,
        reason=f"{resolved.reason}; {why_device}", sample_rate=pipeline.constants.sample_rate,
        not_chosen=resolved.not_chosen, notes=resolved.notes,
    )
    return TTS(pipeline, bundle, info, resolved.stack)
