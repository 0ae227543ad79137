"""A chunk's prompt (MODEL.md "Special tokens and prompts"): its text's tokens checked for the
tokenizer's special tokens, then embedded with the voice's pair and a rolling context's pairs
before ``<|text|>``; the voice's pair is a prefix of its own, so its KV may be cached
(:mod:`~higgs_pack.runtime.loop.prefix_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from higgs_pack.errors import Problem, literal
from higgs_pack.runtime.loop.decode import check_finite
from higgs_pack.runtime.loop.delay import apply_delay
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.prefix_cache import Prompt, voice_prompt
from higgs_pack.runtime.request import refuse, voice_pair_problems


def check_text_tokens(pipeline: Pipeline, text: str, field: str = "text") -> list[int]:
    """Tokenize ``text`` and refuse it if it holds a special token of the tokenizer.

    The prompt's control tokens (``<|tts|>``, ``<|text|>``, ``<|audio|>``, …) and every
    other added token the tokenizer marks special (``<|endoftext|>``, ``<|im_start|>``,
    reserved ids) would reach the model as those ids, not as text.  Added tokens not
    marked special (Qwen3's ``<tool_call>``) are ordinary vocabulary and pass.

    Args:
        pipeline: the backend (its tokenizer and special-token ids).
        text: text to speak, or a reference transcript.
        field: the request field ``text`` came from (``"text"``, ``"ref_text"``), for the
            :class:`~higgs_pack.errors.Problem` of the error (each front door names
            the field in its own terms).

    Returns:
        The token ids of ``text`` (no special tokens added).

    Raises:
        InputError: names the field and the special tokens found.
    """
    ids, problems = special_tokens(pipeline, text, field)
    refuse(problems)
    return ids


def special_tokens(pipeline: Pipeline, text: str, field: str) -> tuple[list[int], list[Problem]]:
    """``text``'s token ids and the problem of its special tokens (``[]`` when it has none)."""
    tok = pipeline.tokenizer
    prompt = set(pipeline.constants.special_tokens.values())
    special = {i for i, added in tok.get_added_tokens_decoder().items() if added.special} | prompt
    out = tok.encode(text, add_special_tokens=False).ids
    found = [i for i in dict.fromkeys(out) if i in special]
    if not found:
        return out, []
    names = ", ".join(tok.id_to_token(i) for i in found)
    if all(i in prompt for i in found):
        why = f"the prompt control token(s) {names}, which the model reserves for its prompt format"
    else:
        why = f"the tokenizer's special token(s) {names}, which would reach the model as control ids, not words"
    message = literal(f"{why}; remove them (inline controls such as <|emotion:amusement|> are read as text "
                      "unless the tokenizer has them)")
    return out, [Problem(field, None, message="{name} contains " + message)]


def build_prompt(
    pipeline: Pipeline,
    text: str,
    ref_codes: np.ndarray | None = None,
    ref_text: str | None = None,
) -> np.ndarray:
    """Embed the prompt (:func:`prompt_of`'s ``embeds``)."""
    return prompt_of(pipeline, text, ref_codes, ref_text).embeds


def prompt_of(
    pipeline: Pipeline,
    text: str,
    ref_codes: np.ndarray | None = None,
    ref_text: str | None = None,
    *,
    voice_prefix: bool = True,
    context: Sequence[tuple[np.ndarray, str]] = (),
) -> Prompt:
    """Embed the prompt (MODEL.md "Special tokens and prompts"), saying where its voice prefix ends.

    Zero-shot: ``<|tts|> <|text|> tok(text) <|audio|>``.  Voice clone:
    ``<|tts|> <|ref_text|> tok(ref_text) <|ref_audio|> [delay-patterned reference
    codes] <|text|> tok(text) <|audio|>``.  A rolling context (:func:`~higgs_pack.runtime.loop.plan.chunk_context`) adds one more
    ``<|ref_text|> tok(chunk text) <|ref_audio|> [its delay-patterned codes]`` pair per earlier
    chunk after the voice's and before ``<|text|>``, as Higgs' own long-form generator gives the
    reference and each buffered chunk one (text, audio) pair of its own
    (../shared/SPEECH-AT-LENGTH.md): the voice's pair stays the prompt's first positions, so its
    cached KV serves every chunk.

    Args:
        pipeline: the backend.
        text: the text to speak (already validated non-empty).
        ref_codes: int64 [frames, N] codec codes of the reference voice, or None.
        ref_text: transcript of the reference audio (required with ``ref_codes``).
        voice_prefix: whether the voice's pair is a voice of its own (so its KV may be cached,
            :mod:`~higgs_pack.runtime.loop.prefix_cache`); False: never cache it.
        context: earlier chunks' ``(codes int64 [frames >= 1, N], text)``, oldest first (needs
            ``ref_codes``: with no voice of its own a rolling context's first chunk is the voice).

    Returns:
        A :class:`~higgs_pack.runtime.loop.prefix_cache.Prompt`: float32 [1, positions, H]
        ``inputs_embeds`` and, for a voice clone, its prefix's length and digests.
    """
    sp = pipeline.constants.special_tokens

    def ids(s: str) -> list[int]:
        return check_text_tokens(pipeline, s)

    def embed_ids(seq: list[int]) -> np.ndarray:
        arr = np.asarray([seq], dtype=np.int64)
        return check_finite("text_embed", pipeline.text_embed.run({"input_ids": arr})["inputs_embeds"], pipeline)

    c = pipeline.constants

    def embed_codes(codes: np.ndarray) -> np.ndarray:
        delayed = apply_delay(codes, c.boc, c.eoc)[None]
        return check_finite("audio_embed", pipeline.audio_embed.run({"codes": delayed})["audio_embeds"], pipeline)

    pieces: list[np.ndarray] = []
    if ref_codes is not None:
        refuse(voice_pair_problems(ref_codes, ref_text))
        prefix_ids = [sp["tts"], sp["ref_text"], *ids(ref_text), sp["ref_audio"]]
        prefix = np.concatenate([embed_ids(prefix_ids).astype(np.float32),
                                 embed_codes(ref_codes).astype(np.float32)], axis=1)
        pieces = [prefix]
        for codes, words in context:
            pieces += [embed_ids([sp["ref_text"], *ids(words), sp["ref_audio"]]), embed_codes(codes)]
        pieces.append(embed_ids([sp["text"], *ids(text), sp["audio"]]))
        embeds = np.concatenate([p.astype(np.float32, copy=False) for p in pieces], axis=1)
        if voice_prefix:
            return voice_prompt(embeds, prefix_ids, prefix, ref_codes, ref_text)
        return Prompt(embeds)
    if context:
        raise ValueError("a rolling context needs a voice (ref_codes) before it")
    pieces.append(embed_ids([sp["tts"], sp["text"], *ids(text), sp["audio"]]))
    return Prompt(np.concatenate([p.astype(np.float32) for p in pieces], axis=1))


Context = list[tuple[np.ndarray, str]]
"""A rolling context: earlier chunks' ``(codes int64 [frames, N], text)``, oldest first."""
