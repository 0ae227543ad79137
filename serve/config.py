"""The server's settings and limits (:class:`ServeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from higgs_pack.manifests.errors import InputError

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
class ServeConfig:
    """How ``higgs-pack serve`` runs: the engine's size and every limit it enforces.

    Attributes:
        max_batch: rows the engine decodes together (None: the most the bundle's backend
            batches, at most 4; 1 where it cannot batch).
        max_queue: requests admitted beyond the batch, waiting for a row; one more is a 429.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        voices_dir: where uploaded voices are kept (None: in memory only, lost at exit); created
            when missing, but only that last folder: its parent must exist.
        allow_local_media: ``ref_audio`` may name a file under this folder (None: never).
        max_input_chars: longest ``input``.
        max_upload_bytes: largest voice upload or decoded ``ref_audio``.
        max_ref_seconds: longest reference clip.
        max_kv_bytes: KV cache budget of the engine's admitted requests (None: the engine's
            default, from free memory; see :func:`higgs_pack.runtime.loop.kv_memory.default_kv_budget`).
        grace_seconds: on SIGTERM, how long requests in flight may take to finish.
        model_names: extra names ``model`` may take (the bundle's name and model slug always work).
        prefix_key_file: the secret that signs the voices' persisted prompt-prefix KV files (made with
            mode 0600 on first start; None: ``$XDG_STATE_HOME/higgs-pack/voice-prefix.key``); must be
            outside ``voices_dir``; servers sharing a voices folder share this file too.
        allow_origins: web page origins (``scheme://host[:port]``, or ``*`` for any) that may call
            this server from a browser besides its own pages (the demo page); a request from any
            other page is refused (see ``serve.app._SameOrigin``).

    Raises:
        InputError: a limit out of range, a folder that is not one, or a ``voices_dir`` whose
            parent folder does not exist ("folder X does not exist; create it first").
    """

    max_batch: int | None = None
    max_queue: int = MAX_QUEUE
    api_key: str | None = None
    voices_dir: Path | None = None
    allow_local_media: Path | None = None
    max_input_chars: int = MAX_INPUT_CHARS
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    max_ref_seconds: float = MAX_REF_SECONDS
    max_kv_bytes: int | None = None
    grace_seconds: float = GRACE_SECONDS
    model_names: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()
    prefix_key_file: Path | None = None

    def __post_init__(self) -> None:
        problems = []
        for name, low in (("max_batch", 1), ("max_queue", 0), ("max_input_chars", 1), ("max_upload_bytes", 1024),
                          ("max_kv_bytes", 1)):
            value = getattr(self, name)
            if value is None and name in ("max_batch", "max_kv_bytes"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"{name} must be a whole number >= {low}, got {value!r}")
        for name in ("max_ref_seconds", "grace_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                problems.append(f"{name} must be a number of seconds > 0, got {value!r}")
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
            raise InputError("; ".join(problems))
