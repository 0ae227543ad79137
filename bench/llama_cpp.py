"""llama.cpp as a bench peer (issue 19): our checkpoint's Qwen3 decoder as GGUF files at
llama.cpp's own 4-bit types, and its decode step timed the way we time ours.

llama.cpp comes from the ``[llamacpp]`` extra (llama-cpp-python, which compiles it).  Its
HF-to-GGUF converter is not installed with it: it lives in the package's source
distribution (``vendor/llama.cpp/convert_hf_to_gguf.py`` with its ``conversion/`` modules
and the matching ``gguf-py``), so :func:`converter_tree` unpacks those files of the sdist
of the installed version once into the cache.

:func:`ensure_ggufs` writes, per checkpoint, under ``$HIGGS_PACK_CACHE/llama.cpp/<checkpoint>/``:
the standard-Qwen3 HF view (:func:`higgs_pack.targets.steps.write_hf_dir`, one tensor in
memory at a time, in a child process), the converter's float GGUF (a child process that
exits; its peak RSS sampled like a build's), then one GGUF per quant
(``llama_model_quantize`` in a child process).  The HF view and the float GGUF are removed
after, unless asked to keep the float one.

:class:`LlamaDecoder` loads one GGUF with the low-level API and steps ``B`` sequences in one
``llama_batch`` (sequence ids ``0..B-1``, each at its own position), as
:func:`bench.decoder_steps.measure_llama_steps` times it.

The text head: llama.cpp's Qwen3 graph always ends in the LM head (``output.weight``, tied
to ``token_embd.weight``: vocab x hidden, 151936 x 2560 at full size, Q6_K in both quants
by llama.cpp's rule for the output tensor), run on every row that asks for logits.  Our
decoder ends at the hidden states.  So every row is timed twice: with logits for each row
(``step_ms``, what a llama.cpp user runs) and with no row asking for output
(``step_ms_no_output``): llama.cpp then multiplies zero rows by the head, and also skips the
last layer's feed-forward for the rows no one reads (its ``inp_out_ids``), so this is a lower
bound of llama.cpp without a head.  The head's bytes are recorded (``head_bytes``) beside
the decoder layers' (``decoder_bytes``).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from bench.systems import LLAMA_CPP, QUANTS, child_env, parse_quant
from higgs_pack.manifests.errors import BuildError, InputError

#: Why the llama.cpp systems and tests do not run without the extra.
NOT_INSTALLED = "llama-cpp-python is not installed (the [llamacpp] extra compiles llama.cpp)"
#: Files of the sdist's vendored llama.cpp the converter needs.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
#: Environment variable naming a local llama-cpp-python sdist (.tar.gz) to take the converter from.
SDIST_ENV = "HIGGS_PACK_LLAMA_CPP_SDIST"
#: Tensors of the text head (the tied embedding serves as ``output`` when there is none).
HEAD_TENSORS = ("output.weight", "token_embd.weight")


def llama_cpp_missing() -> str | None:
    """None when llama-cpp-python can be imported, else :data:`NOT_INSTALLED`."""
    import importlib.util

    return None if importlib.util.find_spec("llama_cpp") is not None else NOT_INSTALLED


def llama_cpp_version() -> str:
    """The installed llama-cpp-python version (``0.3.36``).

    Raises:
        InputError: it is not installed (:data:`NOT_INSTALLED`).
    """
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise InputError(NOT_INSTALLED) from None


def unpack_converter(sdist: Path, out: Path) -> None:
    """Extract :data:`CONVERTER_PARTS` of ``vendor/llama.cpp`` (and the CHANGELOG) from ``sdist``."""
    tmp = Path(tempfile.mkdtemp(prefix="llama-cpp-src-", dir=out.parent))
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = Path(m.name).parts
                inside = parts[1:3] == ("vendor", "llama.cpp") and len(parts) > 3 and parts[3] in CONVERTER_PARTS
                if (inside or parts[1:] == ("CHANGELOG.md",)) and (m.isfile() or m.isdir()):
                    members.append(m)
            if not any(Path(m.name).name == "convert_hf_to_gguf.py" for m in members):
                raise BuildError(f"{sdist} has no vendor/llama.cpp/convert_hf_to_gguf.py")
            tar.extractall(tmp, members=members, filter="data")
        top = next(tmp.iterdir())
        shutil.rmtree(out, ignore_errors=True)
        shutil.move(str(top / "vendor" / "llama.cpp"), str(out))
        shutil.copyfile(top / "CHANGELOG.md", out / "CHANGELOG.md")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def converter_tree(cache: Path) -> Path:
    """The folder holding llama.cpp's ``convert_hf_to_gguf.py`` for the installed version.

    ``<cache>/llama.cpp/src-<version>/``, unpacked once from the llama-cpp-python sdist of
    the installed version: the file named by ``$HIGGS_PACK_LLAMA_CPP_SDIST``, else one
    ``pip download --no-binary :all: --no-deps llama-cpp-python==<version>``.

    Raises:
        InputError: llama-cpp-python is not installed.
        BuildError: the sdist could not be fetched or has no converter.
    """
    version = llama_cpp_version()
    tree = cache / LLAMA_CPP / f"src-{version}"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    tree.parent.mkdir(parents=True, exist_ok=True)
    sdist = os.environ.get(SDIST_ENV)
    with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-", dir=tree.parent) as tmp:
        if not sdist:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "-d", tmp, f"llama-cpp-python=={version}"]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            found = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if done.returncode != 0 or not found:
                raise BuildError(f"could not fetch the llama-cpp-python {version} sdist for its converter "
                                 f"({' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-400:]}); "
                                 f"set {SDIST_ENV} to a local llama_cpp_python-{version}.tar.gz")
            sdist = str(found[0])
        unpack_converter(Path(sdist), tree)
    return tree


def llama_cpp_commit(tree: Path) -> str | None:
    """The llama.cpp commit the vendored tree is, from the sdist's CHANGELOG's newest
    ``update llama.cpp to ggml-org/llama.cpp@<commit>`` line (None when absent)."""
    log = tree / "CHANGELOG.md"
    if not log.is_file():
        return None
    for line in log.read_text(encoding="utf-8").splitlines():
        if "llama.cpp@" in line:
            return line.split("llama.cpp@", 1)[1].split()[0].strip(").,")
    return None


def gguf_facts(path: Path) -> dict[str, Any]:
    """What a GGUF holds, from its header (tensor data memory-mapped, not read).

    Returns:
        ``gguf_bytes`` (file size), ``weight_bytes`` (all tensor data), ``decoder_bytes``
        (``blk.*`` and ``output_norm``: what our ``llm_decoder`` holds), ``head_bytes`` and
        ``head_type`` (``output.weight``, or the tied ``token_embd.weight``), ``embed_bytes``
        (``token_embd.weight`` when it is not the head too), ``tensor_types`` (type -> count).
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: (int(t.n_bytes), t.tensor_type.name) for t in reader.tensors}
    head = next(n for n in HEAD_TENSORS if n in sizes)
    types: dict[str, int] = {}
    for _, kind in sizes.values():
        types[kind] = types.get(kind, 0) + 1
    decoder = sum(b for n, (b, _) in sizes.items() if n.startswith("blk.") or n == "output_norm.weight")
    embed = sizes["token_embd.weight"][0] if head != "token_embd.weight" else 0
    return {"gguf_bytes": path.stat().st_size, "weight_bytes": sum(b for b, _ in sizes.values()),
            "decoder_bytes": decoder, "head_bytes": sizes[head][0], "head_type": sizes[head][1],
            "head_tensor": head, "embed_bytes": embed, "tensor_types": types}


def quantize(src: str, out: str, quant: str, threads: int) -> dict[str, Any]:
    """``llama_model_quantize(src, out)`` at ``quant`` (run in a child process by :func:`ensure_ggufs`).

    Raises:
        BuildError: llama.cpp returned non-zero.
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
    if rc != 0:
        raise BuildError(f"llama_model_quantize {src} -> {out} ({quant}) returned {rc}")
    return {"out": out}


def _float_outtype(checkpoint: Path) -> str:
    """The converter's ``--outtype`` keeping the checkpoint's float type (bf16 or f16; f32 stays f32)."""
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get("torch_dtype")
                or "bfloat16")
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype, "bf16")


def ensure_ggufs(checkpoint: Path, cache: Path, quants: list[str], *, threads: int = 2,
                 keep_float: bool = False, rebuild: bool = False, log=None,
                 converter_cache: Path | None = None) -> dict[str, Any]:
    """The checkpoint's decoder as GGUF files at every quant of ``quants``, cached.

    Args:
        checkpoint: a Higgs-Audio-v3 checkpoint directory.
        cache: the bench cache; files go to ``cache/llama.cpp/<checkpoint name>/``.
        quants: names of :data:`QUANTS`.
        threads: quantization threads.
        keep_float: keep the converter's float GGUF (``float`` in the result) for parity checks.
        rebuild: convert again even where cached files are newer than the checkpoint.
        log: a callable taking progress lines (None: quiet).
        converter_cache: where :func:`converter_tree` keeps the converter (default: ``cache``).

    Returns:
        ``{"dir", "version" (llama-cpp-python), "llama_cpp_commit", "float": {"path", "outtype",
        "convert_s", "convert_peak_rss_mb", "convert_peak_anon_mb", "hf_view_s",
        "hf_view_peak_rss_mb", "hf_view_peak_anon_mb"} (path None once removed), "quants":
        {quant: {"path", "quantize_s", "quantize_peak_rss_mb", "quantize_peak_anon_mb",
        **gguf_facts}}}`` (MiB; anon: not file-backed, memory-mapped inputs left out); the facts of a conversion made by an earlier run are those of that run
        (``cached`` true).

    Raises:
        InputError: llama-cpp-python is missing or a quant is unknown.
        BuildError: a step failed (the converter's log file is named).
    """
    from higgs_pack.exporters.process import run_step, run_tool

    quants = [parse_quant(q) for q in quants]
    tree = converter_tree(converter_cache or cache)
    out = cache / LLAMA_CPP / checkpoint.name
    done_file = out / "done.json"
    stamp = (checkpoint / "config.json").stat().st_mtime
    done: dict[str, Any] = {}
    if done_file.is_file() and not rebuild and done_file.stat().st_mtime >= stamp:
        done = json.loads(done_file.read_text(encoding="utf-8"))
    have = {q: v for q, v in done.get("quants", {}).items() if Path(v["path"]).is_file()}
    float_path = (done.get("float") or {}).get("path")
    need_float = any(q not in have for q in quants) or (keep_float and not (float_path and Path(float_path).is_file()))
    if not need_float:
        return {**done, "quants": have, "cached": True}
    out.mkdir(parents=True, exist_ok=True)
    outtype = _float_outtype(checkpoint)
    facts: dict[str, Any] = {"dir": str(out), "version": llama_cpp_version(), "llama_cpp_commit": llama_cpp_commit(tree)}
    float_gguf = out / f"{checkpoint.name}-{outtype}.gguf"
    if not (float_path and Path(float_path).is_file()):
        hf_dir = out / "qwen3-hf"
        if log:
            log(f"llama.cpp: writing the Qwen3 HF view of {checkpoint} to {hf_dir}")
        _, hf_record = run_step("higgs_pack.targets.steps:write_hf_dir",
                                {"checkpoint": str(checkpoint), "out_dir": str(hf_dir)},
                                name="remapping the checkpoint to a Qwen3 directory", folders=[out], work_dir=out)
        try:
            cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(float_gguf),
                   "--outtype", outtype]
            if log:
                log(f"llama.cpp: {' '.join(cmd)}")
            env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py
            run = run_tool(cmd, out / "convert.log", env=env)
        finally:
            shutil.rmtree(hf_dir, ignore_errors=True)
        if run.returncode != 0 or not float_gguf.is_file():
            tail = "\n".join((out / "convert.log").read_text(errors="replace").splitlines()[-15:])
            raise BuildError(f"convert_hf_to_gguf.py exited {run.returncode} (log: {out / 'convert.log'}):\n{tail}")
        facts["float"] = {"path": str(float_gguf), "outtype": outtype, "convert_s": round(run.seconds, 1),
                          "convert_peak_rss_mb": round(run.peak_rss_mb, 1),
                          "convert_peak_anon_mb": round(run.peak_anon_mb, 1), "hf_view_s": round(hf_record.seconds, 1),
                          "hf_view_peak_rss_mb": round(hf_record.peak_rss_mb, 1),
                          "hf_view_peak_anon_mb": round(hf_record.peak_anon_mb or 0, 1),
                          "gguf_bytes": float_gguf.stat().st_size}
    else:
        facts["float"] = done["float"]
    facts["quants"] = dict(have)
    for quant in quants:
        if quant in have:
            continue
        target = out / f"{checkpoint.name}-{quant}.gguf"
        if log:
            log(f"llama.cpp: quantizing to {quant}: {target}")
        log_file = out / f"quantize-{quant}.log"
        cmd = [sys.executable, "-m", "bench.llama_cpp", str(float_gguf), str(target), quant, str(threads)]
        run = run_tool(cmd, log_file, env=child_env())
        if run.returncode != 0 or not target.is_file():
            raise BuildError(f"llama_model_quantize ({quant}) exited {run.returncode} (log: {log_file})")
        facts["quants"][quant] = {"path": str(target), "quantize_s": round(run.seconds, 1),
                                  "quantize_peak_rss_mb": round(run.peak_rss_mb, 1),
                                  "quantize_peak_anon_mb": round(run.peak_anon_mb, 1), **gguf_facts(target)}
    if not keep_float:
        float_gguf.unlink(missing_ok=True)
        facts["float"] = {**facts["float"], "path": None}
    done_file.write_text(json.dumps(facts, indent=2), encoding="utf-8")
    return {**facts, "cached": False}


class LlamaDecoder:
    """One GGUF loaded with llama.cpp's C API (llama-cpp-python's ctypes bindings), driven
    like our batched decoder: ``prefill(row, length)`` then ``step(rows)``.

    One ``llama_context`` with ``n_seq_max = max_batch`` sequences, each its own KV stream
    (``kv_unified = false``: a row's step attends its own positions only, as ours does),
    ``n_ctx = max_batch * max_length``; token ids in (our decoder takes ``inputs_embeds``;
    llama.cpp's embedding lookup is one row gather per token).

    Args:
        path: the GGUF file.
        max_batch: sequences (rows), >= 1.
        max_length: positions per sequence.
        threads: ``n_threads`` and ``n_threads_batch``.

    Raises:
        InputError: llama-cpp-python missing or bad sizes.
        BuildError: llama.cpp could not load the model or make the context.
    """

    def __init__(self, path: Path, *, max_batch: int, max_length: int, threads: int):
        if llama_cpp_missing():
            raise InputError(NOT_INSTALLED)
        if max_batch < 1 or max_length < 2 or threads < 1:
            raise InputError(f"max_batch, threads >= 1 and max_length >= 2 needed, got {max_batch}, "
                             f"{threads}, {max_length}")
        import llama_cpp

        self._ll = llama_cpp
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise BuildError(f"llama.cpp could not load {path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = max_batch * max_length
        cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = max_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False
        cp.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise BuildError(f"llama.cpp could not make a context of {cp.n_ctx} positions for {path}")
        self.max_batch, self.max_length, self.threads = max_batch, max_length, threads
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.lengths = [0] * max_batch
        self._batch = llama_cpp.llama_batch_init(512, 0, 1)

    def dims(self) -> dict[str, int]:
        """What llama.cpp read from the GGUF: ``hidden``, ``layers``, ``heads``, ``kv_heads``,
        ``head_dim`` (``qwen3.attention.key_length``), ``vocab``."""
        ll = self._ll
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_model_meta_val_str(self.model, b"qwen3.attention.key_length", buf, 64)
        return {"hidden": ll.llama_model_n_embd(self.model), "layers": ll.llama_model_n_layer(self.model),
                "heads": ll.llama_model_n_head(self.model), "kv_heads": ll.llama_model_n_head_kv(self.model),
                "head_dim": int(buf.value) if n > 0 else -1, "vocab": self.n_vocab}

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, position, seq, wants_logits)`` items."""
        b = self._batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        rc = self._ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise BuildError(f"llama_decode returned {rc} ({len(items)} tokens)")

    def prefill(self, row: int, tokens: list[int]) -> None:
        """Start sequence ``row`` over with ``tokens`` (512 per ``llama_decode``), logits of the last."""
        if len(tokens) + 1 > self.max_length:
            raise InputError(f"{len(tokens)} positions do not fit the context of {self.max_length}")
        self._ll.llama_memory_seq_rm(self._ll.llama_get_memory(self.ctx), row, -1, -1)
        for start in range(0, len(tokens), 512):
            chunk = tokens[start:start + 512]
            self._decode([(t, start + i, row, start + i == len(tokens) - 1) for i, t in enumerate(chunk)])
        self.lengths[row] = len(tokens)

    def step(self, rows: list[int], tokens: list[int], *, logits: bool = True) -> None:
        """One position for each of ``rows`` in one ``llama_batch``; ``logits``: every row asks for
        its logits (the LM head runs on each), else none does."""
        if any(self.lengths[r] + 1 > self.max_length for r in rows):
            raise InputError(f"a row would exceed {self.max_length} positions")
        self._decode([(t, self.lengths[r], r, logits) for r, t in zip(rows, tokens, strict=True)])
        for r in rows:
            self.lengths[r] += 1

    def logits(self, index: int):
        """float32 [vocab] logits of output ``index`` of the last decode (a copy)."""
        import numpy as np

        ptr = self._ll.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        """Free the batch, the context and the model."""
        if getattr(self, "ctx", None):
            self._ll.llama_batch_free(self._batch)
            self._ll.llama_free(self.ctx)
            self._ll.llama_model_free(self.model)
            self.ctx = None


def system_info() -> str:
    """llama.cpp's ``llama_print_system_info()`` (the CPU features it was compiled with)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()




if __name__ == "__main__":  # the quantize step of ensure_ggufs, in a child process: SRC OUT QUANT THREADS
    quantize(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
