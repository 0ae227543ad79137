"""The server's settings and limits (:class:`ServeConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from higgs_pack.errors import InputError, Problem

#: Longest ``input`` by default (characters): about 8,000 English words, some 45 minutes of speech,
#: spoken in chunks with a rolling context.  OpenAI's own limit is 4,096 (openai-python
#: speech_create_params.py); a long text is what people use Higgs for, so this server takes more.
MAX_INPUT_CHARS = 50_000
#: Largest voice upload or ``ref_audio`` payload, bytes (a 30 s 48 kHz stereo 16-bit WAV is 5.8 MB).
MAX_UPLOAD_BYTES = 16 * 1024 * 1024
#: Longest reference clip accepted over HTTP, seconds (the runtime itself takes up to 60 s).
MAX_REF_SECONDS = 30.0
#: Requests waiting for a row beyond those in the batch; one more is answered 429.
MAX_QUEUE = 16
#: Seconds SIGTERM leaves the requests in flight to finish before the process exits.
GRACE_SECONDS = 30.0


def origin_problem(origin: str) -> str:
    """What is wrong with a web page origin as ``--allow-origin`` takes it, or ``""``: ``*`` or
    ``scheme://host[:port]`` as a browser sends it in its ``Origin`` header (RFC 6454: no path,
    no trailing slash)."""
    from urllib.parse import urlsplit

    if origin == "*":
        return ""
    parts = urlsplit(origin) if isinstance(origin, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc or \
            origin != f"{parts.scheme}://{parts.netloc}":
        return "an origin is scheme://host[:port] as the browser's Origin header says it (http://localhost:3000), or *"
    return ""


@dataclass(frozen=True)
class Setting:
    """How one :class:`ServeConfig` field is set from outside Python: the one declaration that
    ``higgs-pack serve``'s option (:func:`higgs_pack.serve.cli.serve`), its environment variable and
    Ray Serve's ``build_app`` argument (:mod:`higgs_pack.serve.ray_app`) are made from.

    Attributes:
        flag: the command-line option (``--max-kv-mb``); its environment variable is
            ``HIGGS_PACK_SERVE_`` and the flag's name in capitals (``HIGGS_PACK_SERVE_MAX_KV_MB``),
            unless ``envvar`` names another.
        help: what the option does, for ``--help`` and the Ray argument's description.
        kind: what a value is: ``"whole"``, ``"number"``, ``"text"``, ``"folder"``, ``"file"`` or
            ``"texts"`` (repeatable; comma-separated for Ray).
        minimum: the least value a number takes, in the option's unit (checked by the option, and by
            :class:`ServeConfig` in the field's: ``minimum * unit`` bytes, rounded up, for a size).
        unit: bytes per unit of a size given in MiB (``2**20``; the field holds bytes), else 1.
        envvar: an environment variable of its own (``HIGGS_PACK_API_KEY``), or None.
        metavar: the option's metavar in ``--help``, or None.
        choices: the only values a ``"text"`` takes (the option offers them; :class:`ServeConfig`
            refuses any other, naming the field), or None for any text.
    """

    flag: str
    help: str
    kind: str
    minimum: float | None = None
    unit: int = 1
    envvar: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        """The option's name as a Python identifier (``max_kv_mb``, ``model_name``): the command's
        parameter, and the Ray key of a value given in another unit than the field's."""
        return self.flag.removeprefix("--").replace("-", "_")


def _setting(default: Any, flag: str, help: str, kind: str, **more: Any) -> Any:
    """A :class:`ServeConfig` field with its :class:`Setting` (dataclass field metadata)."""
    return field(default=default, metadata={"setting": Setting(flag, help, kind, **more)})


def settings() -> dict[str, Setting]:
    """Every :class:`ServeConfig` field's :class:`Setting`, by field name, in the order declared."""
    return {f.name: f.metadata["setting"] for f in fields(ServeConfig)}


@dataclass(frozen=True)
class ServeConfig:
    """How ``higgs-pack serve`` runs: the engine's size and every limit it enforces.  Each field is
    declared once, with how it is set from the command line, the environment and Ray Serve
    (:class:`Setting`); those doors are made from it.

    Attributes:
        max_batch: rows the engine decodes together (None: the most the bundle's backend
            batches, at most 4; 1 where it cannot batch).
        max_queue: requests admitted beyond the batch, waiting for a row; one more is a 429.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        voices_dir: where uploaded voices are kept (None: in memory only, lost at exit); created
            when missing, but only that last folder: its parent must exist.
        prefix_key_file: the secret that signs the voices' persisted prompt-prefix KV files (made with
            mode 0600 on first start; None: ``$XDG_STATE_HOME/higgs-pack/voice-prefix.key``); must be
            outside ``voices_dir``; servers sharing a voices folder share this file too.
        allow_local_media: ``ref_audio`` may name a file under this folder (None: never).
        max_kv_bytes: KV cache budget of the engine's admitted requests (None: the engine's
            default, from free memory; see :func:`higgs_pack.runtime.engine.kv_memory.default_kv_budget`).
        max_input_chars: longest ``input``.
        max_upload_bytes: largest voice upload or decoded ``ref_audio``.
        max_ref_seconds: longest reference clip.
        grace_seconds: on SIGTERM, how long requests in flight may take to finish.
        model_names: extra names ``model`` may take (the bundle's name and model slug always work).
        allow_origins: web page origins (``scheme://host[:port]``, or ``*`` for any) that may call
            this server from a browser besides its own pages (the demo page); a request from any
            other page is refused (see ``serve.app._SameOrigin``).

    Raises:
        InputError: a limit out of range, a folder that is not one, or a ``voices_dir`` whose
            parent folder does not exist ("folder X does not exist; create it first").
    """

    max_batch: int | None = _setting(None, "--max-batch", "Requests decoded together (default: 4 where the "
                                     "backend batches, else 1).", "whole", minimum=1)
    max_queue: int = _setting(MAX_QUEUE, "--max-queue", "Requests waiting beyond the batch; one more is answered "
                              "429.", "whole", minimum=0)
    api_key: str | None = _setting(None, "--api-key", "Require Authorization: Bearer KEY on /v1/* (or set "
                                   "HIGGS_PACK_API_KEY).", "text", envvar="HIGGS_PACK_API_KEY")
    voices_dir: Path | None = _setting(None, "--voices-dir", "Keep uploaded voices here; its parent folder must "  # noqa: RUF009 (a field())
                                       "exist (default: in memory, lost at exit).", "folder")
    prefix_key_file: Path | None = _setting(  # noqa: RUF009 (a field())
        None, "--prefix-key-file", "The secret that signs the voices' cached prompt prefixes, kept outside "
        "--voices-dir (made on first start with mode 0600; default: $XDG_STATE_HOME/higgs-pack/voice-prefix.key). "
        "Servers sharing a voices folder give the same file.", "file")
    allow_local_media: Path | None = _setting(None, "--allow-local-media", "ref_audio may name a file under this "  # noqa: RUF009 (a field())
                                              "folder (default: never).", "folder")
    max_kv_bytes: int | None = _setting(None, "--max-kv-mb", "KV cache budget of the requests in the batch, MiB "
                                        "(default: half the memory available at start); a request that does not "
                                        "fit waits.", "number", minimum=1, unit=2**20)
    max_input_chars: int = _setting(MAX_INPUT_CHARS, "--max-input-chars", "Longest `input` of a speech request, "
                                    "characters; a longer one is answered 400.", "whole", minimum=1)
    max_upload_bytes: int = _setting(MAX_UPLOAD_BYTES, "--max-upload-mb", "Largest voice upload or ref_audio, MiB.",
                                     "number", minimum=0.001, unit=2**20)
    max_ref_seconds: float = _setting(MAX_REF_SECONDS, "--max-ref-seconds", "Longest reference clip (ref_audio, or "
                                      "a voice upload), seconds; a longer one is answered 400.", "number",
                                      minimum=0.5)
    grace_seconds: float = _setting(GRACE_SECONDS, "--grace-seconds", "On SIGTERM or Ctrl-C, seconds the requests "
                                    "in flight have to finish; those still running then are cut off (a 503 where "
                                    "no audio was sent yet).", "number", minimum=0.1)
    model_names: tuple[str, ...] = _setting((), "--model-name", "Another name `model` may take (repeatable).",
                                            "texts")
    allow_origins: tuple[str, ...] = _setting(
        (), "--allow-origin", "A web page origin (http://localhost:3000, or *) whose scripts may call this server "
        "besides its own pages (repeatable); requests from other pages are refused with 403.", "texts",
        metavar="ORIGIN")

    @classmethod
    def given(cls, values: dict[str, Any]) -> ServeConfig:
        """A config from values as the command line and Ray take them: keyed by the field's name
        (``model_names``) or the option's (``model_name``; a size in MiB only by the option's:
        ``max_kv_mb``); None or absent: the default.

        Raises:
            InputError: as the class.
        """
        out: dict[str, Any] = {}
        for name, setting in settings().items():
            value = values.get(setting.name) if setting.unit != 1 else values.get(name, values.get(setting.name))
            if value is None or (setting.kind == "texts" and not value):
                continue
            out[name] = int(value * setting.unit) if setting.unit != 1 else \
                tuple(value) if setting.kind == "texts" else value
        return cls(**out)

    def __post_init__(self) -> None:
        problems = []
        for name, setting in settings().items():  # the numbers' kinds and least values, as declared
            value = getattr(self, name)
            if setting.minimum is None or value is None:
                continue
            whole = setting.kind == "whole" or setting.unit != 1  # a size is held in whole bytes
            low = setting.minimum if setting.unit == 1 else math.ceil(setting.minimum * setting.unit)
            if whole and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                problems.append(f"{name} must be a whole number >= {low:g}, got {value!r}")
            elif not whole and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not low <= value < float("inf")):
                problems.append(f"{name} must be a number >= {low:g}, got {value!r}")
        for name, setting in settings().items():  # a text of a few values, as declared
            value = getattr(self, name)
            if setting.choices is not None and value is not None and value not in setting.choices:
                problems.append(f"{name} must be one of {', '.join(setting.choices)}, got {value!r}")
        if any(not isinstance(name, str) or not name.strip() for name in self.model_names):
            problems.append("a --model-name is blank; give each extra model name as a non-empty word, or leave "
                            "--model-name out")
        for origin in self.allow_origins:
            if origin_problem(origin):
                problems.append(f"--allow-origin {origin!r}: {origin_problem(origin)}")
        if self.api_key is not None and not self.api_key.strip():
            problems.append("api_key is blank; give a key, or leave --api-key out to serve without one")
        media = self.allow_local_media
        if media is not None and not Path(media).is_dir():
            problems.append(f"--allow-local-media {media} is not a folder; give the folder reference clips may "
                            "be read from")
        voices = Path(self.voices_dir) if self.voices_dir is not None else None
        if voices is not None and voices.exists() and not voices.is_dir():
            problems.append(f"--voices-dir {voices} is not a folder; give the folder voices are kept in")
        elif voices is not None and not voices.exists() and not voices.absolute().parent.is_dir():
            problems.append(f"--voices-dir {voices}: folder {voices.absolute().parent} does not exist; create it "
                            "first (the server creates only the voices folder itself)")
        if problems:
            raise InputError.of(Problem.said("; ".join(problems)))
