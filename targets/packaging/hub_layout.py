"""``higgs-pack package --format hub``: a folder ready for ``huggingface-cli upload``.

Layout (one hub repository per model, one folder per bundle variant)::

    dist/hub/<model-slug>/
        README.md                      model card: variants, targets, precisions,
                                       requirements, licence, verification results
        <bundle-name>/manifest.json …  the bundle, byte for byte (hashes checked while copying)

Packaging a second bundle of the same model adds its folder and rewrites the card
for every variant present.  Upload with
``huggingface-cli upload ORG/REPO dist/hub/<model-slug> .``; users then run
``higgs-pack pull ORG/REPO`` (which picks the variant for their machine) or
``higgs_pack.load("hf://ORG/REPO")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from higgs_pack.manifests.manifest import MANIFEST_NAME, read_manifest
from higgs_pack.runtime.backends import placement_of, registered

CARD_NAME = "README.md"


def write_hub_bundle(content: Any, dest: Path, epoch: int) -> None:
    """Copy a verified bundle (``packaging.BundleContent``) into the folder ``dest``, checking every file's hash.

    Raises:
        PackagingError: a file changed while it was copied.
    """
    del epoch  # plain files keep today's times; the hub stores content, not times
    dest.mkdir()
    for member in content.members:
        target = dest.joinpath(*member.relpath.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        with member.open() as reader, open(target, "xb") as out:
            while chunk := reader.read(1 << 20):
                out.write(chunk)
            member.check(reader)


def _verification_lines(manifest: dict[str, Any]) -> list[str]:
    checks = (manifest.get("verification") or {}).get("build_time", {}).get("checks", [])
    if not checks:
        return ["Not recorded at build time: run `higgs-pack verify` on the bundle."]
    failed = [c for c in checks if c.get("status") == "FAIL"]
    lines = [f"{len(checks)} checks at build time, {len(failed)} failed "
             f"({'PASS' if not failed else 'FAIL'}):", "", "| check | status | detail |", "|---|---|---|"]
    lines += [f"| {c['name']} | {c['status']} | {str(c['detail']).replace('|', '/')} |" for c in checks]
    return lines


def model_card(repo_folder: Path) -> str:
    """The ``README.md`` of a hub folder, describing every bundle folder in it."""
    manifests = [read_manifest(p) for p in sorted(repo_folder.iterdir()) if (p / MANIFEST_NAME).is_file()]
    if not manifests:
        return ""
    first = manifests[0]["model"]
    licences = sorted({m["model"]["license"] for m in manifests})
    tags = sorted({"text-to-speech", "higgs-pack", *(m["target"] for m in manifests),
                   *(registered()[m["backend"]].format for m in manifests)})
    lines = ["---", "library_name: higgs-pack", "pipeline_tag: text-to-speech", "license: other",
             f"license_name: {licences[0]!r}" if len(licences) == 1 else "license_name: several (see below)",
             "tags:", *(f"- {t}" for t in tags), "---", "",
             f"# {first['slug']}: higgs-pack bundles", "",
             f"Ready-to-run bundles of `{first['id']}` (checkpoint sha256 `{first['checkpoint_sha256'][:16]}…`) "
             "built by higgs-pack. Each folder is one bundle: a `manifest.json` that "
             "lists every file with its sha256, and the files.", "",
             "```bash",
             "pip install 'higgs-pack[cpu]'      # or [cuda], [dml], [openvino]: see the requirements below",
             "higgs-pack pull ORG/REPO            # picks the variant for this machine, verifies every file",
             "higgs-pack synthesize hf://ORG/REPO --text \"Hello.\" -o hello.wav",
             "```", "", "```python", "import higgs_pack", "tts = higgs_pack.load(\"hf://ORG/REPO\")",
             "result = tts.synthesize(\"Hello.\")    # result.samples: float32 mono at 24000 Hz", "```", "",
             "## Variants", "",
             "| folder | target | precision | variant | runs on | requirements | size |",
             "|---|---|---|---|---|---|---|"]
    for m in manifests:
        where = f"{registered()[m['backend']].label} {placement_of(m)}"
        size = sum(f["size"] for f in m["files"]) / 1e6
        lines.append(f"| `{m['name']}` | {m['target']} | {m['precision']} | {m.get('variant') or '-'} | {where} | "
                     f"{'; '.join(f'`{r}`' for r in m['runtime_requirements'])} | {size:.1f} MB |")
    lines += ["", "`higgs-pack pull` and `higgs_pack.load` choose among these by the preference order of "
              "`higgs-pack devices` (NPU variant on an Intel NPU, cuda on an NVIDIA GPU, OpenVINO on an Intel "
              "GPU, dml on a Windows GPU, then the fastest CPU bundle); `--variant FOLDER` picks one.", "",
              "## Licence", ""]
    lines += [f"- `{m['name']}`: {m['model']['license']}" for m in manifests]
    lines += ["", "## Verification", ""]
    for m in manifests:
        lines += [f"### {m['name']}", "", *_verification_lines(m), ""]
    return "\n".join(lines).rstrip() + "\n"
