"""Pick the best bundle variant for this machine: a pure function of an inventory and a bundle list.

:func:`choose` takes what the machine offers (:class:`Inventory`, filled by
:func:`higgs_pack.runtime.machine.inventory.inventory`, or written by hand in tests) and the
bundles that are visible (:class:`Candidate`, one per manifest) and returns a
:class:`Choice`: the chosen bundle and the provider/device to run it on, why, and
for every other bundle why it was not taken.  Nothing here probes the hardware or
opens a session: :func:`choose` reads only its arguments, and the one file-system access is
:func:`candidate_of`, which checks the bundle's files with ``stat`` to mark a
damaged candidate (a missing file or a wrong size; hashes are checked at load).

Preference order (:func:`preference`, first runnable wins; the shared CPU rung is declared
in ``higgs_pack.manifests.providers``, OpenVINO's device rungs by its backend object
(``runtime/backends/openvino``), each execution provider's rung in its row of
``higgs_pack.manifests.providers.EXECUTION_PROVIDERS``: a new backend or provider brings its
own; where a bundle can run is asked of its backend, :meth:`~higgs_pack.runtime.backends.Backend.placements`):

1. ``npu``: an OpenVINO NPU variant on an Intel NPU;
2. ``cuda``: a cuda bundle on an NVIDIA GPU (CUDA execution provider);
3. ``igpu``: an OpenVINO bundle on an Intel GPU (OpenVINO ``GPU`` device);
4. ``dml``: a dml bundle on a Windows GPU (DirectML execution provider);
5. ``cpu``: an OpenVINO bundle on ``CPU`` or a cpu bundle on the CPU execution
   provider, ordered by speed class: measured decode frames/s on this machine when
   a benchmark record exists (``nox -s bench`` writes ``dist/bench.json``), else
   precision (int4, int8, fp16, fp32), then OpenVINO before ONNX Runtime on Intel
   CPUs and ONNX Runtime first elsewhere;
6. ``npu-on-cpu``: an NPU variant on ``CPU`` (static shapes: runs, but slower).

Within one rung, equal speed classes tie; the tie is broken by bundle name and the
reason says so.  Never a silent fallback: a preferred device that is present but has
no matching bundle (or whose runtime is missing) is reported in :attr:`Choice.notes`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from higgs_pack.errors import BundleError, ManifestError
from higgs_pack.manifests.manifest import check_files
from higgs_pack.manifests.providers import CPU_RUNG, EXECUTION_PROVIDERS, ChoiceRung
from higgs_pack.runtime.machine.facts import Candidate, Inventory, Placement


def candidate_of(manifest: Mapping[str, Any], source: str | Path, origin: str = "") -> Candidate:
    """The :class:`~higgs_pack.runtime.machine.facts.Candidate` a bundle's manifest describes; its
    files are checked with ``stat`` only (``damaged`` says what is missing or of the wrong size).

    Args:
        manifest: the bundle's validated manifest.
        source: its folder.
        origin: how it was found (``installed``, ``--bundles``, ``hub ORG/REPO@rev``).
    """
    m = manifest
    return Candidate(name=m["name"], source=str(source), model=m["model"]["slug"], target=m["target"],
                     precision=m["precision"], variant=m.get("variant"), backend=m["backend"],
                     built_for=_built_for(m), requirements=tuple(m.get("runtime_requirements", ())), origin=origin,
                     damaged=_damaged(m, Path(source)))


def _built_for(manifest: Mapping[str, Any]) -> str:
    """The manifest's provider or device; ``""`` for a backend this higgs-pack does not know
    (:func:`placements` then says so)."""
    from higgs_pack.runtime.backends import placement_of

    try:
        return placement_of(manifest)
    except ManifestError:
        return ""


@dataclass
class Choice:
    """The result of :func:`choose`.

    Attributes:
        chosen: the placement to use, or None when nothing runs here.
        reason: one sentence: which bundle, on what, and why.
        rejected: bundle name -> why it was not chosen (cannot run here, or ranked lower).
        notes: preferred devices present without a runnable bundle for them.
    """

    chosen: Placement | None
    reason: str
    rejected: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        """Several lines for stderr: the choice, then notes, then the others."""
        lines = [self.reason]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"  not chosen: {name}: {why}" for name, why in self.rejected.items()]
        return "\n".join(lines)


def preference() -> dict[str, str]:
    """Every rung's name -> what it means, best first: the CPU rung, each backend's own rungs
    (OpenVINO's devices) and each provider row's ``rung`` (read at each call, so a backend or
    row added later takes its place).

    Raises:
        ValueError: two rows declare rungs of one name that differ.
    """
    from higgs_pack.runtime.backends import registered

    rungs = [CPU_RUNG, *(rung for backend in registered().values() for rung in backend.rungs),
             *(row.rung for row in EXECUTION_PROVIDERS.values())]
    ladder: dict[str, ChoiceRung] = {}
    for rung in sorted(rungs, key=lambda r: r.rank):
        if ladder.setdefault(rung.name, rung) != rung:
            raise ValueError(f"two rungs named {rung.name!r} differ: {ladder[rung.name]} and {rung}")
    return {name: rung.means for name, rung in ladder.items()}


def _damaged(manifest: Mapping[str, Any], root: Path) -> str | None:
    """The first problem :func:`~higgs_pack.manifests.manifest.check_files` finds with the files
    of ``manifest`` under ``root`` (sizes only, no hashes), or None."""
    if not root.is_dir():
        return None  # described without files on disk (synthetic inventories, tests)
    try:
        files = check_files(root, dict(manifest), hashes=False)
    except BundleError as exc:  # a listed path that leaves the bundle
        return str(exc)
    if files.missing:
        return f"{files.missing[0]} is missing"
    if files.mismatched:
        path, why = next(iter(files.mismatched.items()))
        return f"{path}: {why}"
    if files.unlisted:
        return f"{files.unlisted[0]} is used but not listed in the manifest"
    return None


def placements(c: Candidate, inv: Inventory, bench: Mapping[str, float] | None = None
               ) -> tuple[list[Placement], str | None]:
    """Where one bundle can run on this machine.

    Returns:
        ``(placements, why_not)``: every rung it can take (best first), and when there
        is none, why it cannot run here (naming the missing runtime and how to install it).
    """
    if c.damaged:
        return [], f"damaged bundle at {c.source}: {c.damaged}"
    from higgs_pack.runtime.backends import registered

    backend = registered().get(c.backend)
    if backend is None:
        return [], f"unknown backend {c.backend!r} (known: {', '.join(sorted(registered()))})"
    return backend.placements(c, inv, bench or {})


def _notes(candidates: list[Candidate], inv: Inventory, runnable: set[str], model: str | None) -> list[str]:
    """Preferred hardware present with nothing runnable for it (never a silent fallback): each backend's."""
    from higgs_pack.runtime.backends import registered

    of = f" of {model}" if model else ""
    return [note for backend in registered().values() for note in backend.notes(candidates, inv, runnable, of)]


def choose(candidates: Iterable[Candidate], inv: Inventory, *, model: str | None = None,
           bench: Mapping[str, float] | None = None) -> Choice:
    """Choose the best runnable bundle (see the module docstring for the order).

    Args:
        candidates: the visible bundles (all of one model, or filtered by ``model``).
        inv: the device inventory.
        model: keep only bundles of this model slug (None: all given).
        bench: measured decode frames/s on this machine per system (``cpu-int4``,
            ``openvino-int8``), from ``dist/bench.json``; empty when none.

    Returns:
        A :class:`Choice` (``chosen`` None when nothing runs; ``reason`` says why).
    """
    bench = bench or {}
    pool = [c for c in candidates if model is None or c.model == model]
    rejected: dict[str, str] = {}
    options: list[Placement] = []
    for c in pool:
        found, why_not = placements(c, inv, bench)
        if why_not:
            rejected[c.name] = f"cannot run here: {why_not}"
        options.extend(found)
    runnable = {p.rung for p in options}
    notes = _notes(pool, inv, runnable, model)
    if not options:
        what = f"bundles of {model}" if model else "bundles"
        reason = (f"none of the {len(pool)} visible {what} can run here" if pool else
                  f"no {what} visible (looked in installed wheels, --bundles folders, pulled hub repos)")
        return Choice(None, reason, rejected, notes)
    ladder = preference()
    rank = {rung: i for i, rung in enumerate(ladder)}
    options.sort(key=lambda p: (rank[p.rung], p.speed, p.candidate.name))
    best = options[0]
    ties = [p for p in options[1:] if rank[p.rung] == rank[best.rung] and p.speed == best.speed]
    reason = (f"chose {best.candidate.name} on {best.why}: preference {rank[best.rung] + 1} of "
              f"{len(ladder)} ({ladder[best.rung]})")
    if ties:
        reason += (f"; tied with {', '.join(f'{p.candidate.name} ({p.candidate.source})' for p in ties)}, "
                   "first by name")
    for p in options[1:]:
        if p.candidate.name != best.candidate.name and p.candidate.name not in rejected:
            rejected[p.candidate.name] = (f"ranked lower: preference {rank[p.rung] + 1} ({p.why})"
                                          if p not in ties else "tied, later by name")
    return Choice(best, reason, rejected, notes)


def require(choice: Choice, what: str) -> Placement:
    """The chosen placement, or a :class:`BundleError` that explains every bundle and note."""
    if choice.chosen is not None:
        return choice.chosen
    details = "; ".join(f"{n}: {w}" for n, w in choice.rejected.items())
    notes = " ".join(choice.notes)
    raise BundleError(f"{what}: {choice.reason}" + (f" ({details})" if details else "") +
                      (f". {notes}" if notes else "") +
                      ". Pass a bundle directory, archive or hf://ORG/REPO, or install a bundle wheel")
