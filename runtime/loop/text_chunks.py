"""A text cut into chunks that fit the decoder's context: frame caps, the positions a chunk's
prompt and frames hold (:func:`chunk_positions`), and :func:`plan_chunks`, which packs sentences
(cut at words or clause marks where one does not fit) into chunks.  The problems of a voice, a
frame cap or a sentence that cannot fit are said here, before anything is generated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np

from higgs_pack.errors import Problem, literal
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.prompt import Context
from higgs_pack.runtime.loop.sentences import split_sentences
from higgs_pack.runtime.request import refuse

#: Frame cap per text token and its floor, when the caller gives no ``max_frames``.
#: 10 frames (0.4 s at 25 fps) per token is well above normal speech
#: (about 0.2-0.3 s per English BPE token), so the cap only stops runaway output.
FRAMES_PER_TEXT_TOKEN = 10.0
MIN_MAX_FRAMES = 50


def token_count(pipeline: Pipeline, text: str) -> int:
    return len(pipeline.tokenizer.encode(text, add_special_tokens=False).ids)


def _prompt_overhead(pipeline: Pipeline, ref_codes: np.ndarray | None, ref_text: str | None,
                     context: Context = ()) -> int:
    """Positions of a chunk's prompt besides its text tokens, plus the delay ramp of its frames
    (``N - 1``): ``<|tts|> <|text|> … <|audio|>`` and, with a voice and each context chunk,
    ``<|ref_text|> text <|ref_audio|>`` and its delayed codes (:func:`~higgs_pack.runtime.loop.prompt.prompt_of`'s layout)."""
    n = pipeline.constants.num_codebooks
    fixed = 3 + n - 1
    pairs = ([] if ref_codes is None else [(ref_codes, ref_text or "")]) + list(context)
    for codes, words in pairs:
        fixed += token_count(pipeline, words) + 2 + codes.shape[0] + n - 1
    return fixed


def voice_room_problems(pipeline: Pipeline, ref_codes: np.ndarray, ref_text: str) -> list[Problem]:
    """The problem of a voice whose prompt (transcript and clip codes) leaves no room in the
    decoder's context for even a one-word sentence and its shortest frame cap, else ``[]``:
    said of the voice, not of the text (a new user's finding: a 5,000-word transcript was
    reported as a sentence of the text to split)."""
    gen = pipeline.generation_defaults
    fixed = _prompt_overhead(pipeline, ref_codes, ref_text)
    limit = pipeline.decoder.max_length
    least = fixed + 1 + frame_cap(1, gen.get("frames_per_text_token", FRAMES_PER_TEXT_TOKEN),
                                  gen.get("min_max_frames", MIN_MAX_FRAMES))
    if least <= limit:
        return []
    return [Problem("ref_text", None, message=literal(
        f"the voice takes {fixed} positions of the decoder's context of {limit} (its transcript, "
        f"{token_count(pipeline, ref_text)} tokens, and its clip, {ref_codes.shape[0]} frames), leaving no room "
        f"for a sentence ({least} needed for one word): use a shorter clip with its transcript"))]


def _too_long(needed: int, limit: int, sentence: str, max_frames: int | None) -> Problem:
    """The problem of one sentence whose prompt and frames do not fit the context: the frame cap's
    when the request set one (lowering it is a fix), else the text's."""
    what = (f"one sentence needs {needed} positions (its prompt and audio frames), more than the decoder's "
            f"context of {limit} (the sentence starts {sentence[:60]!r}), and has no space or comma to cut it "
            "at: split it with spaces or punctuation")
    what = literal(what)
    if max_frames is None or needed - max_frames > limit - 1:  # a frame cap of 1 would not fit it either
        return Problem("text", None, message=what)
    return Problem("max_frames", max_frames, message=what + ", or lower {name}")


def _cap_too_large(max_frames: int | None, limit: int, fixed: int, voice: bool) -> list[Problem]:
    """The problem of a frame cap that no text fits beside, else ``[]``: the largest the bundle takes
    is its decoder's context less the prompt (with the voice, when there is one) and one text token."""
    largest = limit - fixed - 1
    if max_frames is None or max_frames <= largest:
        return []
    return [Problem("max_frames", max_frames, message="{name}" + literal(
        f" is at most {largest} for this bundle{' with this voice' if voice else ''} ({largest / 25:.0f} s: its "
        f"decoder's context holds {limit} positions, the prompt takes {fixed} and the text at least one), got "
        f"{max_frames}; a longer text is spoken in several chunks, each with its own cap"))]


def frame_cap_problems(pipeline: Pipeline, max_frames: int | None, ref_codes: np.ndarray | None = None,
                       ref_text: str | None = None) -> list[Problem]:
    """The problems of a voice and a frame cap that no text fits beside, known before any text
    (:func:`plan_chunks` refuses them first; a live session's ``session.config`` is checked with
    them), else ``[]``: a voice whose prompt leaves no room for a word, or a ``max_frames`` past the
    decoder's context less the prompt (with ``ref_codes`` and ``ref_text``, the voice, when given).
    """
    fixed = _prompt_overhead(pipeline, ref_codes, ref_text)
    return (([] if ref_codes is None else voice_room_problems(pipeline, ref_codes, ref_text or ""))
            or _cap_too_large(max_frames, pipeline.decoder.max_length, fixed, ref_codes is not None))


def chunk_positions(pipeline: Pipeline, text: str, cap: int, ref_codes: np.ndarray | None = None,
                    ref_text: str | None = None, context: Context = ()) -> int:
    """Most positions one text chunk holds in the decoder: its prompt (exactly the length
    :func:`~higgs_pack.runtime.loop.prompt.build_prompt` gives) plus the audio steps of its frame cap (``cap + N - 1``
    with the delay pattern's ramp; :func:`~higgs_pack.runtime.loop.decode.check_context` bounds the same sum).

    Args:
        pipeline: the backend (its tokenizer and constants).
        text: the chunk's text.
        cap: its frame cap (frames at 25 per second).
        ref_codes: int64 [frames, N] reference codes with ``ref_text`` (its transcript), or None.
        context: a rolling context after the voice (:func:`~higgs_pack.runtime.loop.plan.chunk_context`).

    Returns:
        Positions (>= 1): KV bytes are this times the decoder's bytes per position.
    """
    return token_count(pipeline, text) + _prompt_overhead(pipeline, ref_codes, ref_text, context) + cap


def frame_cap(n_text_tokens: int, frames_per_token: float = FRAMES_PER_TEXT_TOKEN,
              minimum: int = MIN_MAX_FRAMES) -> int:
    """Default frame cap for a text of ``n_text_tokens`` BPE tokens (frames at 25 fps)."""
    return max(minimum, math.ceil(frames_per_token * n_text_tokens))


def _word_pieces(sentence: str, max_words: int) -> list[str]:
    """``sentence`` as it is when it holds at most ``max_words`` whitespace-separated words, else
    cut at word boundaries into pieces of ``max_words`` words (the last one shorter), joined by
    single spaces.  Linear in the sentence's length."""
    words = sentence.split()
    if len(words) <= max_words:
        return [sentence]
    return [" ".join(words[i:i + max_words]) for i in range(0, len(words), max_words)]


#: Clause marks a piece with no space in it may be cut after (CJK text has no spaces between words).
_CLAUSE_MARK = re.compile(r"[,;:\uff0c\u3001\uff1b\uff1a]")


def _halves(piece: str) -> list[str]:
    """``piece`` cut in two near its middle: at a space, else after a clause mark (``,`` ``;``
    ``:`` and the CJK ``，`` ``、`` ``；`` ``：``), else not at all (``[piece]``)."""
    words = piece.split()
    if len(words) > 1:
        return [" ".join(words[:len(words) // 2]), " ".join(words[len(words) // 2:])]
    cuts = [m.end() for m in _CLAUSE_MARK.finditer(piece) if m.end() < len(piece)]
    if not cuts:
        return [piece]
    middle = min(cuts, key=lambda cut: abs(2 * cut - len(piece)))
    return [piece[:middle], piece[middle:]]


def _cut_to_fit(pipeline: Pipeline, sentences: list[str], tokens: list[int], fits: Callable[[int], bool]) -> list[str]:
    """``sentences`` in order, each whose ``tokens`` do not ``fits`` halved (:func:`_halves`) until
    its pieces do or cannot be cut (those are refused by the caller).  A sentence of commas and
    no full stop, or a list, is cut this way; the 200-word pieces alone could still overflow a
    small context."""
    out: list[str] = []
    todo = list(zip(sentences, tokens, strict=True))[::-1]
    while todo:
        sentence, count = todo.pop()
        parts = [sentence] if fits(count) else _halves(sentence)
        if len(parts) == 1:
            out.append(sentence)
            continue
        counts = [len(e.ids) for e in pipeline.tokenizer.encode_batch(parts, add_special_tokens=False)]
        todo += list(zip(parts, counts, strict=True))[::-1]
    return out


def plan_chunks(pipeline: Pipeline, text: str, ref_codes: np.ndarray | None = None,
                ref_text: str | None = None, max_frames: int | None = None,
                max_words: int | None = None) -> list[tuple[str, int]]:
    """Split ``text`` into ``(chunk, frame cap)`` pairs whose prompt + frames fit the context.

    The whole text is one chunk when it fits (and holds at most ``max_words`` words);
    otherwise sentences are packed greedily into chunks (the reference voice, if any, is
    repeated in each prompt), each closed before it would pass the context or ``max_words``
    words (whitespace-separated; None: no word budget).  A sentence longer than the word
    budget is cut at word boundaries into pieces of ``max_words`` words, packed as sentences are
    (text without sentence ends is chunked too; without a word budget it stays whole); a piece
    that still does not fit the context is halved at a space or a clause mark until it does.

    Linear in the text: the whole text and each sentence are tokenized once (in one
    batch), a chunk's token count is the sum of its sentences' (each after the first
    counted with the space that joins it), and each chunk is tokenized once more at the
    end to make its count exact; a chunk the exact count puts past the context gives its
    last sentence to the next chunk.  (Re-tokenizing the growing chunk for every sentence
    took 78.6 s for a 313 KB text, issue 30.)

    Raises:
        InputError: ``max_frames`` past the largest cap the context takes beside the prompt (the
            largest named), or a piece with no space or clause mark to cut at does not fit.
    """
    gen = pipeline.generation_defaults
    limit = pipeline.decoder.max_length
    fpt = gen.get("frames_per_text_token", FRAMES_PER_TEXT_TOKEN)
    floor = gen.get("min_max_frames", MIN_MAX_FRAMES)
    fixed = _prompt_overhead(pipeline, ref_codes, ref_text)
    refuse(frame_cap_problems(pipeline, max_frames, ref_codes, ref_text))

    def cap_of(tokens: int) -> int:
        return max_frames if max_frames is not None else frame_cap(tokens, fpt, floor)

    def positions(tokens: int) -> int:
        return fixed + tokens + cap_of(tokens)

    whole = token_count(pipeline, text)
    if positions(whole) <= limit and (max_words is None or len(text.split()) <= max_words):
        return [(text, cap_of(whole))]
    sentences = split_sentences(text)
    if max_words is not None:  # text without sentence ends (a list, a transcript) is chunked too
        sentences = [piece for sentence in sentences for piece in _word_pieces(sentence, max_words)]
    encoded = pipeline.tokenizer.encode_batch([*sentences, *(" " + s for s in sentences)], add_special_tokens=False)
    alone = [len(e.ids) for e in encoded[:len(sentences)]]
    joined = [len(e.ids) for e in encoded[len(sentences):]]
    if positions(1) <= limit and any(positions(tokens) > limit for tokens in alone):  # (no room for a word: refused)
        sentences = _cut_to_fit(pipeline, sentences, alone, lambda tokens: positions(tokens) <= limit)
        encoded = pipeline.tokenizer.encode_batch([*sentences, *(" " + s for s in sentences)], add_special_tokens=False)
        alone = [len(e.ids) for e in encoded[:len(sentences)]]
        joined = [len(e.ids) for e in encoded[len(sentences):]]
    for sentence, tokens in zip(sentences, alone, strict=True):
        if positions(tokens) > limit:
            refuse([_too_long(positions(tokens), limit, sentence, max_frames)])
    words = [len(sentence.split()) for sentence in sentences]
    groups: list[list[int]] = []  # sentence indices of each chunk
    tokens = count = 0
    for i in range(len(sentences)):
        if groups and positions(tokens + joined[i]) <= limit and (max_words is None or count + words[i] <= max_words):
            groups[-1].append(i)
            tokens += joined[i]
            count += words[i]
        else:
            groups.append([i])
            tokens, count = alone[i], words[i]
    chunks: list[tuple[str, int]] = []
    while groups:
        group = groups.pop(0)
        chunk = " ".join(sentences[i] for i in group)
        exact = token_count(pipeline, chunk)
        if positions(exact) > limit and len(group) > 1:  # the sum was a token or two short
            groups.insert(0, group[:-1])
            if groups[1:] and groups[1][0] == group[-1] + 1:
                groups[1].insert(0, group[-1])
            else:
                groups.insert(1, [group[-1]])
            continue
        chunks.append((chunk, cap_of(exact)))
    return chunks
