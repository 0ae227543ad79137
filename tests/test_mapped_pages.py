"""runtime.mapped_pages: paging a mapped file out of the resident set, on real mappings."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest
from conftest import skip_unless_reclaimable

from higgs_pack.runtime.machine.mapped_pages import file_mappings, paging_out, resident_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise(MADV_PAGEOUT) are Linux's")


def test_paging_out_drops_resident_pages_and_keeps_contents(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        data.tofile(f)
        # Clean pages, as a bundle's weights are: MADV_PAGEOUT skips dirty pages and pages under
        # writeback (the CI run beside a full-size build kept all 8 MiB resident without this).
        f.flush()
        os.fsync(f.fileno())
    skip_unless_reclaimable(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page touched
        assert [n for _, n in file_mappings(path)] == [data.size]
        before = resident_bytes(path)
        assert before >= data.size * 0.9, f"the mapping should be resident after reading it: {before} bytes"
        with paging_out(path, interval_s=0.005) as result:
            pass
        if not result.supported:
            pytest.skip(result.reason)
        after = resident_bytes(path)
        assert result.passes >= 1 and result.mapped_bytes == data.size
        assert after < before / 4, f"still {after} of {before} bytes resident after paging out"
        np.testing.assert_array_equal(view, data)  # faulted back in from the file, unchanged
        del view


def test_paging_out_an_unmapped_file_does_nothing(tmp_path):
    path = tmp_path / "never-mapped.bin"
    path.write_bytes(os.urandom(4096))
    with paging_out(path) as result:
        pass
    assert result.mapped_bytes == 0 and not result.supported and resident_bytes(path) == 0


def test_keep_page_cache_drops_clean_private_pages_and_never_a_written_one(tmp_path):
    """ONNX Runtime maps external data private and writable (``rw-p``), as ACCESS_COPY does:
    clean pages leave the resident set and read back unchanged; a mapping the process wrote
    to keeps its private copy (MADV_DONTNEED there would silently restore the file's bytes)."""
    data = np.random.default_rng(1).integers(0, 255, 4 << 20, dtype=np.uint8)
    path = tmp_path / "model.onnx.data"
    data.tofile(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as clean, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as written:
        read, wrote = np.frombuffer(clean, dtype=np.uint8), np.frombuffer(written, dtype=np.uint8)
        assert int(read.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))
        written[100] = (int(data[100]) + 1) % 256  # a private copy of one page
        assert int(wrote.sum(dtype=np.int64)) != int(data.sum(dtype=np.int64))
        before = resident_bytes(path)
        assert before >= data.size, f"both mappings should be mostly resident: {before} bytes"
        with paging_out(path, interval_s=0.005, keep_page_cache=True) as result:
            pass
        assert result.supported and result.mapped_bytes == 2 * data.size
        after = resident_bytes(path)
        assert after < before * 3 / 4, f"still {after} of {before} bytes resident"
        np.testing.assert_array_equal(read, data)  # back from the page cache, unchanged
        assert written[100] == (int(data[100]) + 1) % 256  # the private copy survived
        np.testing.assert_array_equal(wrote[:100], data[:100])
        del read, wrote
