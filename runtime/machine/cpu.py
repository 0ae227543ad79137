"""This machine's CPU: model name, vendor, the vector ISA extensions that decide which
int4/int8 kernels run (read once from ``/proc/cpuinfo`` on Linux; elsewhere from
:mod:`platform`, with no flags) and the size of its last-level cache (``/sys``, else
``lscpu``; None when neither says).

One reader serves the device inventory (``higgs-pack devices``), the build record
(``manifest.build.resources.cpu``) and every benchmark record (``machine``).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: CPU feature flags that decide which int4/int8 kernels run (``/proc/cpuinfo`` names): OpenVINO's
#: dynamic activation quantization needs AVX2-VNNI or AVX-512-VNNI (MODEL.md); AMX tiles and
#: AVX-512-BF16 change the CPU plugin's default inference precision.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_isa(flags: Sequence[str]) -> dict[str, Any]:
    """The ISA entry of a record from a CPU's feature flags.

    Returns:
        ``{"flags": [the ISA_FLAGS present, in that order], "vnni": bool (AVX2-VNNI or
        AVX-512-VNNI: int8 dot products for dynamic quantization), "avx512": bool}``.
    """
    present = set(flags)
    return {"flags": [f for f in ISA_FLAGS if f in present], "vnni": bool({"avx_vnni", "avx512_vnni"} & present),
            "avx512": "avx512f" in present}


@dataclass(frozen=True)
class CpuInfo:
    """The CPU.

    Attributes:
        model: model name (``AMD EPYC 7B13``), or the platform's machine name when unknown.
        vendor: ``intel``, ``amd``, ``arm`` or ``other``.
        flags: every feature flag the kernel reports (empty off Linux).
        logical_cpus: ``os.cpu_count()``.
        llc_bytes: size in bytes of the last-level cache (the highest cache level) that CPU 0
            uses: one instance, as a thread of this process sees it (an EPYC's L3 of one
            CCD, a Xeon's L3 of one socket); None when unknown (see :func:`last_level_cache`).
        llc_level: that cache's level (3 for an L3), None when unknown.
    """

    model: str
    vendor: str
    flags: tuple[str, ...]
    logical_cpus: int
    llc_bytes: int | None = None
    llc_level: int | None = None

    @property
    def isa(self) -> dict[str, Any]:
        """:func:`cpu_isa` of its flags."""
        return cpu_isa(self.flags)

    def describe(self) -> str:
        """One line: model, the ISA extensions that matter, logical CPUs."""
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in self.flags]
        llc = f"; L{self.llc_level} {self.llc_bytes / 2**20:g} MiB" if self.llc_bytes else ""
        return f"{self.model} ({', '.join(isa) or 'no AVX2'}; {self.logical_cpus} logical CPUs{llc})"


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's :class:`CpuInfo` (read once per process)."""
    model, flags = "", ()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = tuple(line.split(":", 1)[1].split())
            if model and flags:
                break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    low = model.lower()
    vendor = ("intel" if "intel" in low else "amd" if ("amd" in low or "epyc" in low or "ryzen" in low)
              else "arm" if platform.machine().lower() in ("arm64", "aarch64") else "other")
    llc_level, llc_bytes = last_level_cache() or (None, None)
    return CpuInfo(model, vendor, flags, os.cpu_count() or 1, llc_bytes, llc_level)


_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
               "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_cache_size(text: str) -> int | None:
    """Bytes of a cache size as ``/sys`` (``32768K``) or ``lscpu`` (``32 MiB``) writes it; None
    if it is not one (binary units: a cache's "K"/"KB"/"MB" are powers of two)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def last_level_cache(sys_cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> tuple[int, int] | None:
    """``(level, bytes)`` of the highest-level data or unified cache of CPU 0.

    Read from ``sys_cpu/index*/{level,type,size}`` (Linux); without it, from ``lscpu -J``
    (whose sizes may sum the instances of a cache; the largest level it lists). None when
    neither is available (macOS, Windows, containers hiding ``/sys``).
    """
    best: tuple[int, int] | None = None
    for index in sorted(sys_cpu.glob("index*")):
        try:
            level = int((index / "level").read_text().strip())
            kind = (index / "type").read_text().strip()
            size = parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and size and (best is None or level > best[0]):
            best = (level, size)
    if best is not None:
        return best
    try:
        out = subprocess.run(["lscpu", "-J"], capture_output=True, text=True, timeout=10, check=True).stdout
        rows = json.loads(out).get("lscpu", [])
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    for row in rows:
        match = re.fullmatch(r"L([0-9]) cache:", str(row.get("field", "")))
        size = parse_cache_size(str(row.get("data", "")).split("(")[0]) if match else None
        if match and size and (best is None or int(match.group(1)) > best[0]):
            best = (int(match.group(1)), size)
    return best
