"""The tuning records file under faults: records that lie, paths that are not regular files or
cannot be used, shared files' permissions, and writers killed mid-write."""

import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import shapecache as sc
from shapecache._extension import _C
from shapecache.ops import _tuning
from shapecache.ops._tuning import FORMAT, VERSION, TuningDb

PROBLEM = dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1)


@pytest.fixture
def fresh_tuner():
    _C.tuning_clear()
    _C.tuning_take_unsaved()
    yield
    _C.tuning_clear()
    _C.tuning_take_unsaved()


def im2col_record(x, w) -> dict:
    """A record of this machine for (x, w), naming the algorithm that needs workspace."""
    record = _C.tune_conv2d(x, w, None, **PROBLEM)
    record.pop("candidates")
    return dict(record, algorithm="im2col_gemm")


@pytest.mark.parametrize("workspace_bytes", [0, -1, 1, 10**13])
def test_a_record_with_a_wrong_workspace_is_a_hint_never_a_buffer_size(tmp_path, fresh_tuner, workspace_bytes):
    x, w = torch.randn(2, 8, 12, 12), torch.randn(16, 8, 3, 3)
    record = dict(im2col_record(x, w), workspace_bytes=workspace_bytes)
    _C.tuning_clear()
    db = tmp_path / "tuning.json"
    db.write_text(json.dumps({"format": FORMAT, "version": VERSION, "records": [record]}))
    assert TuningDb(db).load() == 1
    tuned_before = _C.tuning_stats()["tuned"]  # the process's count
    for _ in range(2):  # the first call checks the record, the second uses the checked figure
        out = torch.ops.shapecache.conv2d(x, w, None, **PROBLEM)
        torch.testing.assert_close(out, F.conv2d(x, w, padding=1), rtol=1e-4, atol=1e-4)
    assert _C.tuning_stats()["tuned"] == tuned_before  # the record was used, at the workspace its algorithm needs


def test_a_path_that_is_not_a_regular_file_is_never_moved_or_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(_tuning, "_databases", {})
    before = os.stat("/dev/null")
    with pytest.warns(RuntimeWarning, match="cannot use the tuning records file /dev/null .*not a regular file"):
        assert _tuning.open_db("/dev/null") is None
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    directory = tmp_path / "records"
    directory.mkdir()
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert _tuning.open_db(directory) is None
    assert directory.is_dir()


def test_an_unusable_path_keeps_records_in_memory_with_one_warning(tmp_path, monkeypatch, fresh_tuner):
    monkeypatch.setattr(_tuning, "_databases", {})
    blocker = tmp_path / "file"
    blocker.write_text("")
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1)).eval()
    with pytest.warns(RuntimeWarning, match="cannot use the tuning records file .*; tuning records are kept in memory"):
        handle = sc.tune_convs(net, db=blocker / "tuning.json")  # a file where a directory should be
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(torch.randn(1, 3, 8, 8))  # tunes, keeps the record in memory, warns no more
    assert _C.tuning_stats()["records"] == 1
    sc.uncached(handle)


def test_a_rewrite_keeps_the_files_mode_and_removes_what_a_killed_writer_left(tmp_path, fresh_tuner):
    db = tmp_path / "tuning.json"
    db.write_text(json.dumps({"format": FORMAT, "version": VERSION, "records": []}))
    db.chmod(0o644)
    leftover = tmp_path / ".tuning.json.tmp-abc123"
    leftover.write_text("{half a fil")
    _C.tune_conv2d(torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3), None, **PROBLEM)
    assert TuningDb(db).flush() == 1
    assert stat.S_IMODE(db.stat().st_mode) == 0o644
    assert not leftover.exists() and len(TuningDb(db).records()) == 1


def test_a_writer_killed_mid_write_leaves_the_file_whole_and_the_next_writer_cleans_up(tmp_path, fresh_tuner):
    db = tmp_path / "tuning.json"
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from shapecache.ops._tuning import TuningDb
        database = TuningDb({str(db)!r})
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # dies with its temporary file written
        with database._locked():
            database._write([])
    """)], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9
    assert len(list(tmp_path.glob(".tuning.json.tmp-*"))) == 1 and not db.exists()
    _C.tune_conv2d(torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3), None, **PROBLEM)
    assert TuningDb(db).flush() == 1
    assert list(tmp_path.glob(".tuning.json.tmp-*")) == [] and len(TuningDb(db).records()) == 1


def test_a_candidate_that_fails_while_tuning_is_skipped_not_the_users_call(fresh_tuner):
    x, w = torch.randn(2, 8, 12, 12), torch.randn(16, 8, 3, 3)
    try:
        _C._testing.tuning_fail_candidate("im2col_gemm")
        result = _C.tune_conv2d(x, w, None, **PROBLEM)
        out = torch.ops.shapecache.conv2d(x, w, None, **PROBLEM)
    finally:
        _C._testing.tuning_fail_candidate("")
    failed = [c for c in result["candidates"] if c["algorithm"] == "im2col_gemm"]
    assert failed and failed[0]["skipped"] == "failed: failure injected for tests" and failed[0]["microseconds"] is None
    assert result["algorithm"] != "im2col_gemm"
    torch.testing.assert_close(out, F.conv2d(x, w, padding=1), rtol=1e-4, atol=1e-4)
