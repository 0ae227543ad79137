"""This machine's CPU: model name, vendor and the vector ISA extensions that decide which
int4/int8 kernels run (read once from ``/proc/cpuinfo`` on Linux; elsewhere from
:mod:`platform`, with no flags).

One reader serves the device inventory (``higgs-pack devices``), the build record
(``manifest.build.resources.cpu``) and every benchmark record (``machine``).
"""

from __future__ import annotations

import functools
import os
import platform
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
    """

    model: str
    vendor: str
    flags: tuple[str, ...]
    logical_cpus: int

    @property
    def isa(self) -> dict[str, Any]:
        """:func:`cpu_isa` of its flags."""
        return cpu_isa(self.flags)

    def describe(self) -> str:
        """One line: model, the ISA extensions that matter, logical CPUs."""
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in self.flags]
        return f"{self.model} ({', '.join(isa) or 'no AVX2'}; {self.logical_cpus} logical CPUs)"


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
    return CpuInfo(model, vendor, flags, os.cpu_count() or 1)
