"""llama.cpp as a bench peer (issue 19, ``[llamacpp]`` extra): the checkpoint's Qwen3 decoder as
GGUFs (:func:`ensure_ggufs`: llama.cpp's own converter from the installed version's sdist, then
``llama_model_quantize``, each in a child process) and :class:`LlamaDecoder`, stepped as we step
ours.  Its graph ends in the text head, run on every row asking for logits: rows are timed with
(``step_ms``) and without (``step_ms_no_output``, a lower bound); docs/benchmarks/index.md.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common.systems import LLAMA_CPP, QUANTS, child_env, parse_quant
from higgs_pack.errors import BuildError, InputError

#: Why the llama.cpp systems and tests do not run without the extra.
NOT_INSTALLED = "llama-cpp-python is not installed (the [llamacpp] extra compiles llama.cpp)"
#: Files of the sdist's vendored llama.cpp the converter needs.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
#: Environment variable naming a local llama-cpp-python sdist (.tar.gz) to take the converter from.
SDIST_ENV = "HIGGS_PACK_LLAMA_CPP_SDIST"
#: Tensors of the text head (the tied embedding serves as ``output`` when there is none).
HEAD_TENSORS = ("output.weight", "token_embd.weight")


def llama_cpp_missing() -> str | None:
    return None if importlib.util.find_spec("llama_cpp") is not None else NOT_INSTALLED


def llama_cpp_version() -> str:
    """The installed llama-cpp-python version; InputError when it is not installed."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise InputError(NOT_INSTALLED) from None


def unpack_converter(sdist: Path, out: Path) -> None:
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
    """``<cache>/llama.cpp/src-<version>/`` holding llama.cpp's converter, unpacked once from the installed
    version's sdist (``$HIGGS_PACK_LLAMA_CPP_SDIST``, else ``pip download``); BuildError when it cannot be had."""
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
    """From the sdist CHANGELOG's newest ``llama.cpp@<commit>`` line (None without)."""
    log = tree / "CHANGELOG.md"
    lines = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
    return next((line.split("llama.cpp@", 1)[1].split()[0].strip(").,") for line in lines if "llama.cpp@" in line), None)


def gguf_facts(path: Path) -> dict[str, Any]:
    """A GGUF's sizes from its header: ``gguf_bytes``, ``weight_bytes``, ``decoder_bytes`` (``blk.*``,
    ``output_norm``), ``head_bytes``/``head_type``/``head_tensor``, ``embed_bytes``, ``tensor_types``."""
    from gguf import GGUFReader

    sizes = {t.name: (int(t.n_bytes), t.tensor_type.name) for t in GGUFReader(str(path)).tensors}
    head = next(n for n in HEAD_TENSORS if n in sizes)
    types = dict(Counter(kind for _, kind in sizes.values()))
    decoder = sum(b for n, (b, _) in sizes.items() if n.startswith("blk.") or n == "output_norm.weight")
    embed = sizes["token_embd.weight"][0] if head != "token_embd.weight" else 0
    return {"gguf_bytes": path.stat().st_size, "weight_bytes": sum(b for b, _ in sizes.values()),
            "decoder_bytes": decoder, "head_bytes": sizes[head][0], "head_type": sizes[head][1],
            "head_tensor": head, "embed_bytes": embed, "tensor_types": types}


def quantize(src: str, out: str, quant: str, threads: int) -> dict[str, Any]:
    """``llama_model_quantize(src, out)`` at ``quant`` (in a child process); BuildError on failure."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = QUANTS[quant], threads
    if (rc := llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))) != 0:
        raise BuildError(f"llama_model_quantize {src} -> {out} ({quant}) returned {rc}")
    return {"out": out}


def _float_outtype(checkpoint: Path) -> str:
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get("torch_dtype")
                or "bfloat16")
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype, "bf16")


def _costs(name: str, run: Any) -> dict[str, float]:
    """A child process's seconds, peak RSS and peak anonymous memory (MiB) as ``<name>_*`` fields."""
    return {f"{name}_s": round(run.seconds, 1), f"{name}_peak_rss_mb": round(run.peak_rss_mb, 1),
            f"{name}_peak_anon_mb": round(run.peak_anon_mb or 0, 1)}


def ensure_ggufs(checkpoint: Path, cache: Path, quants: list[str], *, threads: int = 2,
                 keep_float: bool = False, rebuild: bool = False, log=None,
                 converter_cache: Path | None = None) -> dict[str, Any]:
    """The checkpoint's decoder as a GGUF per quant, cached in ``cache/llama.cpp/<checkpoint>/``
    (``done.json``): ``{dir, version, llama_cpp_commit, float: {path (None once removed), outtype,
    convert_s, convert_peak_rss_mb, convert_peak_anon_mb, hf_view_*}, quants: {quant: {path,
    quantize_s, quantize_peak_rss_mb, quantize_peak_anon_mb, **gguf_facts}}, cached}`` (MiB).
    InputError without llama-cpp-python or for an unknown quant; BuildError when a step fails."""
    from higgs_pack.exporters.process import run_step, run_tool

    log = log or (lambda _m: None)
    quants = [parse_quant(q) for q in quants]
    tree = converter_tree(converter_cache or cache)
    out = cache / LLAMA_CPP / checkpoint.name
    done_file = out / "done.json"
    fresh = done_file.is_file() and done_file.stat().st_mtime >= (checkpoint / "config.json").stat().st_mtime
    done = json.loads(done_file.read_text(encoding="utf-8")) if fresh and not rebuild else {}
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
        log(f"llama.cpp: writing the Qwen3 HF view of {checkpoint} to {hf_dir}")
        _, hf_record = run_step("higgs_pack.targets.steps:write_hf_dir",
                                {"checkpoint": str(checkpoint), "out_dir": str(hf_dir)},
                                name="remapping the checkpoint to a Qwen3 directory", folders=[out], work_dir=out)
        try:
            cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(float_gguf),
                   "--outtype", outtype]
            log(f"llama.cpp: {' '.join(cmd)}")
            env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py
            run = run_tool(cmd, out / "convert.log", env=env)
        finally:
            shutil.rmtree(hf_dir, ignore_errors=True)
        if run.returncode != 0 or not float_gguf.is_file():
            tail = "\n".join((out / "convert.log").read_text(errors="replace").splitlines()[-15:])
            raise BuildError(f"convert_hf_to_gguf.py exited {run.returncode} (log: {out / 'convert.log'}):\n{tail}")
        facts["float"] = {"path": str(float_gguf), "outtype": outtype, **_costs("convert", run),
                          **_costs("hf_view", hf_record), "gguf_bytes": float_gguf.stat().st_size}
    else:
        facts["float"] = done["float"]
    facts["quants"] = dict(have)
    for quant in quants:
        if quant in have:
            continue
        target = out / f"{checkpoint.name}-{quant}.gguf"
        log(f"llama.cpp: quantizing to {quant}: {target}")
        log_file = out / f"quantize-{quant}.log"
        run = run_tool([sys.executable, "-m", "bench.decoder.llama_cpp", str(float_gguf), str(target), quant, str(threads)],
                       log_file, env=child_env())
        if run.returncode != 0 or not target.is_file():
            raise BuildError(f"llama_model_quantize ({quant}) exited {run.returncode} (log: {log_file})")
        facts["quants"][quant] = {"path": str(target), **_costs("quantize", run), **gguf_facts(target)}
    if not keep_float:
        float_gguf.unlink(missing_ok=True)
        facts["float"] = {**facts["float"], "path": None}
    done_file.write_text(json.dumps(facts, indent=2), encoding="utf-8")
    return {**facts, "cached": False}


class LlamaDecoder:
    """One GGUF through llama.cpp's C API, driven like our batched decoder: one context of
    ``max_batch`` sequences, each its own KV stream (``kv_unified`` off), token ids in."""

    def __init__(self, path: Path, *, max_batch: int, max_length: int, threads: int):
        if llama_cpp_missing():
            raise InputError(NOT_INSTALLED)
        if max_batch < 1 or max_length < 2 or threads < 1:
            raise InputError(f"max_batch, threads >= 1 and max_length >= 2 needed, got {max_batch}, "
                             f"{threads}, {max_length}")
        import llama_cpp

        self._ll = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise BuildError(f"llama.cpp could not load {path}")
        cp = llama_cpp.llama_context_default_params()
        for key, value in {"n_ctx": max_batch * max_length, "n_batch": 512, "n_ubatch": 512, "n_seq_max": max_batch,
                           "n_threads": threads, "n_threads_batch": threads, "kv_unified": False, "no_perf": True}.items():
            setattr(cp, key, value)
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise BuildError(f"llama.cpp could not make a context of {cp.n_ctx} positions for {path}")
        self.max_batch, self.max_length, self.threads = max_batch, max_length, threads
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.lengths = [0] * max_batch
        self._batch = llama_cpp.llama_batch_init(512, 0, 1)

    def dims(self) -> dict[str, int]:
        """What llama.cpp read: hidden, layers, heads, kv_heads, head_dim, vocab."""
        ll = self._ll
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_model_meta_val_str(self.model, b"qwen3.attention.key_length", buf, 64)
        return {"hidden": ll.llama_model_n_embd(self.model), "layers": ll.llama_model_n_layer(self.model),
                "heads": ll.llama_model_n_head(self.model), "kv_heads": ll.llama_model_n_head_kv(self.model),
                "head_dim": int(buf.value) if n > 0 else -1, "vocab": self.n_vocab}

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        b = self._batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        if (rc := self._ll.llama_decode(self.ctx, b)) != 0:
            raise BuildError(f"llama_decode returned {rc} ({len(items)} tokens)")

    def prefill(self, row: int, tokens: list[int]) -> None:
        """Start sequence ``row`` over with ``tokens``, logits of the last."""
        if len(tokens) + 1 > self.max_length:
            raise InputError(f"{len(tokens)} positions do not fit the context of {self.max_length}")
        self._ll.llama_memory_seq_rm(self._ll.llama_get_memory(self.ctx), row, -1, -1)
        for start in range(0, len(tokens), 512):
            chunk = tokens[start:start + 512]
            self._decode([(t, start + i, row, start + i == len(tokens) - 1) for i, t in enumerate(chunk)])
        self.lengths[row] = len(tokens)

    def step(self, rows: list[int], tokens: list[int], *, logits: bool = True) -> None:
        """One position for each of ``rows`` in one batch, every row asking for logits or none."""
        if any(self.lengths[r] + 1 > self.max_length for r in rows):
            raise InputError(f"a row would exceed {self.max_length} positions")
        self._decode([(t, self.lengths[r], r, logits) for r, t in zip(rows, tokens, strict=True)])
        for r in rows:
            self.lengths[r] += 1

    def logits(self, index: int):
        """float32 [vocab] logits of output ``index`` of the last decode (a copy)."""
        import numpy as np

        return np.ctypeslib.as_array(self._ll.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._ll.llama_batch_free(self._batch)
            self._ll.llama_free(self.ctx)
            self._ll.llama_model_free(self.model)
            self.ctx = None


def system_info() -> str:
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()




if __name__ == "__main__":  # the quantize step of ensure_ggufs, in a child process: SRC OUT QUANT THREADS
    quantize(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
