"""The voice store: a reference clip is encoded once by the bundle's codec, its codes kept
and used by name in ``voice`` (``GET/POST/DELETE /v1/audio/voices``).

A stored voice is one safetensors file in ``--voices-dir``: the codes (int64 [frames, 8])
and, in its metadata, the transcript, when it was made and the sha256 of the codec that
encoded it (a voice made by another codec is not offered: its codes would mean other sounds).
Files are written to a temporary name and renamed, so a crash leaves no half voice.  The folder
is the truth: listing reads it again and a name is looked up in it, so servers (or Ray replicas)
sharing one folder see each other's voices.  A file that is not a usable voice (damaged, or
made by another codec) is warned about once, and again only when it changes (its mtime or size).

Beside each voice the KV cache of its prompt prefix may persist (issue 30 item 4): the
engine's :class:`~higgs_pack.runtime.loop.prefix_cache.PrefixCache` asks :meth:`VoiceStore.
prefix_path` where, and reads, checks (its key and the sha256 of its tensors, in its metadata)
and writes the file itself: ``<folder>/.prefix-kv/<name>.safetensors`` (a hidden folder, so
listing voices never sees it).  Replacing or deleting a voice deletes its prefix file.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.runtime.loop.prefix_cache import voice_digest
from higgs_pack.runtime.request import PreparedVoice

log = logging.getLogger(__name__)

#: A voice name: ASCII letters, digits, ``_``, ``-`` and ``.`` (no path separators), starting with a
#: letter or digit, at most 64 characters.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: :data:`NAME_PATTERN` in words, as every message and the API docs say it (``é`` or ``ß`` is not an
#: ASCII letter: a name is a file name on every system).
NAME_RULE = ("1 to 64 ASCII letters (a-z, A-Z), digits (0-9), '_', '-' or '.', starting with a letter or digit, "
             "without '..'")
#: Names that are not voices in the store.
RESERVED = ("default", "ref_audio")
SUFFIX = ".safetensors"
#: The folder, inside the voices folder, of the voices' persisted prompt-prefix KV caches.
PREFIX_FOLDER = ".prefix-kv"


def name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a voice, or None when it can."""
    if not isinstance(name, str) or not name:
        return f"a voice needs a name ({NAME_RULE})"
    if not NAME_PATTERN.fullmatch(name) or ".." in name:
        return f"voice name {name[:80]!r} is not allowed: use {NAME_RULE}"
    if name.lower() in RESERVED:  # Default is default: stored voices' names differ by more than case
        return f"voice name {name!r} is reserved ({', '.join(RESERVED)}); choose another"
    return None


def default_prefix_key_file() -> Path:
    """Where the server keeps the secret that signs persisted voice prefixes when
    ``--prefix-key-file`` is not given: ``$XDG_STATE_HOME/higgs-pack/voice-prefix.key`` (the XDG
    Base Directory spec's default ``~/.local/state``), outside any voices folder."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "higgs-pack" / "voice-prefix.key"


def load_prefix_key(path: Path, voices_dir: Path | None) -> bytes:
    """The secret in ``path`` (64 hex digits), made on first use: 32 random bytes
    (:func:`secrets.token_hex`), in a file created with mode 0600 (its folder with 0700 when made).

    Raises:
        InputError: ``path`` is inside ``voices_dir`` (whoever writes the voices could read the key and
            sign a forgery), or holds something other than 64 hex digits.
        OSError: it cannot be read or created (said by the caller with the path).
    """
    from higgs_pack.errors import InputError, Problem

    path = Path(path)
    if voices_dir is not None and path.absolute().resolve().is_relative_to(Path(voices_dir).absolute().resolve()):
        raise InputError.of(Problem.said(f"--prefix-key-file {path} is inside --voices-dir {voices_dir}: whoever can write the voices "
                                         "could read it and sign a forged prefix; keep it outside the voices folder"))
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another server made it meanwhile: read theirs
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            log.info("made the voice prefix signing key %s (mode 0600)", path)
    text = path.read_text(encoding="ascii", errors="replace").strip()
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        raise InputError.of(Problem.said(f"--prefix-key-file {path} does not hold a key (64 hex digits); remove it to have one made, "
                                         "or give the file every server sharing the voices folder uses"))
    return bytes.fromhex(text)


class VoiceStore:
    """Voices by name, in memory and (with a folder) on disk.

    Args:
        folder: where voices are kept (created if missing, not its parents), or None: in memory only.
        codec_sha256: sha256 of the bundle's codec (its ``audio_tokenizer`` file); voices
            encoded by another codec in the folder are skipped, with a logged line.
        signing_key: the secret persisted voice prefixes are signed with
            (:data:`~higgs_pack.runtime.loop.prefix_cache.META_HMAC`; :func:`load_prefix_key`);
            a store with a folder needs one.

    Raises:
        OSError: the folder cannot be created (its parent folder is missing, say).
    """

    def __init__(self, folder: str | os.PathLike | None, codec_sha256: str = "", signing_key: bytes = b""):
        self.folder = Path(folder) if folder is not None else None
        self.codec_sha256 = codec_sha256
        self.signing_key = signing_key
        self._voices: dict[str, tuple[PreparedVoice, dict[str, str]]] = {}
        self._unusable: dict[str, str] = {}  # name -> version of a file found unusable (warned about once)
        self._lock = threading.Lock()
        if self.folder is not None:
            self.folder.mkdir(exist_ok=True)
            self._load()

    def _load(self) -> None:
        """Bring the memory in line with the folder: read new or changed files, forget removed
        ones (several servers or Ray replicas may share one folder)."""
        seen = {}
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            name = path.name[: -len(SUFFIX)]
            version = _version(path)
            if version is None:  # removed meanwhile
                continue
            seen[name] = version
            self._refresh(path, name, version)
        with self._lock:
            for name in [n for n in self._voices if n not in seen]:
                del self._voices[name]
            for name in [n for n in self._unusable if n not in seen]:
                del self._unusable[name]

    def _refresh(self, path: Path, name: str, version: str) -> tuple[PreparedVoice, dict[str, str]] | None:
        """The voice in ``path`` at ``version`` (its mtime and size): the one in memory when it
        is that version, else read again; None for a file found unusable (said once per version)."""
        with self._lock:
            known = self._voices.get(name)
            if self._unusable.get(name) == version:
                return None
        if known is not None and known[1].get("_version") == version:
            return known
        found = self._read(path, name)
        with self._lock:
            if found is None:
                self._voices.pop(name, None)
                self._unusable[name] = version
                return None
            found[1]["_version"] = version
            self._voices[name] = found
            self._unusable.pop(name, None)
        return found

    def _read(self, path: Path, name: str) -> tuple[PreparedVoice, dict[str, str]] | None:
        from safetensors import safe_open
        from safetensors.numpy import load_file

        try:
            with safe_open(str(path), "np") as f:
                meta = dict(f.metadata() or {})
            voice = PreparedVoice(load_file(str(path))["codes"], meta.get("transcript", ""), name)
        except Exception as exc:  # a damaged file: say so, serve the others
            log.warning("voice file %s is not a usable voice (%s); skipped", path, exc)
            return None
        if name_problem(name) or (self.codec_sha256 and meta.get("codec_sha256") != self.codec_sha256):
            log.warning("voice file %s was made by another codec or has a bad name; skipped", path)
            return None
        meta["_digest"] = voice_digest(voice.codes, voice.transcript)
        return voice, meta

    def prefix_path(self, voice: str) -> Path | None:
        """Where the prompt-prefix KV of the stored voice whose
        :func:`~higgs_pack.runtime.loop.prefix_cache.voice_digest` is ``voice`` persists (the
        file may not exist yet); None for a voice not in the store, or a store without a folder."""
        if self.folder is None or not self.signing_key:
            return None
        with self._lock:
            name = next((n for n, (_, meta) in self._voices.items() if meta.get("_digest") == voice), None)
        return None if name is None else self.folder / PREFIX_FOLDER / f"{name}{SUFFIX}"

    def _drop_prefix(self, name: str) -> None:
        if self.folder is not None:
            (self.folder / PREFIX_FOLDER / f"{name}{SUFFIX}").unlink(missing_ok=True)

    def names(self) -> list[str]:
        """Stored voice names, sorted (the folder is read again first)."""
        if self.folder is not None:
            self._load()
        with self._lock:
            return sorted(self._voices)

    def get(self, name: str) -> PreparedVoice | None:
        """The voice called ``name``, or None (a voice another server wrote to a shared folder
        since is found; one it removed is gone)."""
        if self.folder is not None and name_problem(name) is None:
            path = self.folder / f"{name}{SUFFIX}"
            version = _version(path)
            if version is None:
                with self._lock:
                    self._voices.pop(name, None)
                    self._unusable.pop(name, None)
                return None
            found = self._refresh(path, name, version)
            return found[0] if found else None
        with self._lock:
            found = self._voices.get(name)
        return found[0] if found else None

    def describe(self, name: str) -> dict[str, Any]:
        """``{"name", "transcript", "seconds", "frames", "created"}`` of a stored voice.

        Raises:
            KeyError: no such voice.
        """
        with self._lock:
            voice, meta = self._voices[name]
        return {"name": name, "transcript": voice.transcript, "seconds": voice.seconds,
                "frames": int(voice.codes.shape[0]), "created": float(meta.get("created", 0.0))}

    def add(self, voice: PreparedVoice) -> dict[str, Any]:
        """Keep ``voice`` under ``voice.name`` (replacing one of that name), on disk first.

        Raises:
            ValueError: a bad name (:func:`name_problem`).
            OSError: the file cannot be written (out of disk is said as such by the caller).
        """
        problem = name_problem(voice.name)
        if problem:
            raise ValueError(problem)
        meta = {"transcript": voice.transcript, "created": f"{time.time():.3f}", "codec_sha256": self.codec_sha256}
        self._drop_prefix(voice.name)  # a replaced voice's prefix is not its successor's
        if self.folder is not None:
            from safetensors.numpy import save_file

            fd, tmp = tempfile.mkstemp(prefix=f".{voice.name}.", suffix=".tmp", dir=self.folder)
            os.close(fd)
            target = self.folder / f"{voice.name}{SUFFIX}"
            try:
                save_file({"codes": np.ascontiguousarray(voice.codes, dtype=np.int64)}, tmp, metadata=meta)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            meta = {**meta, "_version": _version(target) or ""}
        meta["_digest"] = voice_digest(voice.codes, voice.transcript)
        with self._lock:
            self._voices[voice.name] = (voice, meta)
            self._unusable.pop(voice.name, None)
        return self.describe(voice.name)

    def delete(self, name: str) -> bool:
        """Forget the voice called ``name`` (and its file); False when there was none."""
        with self._lock:
            found = self._voices.pop(name, None)
        if found is not None and self.folder is not None:
            (self.folder / f"{name}{SUFFIX}").unlink(missing_ok=True)
            self._drop_prefix(name)
        return found is not None


def _version(path: Path) -> str | None:
    """``"mtime_ns:size"`` of a voice file (a rewrite changes it), or None when it is gone."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return f"{st.st_mtime_ns}:{st.st_size}"
