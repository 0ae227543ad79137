"""The request bodies as the API docs (``/docs``, ``/openapi.json``) show them.

The sampling, frame and context fields of the speech and dialogue bodies are not declared here:
they come from the request's one declaration (:class:`~higgs_pack.runtime.options.RequestFields`),
with its defaults, limits and descriptions.  These pydantic models only describe: the routes read their bodies themselves and check every
field with their own messages (:func:`~higgs_pack.serve.speech.parse_speech`, the voice
upload in :mod:`~higgs_pack.serve.app`), which name the field, what was wrong and what is
allowed, and refuse an unknown field with a close match.  :func:`add_bodies` puts the models in
the app's OpenAPI schema; each route points at its model with ``openapi_extra``
(:func:`json_body`, :func:`form_body`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from higgs_pack.runtime.loop.sentences import GRANULARITIES
from higgs_pack.runtime.options import FIELDS, RequestFields, http_fields
from higgs_pack.serve.config import MAX_INPUT_CHARS, MAX_REF_SECONDS
from higgs_pack.serve.formats import DEFAULT_FORMAT, FORMATS
from higgs_pack.serve.tempo import SPEED_RANGE
from higgs_pack.serve.voices import NAME_RULE, RESERVED

#: The ``response_format`` values, as the schema lists them.
ResponseFormat = Literal[tuple(FORMATS)]  # type: ignore[valid-type]


class VoiceId(BaseModel):
    """A voice as an object (the form OpenAI's newer clients send)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="The voice's name.")


class Reference(BaseModel):
    """One reference voice (Boson's form of ``ref_audio`` with ``ref_text``)."""

    model_config = ConfigDict(extra="forbid")
    audio: str | None = Field(None, description="The clip: base64, or a data: URI (a file path only under "
                              "--allow-local-media).")
    audio_path: str | None = Field(None, description="Another name of audio.")
    text: str = Field(description="The exact words said in the clip.")


class _SpeechBody(BaseModel):
    """The body of ``POST /v1/audio/speech``: OpenAI's fields and the extensions of vllm-omni
    and sglang-omni.  A field sent as null counts as left out (``seed``: null is a random seed).
    The sampling, frame and context fields are the request's own declaration
    (:class:`~higgs_pack.runtime.options.RequestFields`), added by their HTTP names."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "higgs-audio-v3-tiny", "input": "Hello from the server.", "voice": "default",
         "response_format": "mp3", "speed": 1.25},
        {"model": "higgs-audio-v3-tiny", "input": "Raw PCM as it is made.", "response_format": "pcm",
         "stream_format": "audio", "seed": 7}]})

    model: str = Field(description="The bundle's name or its model slug (GET /v1/models lists them, with the "
                       "names --model-name adds).")
    input: str = Field(description=f"{RequestFields.model_fields['text'].description} At most {MAX_INPUT_CHARS} "
                       "characters by default (--max-input-chars).")  # the rule in the field's one declaration
    voice: str | VoiceId = Field("default", description="\"default\" (the bundle's own voice), a stored voice's "
                                 "name (GET /v1/audio/voices), or {\"id\": name}.")
    response_format: ResponseFormat = Field(
        DEFAULT_FORMAT, description="OpenAI's six, mp3 by default as OpenAI's; each streams as it is generated: mp3 frames, "
        "Opus in Ogg, AAC in ADTS, a FLAC stream, a WAV of open length, pcm (raw 24 kHz 16-bit little-endian "
        "mono).")
    speed: float = Field(1.0, ge=SPEED_RANGE[0], le=SPEED_RANGE[1], description="The tempo, 0.25 to 4.0 (2.0: twice as fast), the "
                         "pitch kept (FFmpeg's atempo); segment timings are scaled to match.")
    instructions: str | None = Field(None, description="Refused: the model's prompt has no instruction slot; "
                                     "write inline controls in the input instead.")
    stream_format: Literal["audio", "sse"] | None = Field(
        None, description="Left out: the whole file at once. \"audio\": bytes as frames are generated. \"sse\": "
        "speech.audio.delta events (base64 audio), a speech.segment event (text, start, end in seconds, chunk, "
        "exact) once a sentence's audio is all sent, then speech.audio.done with usage, or speech.audio.error.")
    segments: bool | None = Field(None, description="true: the whole answer is JSON, {\"audio\": base64 of the "
                                  "file in response_format, \"response_format\", \"sample_rate\", \"segments\": "
                                  "[{\"text\", \"start\", \"end\", \"chunk\", \"exact\"}]}: one per sentence, "
                                  "in seconds, timed from frame counts (exact: false where a sentence shared its "
                                  "text chunk and its ends are estimated); no word timings. Not with "
                                  "stream_format \"audio\" (\"sse\" sends speech.segment events).")
    stream: bool | None = Field(None, description="sglang-omni's switch: true is stream_format \"audio\", false "
                                "the whole file; given beside a stream_format that disagrees, a 400.")
    ref_audio: str | None = Field(None, description="A reference clip to clone: base64 or a data: URI (a file "
                                  "path only under --allow-local-media; URLs are refused); 0.5 s to "
                                  f"{MAX_REF_SECONDS:g} s by default (--max-ref-seconds). Needs ref_text.")
    ref_text: str | None = Field(None, description="The exact transcript of ref_audio.")
    references: list[Reference] | None = Field(None, min_length=1, max_length=1, description="Boson's form of "
                                               "ref_audio with ref_text: exactly one entry.")


SpeechBody = create_model("SpeechBody", __base__=_SpeechBody, __doc__=_SpeechBody.__doc__, __module__=__name__,
                        **http_fields())  # type: ignore[call-overload]


class DialogueTurn(BaseModel):
    """One turn of a dialogue."""

    model_config = ConfigDict(extra="forbid")
    speaker: str = Field(description="Who says it (1 to 64 characters, no ':').")
    input: str = Field(description="The words of the turn.")


class _DialogueBody(BaseModel):
    """The body of ``POST /v1/audio/dialogue``: turns of several speakers spoken as one audio, each
    in its speaker's voice with that speaker's recent turns as context; the answer is
    /v1/audio/speech's (one segment per turn, with its speaker)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "higgs-audio-v3-tiny", "turns": [{"speaker": "ANN", "input": "Good morning!"},
                                                   {"speaker": "BEN", "input": "Morning. Coffee?"}],
         "voices": {"BEN": "narrator"}, "response_format": "wav", "segments": True}]})

    model: str = Field(description="As /v1/audio/speech.")
    turns: list[DialogueTurn] = Field(min_length=1, max_length=1000, description="The script, in order: at most "
                                      "1000 turns, their inputs together at most --max-input-chars characters.")
    voices: dict[str, str | VoiceId | Reference] | None = Field(
        None, description="Speaker -> a stored voice's name (or {\"id\": name}; \"default\": none), or a clip "
        "{\"audio\", \"text\"}. A speaker left out speaks its first turn in a voice of the model's choosing, which "
        "is then its voice.")
    response_format: ResponseFormat = Field(DEFAULT_FORMAT, description="As /v1/audio/speech.")
    speed: float = Field(1.0, ge=SPEED_RANGE[0], le=SPEED_RANGE[1], description="As /v1/audio/speech: the tempo, "
                         "the pitch kept; each turn's segment timings scaled to match.")
    stream_format: Literal["audio", "sse"] | None = Field(None, description="As /v1/audio/speech; with \"sse\" "
                                                          "a speech.segment event (with speaker) per turn.")
    stream: bool | None = Field(None, description="As /v1/audio/speech.")
    segments: bool | None = Field(None, description="As /v1/audio/speech: true gives JSON with the audio and one "
                                  "segment per turn (exact times, speaker).")


DialogueBody = create_model("DialogueBody", __base__=_DialogueBody, __doc__=_DialogueBody.__doc__,
                          __module__=__name__, **http_fields(dialogue=True))  # type: ignore[call-overload]


#: The largest ``first_commit_words``: the word count that triggers a live response's first commit.
FIRST_COMMIT_WORDS_MAX = 50


#: A live session's ``initial_chunk_frames`` when its config gives none: its first audio is the
#: stateful codec's first call, made once the codec's lookahead and ONE frame past it exist (issue 41
#: goal 2: first audio at prefill + lookahead + 1 frames + one codec call).  The HTTP route's default
#: (:data:`~higgs_pack.runtime.options.FIRST_CHUNK_FRAMES`, 10) waited for 9 frames more before it (at
#: full size on 2 cores, 9 x 75 ms of decoder steps); a session that wants a larger first piece says so.
LIVE_FIRST_CHUNK_FRAMES = 1


class SessionFields(BaseModel):
    """The fields a live session's ``session.config`` takes besides the speech body's
    (``/v1/audio/speech/stream``, docs/serving/live.md): how text is committed to speech
    (:class:`~higgs_pack.runtime.loop.sentences.TextCommits`)."""

    model_config = ConfigDict(extra="forbid")
    split_granularity: Literal[GRANULARITIES] = Field(  # type: ignore[valid-type]
        "clause", description="Text is committed to speech at sentence ends, or at clause ends too (the default, "
        "with first_commit_words 3: the rule the agent benchmark chose, docs/benchmarks/agent.md).")
    first_commit_words: int = Field(3, ge=0, le=FIRST_COMMIT_WORDS_MAX, description="How many whole words of a "
                                    "response start its speech: once that many have arrived, they are spoken "
                                    "alone, before their sentence ends, unless a sentence or clause end came first "
                                    "(0: no first commit). A response ends at input.flush or input.cancel: the next "
                                    "text is a new response's.")


#: Fields of the speech body a session cannot take, each with why (said when one is sent): the
#: request fields declared not live (text comes in ``input.text`` messages:
#: :class:`~higgs_pack.runtime.options.Door`), the stream switches (a session always streams) and
#: ``segments`` (a whole answer's timings: a session's ``audio.done`` carries them).
NOT_IN_CONFIG: dict[str, str] = {
    **{door.http: "text comes in input.text messages" for door in FIELDS.values() if door.http and not door.live},
    "stream_format": "a session always streams its audio", "stream": "a session always streams its audio",
    "segments": "each sentence's timings come in its audio.done event"}


def config_fields() -> tuple[str, ...]:
    """Every field a ``session.config`` takes besides ``type``: the speech body's, less
    :data:`NOT_IN_CONFIG`, and :class:`SessionFields`'s."""
    return (*(name for name in SpeechBody.model_fields if name not in NOT_IN_CONFIG), *SessionFields.model_fields)


class VoiceUpload(BaseModel):
    """The multipart form of ``POST /v1/audio/voices``: a clip encoded once by the bundle's
    codec and kept by name (``transcript`` may be sent as ``ref_text``, ``audio`` as ``file``)."""

    model_config = ConfigDict(extra="forbid")
    audio: bytes = Field(description="The clip: a file libsndfile reads, 0.5 s to --max-ref-seconds, at most "
                         "--max-upload-mb.", json_schema_extra={"format": "binary"})
    transcript: str = Field(description="The exact words said in the clip.")
    name: str = Field(description=f"{NAME_RULE}; not {' or '.join(map(repr, RESERVED))}.")


class ErrorDetail(BaseModel):
    message: str = Field(description="What was wrong and what to do.")
    type: str = Field(description="invalid_request_error, not_found_error, rate_limit_error, server_error, ...")
    param: str | None = Field(description="The request field at fault, or null.")
    code: str | None = Field(description="A stable name: unknown_field, queue_full, shutting_down, ...")


class ErrorBody(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


#: The models :func:`add_bodies` puts in the schema.
MODELS = (SpeechBody, DialogueBody, VoiceUpload, ErrorBody)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses`` entries for error ``statuses``, each an :class:`ErrorBody`."""
    return {status: {"description": "An error in OpenAI's shape", "content": {"application/json": {
        "schema": _ref(ErrorBody)}}} for status in statuses}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is ``model`` as JSON."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(model)}}}}


def body_hint(model: type[BaseModel], what: str = "a JSON object") -> str:
    """What a JSON body of ``model`` is, for the refusal of a body that is not JSON: an object with the
    model's first three fields (what a request names: the model, the words, the voices), so each
    route names its own ("model, input and voice"; a dialogue's "model, turns and voices")."""
    first, second, third = list(model.model_fields)[:3]
    return f"send {what} with {first}, {second} and {third}"


def form_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is ``model`` as multipart/form-data."""
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _ref(model)}}}}


def add_bodies(app: Any) -> None:
    """Make ``app.openapi()`` hold :data:`MODELS` under ``components.schemas`` (the routes'
    ``openapi_extra`` points at them by name)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in MODELS:
                found = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(found.pop("$defs", {}))
                schemas[model.__name__] = found
        return app.openapi_schema

    app.openapi = openapi
