"""The cpu decoder's float and int8 KV caches measured side by side (issue 19 item 3).

``python -m bench.ort_kv_cache [--preset bench] [--precisions int4,fp32]
[--out FILE]`` exports the cpu target's ``llm_decoder`` once per precision and KV cache
(``--kv-cache float`` and ``int8``: ModelBuilder's ``kv_cache_quant_scheme=int8_per_channel``
with scales from its ``kv_cache_calibration`` tool, exactly as ``higgs-pack build`` makes
them, through :func:`~bench.decoder_variants.export_decoder_variants`),
and measures, in one run:

* the bare decoder's step (:class:`~higgs_pack.runtime.backends.onnxruntime.runners.OrtDecoder`:
  shared KV buffers in the dtype the graph declares, IOBinding, the runtime's session
  options) at each context length (64 and 900 positions), float and int8 interleaved
  (:func:`~bench.decoder_variants.time_interleaved`: random
  ``inputs_embeds``, rounds rotated), best and median ms per step, with the hidden states'
  cosine and relative L2 against the float KV cache at the same precision and the agreement
  of the first code (codebook 0's argmax of the tied audio heads, ``hidden @ W^T``) over
  every timed step;
* a TTS-shaped sequence (``loop``): the zero-shot prompt of a case text, then ``--frames``
  frames fed back as audio embeddings of the float decoder's greedy codes (teacher forcing:
  both decoders see the same inputs, so the positions the calibration never saw, audio
  frames, are judged too), with the worst and median hidden-state relative L2, the worst
  cosine, and the first-code and all-codebook agreement per frame;
* the KV bytes per position and the peak resident memory of each export and of this process.

Every row carries the CPU model and ISA (:func:`~bench.decoder_variants.machine_record`).
The decoders are written under ``--work`` (kept and reused) or a scratch folder removed at the end.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.decoder_variants import (
    TIMING_HEADER,
    add_timing_arguments,
    export_decoder_variants,
    load_average,
    machine_record,
    row_facts,
    time_interleaved,
    timing_columns,
    work_folder,
)

#: The KV caches compared; the first is every precision's parity reference.
KV_CACHES = ("float", "int8")
#: Precisions measured by default: the cpu target's (int4 is its default).
PRECISIONS = ("int4", "fp32")
#: The text of the TTS-shaped sequence (a case text; tests/test_kv_cache.py: a cases text).
LOOP_TEXT = "The quick brown fox jumps over the lazy dog. Packaging models for every device is hard work."


def variant_name(precision: str, kv_cache: str) -> str:
    """``<precision>-<kv cache>``, e.g. ``int4-int8``."""
    return f"{precision}-{kv_cache}"


def variants(precision: str) -> dict[str, dict[str, Any]]:
    """Variant name -> the decoder exporter options of that KV cache at ``precision`` (the float
    one lays nothing over the cpu recipe; the int8 one sets ``kv_cache``)."""
    return {variant_name(precision, kv): ({} if kv == "float" else {"kv_cache": kv}) for kv in KV_CACHES}


class _Recording:
    """A decoder whose one-position outputs are kept (float32 [1, 1, H] each, in call order)."""

    def __init__(self, decoder: Any) -> None:
        self.decoder, self.steps = decoder, []

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        out = self.decoder.forward(inputs_embeds)
        if out.shape[1] == 1:
            self.steps.append(out)
        return out


def heads_table(checkpoint: Path) -> tuple[np.ndarray, np.ndarray, dict[str, int], Any, int]:
    """What the TTS-shaped sequence and the first-code agreement need from the checkpoint.

    Returns:
        ``(W, text table, special token ids, tokenizer, N)``: ``W`` float32
        [N * V, H], the audio heads' weight (the separate head where the checkpoint has one,
        else the tied fused audio embedding, MODEL.md); the text embedding float32
        [vocab, H]; the special-token ids by role; a ``tokenizers.Tokenizer``; N.
    """
    from tokenizers import Tokenizer

    from higgs_pack.exporters.checkpoint import open_checkpoint
    from higgs_pack.exporters.checkpoint_layout import (
        AUDIO_EMBEDDING,
        AUDIO_HEAD_PREFIX,
        TEXT_EMBEDDING,
    )

    with open_checkpoint(checkpoint) as ckpt:
        head = next((n for n in ckpt.tensor_names() if n.startswith(AUDIO_HEAD_PREFIX) and n.endswith("weight")),
                    AUDIO_EMBEDDING)
        w = ckpt.tensor(head).float().numpy()
        text = ckpt.tensor(TEXT_EMBEDDING).float().numpy()
        c = ckpt.constants
        tokenizer = Tokenizer.from_file(str(next(p for p in ckpt.tokenizer_files() if p.name == "tokenizer.json")))
        return w, text, dict(c.special_tokens), tokenizer, int(c.num_codebooks)


def codes_of(hidden: np.ndarray, w: np.ndarray, codebooks: int) -> np.ndarray:
    """int64 [N]: each codebook's argmax of the audio heads' logits for one position's hidden
    state (float32 [..., H], the last position taken)."""
    logits = hidden.reshape(-1, hidden.shape[-1])[-1] @ w.T
    return logits.reshape(codebooks, -1).argmax(axis=1)


def first_code_agreement(reference: list[np.ndarray], got: list[np.ndarray], w: np.ndarray, codebooks: int
                         ) -> dict[str, float]:
    """Fraction of positions whose codebook-0 argmax (``first_code``) and all 8 argmaxes
    (``all_codes``) equal the reference's."""
    pairs = [(codes_of(a, w, codebooks), codes_of(b, w, codebooks)) for a, b in zip(reference, got, strict=True)]
    return {"first_code": round(float(np.mean([a[0] == b[0] for a, b in pairs])), 4),
            "all_codes": round(float(np.mean([(a == b).all() for a, b in pairs])), 4)}


def teacher_forced(decoders: dict[str, Any], reference: str, prompt: np.ndarray, w: np.ndarray, codebooks: int,
                   frames: int) -> dict[str, dict[str, Any]]:
    """A TTS-shaped sequence through every decoder: ``prompt`` (float32 [1, S, H]), then
    ``frames`` positions, each the audio embedding (sum over codebooks of ``W[c * V + code]``)
    of the reference decoder's greedy codes at the previous position.

    Returns:
        name -> ``{"positions", "rel_l2_max", "rel_l2_median", "cosine_min", "first_code",
        "all_codes"}`` against ``reference`` (every frame and the prompt's last position).
    """
    from higgs_pack.runtime.verification.report import compare, rel_l2

    vocab = w.shape[0] // codebooks
    outs = {name: [d.forward(prompt)[:, -1:]] for name, d in decoders.items()}
    for _ in range(frames):
        codes = codes_of(outs[reference][-1], w, codebooks)
        embed = w[codes + np.arange(codebooks) * vocab].sum(axis=0, dtype=np.float32)[None, None]
        for name, decoder in decoders.items():
            outs[name].append(decoder.forward(embed))
    result = {}
    for name, got in outs.items():
        pairs = list(zip(outs[reference], got, strict=True))
        errors = [rel_l2(a, b) for a, b in pairs]
        result[name] = {"positions": prompt.shape[1] + frames, "rel_l2_max": round(max(errors), 6),
                        "rel_l2_median": round(statistics.median(errors), 6),
                        "cosine_min": round(min(compare(a, b, "cosine")[0] for a, b in pairs), 6),
                        **first_code_agreement(outs[reference], got, w, codebooks)}
    return result


def _open(path: str, config: dict[str, Any], max_length: int) -> Any:
    from higgs_pack.runtime.backends.onnxruntime.runners import OrtDecoder
    from higgs_pack.runtime.backends.onnxruntime.sessions import create_session

    session, _ = create_session(Path(path), "cpu")
    return OrtDecoder(session, max_length=max_length, kv_heads=config["num_key_value_heads"],
                      head_dim=config["head_dim"])


def kv_bytes_per_position(config: dict[str, Any], itemsize: int) -> int:
    """Bytes of KV cache per position: key and value of every layer, ``kv_heads * head_dim`` each."""
    return int(config["num_hidden_layers"]) * 2 * int(config["num_key_value_heads"]) * int(config["head_dim"]) * itemsize


def run(preset: str = "bench", *, seed: int = 0, precisions: tuple[str, ...] = PRECISIONS,
        contexts: tuple[int, ...] = (64, 900), steps: int = 8, repeats: int = 15, frames: int = 400,
        work: Path | None = None) -> dict[str, Any]:
    """Export the decoders, measure them, and return the report.

    Args:
        preset: checkpoint preset (``tiny``, ``bench``, ``full``).
        precisions: cpu precisions to measure each KV cache at (``int4``, ``fp32``).
        contexts: prompt positions before the timed steps.
        steps, repeats: one-position steps per round, rounds per decoder.
        frames: frames of the TTS-shaped sequence after its prompt (0: none).
        work: folder for the decoders, kept and reused by later runs; default a scratch
            folder removed at the end.

    Returns:
        ``{"machine", "onnxruntime", "preset", "steps", "repeats", "decoders": {name: export
        facts + "kv_bytes_per_position"}, "results": [one record per decoder and context:
        "variant", "precision", "kv_cache", the timing and parity fields of
        :func:`~bench.decoder_variants.time_interleaved`, "first_code",
        "all_codes", "cpu", "isa", "vnni", "load_before", "load_after"], "loop": {name:
        :func:`teacher_forced`'s fields}, "peak_rss_mb": this process's peak}``.
    """
    import onnxruntime

    from higgs_pack.targets.build import default_checkpoint

    machine = machine_record()
    checkpoint = default_checkpoint(preset, seed)
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["text_config"]
    hidden = int(config["hidden_size"])
    w, text_table, special, tokenizer, codebooks = heads_table(checkpoint)
    ids = [special["tts"], special["text"], *tokenizer.encode(LOOP_TEXT, add_special_tokens=False).ids, special["audio"]]
    prompt = text_table[np.asarray(ids)][None].astype(np.float32)
    del text_table
    decoders: dict[str, dict[str, Any]] = {}
    results: list[dict[str, Any]] = []
    loop: dict[str, dict[str, Any]] = {}
    with work_folder(work, "higgs-pack-ort-kv-cache-") as folder:
        for precision in precisions:
            names = list(variants(precision))
            (folder / precision).mkdir(parents=True, exist_ok=True)
            exported = export_decoder_variants("cpu", checkpoint, folder / precision, variants(precision), names,
                                               precision=precision)
            reference = variant_name(precision, "float")
            for name in names:
                kv = name.split("-", 1)[1]
                decoders[name] = {**{k: v for k, v in exported[name].items() if k != "path"},
                                  "kv_bytes_per_position": kv_bytes_per_position(config, 4 if kv == "float" else 1)}
            for context in contexts:
                opened = {n: _Recording(_open(exported[n]["path"], config, context + repeats * steps + 1))
                          for n in names}
                before = load_average()
                timed = time_interleaved(opened, hidden=hidden, context=context, steps=steps, repeats=repeats,
                                         seed=seed, reference=reference)
                after = load_average()
                for name in names:
                    agree = first_code_agreement(opened[reference].steps, opened[name].steps, w, codebooks)
                    results.append({"variant": name, "precision": precision, "kv_cache": name.split("-", 1)[1],
                                    **timed[name], **agree, **row_facts(machine, before, after)})
                del opened
            if frames:
                opened = {n: _open(exported[n]["path"], config, prompt.shape[1] + frames + 1) for n in names}
                loop.update(teacher_forced(opened, reference, prompt, w, codebooks, frames))
                del opened
    return {"machine": machine, "onnxruntime": onnxruntime.__version__, "preset": preset, "steps": steps,
            "repeats": repeats, "frames": frames, "loop_text": LOOP_TEXT, "decoders": decoders, "results": results,
            "loop": loop, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def table(report: dict[str, Any]) -> str:
    """The report as text: one row per decoder and context, then the TTS-shaped sequence."""
    lines = [f"{report['machine']['cpu']}, onnxruntime {report['onnxruntime']}, preset {report['preset']}, "
             f"{report['steps']} steps x {report['repeats']} rounds",
             f"{'decoder':<11}{'KV B/pos':>9}{TIMING_HEADER}{'code0':>7}"]
    for row in report["results"]:
        facts = report["decoders"][row["variant"]]
        cols = timing_columns(row, facts["weights_mb"])
        lines.append(f"{row['variant']:<11}{facts['kv_bytes_per_position']:>9}{cols}  code0 {row['first_code']:.3f}")
    if report["loop"]:
        lines.append(f"TTS-shaped sequence, {report['frames']} frames teacher-forced (rel_l2 max/median, cosine min, "
                     "first-code and all-code agreement):")
        for name, row in report["loop"].items():
            lines.append(f"{name:<11}{row['positions']:>6} pos  rel_l2 {row['rel_l2_max']:.4f}/{row['rel_l2_median']:.4f}"
                         f"  cos {row['cosine_min']:.6f}  code0 {row['first_code']:.3f}  all {row['all_codes']:.3f}")
    lines.append(f"peak RSS of the measuring process {report['peak_rss_mb']} MB; exports: "
                 + ", ".join(f"{n} {d['export_peak_rss_mb']} MB" for n, d in report["decoders"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ort_kv_cache",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench", choices=("tiny", "bench", "full"),
                   help="checkpoint preset (full: 4B dimensions; each export needs ~16 GB of scratch)")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated cpu precisions (int4, fp32)")
    p.add_argument("--frames", type=int, default=400, help="frames of the TTS-shaped sequence (0: none)")
    add_timing_arguments(p, contexts=(64, 900), what="decoders")
    args = p.parse_args(argv)
    precisions = tuple(x for x in args.precisions.split(",") if x.strip())
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        p.error(f"unknown precision(s) {unknown}; the cpu target builds {', '.join(PRECISIONS)}")
    report = run(args.preset, seed=args.seed, precisions=precisions, contexts=tuple(args.contexts), steps=args.steps,
                 repeats=args.repeats, frames=args.frames, work=args.work)
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
