"""A build that runs out of disk or memory, or is killed, says so and leaves nothing behind.

Every fault here is real: a child process killed with SIGKILL (what the kernel's
out-of-memory killer sends), a write to ``/dev/full`` (ENOSPC), a free-space estimate
larger than the disk, and a whole ``higgs-pack build`` killed mid-step.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from higgs_pack.errors import BuildError
from higgs_pack.exporters.process import run_step
from higgs_pack.targets.workspace import WORK_PREFIX, SpaceNeed, check_space, work_area


def test_a_step_killed_with_sigkill_is_reported_as_out_of_memory(tmp_path):
    # The child kills itself as the OOM killer would ($PPID of the shell is the step's Python).
    with pytest.raises(BuildError, match=r"exporting x was killed by signal 9 \(SIGKILL\).*out-of-memory killer"):
        run_step("subprocess:run", {"args": ["sh", "-c", "kill -9 $PPID"]}, name="exporting x",
                 folders=[tmp_path], work_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # its spec folder is gone


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to write into a full device")
def test_a_step_out_of_disk_says_so(tmp_path):
    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(1 << 20))
    with pytest.raises(BuildError, match=r"writing weights failed: out of disk space \(\[Errno 28\]"):
        run_step("shutil:copyfile", {"src": str(src), "dst": "/dev/full"}, name="writing weights",
                 work_dir=tmp_path)


def test_space_estimate_larger_than_the_disk_is_refused_before_work(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()
    with pytest.raises(BuildError) as info:
        check_space(SpaceNeed(scratch=free + (50 << 30), bundle=1 << 30), scratch_root, tmp_path / "out")
    message = str(info.value)
    assert f"in {scratch_root}," in message and "scratch + bundle needs about" in message
    needed = (free + (51 << 30)) / 2**30
    assert f"{needed:.1f} GiB" in message and "GiB free" in message and "--work-dir" in message
    # What fits is described, not refused.
    line = check_space(SpaceNeed(scratch=3 << 30, bundle=280 << 20), scratch_root, tmp_path / "out")
    # sizes in the unit that reads (a tiny bundle's bound was "~0.3 GiB" for 24 MB; issue 37 item 6)
    assert line.startswith("disk: room checked for scratch up to 3.0 GiB in ")
    assert "a bundle up to 280 MiB in " in line and line.endswith("(upper bounds, with a margin)")


def test_scratch_of_a_killed_build_is_removed_by_the_next(tmp_path, tiny_checkpoint):
    """``higgs-pack build`` killed with SIGKILL mid-step leaves its scratch and staging folders;
    the next build's work area removes the scratch (its pid is gone), and its staging
    folder beside ``--out`` never becomes a bundle."""
    work, out = tmp_path / "work", tmp_path / "dist" / "b"
    work.mkdir()
    env = {**os.environ, "HIGGS_PACK_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "higgs_pack.runtime.cli", "build", "-t", "cpu", "-p", "fp32",
                             "-m", str(tiny_checkpoint), "-o", str(out), "--work-dir", str(work)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not any(p.name.startswith("higgs-pack-step-") for s in work.glob(f"{WORK_PREFIX}*")
                      for p in s.iterdir()):
            assert proc.poll() is None, "the build ended before its first step started"
            assert time.monotonic() < deadline, "no build step started within 240 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the builder and its step child, as the OOM killer may
        proc.wait()
    left = list(work.glob(f"{WORK_PREFIX}{proc.pid}-*"))
    assert len(left) == 1 and left[0].is_dir()
    assert not out.exists()  # no half-written bundle where one is expected
    with work_area(work) as fresh:
        assert not left[0].exists()
        assert fresh.parent == work
    assert list(work.iterdir()) == []


@pytest.mark.slow
def test_a_sub_part_built_with_other_quantization_settings_is_refused(tmp_path, tiny_checkpoint, monkeypatch):
    """The plan records every declared quantization setting (the cpu decoder's int4 block size:
    targets/declarations.py); an exporter that writes another is refused, naming the setting, and
    leaves no bundle.  The mutation: the option the decoder exporter is handed is changed after
    planning (the plan still says the declared block size), so ModelBuilder really writes 32."""
    from dataclasses import replace

    from higgs_pack.manifests.model import SubPart
    from higgs_pack.targets import build as build_module
    from higgs_pack.targets.plan import make_plan

    def mutated_plan(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        rows = tuple(replace(r, options={**r.options, "extra_options": {**r.options["extra_options"], "block_size": 32}})
                     if r.subpart == SubPart.LLM_DECODER else r for r in plan.rows)
        return replace(plan, rows=rows)

    declared = {r.subpart: r for r in make_plan("cpu", "int4").rows}[SubPart.LLM_DECODER].quantization["block_size"]
    assert declared != 32
    monkeypatch.setattr(build_module, "make_plan", mutated_plan)
    out, work = tmp_path / "dist" / "b", tmp_path / "work"
    work.mkdir()
    with pytest.raises(BuildError, match=rf"did not build what the plan says.*llm_decoder: quantization "
                                         rf"block_size=32, planned {declared}"):
        build_module.build("cpu", precision="int4", model=tiny_checkpoint, out=out, work_dir=work)
    assert not out.exists() and list(work.iterdir()) == [] and list(out.parent.iterdir()) == []


def test_a_bad_work_dir_is_refused_before_the_checkpoint_is_opened(tmp_path, monkeypatch):
    """Path problems are the caller's input (InputError naming the argument), found before any
    work: the checkpoint (perhaps a download) is never opened."""
    from higgs_pack.errors import InputError
    from higgs_pack.exporters.checkpoint import reader
    from higgs_pack.targets.build import build

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was opened")

    monkeypatch.setattr(reader, "open_checkpoint", never)
    (tmp_path / "file").write_text("")
    for bad, state in ((tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a folder")):
        with pytest.raises(InputError, match=rf"work_dir must be an existing folder .*{state}; .*--work-dir") as info:
            build("cpu", model="org/never-fetched", out=tmp_path / "out", work_dir=bad)
        assert [p.field for p in info.value.problems] == ["work_dir"]
    assert not (tmp_path / "out").exists()
