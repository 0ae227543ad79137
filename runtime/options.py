"""The one declaration of a synthesis request's fields: :class:`RequestFields`.

Each field is declared here once, as a pydantic field: its Python keyword, type, default,
limits (``ge``, ``gt``, ``le``, finite) and description, and, in its :class:`Door`, its name
at every other front door: the CLI flag of ``higgs-pack synthesize`` / ``dialogue``, the field
of the server's speech body (``POST /v1/audio/speech``, ``/v1/audio/dialogue``) and of a live
session's ``session.config``.  Everything else is derived from it:

- the checks of the Python API and the CLI (:func:`value_problems`, called by
  :class:`~higgs_pack.runtime.request.SynthesisRequest`), each bad value one
  :class:`~higgs_pack.errors.Problem` whose ``allowed`` is rendered from the limits;
- the names each door uses in messages (:data:`FIELDS`, :func:`how_set` and :func:`python_name` for
  Python's, :func:`cli_name` for the CLI's);
- the CLI's click options (:func:`click_options`);
- the speech and dialogue bodies' pydantic models, so ``/docs`` shows the true defaults and
  limits (:func:`http_fields`, used by :mod:`higgs_pack.serve.schema`), the body's field list,
  its whole-number fields and the keyword each field sets (:func:`http_keywords`);
- the field table of the documentation (``docs/hooks/generated.py``, kept in the Markdown).

Beside it, what the loop samples with once a request meets a bundle: :class:`SamplingOptions`
(the bundle's manifest ``generation`` defaults, then the request's choices: :func:`bundle_sampling`),
judged by the same declaration.

A field added here appears at every door (``tests/test_request_fields.py`` checks that the CLI's
help, the OpenAPI schema, a live session and the docs agree with it).

The fields marked ``shaped`` (the text and the voice) take a form of their own at each door (a
file at the CLI, base64 in a body, a clip tuple in Python) and keep their own checks
(:mod:`higgs_pack.runtime.text`, :func:`~higgs_pack.runtime.request.voice_problems`); they are
declared here for their names and meaning.

Runtime code: no torch, no web stack (pydantic is a dependency of the runtime).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from numbers import Integral, Real
from typing import Annotated, Any

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from higgs_pack.errors import InputError, Problem

#: Rolling context of a long text: previous text chunks whose text and codes open the next chunk's
#: prompt (Higgs' own long-form generation calls it ``generation_chunk_buffer_size``).  1 carries the
#: voice and prosody of the chunk just spoken.
CONTEXT_CHUNKS = 1

#: Most frames (25 per second) of each context chunk kept in a prompt: its last 10 s, cut at a
#: word.  Chosen from the rolling-context table at full size (``python -m bench.ab rolling-context``,
#: cpu int4, AMD EPYC 2 vCPUs, 2026-12-05; docs/benchmarks/runs/rolling-context-full-2026-12-05.json):
#: 9.3-9.8 ms per prefilled position and 49-52 ms per frame, so a 200-word chunk (about 1,850
#: frames) prefills about 19% of its generation time with the whole previous chunk as context and
#: about 5% with its last 250 frames (8% with 500); one-sentence chunks measured 18.2% whole, 8.2%
#: at 50 frames.  The voice's own prefix comes from the prefix cache and is not counted.
CONTEXT_FRAMES = 250

#: Default streaming schedule (frames at 25 fps): 0.4 s first, doubling up to 4 s.
FIRST_CHUNK_FRAMES = 10
CHUNK_GROWTH = 2.0
MAX_CHUNK_FRAMES = 100


@dataclass(frozen=True)
class Door:
    """How each front door names one request field.

    Attributes:
        flag: the CLI option (``--top-k``), or None when the CLI has none; ``--text or
            --text-file`` for text.
        http: the field of the server's speech body, or None when the server has none.
        aliases: other names the speech body takes for it (sglang-omni's).
        live: whether a live session's ``session.config`` takes it (text comes in ``input.text``).
        meaning: what a value counts, said after its limits in a message
            (``>= 1 (frames, 25 per second)``); "" for none.
        shaped: the field takes a form of its own at each door (see the module's docstring):
            no generated option, body field or value check.
        dialogue: the dialogue body takes it too.
    """

    flag: str | None
    http: str | None
    aliases: tuple[str, ...] = ()
    live: bool = True
    meaning: str = ""
    shaped: bool = False
    dialogue: bool = True


class RequestFields(BaseModel):
    """Every field of a synthesis request, declared once (see the module's docstring).

    ``None`` in a sampling field means "the bundle's default" (the manifest's ``generation``
    object, :meth:`~higgs_pack.runtime.request.SynthesisRequest.sampling_options`).
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    text: Annotated[Any, Door("--text or --text-file", "input", live=False, shaped=True, dialogue=False)] = Field(
        description="The words to speak, as valid Unicode. Refused when it holds, anywhere, a control character "
        "other than tab and line breaks, or one of the tokenizer's special tokens (<|im_start|>, <|endoftext|>...); "
        "refused when it has nothing to speak: empty, or only whitespace and format characters (U+200B, U+FEFF...). "
        "A leading byte-order mark is dropped; inline controls such as <|emotion:amusement|> are read as text.")
    ref_audio: Annotated[Any, Door("--ref-audio", "ref_audio", shaped=True, dialogue=False)] = Field(
        None, description="A reference clip to clone (a file; in a body base64 or a data: URI). Needs ref_text.")
    ref_text: Annotated[Any, Door("--ref-text", "ref_text", shaped=True, dialogue=False)] = Field(
        None, description="The exact transcript of ref_audio.")
    voice: Annotated[Any, Door(None, "voice", shaped=True, dialogue=False)] = Field(
        None, description="A voice prepared once (Python: tts.prepare_voice; server: a stored voice's name).")
    seed: Annotated[int | None, Door("--seed", "seed", meaning="numpy's PCG64 seeds are non-negative")] = Field(
        0, ge=0, description="Sampler seed: the same seed, bundle and device give the same audio (None in Python, null in JSON: "
        "a fresh seed each time).")
    temperature: Annotated[float | None, Door("--temperature", "temperature", meaning="0 = greedy")] = Field(
        None, ge=0, allow_inf_nan=False, description="Sampling temperature, 0 = greedy; left out: the bundle's "
        "default (0.8).")
    top_k: Annotated[int | None, Door("--top-k", "top_k", meaning="0 = off")] = Field(
        None, ge=0, description="Sample among the k most likely codes (0: all); left out: the bundle's default "
        "(50).")
    top_p: Annotated[float | None, Door("--top-p", "top_p")] = Field(
        None, gt=0, le=1, description="Nucleus mass: sample within this cumulative probability; left out: the "
        "bundle's default (1.0, off).")
    max_frames: Annotated[int | None, Door("--max-frames", "max_new_tokens", meaning="frames, 25 per second")] = Field(
        None, ge=1, description="Frame cap per text chunk (25 frames per second), at most the decoder's context "
        "less the prompt; left out: from the text's length.")
    first_chunk_frames: Annotated[int, Door("--first-chunk-frames", "initial_chunk_frames",
                                             aliases=("initial_codec_chunk_frames",),
                                             meaning="frames, 25 per second")] = Field(
        FIRST_CHUNK_FRAMES, ge=1, description="Frames in the first streamed chunk (fewer: audio sooner).")
    chunk_growth: Annotated[float, Door("--chunk-growth", None, meaning="1 = equal chunks")] = Field(
        CHUNK_GROWTH, ge=1, allow_inf_nan=False, description="Each later streamed chunk is this many times the "
        "previous one.")
    max_chunk_frames: Annotated[int, Door("--max-chunk-frames", None, meaning="frames, 25 per second")] = Field(
        MAX_CHUNK_FRAMES, ge=1, description="Largest streamed chunk, at least first_chunk_frames.")
    context_chunks: Annotated[int, Door("--context-chunks", "context_chunks", meaning="previous text chunks")] = Field(
        CONTEXT_CHUNKS, ge=0, description="A long text's rolling context: previous text chunks (their text and "
        "audio) that open each next chunk's prompt after the voice, so the voice and prosody carry on "
        "(0: the voice alone).")
    context_frames: Annotated[int | None, Door("--context-frames", "context_frames",
                                                meaning="frames of each context chunk, 25 per second")] = Field(
        CONTEXT_FRAMES, ge=1, description="Most frames of each context chunk kept in a prompt (its end, cut at a "
        "word; 25 frames per second); None in Python: whole chunks.")


def _valued() -> Iterator[tuple[str, FieldInfo, Door]]:
    """The fields whose value is checked by its declared type and limits (:func:`value_problems`)."""
    for name, info in RequestFields.model_fields.items():
        door = door_of(info)
        if not door.shaped:
            yield name, info, door


def door_of(info: FieldInfo) -> Door:
    """The :class:`Door` in a field's metadata."""
    return next(item for item in info.metadata if isinstance(item, Door))


#: The one table of request fields by Python keyword (the name :class:`Problem` uses): each front
#: door renders a problem in its own terms from it.  ``voices`` is a dialogue's.
FIELDS: dict[str, Door] = {name: door_of(info) for name, info in RequestFields.model_fields.items()}
FIELDS["voices"] = Door("--voice", "voices", shaped=True)


def how_set(field: str | None) -> str | None:
    """How the Python API sets ``field``: its keyword, ``"top_p="`` (None for no field).  The CLI
    names the flag itself instead (:func:`cli_name`), the server the body's field."""
    return f"{field}=" if field in FIELDS else None


#: A dialogue voice's part, as a problem names it (``voices.ANN.text``), in words.
_VOICE_PART = re.compile(r"voices\.(?P<speaker>.+)\.(?P<part>text|audio)", re.DOTALL)
_PART_WORDS = {"text": "transcript", "audio": "clip"}


def python_name(field: str | None) -> str | None:
    """A problem's field in the Python API's terms: the keyword (``top_p``); a dialogue voice's part
    as ``the transcript of voices['ANN']``."""
    found = _VOICE_PART.fullmatch(field or "")
    if found:
        return f"the {_PART_WORDS[found['part']]} of voices[{found['speaker']!r}]"
    return field


def cli_name(field: str | None, text: str = "--text") -> str | None:
    """A problem's field in the CLI's terms: its flag (``--top-p``); the words to speak as where they
    came from (``text``: ``--text``, ``--text-file FILE``, ``standard input``); a dialogue voice's
    part as ``the transcript of --voice ANN``."""
    found = _VOICE_PART.fullmatch(field or "")
    if found:
        return f"the {_PART_WORDS[found['part']]} of --voice {found['speaker']}"
    if field == "text":
        return text
    door = FIELDS.get(field or "")
    return door.flag if door is not None and door.flag else field


def _limits(info: FieldInfo) -> dict[str, Any]:
    """``{"ge": 0, "gt": ..., "le": ..., "finite": True}`` of a field's declared constraints."""
    found: dict[str, Any] = {}
    for item in info.metadata:
        for key in ("ge", "gt", "le", "lt"):
            if isinstance(item, getattr(annotated_types, key.capitalize())):
                found[key] = getattr(item, key)
        if getattr(item, "allow_inf_nan", None) is False:
            found["finite"] = True
    return found


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def allowed(name: str) -> str:
    """What field ``name`` takes, in words from its declared limits: ``in (0, 1]``,
    ``a finite number >= 0 (0 = greedy)``, ``>= 1 (frames, 25 per second)``."""
    info = RequestFields.model_fields[name]
    limits = _limits(info)
    if "gt" in limits and "le" in limits:
        said = f"in ({_number(limits['gt'])}, {_number(limits['le'])}]"
    elif "ge" in limits and "le" in limits:
        said = f"from {_number(limits['ge'])} to {_number(limits['le'])}"
    else:
        said = " ".join(f"{sign} {_number(limits[key])}" for key, sign in (("ge", ">="), ("gt", ">"), ("le", "<="),
                                                                          ("lt", "<")) if key in limits)
    if limits.get("finite"):
        said = f"a finite number {said}"
    meaning = door_of(info).meaning
    return f"{said} ({meaning})" if meaning else said


def is_whole(name: str) -> bool:
    """Whether field ``name`` holds whole numbers (its declared type is int)."""
    return _kind(RequestFields.model_fields[name]) is int


def _kind(info: FieldInfo) -> type:
    annotation = info.annotation
    args = getattr(annotation, "__args__", (annotation,))
    return next((arg for arg in args if arg in (int, float)), object)


@cache
def _adapter(name: str) -> TypeAdapter:
    info = RequestFields.model_fields[name]
    return TypeAdapter(Annotated[(info.annotation, *info.metadata)], config=ConfigDict(strict=True))


def _as_python(value: Any, kind: type) -> Any:
    """numpy's and other Integral/Real values as the Python number pydantic's strict mode takes
    (``np.int64(7)`` is 7; a bool stays a bool, which no number field takes)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, Integral):
        return int(value)
    if kind is float and isinstance(value, Real):
        return float(value)
    return value


def value_problems(values: Mapping[str, Any]) -> list[Problem]:
    """One problem per value of ``values`` (keyword -> value) that breaks its field's declared type
    or limits, in declaration order; fields left out, and the shaped ones, are not judged; ``[]``
    when all are valid.  The one place the value rules live: every door's values reach the
    request, which calls this.

    Raises:
        KeyError: a name that is not a field (callers refuse unknown names first, with a close match).
    """
    found = []
    for name, info, _door in _valued():
        if name not in values:
            continue
        value = values[name]
        try:
            _adapter(name).validate_python(_as_python(value, _kind(info)))
        except ValidationError as exc:
            kinds = {error["type"] for error in exc.errors()}
            typed = not kinds & {"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                                 "finite_number"}
            if typed:
                found.append(Problem(name, value, "a whole number" if _kind(info) is int else "a number"))
            else:
                found.append(Problem(name, value, allowed(name)))
    unknown = set(values) - set(RequestFields.model_fields)
    if unknown:
        raise KeyError(sorted(unknown)[0])
    return found


# --- what the loop samples with ------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingOptions:
    """How each codebook's next code is drawn.

    Attributes:
        temperature: 0 means greedy (argmax); the model's authors' common default is
            0.8 (MODEL.md: greedy alone degenerates into a buzz on the real model).
        top_k: keep the k most likely codes (0 = all); default 50.
        top_p: nucleus mass in (0, 1]; 1.0 = off.
        seed: seed of the numpy PCG64 generator; same seed, same logits -> same codes.
        repeat_guard_frames: stop once codebook 0 repeats one code this many frames
            in a row (0 = off).
    """

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    seed: int | None = 0
    repeat_guard_frames: int = 50

    def __post_init__(self) -> None:
        found = sampling_problems(dataclasses.asdict(self))
        if found:
            raise InputError(problems=found)


def sampling_problems(values: Mapping[str, Any]) -> list[Problem]:
    """One problem per bad :class:`SamplingOptions` field of ``values`` (its name, the value given and
    what is allowed), in field order; ``[]`` when all are valid.  Fields ``values`` leaves out are
    not judged.  The seed and the three sampling knobs are judged by the request's one declaration
    (:func:`~higgs_pack.runtime.options.value_problems`: a bundle's defaults and a caller's choices
    by the same limits); ``repeat_guard_frames`` is the bundle's alone."""
    found = value_problems({k: v for k, v in values.items() if k != "repeat_guard_frames"})
    found += [Problem(name, None, "a whole number" if is_whole(name) else "a number")  # None is a request's
              for name in ("temperature", "top_k", "top_p") if name in values and values[name] is None]  # "unset"
    if "repeat_guard_frames" in values:
        guard = values["repeat_guard_frames"]
        if isinstance(guard, bool) or not isinstance(guard, Integral):
            found.append(Problem("repeat_guard_frames", guard, "a whole number"))
        elif guard < 0:
            found.append(Problem("repeat_guard_frames", guard, ">= 0"))
    return found


def bundle_sampling(generation_defaults: Mapping[str, Any], **overrides: Any) -> SamplingOptions:
    """The sampling options a request runs with: the bundle's defaults, then ``overrides``.

    The one place a bundle's own defaults (the manifest's ``generation`` object, which
    :func:`higgs_pack.runtime.sources.bundle.load_pipeline` puts in ``Pipeline.generation_defaults["sampling"]``)
    meet the caller's choices; fields neither gives keep the :class:`SamplingOptions` defaults.

    Args:
        generation_defaults: ``Pipeline.generation_defaults`` (its ``"sampling"`` mapping is read).
        overrides: :class:`SamplingOptions` fields to set (pass only those the caller chose).

    Returns:
        :class:`SamplingOptions` (checked when made).

    Raises:
        InputError: a resulting option is out of range (its problems name it).
    """
    return SamplingOptions(**{**generation_defaults.get("sampling", {}), **overrides})


# --- what each door derives ---------------------------------------------------------------------

def http_fields(dialogue: bool = False) -> dict[str, tuple[Any, FieldInfo]]:
    """The valued fields' entries of a speech (or dialogue) body's pydantic model, by HTTP name
    (aliases too), for ``pydantic.create_model``: each nullable (null counts as left out, except
    ``seed``: a fresh seed), with the declared default, limits and description."""
    out: dict[str, tuple[Any, FieldInfo]] = {}
    for _name, info, door in _valued():
        if door.http is None or (dialogue and not door.dialogue):
            continue
        declared = _limits(info)
        limits = {key: value for key, value in declared.items() if key != "finite"}
        if declared.get("finite"):
            limits["allow_inf_nan"] = False
        kind = _kind(info)
        for http in (door.http, *door.aliases):
            description = info.description if http == door.http else f"Another name of {door.http}."
            default = info.default if http == door.http else None
            out[http] = (kind | None, Field(default, description=description, **limits))
    return out


def http_keywords() -> dict[str, str]:
    """HTTP name (aliases too) -> the Python keyword it sets, for every valued field the body takes."""
    return {http: name for name, _info, door in _valued() if door.http
            for http in (door.http, *door.aliases)}


def click_options(*names: str) -> Callable[[Callable], Callable]:
    """A decorator adding the CLI options of fields ``names`` (valued fields with a flag), each from
    its declaration: flag, type, default (shown where it is not "the bundle's" or "from the text"),
    help (the description)."""
    import click

    def decorate(function: Callable) -> Callable:
        for name in reversed(names):
            info = RequestFields.model_fields[name]
            door = door_of(info)
            if door.flag is None or door.shaped:
                raise ValueError(f"request field {name} has no generated CLI option")
            kind = _kind(info)
            function = click.option(door.flag, name, type=kind, default=info.default,
                                    show_default=info.default is not None,
                                    help=f"{info.description} Allowed: {allowed(name)}.")(function)
        return function

    return decorate


def field_rows() -> list[dict[str, str]]:
    """One row per field for the documentation's table: keyword, CLI flag, HTTP field (aliases),
    live, default, allowed, meaning."""
    rows = []
    for name, info in RequestFields.model_fields.items():
        door = door_of(info)
        default = "" if door.shaped or info.default is None else _number(info.default)
        rows.append({
            "keyword": name, "flag": door.flag or "",
            "http": " or ".join((door.http, *door.aliases)) if door.http else "",
            "live": "yes" if door.live and door.http else "",
            "default": default, "allowed": "" if door.shaped else allowed(name),
            "meaning": info.description or ""})
    return rows
