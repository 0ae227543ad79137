"""The ``POST /v1/audio/speech`` body: every field checked, then one
:class:`~higgs_pack.runtime.request.SynthesisRequest` (:func:`parse_speech`).

Fields (OpenAI's, source: openai-python ``types/audio/speech_create_params.py``): ``model``,
``input``, ``voice`` (a name, or ``{"id": name}``), ``response_format``, ``speed``,
``instructions``, ``stream_format`` (``"audio"`` or ``"sse"``).  Extensions, named as
vllm-omni and sglang-omni name them (../shared/SERVING.md): ``ref_audio`` and ``ref_text`` (or
Boson's ``references: [{"audio", "text"}]``, one entry), ``seed``, ``temperature``, ``top_k``,
``top_p``, ``max_new_tokens`` (frames, 25 per second), ``initial_chunk_frames`` (sglang-omni's
``initial_codec_chunk_frames`` too) and ``stream`` (sglang-omni's boolean: ``true`` is
``stream_format="audio"``).  Any other field is a 400 that names it: a field dropped in
silence gives the wrong voice with no error (vllm-omni#4169); a close match is suggested.
A field sent as ``null`` counts as left out, except ``seed`` (null: a random seed).  Every text
field (``input``, ``ref_text``, a reference's ``text``, ``voice``) goes through the runtime's
one text check, :func:`~higgs_pack.runtime.request.unspeakable`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from higgs_pack.errors import InputError, Problem, clipped, literal, unknown_choice
from higgs_pack.runtime.audio import read_audio_bytes
from higgs_pack.runtime.options import MAX_CHUNK_FRAMES, http_keywords, is_whole
from higgs_pack.runtime.request import SynthesisRequest, plain_type, unspeakable
from higgs_pack.runtime.text import clean
from higgs_pack.serve.config import ServeConfig
from higgs_pack.serve.errors import ApiError, from_input_error, refused
from higgs_pack.serve.formats import DEFAULT_FORMAT, FORMATS, decode_with_ffmpeg
from higgs_pack.serve.schema import DialogueBody, SpeechBody
from higgs_pack.serve.tempo import SPEED_RANGE
from higgs_pack.serve.voices import name_problem

#: Every field the body may hold (its model's, :class:`~higgs_pack.serve.schema.SpeechBody`).
FIELDS = tuple(SpeechBody.model_fields)
#: The name of the bundle's own voice (no reference clip).
DEFAULT_VOICE = "default"
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(;[\w-]+=[\w.-]+)*;base64,", re.ASCII)


@dataclass(frozen=True)
class SpeechJob:
    """One checked speech request.

    Attributes:
        request: what the engine runs.
        response_format: a key of :data:`~higgs_pack.serve.formats.FORMATS` (``mp3`` when left out).
        stream_format: None (the whole file at once), ``"audio"`` (bytes as generated) or ``"sse"``.
        model: the ``model`` asked for.
        voice: the voice's name (``"default"``, a stored voice, or ``"ref_audio"`` for a clip
            in the body).
        segments: a whole answer is JSON with the audio and its segments
            (:func:`~higgs_pack.serve.formats.segments_answer`), not the bare file.
        speed: the audio's tempo, 0.25 to 4.0 (2.0: half as long, the same pitch;
            :mod:`~higgs_pack.serve.tempo`).
        names: the request's fields as this body named them, where they differ from the speech
            body's own (``{"ref_text": "references[0].text", "ref_audio": "references[0].audio"}``):
            a refusal found later (a special token, at submission) names the field the body sent.
    """

    request: SynthesisRequest
    response_format: str
    stream_format: str | None
    model: str
    voice: str
    segments: bool = False
    speed: float = 1.0
    names: tuple[tuple[str, str], ...] = ()


def _bad(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    """The HTTP door's 400 of one problem the body's own checks found (its words, its ``code``)."""
    return refused(Problem.said(message, code=code), param=param)


def _check_body(body: Any, fields: Any) -> None:
    """A request body is a JSON object naming only ``fields``.

    Raises:
        ApiError: 400 ``invalid_body`` for another JSON type, ``unknown_field`` (with a close match)
            for a name not in ``fields``.
    """
    if not isinstance(body, dict):
        raise _bad(f"the body must be a JSON object, got {plain_type(body)}", None, "invalid_body")
    unknown = [name for name in body if name not in fields]
    if unknown:
        raise _bad(unknown_fields(unknown, fields), unknown[0][:80], "unknown_field")


def parse_speech(body: Any, *, models: tuple[str, ...], voices: Any, config: ServeConfig) -> SpeechJob:
    """Check a speech body and turn it into a :class:`SpeechJob`.

    Args:
        body: the decoded JSON.
        models: the names ``model`` may take (the first is the bundle's name).
        voices: the :class:`~higgs_pack.serve.voices.VoiceStore` (``get(name)`` and ``names()``).
        config: the limits.

    Raises:
        ApiError: 400 for an unknown field (with a close match when there is one), a bad value
            (the field named, with what is allowed), text that is not speakable (not a string,
            not valid Unicode, a control character, nothing to speak), or ``stream`` and
            ``stream_format`` that disagree; 404 for an unknown model; 413 for a ``ref_audio``
            over the upload limit.
    """
    _check_body(body, FIELDS)
    body = chosen_names(body)
    model = _model(body, models)
    text = _input(body, config)
    response_format, stream_format = _formats(body)
    speed = _speed(body.get("speed"))
    if body.get("instructions"):
        raise _bad("instructions are not supported by this bundle: its prompt format has no instruction slot "
                   "(the tokenizer has no instruction control token); write inline controls such as "
                   "<|emotion:amusement|> in the input instead", "instructions", "unsupported_value")
    voice_name, voice_keywords = _voice(body, voices, config)
    names = REFERENCE_NAMES if body.get("references") is not None else ()
    keywords = {**voice_keywords, **_sampling(body)}
    try:
        request = SynthesisRequest.create(text, **keywords)
    except InputError as exc:
        raise from_input_error(exc, names=dict(names)) from exc
    return SpeechJob(request, response_format, stream_format, model, voice_name, segments_wanted(body, stream_format),
                     speed, names)


#: ``ref_audio`` and ``ref_text`` as a body that sends ``references`` names them.
REFERENCE_NAMES = (("ref_audio", "references[0].audio"), ("ref_text", "references[0].text"))


def _speed(speed: Any) -> float:
    """The ``speed`` field: a number from 0.25 to 4.0 (OpenAI's range); left out or null, 1.0.

    Raises:
        ApiError: 400 naming ``speed`` for anything else (a string such as "fast", a boolean, 5).
    """
    if speed is None:
        return 1.0
    low, high = SPEED_RANGE
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not low <= speed <= high:
        raise _bad(f"speed must be a number from {low} to {high} (1.0: as generated; 2.0: twice as fast, the same "
                   f"pitch), got {got(speed)}", "speed", "invalid_value")
    return float(speed)


def segments_wanted(body: dict, stream_format: str | None) -> bool:
    """The ``segments`` field: true asks a whole answer for its timings (JSON with the audio base64).

    Raises:
        ApiError: 400 for a value that is not a boolean, or ``true`` with ``stream_format`` "audio"
            (raw bytes have no place for timings: "sse" sends them as ``speech.segment`` events).
    """
    wanted = body.get("segments")
    if wanted is None:
        return False
    if not isinstance(wanted, bool):
        raise _bad(f"segments must be true or false, got {got(wanted)}", "segments")
    if wanted and stream_format == "audio":
        raise _bad("segments true needs an answer with room for timings: stream_format \"sse\" sends them as "
                   "speech.segment events, and the whole answer (no stream_format) as JSON; a stream of "
                   "audio bytes has none", "segments", "conflicting_fields")
    return wanted


#: Every field the body of ``POST /v1/audio/dialogue`` may hold (:class:`~higgs_pack.serve.schema.DialogueBody`).
DIALOGUE_FIELDS = tuple(DialogueBody.model_fields)


def parse_dialogue(body: Any, *, models: tuple[str, ...], voices: Any, config: ServeConfig) -> SpeechJob:
    """Check a dialogue body and turn it into a :class:`SpeechJob` whose request is a
    :class:`~higgs_pack.runtime.loop.dialogue.DialogueRequest`.

    ``turns`` is a list of ``{"speaker", "input"}`` (at most
    :data:`~higgs_pack.runtime.loop.dialogue.MAX_TURNS`, all inputs together at most
    ``--max-input-chars``); ``voices`` maps a speaker to a stored voice's name (or ``{"id": name}``;
    ``"default"``: none), or to a clip ``{"audio", "text"}`` as in ``references``; a speaker left
    out has no voice of its own (its first turn becomes its voice).  The other fields are
    ``/v1/audio/speech``'s.

    Raises:
        ApiError: 400 naming the field (``turns[3].input``, ``voices.ANN``) for every bad value, an
            unknown field or speaker, or a voice not in the store; 404 for an unknown model; 413 for
            a clip over the upload limit.
    """
    from higgs_pack.runtime.loop.dialogue import (
        MAX_TURNS,
        MORE_PROBLEMS,
        TURN_PROBLEMS_SAID,
        DialogueRequest,
        Turn,
        speaker_name,
    )

    _check_body(body, DIALOGUE_FIELDS)
    body = chosen_names(body)
    model = _model(body, models)
    turns = body.get("turns")
    if not isinstance(turns, list) or not turns:
        shown = "an empty list" if turns == [] else got(turns)
        raise _bad(f"turns must be a list of {{\"speaker\", \"input\"}} objects, one per turn, got {shown}", "turns",
                   "missing_field" if turns is None else "invalid_value")
    if len(turns) > MAX_TURNS:
        raise _bad(f"turns holds {len(turns)} turns; at most {MAX_TURNS} are spoken in one dialogue: split it",
                   "turns", "too_many_turns")
    checked: list[Turn] = []
    bad: list[Problem] = []  # every bad turn at once (up to TURN_PROBLEMS_SAID), as a speech body's fields are
    for index, turn in enumerate(turns):
        where = f"turns[{index}]"
        if not isinstance(turn, dict) or set(turn) != {"speaker", "input"}:
            bad.append(Problem(where, None, message=literal(
                f"{where} must be an object with exactly speaker and input, got "
                f"{short(sorted(turn)) if isinstance(turn, dict) else got(turn)}")))
        else:
            for key, meaning, why in (("speaker", "the name of who says the turn", ""),
                                      ("input", "the words of the turn", "there is nothing to speak")):
                problem = unspeakable(turn[key], f"{where}.{key}", why)
                if problem is not None:
                    bad.append(Problem(f"{where}.{key}", None, message=literal(f"{problem}; {where}.{key} is {meaning}")))
            if not bad:
                # " ANN " is ANN, as as_turns; named turns[i] by every later check, as here and in param
                checked.append(Turn(speaker_name(turn["speaker"]), clean(turn["input"]), where))
        if len(bad) >= TURN_PROBLEMS_SAID:
            bad.append(MORE_PROBLEMS)
            break
    if bad:
        raise from_input_error(InputError(problems=bad))
    total = sum(len(turn.text) for turn in checked)
    if total > config.max_input_chars:
        raise _bad(f"the turns' inputs are {total} characters together; the limit is {config.max_input_chars} "
                   "(--max-input-chars); split the dialogue into several requests", "turns", "input_too_long")
    response_format, stream_format = _formats(body)
    chosen = _dialogue_voices(body.get("voices"), {turn.speaker for turn in checked}, voices, config)
    try:
        request = DialogueRequest.create(checked, chosen, **_sampling(body))
    except InputError as exc:
        raise from_input_error(exc, param="turns") from exc
    return SpeechJob(request, response_format, stream_format, model, "dialogue",  # type: ignore[arg-type]
                     segments_wanted(body, stream_format), _speed(body.get("speed")))


def _stored_voice(voices: Any, name: str, where: str, clone: str) -> Any:
    """The stored voice ``name`` (a voice name, not the default) that the field ``where`` names
    (``voice``, or a dialogue's ``voices.SPEAKER``, whose messages it begins with).

    Raises:
        ApiError (400) ``invalid_name``: no such voice is stored and the name breaks the rule
            (a voice stored before the rule keeps its name); ``unknown_voice``: no such voice,
            naming those there are, how to upload one and ``clone``, the way to clone instead.
    """
    prepared = voices.get(name)
    if prepared is not None:
        return prepared
    lead = "" if where == "voice" else f"{where}: "
    if (problem := name_problem(name)) is not None:
        raise _bad(lead + problem, where, "invalid_name")
    raise _bad(f"{lead}voice {short(name)} is not known; use one of {', '.join([DEFAULT_VOICE, *voices.names()])} "
               f"(upload one with POST /v1/audio/voices), or {clone}", where, "unknown_voice")


def _dialogue_voices(given: Any, speakers: set[str], voices: Any, config: ServeConfig) -> dict[str, Any]:
    """``voices`` of a dialogue body as ``DialogueRequest.create`` takes them (speaker -> a prepared
    voice, a ``((samples, rate), transcript)`` clip, or None)."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise _bad(f"voices must be an object mapping a speaker to a voice, got {got(given)}", "voices")
    from higgs_pack.runtime.loop.dialogue import (
        key_problem,
        named_twice,
        speaker_name,
        twice_message,
    )

    out: dict[str, Any] = {}
    # as the Python and CLI doors check a speaker's key
    problems = {key: key_problem(key, "a key of voices") for key in given}
    twice = named_twice(key for key, problem in problems.items() if problem is None)
    for key, voice in given.items():
        if problems[key] is not None:
            raise _bad(problems[key], "voices")
        speaker = speaker_name(key)  # as a turn's speaker is read: a leading BOM dropped, stripped
        where = f"voices.{speaker[:40]}"
        if speaker in twice:
            raise _bad(twice_message(speaker, twice[speaker], short), where, "duplicate_field")
        if speaker not in speakers:
            raise _bad(f"voices names {short(speaker)}, who speaks no turn; the speakers are "
                       f"{', '.join(sorted(map(repr, speakers))[:20])}", where, "unknown_speaker")
        if isinstance(voice, dict) and set(voice) == {"id"}:
            voice = voice["id"]
        if isinstance(voice, str):
            voice = voice_name(voice, where)  # as speech's voice
            if voice == DEFAULT_VOICE:
                out[speaker] = None
                continue
            out[speaker] = _stored_voice(voices, voice, where, 'give a clip as {"audio", "text"}')
        elif isinstance(voice, dict) and set(voice) <= {"audio", "audio_path", "text"} and "text" in voice:
            text = _text(voice["text"], f"{where}.text", "the exact transcript of the clip")
            clip = voice.get("audio", voice.get("audio_path"))
            out[speaker] = (reference_clip(clip, config, f"{where}.audio"), text)
        else:
            raise _bad(f"{where} must be a stored voice's name, {{\"id\": name}}, or a clip {{\"audio\", \"text\"}}, "
                       f"got {got(voice) if not isinstance(voice, dict) else short(sorted(voice))}", where)
    return out


def unknown_fields(unknown: list[str], known: tuple[str, ...], kind: str = "field",
                   fix: str = "one of these fields (each described at /docs)") -> str:
    """The message for the unknown fields (or form parts, ``kind``) ``unknown``: the first with
    its close match among ``known`` (``unknown field 'sede' (did you mean 'seed'?)``), then the
    others.  Names are cut to 80 characters (a huge name is not echoed back)."""
    message = unknown_choice(kind, unknown[0][:80], known, fix)
    if len(unknown) > 1:
        others = ", ".join(repr(name[:80]) for name in unknown[1:5])
        message += f" Also unknown: {others}{' and more' if len(unknown) > 5 else ''}."
    return message


class _Keyed(dict):
    """A JSON object as :func:`unique_json` parses it: ``twice`` is the first key given twice in it."""

    twice: str | None = None


def _keyed(pairs: list[tuple[str, Any]]) -> _Keyed:
    out = _Keyed()
    for key, value in pairs:
        if key in out and out.twice is None:
            out.twice = key
        out[key] = value
    return out


def _twice_at(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first key given twice in ``value`` and its name in the request (``voices.A``,
    ``turns[0].speaker``, ``input``), or None."""
    if isinstance(value, _Keyed):
        if value.twice is not None:
            return (f"{path}.{value.twice}" if path else value.twice), value.twice
        children = ((f"{path}.{key}" if path else key, item) for key, item in value.items())
    elif isinstance(value, list):
        children = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    return next((found for name, item in children if (found := _twice_at(item, name)) is not None), None)


def unique_json(text: str, where: str = "the JSON body") -> Any:
    """``text`` parsed as JSON, refusing a key given twice in any object (which value counts is
    ambiguous), named by its place in the request as every other field is (``voices.A``,
    ``turns[0].speaker``): every JSON door's parser (the HTTP bodies; a live message, with
    ``where`` "the message").

    Raises:
        json.JSONDecodeError: not JSON.
        ApiError: 400 ``duplicate_field`` naming the key and its place.
    """
    data = json.loads(text, object_pairs_hook=_keyed)
    found = _twice_at(data)
    if found is not None:
        place, key = found
        raise _bad(f"{where} gives {short(key)} twice{'' if place == key else f' (at {short(place)})'}; "
                   "give each field once", clipped(place), "duplicate_field")
    return data


def short(value: Any) -> str:
    """``repr(value)``, :func:`~higgs_pack.errors.clipped` (an error never echoes a huge input)."""
    return clipped(repr(value))


def got(value: Any) -> str:
    """``value`` for a message in JSON's words: a string quoted (cut to 80 characters), else
    what it is (``a number (1.5)``, ``a boolean (true)``, ``a list``), never a Python type name
    (the HTTP bodies' and a live session's messages)."""
    return short(value) if isinstance(value, str) else plain_type(value)


#: The fields whose value is a name chosen from a list (the served model, a format, a live session's
#: commit rule): read by :func:`chosen_names` as :func:`voice_name` reads a voice's name, a leading
#: BOM dropped (the one text rule's :func:`~higgs_pack.runtime.text.clean`), so ``"\ufeffwav"`` is
#: ``"wav"`` as ``"\ufeffdefault"`` is ``"default"``; and a live message's ``type``.
CHOICE_FIELDS = ("model", "response_format", "stream_format", "split_granularity", "type")


def chosen_names(body: dict) -> dict:
    """``body`` (a speech or dialogue body, a live session.config) with each :data:`CHOICE_FIELDS`
    value read by the text rule (a leading BOM dropped); every other field as it is, and a value
    that is not a string left for its check to name."""
    return {key: clean(value) if key in CHOICE_FIELDS else value for key, value in body.items()}


def voice_name(value: Any, param: str) -> str:
    """A voice's name as every door that names one in JSON reads it (speech's ``voice``, a dialogue's
    ``voices.NAME``; an upload's name and ``DELETE /v1/audio/voices/NAME``, which may be bytes, are read
    by :func:`~higgs_pack.serve.upload.given_name`): under the one text rule (:func:`_text`: a
    leading BOM dropped, a control character refused), so one name is one voice at every door.

    Raises:
        ApiError: 400 naming ``param``.
    """
    return _text(value, param, f"a voice name ({DEFAULT_VOICE!r}, or one GET /v1/audio/voices lists)")


def _text(value: Any, param: str, meaning: str, why: str = "") -> str:
    """``value`` under the one text rule (:mod:`higgs_pack.runtime.text`) when it is speakable text
    (:func:`~higgs_pack.runtime.request.unspeakable`): a leading BOM dropped, CR LF and CR as LF.

    Raises:
        ApiError: 400 naming ``param`` and what it should hold (``meaning``).
    """
    problem = unspeakable(value, param, why)
    if problem is not None:
        raise _bad(f"{problem}; {param} is {meaning}", param)
    return clean(value)


def _model(body: dict, models: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None:
        raise _bad(f"model is required; this server serves {', '.join(models)}", "model", "missing_field")
    if not isinstance(model, str) or not model.strip():
        raise _bad(f"model must be a model name, got {got(model)}; this server serves {', '.join(models)}",
                   "model")
    if model not in models:
        raise ApiError(404, f"model {short(model)} is not served here; this server serves {', '.join(models)}",
                       param="model", code="model_not_found")
    return model


def _input(body: dict, config: ServeConfig) -> str:
    text = body.get("input")
    if text is None:
        raise _bad("input is required: the words to speak, as a string", "input", "missing_field")
    text = _text(text, "input", "the words to speak", "there is nothing to speak")
    if len(text) > config.max_input_chars:
        raise _bad(f"input is {len(text)} characters; the limit is {config.max_input_chars} (--max-input-chars); "
                   "split the text into several requests", "input", "input_too_long")
    return text


def _formats(body: dict) -> tuple[str, str | None]:
    response_format = body.get("response_format")
    response_format = DEFAULT_FORMAT if response_format is None else response_format
    if not isinstance(response_format, str) or response_format not in FORMATS:
        raise _bad(f"response_format {got(response_format)} is not supported; use one of {', '.join(FORMATS)}",
                   "response_format", "unsupported_value")
    stream_format = body.get("stream_format")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {got(stream)}", "stream")
    if stream_format not in (None, "audio", "sse"):
        raise _bad(f"stream_format {got(stream_format)} is not supported; use \"audio\" (bytes as they are "
                   "generated) or \"sse\" (speech.audio.delta events), or leave it out for the whole file",
                   "stream_format", "unsupported_value")
    if stream is not None and stream_format is not None and not (stream and stream_format == "audio"):
        # stream: true is stream_format "audio"; stream: false is the whole file: either disagrees with "sse".
        meant = "stream_format \"audio\"" if stream else "the whole file at once"
        raise _bad(f"stream {str(stream).lower()} and stream_format \"{stream_format}\" disagree: stream "
                   f"{str(stream).lower()} means {meant}; send only stream_format (\"audio\" or \"sse\"), or "
                   "only stream", "stream", "conflicting_fields")
    if stream_format is None and stream:
        stream_format = "audio"
    return response_format, stream_format


def _voice(body: dict, voices: Any, config: ServeConfig) -> tuple[str, dict[str, Any]]:
    """The voice's name and the request keywords that carry it."""
    voice = body.get("voice")
    voice = DEFAULT_VOICE if voice is None else voice
    if isinstance(voice, dict):
        if set(voice) != {"id"}:
            raise _bad(f"voice as an object takes only \"id\", got {short(sorted(voice))}", "voice")
        voice = voice["id"]
    if not isinstance(voice, str):
        raise _bad(f"voice must be a voice name or {{\"id\": name}}, got {got(voice)}", "voice")
    voice = voice_name(voice, "voice")
    ref_audio, ref_text = body.get("ref_audio"), body.get("ref_text")
    audio_param, text_param = "ref_audio", "ref_text"
    if body.get("references") is not None:
        if ref_audio is not None or ref_text is not None:
            raise _bad("give references or ref_audio with ref_text, not both", "references", "conflicting_fields")
        ref_audio, ref_text = _reference_entry(body["references"])
        audio_param, text_param = (name for _, name in REFERENCE_NAMES)
    if ref_audio is None:
        if ref_text is not None:
            raise _bad(f"{text_param} needs {audio_param} (the clip it is the transcript of)", text_param,
                       "missing_field")
        if voice == DEFAULT_VOICE:
            return voice, {}
        prepared = _stored_voice(voices, voice, "voice", "clone with ref_audio and ref_text")
        return voice, {"voice": prepared}
    if voice != DEFAULT_VOICE:
        raise _bad(f"give voice ({short(voice)}) or {audio_param} with {text_param}, not both", "voice",
                   "conflicting_fields")
    if ref_text is None:
        raise _bad(f"{audio_param} needs {text_param}, the exact transcript of the clip", text_param, "missing_field")
    _text(ref_text, text_param, "the exact transcript of the reference clip")
    samples, rate = reference_clip(ref_audio, config, audio_param)
    return "ref_audio", {"ref_audio": (samples, rate), "ref_text": ref_text}


def _reference_entry(references: Any) -> tuple[Any, Any]:
    if not isinstance(references, list) or len(references) != 1 or not isinstance(references[0], dict):
        shown = (f"a list of {len(references)}" if isinstance(references, list) and len(references) != 1 else
                 "a list holding " + plain_type(references[0]) if isinstance(references, list) else got(references))
        raise _bad(f"references must be a list of exactly one {{\"audio\", \"text\"}} object (one reference "
                   f"voice per request), got {shown}", "references")
    entry = references[0]
    extra = set(entry) - {"audio", "audio_path", "text"}
    if extra:
        raise _bad(f"a reference takes audio (or audio_path) and text, got {short(sorted(extra))} too",
                   "references")
    return entry.get("audio", entry.get("audio_path")), entry.get("text")


def reference_clip(ref_audio: Any, config: ServeConfig, param: str = "ref_audio") -> tuple[Any, int]:
    """Decode a ``ref_audio`` value: base64, a ``data:`` URI, or (only under
    ``--allow-local-media``) a file path or ``file://`` URI; or an upload's bytes.  URLs are
    refused.

    Returns:
        ``(samples, sample_rate)``: float32 [samples] mono, Hz.

    Raises:
        ApiError: 400 (not audio, a URL, a path outside the allowed folder, longer than
            ``max_ref_seconds``), 413 (more bytes than ``max_upload_bytes``).
    """
    if isinstance(ref_audio, bytes):  # an upload's bytes
        return _decoded(ref_audio, param, config, param)
    if not isinstance(ref_audio, str) or not ref_audio:
        shown = "an empty string" if ref_audio == "" else plain_type(ref_audio)
        raise _bad(f"{param} must be a base64 string or a data: URI, got {shown}", param)
    if re.match(r"^[a-z][a-z0-9+.-]*://", ref_audio, re.IGNORECASE) and not ref_audio.startswith("file://"):
        raise _bad(f"{param} is a URL ({ref_audio[:60]}); this server does not fetch URLs: send the clip as "
                   "base64 or a data: URI", param, "url_refused")
    path = _local_path(ref_audio, config, param)
    if path is not None:
        data = _read_bounded(path, config, param)
        source = f"{param} {path.name}"
    else:
        data = _base64(ref_audio, config, param)
        source = param
    return _decoded(data, source, config, param)


def _decoded(data: bytes, source: str, config: ServeConfig, param: str) -> tuple[Any, int]:
    try:
        samples, rate = read_audio_bytes(data, source, param, max_seconds=config.max_ref_seconds,
                                         limit=" (--max-ref-seconds)")
    except InputError as exc:
        unreadable = exc.code == "unreadable_audio"  # what libsndfile cannot read (AAC, which this server writes)
        decoded = decode_with_ffmpeg(data, config.max_ref_seconds) if unreadable else None
        if decoded is None:
            raise _bad(str(exc) + ("; FFmpeg could not decode it either" if unreadable else ""), param,
                       exc.code) from exc
        samples, rate = decoded
    seconds = len(samples) / rate
    if seconds > config.max_ref_seconds:
        raise _bad(f"{source} is {seconds:.1f} s long; this server takes reference clips of at most "
                   f"{config.max_ref_seconds:g} s (--max-ref-seconds); 3-10 s works best", param, "reference_too_long")
    return samples, rate


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}", re.ASCII)


def _looks_like_path(value: str, config: ServeConfig) -> bool:
    """Whether a ``ref_audio`` string is meant as a path, not base64: ``file://``; or a short value
    (under 1024 characters) that ends in an audio suffix (base64 has no "."), is absolute and
    not base64 (``/etc/passwd``), or, under --allow-local-media, names something that exists
    (absolute, or under the folder: ``sub``)."""
    if value.startswith("file://"):
        return True
    if len(value) >= 1024 or _DATA_URI.match(value):
        return False
    if Path(value).suffix.lower() in (".wav", ".flac", ".ogg", ".opus", ".mp3"):
        return True
    if value.startswith("/") and not (len(value) % 4 == 0 and _BASE64.fullmatch(value)):
        return True
    if config.allow_local_media is None:
        return False
    try:
        return (Path(config.allow_local_media) / value).exists()  # an absolute value replaces the folder
    except (OSError, ValueError):  # a NUL character, a name too long
        return False


def _local_path(value: str, config: ServeConfig, param: str) -> Path | None:
    if not _looks_like_path(value, config):
        return None
    if config.allow_local_media is None:
        raise _bad(f"{param} names a file ({value[:80]}); this server reads no local files unless started with "
                   "--allow-local-media DIR: send the clip as base64 or a data: URI", param, "local_media_refused")
    root = Path(config.allow_local_media).resolve()
    path = (root / value.removeprefix("file://")).resolve()  # a relative path is relative to the folder
    if not path.is_relative_to(root):
        raise _bad(f"{param} {value[:80]} is outside the allowed folder {root} (--allow-local-media)",
                   param, "local_media_refused")
    if not path.is_file():
        raise _bad(f"{param} {value[:80]} is not a file in the allowed folder {root} (--allow-local-media); "
                   "give a path relative to it, or absolute", param, "local_media_missing")
    return path


def _read_bounded(path: Path, config: ServeConfig, param: str) -> bytes:
    size = path.stat().st_size
    if size > config.max_upload_bytes:
        raise ApiError(413, f"{param} {path.name} is {size} bytes; the limit is {config.max_upload_bytes} "
                       "(--max-upload-mb)", param=param, code="too_large")
    return path.read_bytes()


def _base64(value: str, config: ServeConfig, param: str) -> bytes:
    match = _DATA_URI.match(value)
    payload = value[match.end():] if match else value
    if len(payload) * 3 // 4 > config.max_upload_bytes:
        raise ApiError(413, f"{param} is about {len(payload) * 3 // 4} bytes; the limit is {config.max_upload_bytes} "
                       "(--max-upload-mb)", param=param, code="too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(f"{param} is not valid base64 ({exc}); send the clip's bytes base64-encoded, or as "
                   "data:audio/wav;base64,...", param) from exc


#: HTTP name -> the request keyword it sets, for the body's valued fields (the request's one declaration).
KEYWORDS = http_keywords()
#: Fields that hold whole numbers: JSON has one kind of number, so ``7.0`` is 7 there (RFC 8259 section 6).
WHOLE_FIELDS = tuple(http for http, keyword in KEYWORDS.items() if is_whole(keyword))


def _sampling(body: dict) -> dict[str, Any]:
    """The request keywords of the body's valued fields (sampling, frame cap, first chunk, rolling
    context), each judged by the request against its declaration; null is left out, except
    ``seed`` (null: a fresh seed).  A whole-number field given as an integral float (``7.0``, as
    some JSON encoders write 7) is that whole number.  A first chunk larger than the default
    largest chunk raises the largest to match.

    Raises:
        ApiError: 400 for ``initial_chunk_frames`` beside ``initial_codec_chunk_frames`` (one field, two names).
    """
    body = {k: int(v) if k in WHOLE_FIELDS and isinstance(v, float) and v.is_integer() else v for k, v in body.items()}
    given: dict[str, str] = {}
    keywords: dict[str, Any] = {}
    for http, keyword in KEYWORDS.items():
        if body.get(http) is None:
            continue
        if keyword in given:
            raise _bad(f"give {given[keyword]} or {http}, not both (two names of one field)", http,
                       "conflicting_fields")
        given[keyword] = http
        keywords[keyword] = body[http]
    if "seed" in body and body["seed"] is None:
        keywords["seed"] = None
    first = keywords.get("first_chunk_frames")
    if isinstance(first, int) and not isinstance(first, bool):
        keywords["max_chunk_frames"] = max(first, MAX_CHUNK_FRAMES)
    return keywords
