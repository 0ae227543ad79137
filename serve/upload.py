"""A voice upload's multipart body read into its parts (``POST /v1/audio/voices``): the clip's bytes,
its transcript and the voice's name, each checked, before anything is decoded as audio.

Text parts follow the one text rule of every front door (:mod:`higgs_pack.runtime.text`): UTF-8 or
refused naming the part (Starlette's parser decodes a part that is not UTF-8 as Latin-1, which
would store ``The quick \\xff fox`` as ``The quick ÿ fox``: a wrong transcript is a wrong voice),
a leading byte-order mark dropped, no control characters.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser, parse_options_header
from starlette.requests import Request

from higgs_pack.errors import InputError, Problem
from higgs_pack.runtime import text as text_rule
from higgs_pack.serve.errors import ApiError, refused
from higgs_pack.serve.speech import unknown_fields
from higgs_pack.serve.voices import name_problem

#: The parts a voice upload takes (``ref_text`` and ``file`` are other names of transcript and audio).
PARTS = ("name", "transcript", "ref_text", "audio", "file")


class _StrictParts(MultiPartParser):
    """Starlette's multipart parser, but a text part that is not UTF-8 is kept as its bytes (Starlette
    would decode it as Latin-1), so :func:`given_text` refuses it naming the part."""

    #: The first part name that is not UTF-8, as its bytes (Starlette would read it as Latin-1, so a
    #: name b"\xff" would be said as 'ÿ'); :func:`read_upload` refuses it naming the byte.
    bad_name: bytes | None = None

    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        _, options = parse_options_header(self._current_part.content_disposition)
        raw = options[b"name"]
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            self.bad_name = self.bad_name or raw
            self._current_part.field_name = raw.decode("utf-8", "backslashreplace")  # '\\xff', never 'ÿ'

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode("utf-8")
            except UnicodeDecodeError:
                self.items.append((part.field_name, bytes(part.data)))  # type: ignore[arg-type]
                return
        super().on_part_end()


@dataclass(frozen=True)
class Upload:
    """A voice upload's checked parts.

    Attributes:
        name: the voice's name (checked by :func:`~higgs_pack.serve.voices.name_problem`).
        transcript: the exact words said in the clip (:func:`~higgs_pack.runtime.text.clean`-ed).
        audio: the clip file's bytes (at most ``max_bytes``), not yet decoded.
    """

    name: str
    transcript: str
    audio: bytes


async def read_upload(request: Request, max_bytes: int) -> Upload:
    """The upload's parts, each checked in order: the body's kind, unknown or repeated parts, the name,
    the audio part, the transcript, the clip's size.

    Args:
        request: the ``multipart/form-data`` request.
        max_bytes: the largest clip file (``--max-upload-mb``).

    Raises:
        ApiError: 400 (not multipart, a parser limit, an unknown or repeated part, a bad or missing
            name, audio or transcript, a text part that is not UTF-8), 413 (the clip is too large).
    """
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise refused(Problem.said("a voice upload is multipart/form-data with the parts audio (the clip), "
                                   "transcript and name", code="invalid_body"), param="audio")
    parser = _StrictParts(request.headers, request.stream(), max_files=1, max_fields=8, max_part_size=max_bytes + 1)
    try:
        form = await parser.parse()
    except MultiPartException as exc:  # the parser's limits: more than one file, too many parts
        raise refused(Problem.said(f"{exc.message} A voice upload is one audio file part with transcript and "
                                   "name parts", code="invalid_body"), param="audio") from exc
    if parser.bad_name is not None:  # named by its bytes, as a part's value that is not UTF-8 is
        await form.close()
        escaped = parser.bad_name.decode("utf-8", "backslashreplace")[:80]
        try:
            text_rule.decode(parser.bad_name, f"the name of the part '{escaped}'", fix="name the part audio, "
                             "transcript or name, in UTF-8")
        except InputError as exc:
            raise refused(Problem.said(str(exc), code="unknown_field"), param=escaped) from None
    _check_parts(form)
    if form.get("name") is None:
        raise refused(Problem.said(name_problem(None) or "", "name", code="missing_field"))
    name = given_name(form["name"])  # type: ignore[arg-type]
    if (problem := name_problem(name)) is not None:
        raise refused(Problem.said(problem, "name", name, code="invalid_name"))
    upload = form.get("audio", form.get("file"))
    if upload is None or isinstance(upload, (str, bytes)):
        raise refused(Problem.said("the upload needs an audio file part (multipart field 'audio')", "audio",
                                   code="missing_field"))
    key = "transcript" if "transcript" in form else "ref_text"
    transcript = _text_part(form, key, "transcript", "a transcript holds the words the clip says",
                            fix="; transcript is the exact words said in the clip")
    data = await upload.read(max_bytes + 1)
    await form.close()
    if len(data) > max_bytes:
        raise ApiError(413, f"the audio file is over the limit of {max_bytes} bytes (--max-upload-mb)",
                       param="audio", code="too_large")
    return Upload(name, transcript.strip(), data)


def _check_parts(form: FormData) -> None:
    """Refuse parts a voice upload does not take, and a part given twice (which one counts would
    be a guess, and a wrong transcript is a wrong voice)."""
    unknown = [k for k in form if k not in PARTS]
    if unknown:
        raise refused(Problem.said(unknown_fields(unknown, PARTS, "part", "one of these multipart parts (a voice "
                                                  "upload takes audio, transcript and name)"), code="unknown_field"),
                      param=unknown[0][:80])
    given = [k for k, _ in form.multi_items()]
    twice = sorted({k for k in given if given.count(k) > 1} | {"/".join(pair) for pair in
                                                                (("transcript", "ref_text"), ("audio", "file"))
                                                                if set(pair) <= set(given)})
    if twice:
        raise refused(Problem.said(f"the upload gives {', '.join(twice)} more than once; give each part once "
                                   "(transcript or ref_text, audio or file)", code="duplicate_field"),
                      param=twice[0].split("/")[0])


def _text_part(form: FormData, key: str, param: str, why: str, code: str = "invalid_value", fix: str = "") -> str:
    """The text part ``key`` under the one text rule, named ``param`` in errors.

    Raises:
        ApiError: 400 ``missing_field`` (absent), ``code`` (not UTF-8, a control character, blank).
    """
    value = form.get(key)
    if value is None:
        raise refused(Problem.said(f"the upload needs '{param}': the exact words said in the clip", param,
                                   code="missing_field"))
    return given_text(value, param, f"the {param} part", why, code, fix)  # type: ignore[arg-type]


def given_name(value: str | bytes, where: str = "the name part") -> str:
    """A voice's name as an upload's ``name`` part and the ``NAME`` of ``DELETE /v1/audio/voices/NAME``
    give it (one check for both): bytes that are not UTF-8 refused naming ``where`` and the byte, then
    the one text rule (a leading BOM dropped, a control character refused), ``param`` ``name``.

    Raises:
        ApiError: 400 ``invalid_name``.
    """
    return given_text(value, "name", where, "a voice is stored under a name", code="invalid_name")


def given_text(value: str | bytes, param: str, where: str, why: str, code: str = "invalid_value",
               fix: str = "") -> str:
    """``value`` (text, or bytes that should be UTF-8 text) under the one text rule, named ``param``
    in errors and ``where`` when its bytes are not UTF-8 (``"the transcript part"``).

    Raises:
        ApiError: 400 ``code`` (not UTF-8, a control character, blank).
    """
    if isinstance(value, bytes):
        try:
            value = text_rule.decode(value, where, fix="send it as UTF-8 text")
        except InputError as exc:
            raise refused(Problem.said(str(exc), param, code=code)) from None
    problem = text_rule.problem(value, param, why)
    if problem is not None:
        raise refused(Problem.said(problem + fix, param, value, code=code))
    return text_rule.clean(value)
