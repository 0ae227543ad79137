"""The decoder KV cache of a voice's prompt prefix, computed once and reused (issue 30 item 4).

A voice-clone prompt is ``<|tts|> <|ref_text|> transcript <|ref_audio|> [delay-patterned
reference codes] <|text|> text <|audio|>`` (MODEL.md "Special tokens and prompts"): everything
before ``<|text|>`` depends on the voice alone (a 7-second clip: about 190 of a 219-position
prompt).  The KV cache of those positions is kept here after the first request of a voice, and
a later request of the same voice copies it into its decoder (or its row of the batched
decoder) and prefills only the rest of its prompt, from that position on.

**Never served for anything else** (vllm-omni served one voice's cached KV to another,
vllm-project/vllm-omni#7822): an entry's key is the sha256 of everything that changes the KV:

* the bundle's content (the sha256 of every file the manifest lists), its backend, the device
  its decoder runs on (as the backend reported it) and its precision;
* the decoder's KV layout and cache type (``prefix_layout`` of the decoder in use: the
  ONNX Runtime cache dtype, float32 or int8; OpenVINO's key/value cache precision, u8 or f32);
* the voice: the sha256 of its codes (int64 [frames, N]) and of its transcript, and of the
  exact prefix (its token ids and its float32 ``inputs_embeds``) and the prefix's length.

:class:`PrefixCache` holds entries in memory as a least-recently-used map bounded in bytes,
and, given a store (the server's voice store, :mod:`higgs_pack.serve.voices`), persists the
entry of a named voice beside it as a safetensors file whose metadata holds the key, the
sha256 of the tensors and an HMAC-SHA256 of both with the store's secret ``signing_key``.  A
persisted entry that cannot be read, whose tensors do not hash to its recorded sha256, whose
key differs (another bundle, backend, device, precision, KV type or voice), or whose HMAC does
not verify (anyone who can write the folder can write a file and its sha256, e.g. another
voice's KV under this voice's key: only the holder of the secret can sign) is refused with a
logged warning and recomputed (then written again).

A decoder takes part when it states ``prefix_layout`` (a string; None: it cannot) and has
``read_prefix`` / ``write_prefix`` (the batch-1 decoders; the batched ones take a row too):
the ONNX Runtime decoders and OpenVINO's stateful decoder do; the NPU variant's static KV
decoder does not (its KV lives in fixed-shape buffers of a stateless graph that the runtime
does not export), so its prompts are prefilled whole.

Exactness: with a cache, a voice prompt is prefilled in two parts, the prefix (or its cached
KV) and then the rest from position P, whether the prefix was cached or not.  On ONNX
Runtime's CPU provider with float32 a prompt prefilled in parts of two or more positions is
bit-identical to one prefilled whole (measured on the tiny fp32 bundle: 60 positions as
40 + 20 and as 6 x 10, max difference 0), so codes with the cache equal codes without it.
OpenVINO's CPU plugin computes a prefill of another length with other kernel blocks (int4
weights with dynamic activation quantization): a prompt prefilled in two parts is about 2e-4
from one prefilled whole on the tiny int4 bundle's hidden states, so codes with a cache (hit
or miss: the same) agree with, but are not bound to equal, codes without one; its u8 KV
cache is quantized again when a cached prefix is written back into the state, so there a hit
agrees with a miss only approximately (bit-identical with an f32 KV cache).

Runtime code: numpy only (safetensors for the persisted entries, imported when one is read
or written).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from higgs_pack.errors import InputError, Problem

log = logging.getLogger(__name__)

#: Default bytes of voice prefixes kept in memory.  One 219-position prefix of the full-size
#: model is about 63 MB at float32 KV (36 layers x 2 x 8 heads x 128 x 4 B = 288 KiB a position),
#: so the default holds the prefixes of about eight 7-second voices.
DEFAULT_PREFIX_CACHE_BYTES = 512 * 2**20

#: Metadata keys of a persisted entry (safetensors ``__metadata__``: str -> str).
META_KEY, META_LENGTH, META_SHA256, META_IDENTITY = "prefix_key", "prefix_length", "tensors_sha256", "identity"
#: Metadata key of a persisted entry's HMAC-SHA256 (hex) over its key, length and tensors' sha256,
#: with the store's ``signing_key``: the sha256 alone is written by whoever writes the file, so it
#: tells damage, not a forgery (another voice's tensors under this voice's key).
META_HMAC = "hmac_sha256"


def _sha256(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def voice_digest(codes: np.ndarray, transcript: str) -> str:
    """sha256 of a voice: its codes (int64 [frames, N], with their shape) and its transcript.

    The voice store finds a named voice's persisted prefix by this digest.
    """
    codes = np.ascontiguousarray(codes, dtype=np.int64)
    return _sha256(repr(codes.shape), codes.tobytes(), transcript)


def bundle_identity(manifest: dict[str, Any], decoder_device: str) -> dict[str, str]:
    """The facts of a loaded bundle that change a prefix's KV, for :class:`PrefixCache`.

    Args:
        manifest: the bundle's manifest (its ``files`` records with their sha256, ``backend``,
            ``precision``, ``target`` and ``variant``).
        decoder_device: where the decoder runs, as the backend reported it (the pipeline's
            ``description["llm_decoder"]``: ``CPUExecutionProvider``, ``OpenVINO CPU (...)``).

    Returns:
        ``{"bundle": sha256 over every file's path and sha256, "backend", "device", "precision",
        "target", "variant"}`` (str values).
    """
    files = sorted((str(f.get("path")), str(f.get("sha256"))) for f in manifest.get("files", []))
    return {
        "bundle": _sha256(json.dumps(files)),
        "backend": str(manifest.get("backend", "")),
        "device": str(decoder_device),
        "precision": str(manifest.get("precision", "")),
        "target": str(manifest.get("target", "")),
        "variant": str(manifest.get("variant") or ""),
    }


@dataclass(frozen=True)
class Prompt:
    """A chunk's prompt with where its voice prefix ends.

    Attributes:
        embeds: float32 [1, S, H] ``inputs_embeds`` of the whole prompt.
        prefix_length: the first positions, which depend on the voice alone (its
            ``<|tts|> <|ref_text|> transcript <|ref_audio|> codes``; a rolling context's earlier
            chunks come after them); 0: none that may be cached (a zero-shot prompt).
        voice: :func:`voice_digest` of the voice ("" with no cacheable prefix).
        material: sha256 of the exact prefix: its token ids and its ``inputs_embeds``.
    """

    embeds: np.ndarray
    prefix_length: int = 0
    voice: str = ""
    material: str = ""

    @property
    def length(self) -> int:
        """S, the prompt's positions."""
        return int(self.embeds.shape[1])


def voice_prompt(embeds: np.ndarray, prefix_ids: list[int], prefix_embeds: np.ndarray,
                 codes: np.ndarray, transcript: str) -> Prompt:
    """A :class:`Prompt` whose first ``prefix_embeds.shape[1]`` positions are a voice's prefix.

    Args:
        embeds: float32 [1, S, H], the whole prompt.
        prefix_ids: the prefix's text token ids (``<|tts|> <|ref_text|> transcript <|ref_audio|>``).
        prefix_embeds: float32 [1, P, H], the prefix's ``inputs_embeds`` (text and delayed codes).
        codes, transcript: the voice.
    """
    prefix = np.ascontiguousarray(prefix_embeds, dtype=np.float32)
    material = _sha256(np.asarray(prefix_ids, dtype=np.int64).tobytes(), repr(prefix.shape), prefix.tobytes())
    return Prompt(embeds, int(prefix.shape[1]), voice_digest(codes, transcript), material)


@dataclass
class PrefixEntry:
    """The KV cache of one voice prefix.

    Attributes:
        key: the sha256 key (:meth:`PrefixCache.key`).
        length: P, positions held.
        arrays: name -> the decoder's KV of those positions: ``past_key_values.*`` [kv_heads, P,
            head_dim] in the cache dtype (ONNX Runtime), state variable -> float32 [kv_heads,
            P, head_dim] (OpenVINO's stateful decoder), or ``key_cache.N`` / ``value_cache.N`` ->
            the raw blocks [ceil(P / block_size), ...] holding them (OpenVINO's paged decoder).
    """

    key: str
    length: int
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))

    def tensors_sha256(self) -> str:
        parts: list[bytes | str] = []
        for name in sorted(self.arrays):
            a = np.ascontiguousarray(self.arrays[name])
            parts += [name, a.dtype.str, repr(a.shape), a.tobytes()]
        return _sha256(*parts)


class PrefixStore(Protocol):
    """Where persisted prefixes live (the server's voice store)."""

    def prefix_path(self, voice: str) -> Path | None:
        """The file of the persisted prefix of the named voice whose :func:`voice_digest` is
        ``voice`` (it may not exist yet), or None: not a named voice, not persisted."""
        ...

    @property
    def signing_key(self) -> bytes:
        """The secret persisted entries are signed with (:data:`META_HMAC`), kept where the files'
        writers cannot read it (the server: ``--prefix-key-file``, outside the voices folder)."""
        ...


@dataclass
class PrefixCacheStats:
    """Counts of a :class:`PrefixCache` (read them at any time).

    Attributes:
        hits: lookups served (from memory or a persisted entry).
        misses: lookups not served (the prefix was then computed).
        bytes: KV bytes held in memory now.
        entries: entries held in memory now.
        evictions: entries dropped to stay within the byte bound.
        disk_loads: hits served by a persisted entry.
        disk_writes: entries persisted.
        refused: persisted entries refused (damaged, or written for another key).
    """

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    entries: int = 0
    evictions: int = 0
    disk_loads: int = 0
    disk_writes: int = 0
    refused: int = 0


@dataclass
class PrefixCache:
    """Voice prefixes' KV, least recently used first out, bounded in bytes (module docstring).

    Thread-safe: the engine's thread and callers of ``synthesize`` / ``stream`` share one.

    Args:
        identity: :func:`bundle_identity` of the loaded bundle.
        max_bytes: most KV bytes held in memory (an entry larger than this is not kept).
        store: where named voices' prefixes persist (None: memory only).

    Raises:
        InputError: ``max_bytes`` is not a whole number >= 0.
    """

    identity: dict[str, str]
    max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    store: PrefixStore | None = None
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise InputError.of(Problem.said(f"prefix cache max_bytes must be a whole number of bytes >= 0, got {self.max_bytes!r}"))
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[PrefixEntry, str, str]] = queue.Queue()  # entries to persist (put)
        self._writer: threading.Thread | None = None

    def key(self, prompt: Prompt, layout: str) -> str:
        """The key of ``prompt``'s voice prefix on a decoder of ``layout`` (its ``prefix_layout``)."""
        facts = {**self.identity, "layout": layout, "voice": prompt.voice, "material": prompt.material,
                 "prefix_length": prompt.prefix_length}
        return _sha256(json.dumps(facts, sort_keys=True))

    def _facts(self, layout: str) -> str:
        return json.dumps({**self.identity, "layout": layout}, sort_keys=True)

    def lookup(self, key: str, voice: str, layout: str) -> PrefixEntry | None:
        """The entry of ``key`` from memory, else from the store (then kept in memory); None
        (a miss) when neither has it.  A persisted entry that is damaged or was written for
        another key is refused with a logged warning (a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return entry
        entry = self._read(key, voice, layout)
        with self._lock:
            if entry is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.disk_loads += 1
            self._keep(entry)
        return entry

    def prefetch(self, key: str, voice: str, layout: str) -> None:
        """Bring a persisted entry into memory ahead of its use, on the caller's thread (the engine's
        submit), so the engine's own lookup is a memory hit: reading and checking a full-size
        prefix file (about 63 MB) between the running rows' steps stalled them.  Counts a disk
        load, not a hit; nothing when it is in memory, not persisted, or refused."""
        with self._lock:
            if key in self._entries:
                return
        entry = self._read(key, voice, layout)
        if entry is not None:
            with self._lock:
                self.stats.disk_loads += 1
                self._keep(entry)

    def put(self, entry: PrefixEntry, voice: str, layout: str, background: bool = False) -> None:
        """Keep a computed entry (in memory within the bound; persisted for a named voice).

        Args:
            background: persist it on the cache's writer thread (the engine: hashing, signing and
                writing a full-size prefix held the running rows for tenths of a second); the
                memory entry serves at once.  :meth:`flush` waits for the writes.
        """
        with self._lock:
            self._keep(entry)
        if not background or self._path(voice) is None:
            self._write(entry, voice, layout)
            return
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_queued, name="prefix-cache-writer", daemon=True)
                self._writer.start()
            self._queue.put((entry, voice, layout))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every entry :meth:`put` in the background is persisted (or ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._queue.all_tasks_done.wait(left)

    def _write_queued(self) -> None:
        while True:
            entry, voice, layout = self._queue.get()
            try:
                self._write(entry, voice, layout)
            finally:
                self._queue.task_done()

    def discard(self, key: str) -> None:
        """Forget ``key``'s entry (in memory; a decoder refused it)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.stats.bytes -= entry.nbytes
                self.stats.entries -= 1

    def clear(self) -> None:
        """Forget every entry held in memory (persisted ones stay)."""
        with self._lock:
            self._entries.clear()
            self.stats.bytes = self.stats.entries = 0

    def _keep(self, entry: PrefixEntry) -> None:
        if entry.key in self._entries or entry.nbytes > self.max_bytes:
            return
        self._entries[entry.key] = entry
        self.stats.bytes += entry.nbytes
        self.stats.entries += 1
        while self.stats.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.stats.bytes -= old.nbytes
            self.stats.entries -= 1
            self.stats.evictions += 1

    # persisted entries
    def _path(self, voice: str) -> Path | None:
        if self.store is None or not voice:
            return None
        return self.store.prefix_path(voice)

    def _read(self, key: str, voice: str, layout: str) -> PrefixEntry | None:
        path = self._path(voice)
        if path is None or not path.is_file():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(path), "np") as f:
                meta = dict(f.metadata() or {})
                arrays = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        except Exception as exc:  # a damaged file: refuse it, recompute
            self._refuse(path, f"it cannot be read ({type(exc).__name__}: {exc})")
            return None
        if meta.get(META_KEY) != key:
            self._refuse(path, f"it was written for another bundle, backend, device, precision, KV cache type or "
                               f"voice (written for {meta.get(META_IDENTITY, 'an unknown identity')}; this one is "
                               f"{self._facts(layout)})")
            return None
        try:
            entry = PrefixEntry(key, int(meta[META_LENGTH]), arrays)
        except (KeyError, ValueError):
            self._refuse(path, "its prefix length is missing or not a number")
            return None
        if not arrays:
            self._refuse(path, "it holds no tensors")
            return None
        # Their shapes are the layout's (positions [kv_heads, P, head_dim], or a paged decoder's
        # blocks [n, ...]): the decoder's write_prefix checks them, and a refusal there discards
        # the entry and computes it again (restore_prefix).
        digest = entry.tensors_sha256()
        if digest != meta.get(META_SHA256):
            self._refuse(path, "its tensors do not match the sha256 recorded with them (damaged)")
            return None
        if not hmac.compare_digest(self._signature(entry, digest), str(meta.get(META_HMAC, ""))):
            self._refuse(path, "its signature does not match this server's prefix key (written by a server with "
                               "another --prefix-key-file, or forged)")
            return None
        return entry

    def _signature(self, entry: PrefixEntry, digest: str) -> str:
        """HMAC-SHA256 (hex) of an entry's key, length and tensors' sha256 with the store's signing key."""
        assert self.store is not None
        message = f"{entry.key}\n{entry.length}\n{digest}".encode()
        return hmac.new(self.store.signing_key, message, hashlib.sha256).hexdigest()

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("voice prefix cache file %s refused: %s; the prefix is computed again", path, why)
        with self._lock:
            self.stats.refused += 1

    def _write(self, entry: PrefixEntry, voice: str, layout: str) -> None:
        path = self._path(voice)
        if path is None:
            return
        digest = entry.tensors_sha256()
        meta = {META_KEY: entry.key, META_LENGTH: str(entry.length), META_SHA256: digest,
                META_HMAC: self._signature(entry, digest), META_IDENTITY: self._facts(layout)}
        try:
            from safetensors.numpy import save_file

            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            try:
                save_file({n: np.ascontiguousarray(a) for n, a in entry.arrays.items()}, tmp, metadata=meta)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as exc:  # out of disk, a read-only folder: the memory entry still serves
            log.warning("voice prefix cache file %s not written (%s)", path, exc)
            return
        with self._lock:
            self.stats.disk_writes += 1


def prefix_layout(decoder: Any) -> str | None:
    """The decoder's KV layout for prefix entries (its ``prefix_layout``), or None when it
    cannot take part (no ``read_prefix`` / ``write_prefix``, or it says None)."""
    layout = getattr(decoder, "prefix_layout", None)
    return layout if isinstance(layout, str) and layout else None


def restore_prefix(cache: PrefixCache | None, prompt: Prompt, layout: str | None, write) -> tuple[int, str | None]:
    """Look ``prompt``'s voice prefix up in ``cache`` and, on a hit, write it into a decoder.

    Args:
        cache, prompt: the cache (None: no caching) and the prompt.
        layout: the decoder's :func:`prefix_layout` (None: it cannot take part).
        write: ``write(arrays, length)`` puts an entry's KV into the decoder (its
            ``write_prefix``, on the row for a batched one).

    Returns:
        ``(positions restored, key)``: on a hit ``(P, None)``; on a miss ``(0, key)``, the key to
        :func:`store_prefix` under once the decoder holds the prompt's first P positions;
        ``(0, None)`` when nothing is cached for this prompt or decoder.
    """
    if cache is None or layout is None or not 0 < prompt.prefix_length < prompt.length:
        return 0, None
    key = cache.key(prompt, layout)
    entry = cache.lookup(key, prompt.voice, layout)
    if entry is None:
        return 0, key
    try:
        write(entry.arrays, entry.length)
    except (KeyError, ValueError) as exc:  # names or shapes that this decoder does not hold
        log.warning("voice prefix cache entry refused by the decoder (%s); the prefix is computed again", exc)
        cache.discard(key)
        return 0, key
    return entry.length, None


def store_prefix(cache: PrefixCache, prompt: Prompt, layout: str, key: str, arrays: dict[str, np.ndarray],
                 background: bool = False) -> None:
    """Keep the KV of ``prompt``'s voice prefix (``arrays``, the decoder's ``read_prefix`` of its
    ``prompt.prefix_length`` positions) under ``key`` (:func:`restore_prefix`'s); ``background``:
    persisted on the cache's writer thread (:meth:`PrefixCache.put`)."""
    cache.put(PrefixEntry(key, prompt.prefix_length, arrays), prompt.voice, layout, background=background)


def prefetch_prefix(cache: PrefixCache | None, prompt: Prompt, layout: str | None) -> None:
    """Read ``prompt``'s persisted voice prefix into memory ahead of its prefill
    (:meth:`PrefixCache.prefetch`); nothing without a cache, a cacheable prefix or a layout."""
    if cache is not None and layout is not None and 0 < prompt.prefix_length < prompt.length:
        cache.prefetch(cache.key(prompt, layout), prompt.voice, layout)


def cached_prefill(decoder: Any, prompt: Prompt, cache: PrefixCache | None) -> np.ndarray:
    """:func:`prefill_prompt`'s hidden states alone."""
    return prefill_prompt(decoder, prompt, cache)[0]


def prefill_prompt(decoder: Any, prompt: Prompt, cache: PrefixCache | None) -> tuple[np.ndarray, int]:
    """Start a batch-1 :class:`~higgs_pack.runtime.loop.pipeline.Decoder` over with ``prompt``,
    from its cached voice prefix when there is one.

    A hit writes the prefix's KV into the decoder (``write_prefix``) and prefills the rest of the
    prompt from position P on; a miss prefills the prefix, keeps its KV (``read_prefix``) and
    prefills the rest from P on: hit or miss, the rest is prefilled the same way, so a voice's
    codes do not depend on whether its prefix was cached (on OpenVINO too, whose prefill of a
    prompt in two parts is not bit-identical to one of the whole).  Without a cache, a
    cacheable prefix or a decoder that takes part, the whole prompt is prefilled at once.

    Returns:
        ``(hidden, restored)``: float32 [1, S', H] hidden states of the positions prefilled (the
        last one is the prompt's last: all the loop reads), and the positions restored from the
        cache (P on a hit, else 0; the decoder computed ``S - restored``).
    """
    layout = prefix_layout(decoder)
    restored, key = restore_prefix(cache, prompt, layout, lambda arrays, length: decoder.write_prefix(arrays, length))
    if restored:
        return decoder.forward(prompt.embeds[:, restored:]), restored
    decoder.reset()
    if key is None:
        return decoder.forward(prompt.embeds), 0
    decoder.forward(prompt.embeds[:, :prompt.prefix_length])
    store_prefix(cache, prompt, layout, key, decoder.read_prefix(prompt.prefix_length))
    return decoder.forward(prompt.embeds[:, prompt.prefix_length:]), 0


def check_prefix_arrays(arrays: dict[str, np.ndarray], names: list[str], length: int) -> None:
    """Refuse prefix arrays that do not hold exactly ``names``, each [kv_heads, length, head_dim].

    Raises:
        KeyError: a name is missing or extra.
        ValueError: a shape is not 3-d with ``length`` positions.
    """
    if sorted(arrays) != sorted(names):
        raise KeyError(f"prefix arrays {sorted(arrays)[:3]}... are not the decoder's {sorted(names)[:3]}...")
    for name, a in arrays.items():
        if a.ndim != 3 or a.shape[1] != length:
            raise ValueError(f"prefix array {name} is {list(a.shape)}, not [kv_heads, {length}, head_dim]")
