"""Tuning records on disk, tune_convs routing, and the workspace in a cache's budget."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shapecache as sc
from shapecache._extension import _C
from shapecache.ops._tuning import FORMAT, VERSION, TuningDb
from shapecache.testing.models import ConvNet

RUN_TUNED_NET = textwrap.dedent(
    """
    import json, sys, torch, shapecache as sc
    from shapecache._extension import _C
    from shapecache.testing.models import ConvNet
    torch.manual_seed(0)
    net = ConvNet(hidden=int(sys.argv[1])).eval()
    sc.tune_convs(net)
    with torch.no_grad():
        for size in (16, 24):
            net(torch.randn(1, 3, size, size))
    print(json.dumps(_C.tuning_stats()))
    """
)


def run_tuned_net(db: Path, hidden: int = 16) -> dict:
    env = {"SHAPECACHE_TUNING_DB": str(db), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", RUN_TUNED_NET, str(hidden)], capture_output=True, text=True,
                            timeout=300, env={**env, **_python_env()})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _python_env():
    import os

    return {k: v for k, v in os.environ.items() if k in ("HOME", "PYTHONPATH", "LD_LIBRARY_PATH", "PYENV_VERSION")}


def test_records_survive_a_restart_and_skip_tuning(tmp_path):
    db = tmp_path / "tuning.json"
    first = run_tuned_net(db)
    assert first["tuned"] == 6 and first["loaded"] == 0  # 3 convolutions x 2 sizes
    data = json.loads(db.read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION and len(data["records"]) == 6
    second = run_tuned_net(db)
    assert second["tuned"] == 0 and second["loaded"] == 6 and second["hits"] >= 6


def test_concurrent_writers_keep_every_record(tmp_path):
    db = tmp_path / "tuning.json"
    env = {"SHAPECACHE_TUNING_DB": str(db), "PATH": "/usr/bin:/bin", **_python_env()}
    writers = [subprocess.Popen([sys.executable, "-c", RUN_TUNED_NET, str(hidden)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for hidden in (4, 8, 12, 20)]
    for writer in writers:
        out, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err
    records = TuningDb(db).records()
    # every process tuned 6 problems; the first and last layers' shapes differ by hidden width
    keys = {_C.record_key(r) for r in records}
    assert len(records) == len(keys) == 4 * 6
    assert not list(tmp_path.glob("*.corrupt-*")) and not list(tmp_path.glob("tuning.json.*[!k]"))


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": FORMAT, "version": 99, "records": []}),
                                     json.dumps({"format": FORMAT, "version": VERSION, "records": [{"dtype": 1}]}),
                                     json.dumps([1, 2, 3])])
def test_a_corrupt_or_foreign_file_is_set_aside_and_work_goes_on(tmp_path, content):
    db = tmp_path / "tuning.json"
    db.write_text(content)
    with pytest.warns(RuntimeWarning, match="could not be used .* moved the file to .*corrupt"):
        assert TuningDb(db).load() == 0
    aside = list(tmp_path.glob("tuning.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == content and not db.exists()
    stats = run_tuned_net(db)  # a fresh file is written
    assert stats["tuned"] == 6 and len(TuningDb(db).records()) == 6


def test_records_of_another_environment_stay_in_the_file_but_are_not_used(tmp_path):
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    record = _C.tune_conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    record.pop("candidates")
    foreign = dict(record, environment="torch 0.0; cpu elsewhere; threads 64")
    db = tmp_path / "tuning.json"
    db.write_text(json.dumps({"format": FORMAT, "version": VERSION, "records": [foreign]}))
    database = TuningDb(db)
    assert database.load() == 0
    _C.tune_conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    database.flush()
    environments = sorted(r["environment"] for r in database.records())
    assert len(environments) >= 2 and "torch 0.0; cpu elsewhere; threads 64" in environments


def test_tune_convs_routes_what_it_can_and_says_why_not():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding="same"),
        torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
        torch.nn.Conv2d(4, 4, 2, padding="same"),  # even kernel: asymmetric "same"
        torch.nn.Conv2d(4, 2, 1, padding="valid"),
    ).eval()
    x = torch.randn(2, 3, 10, 10)
    expected = model(x)
    handle = sc.tune_convs(model, db=False)
    assert handle.routed == ["0", "3"]
    assert handle.skipped == {"1": "padding_mode='reflect' (only 'zeros' is tuned)",
                              "2": "padding='same' that is not symmetric"}
    torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-4)
    assert sc.uncached(handle) is model
    assert all("forward" not in m.__dict__ for m in model)
    assert torch.equal(model(x), expected)


def test_tune_convs_bad_arguments():
    with pytest.raises(TypeError, match="tune_convs: expected an nn.Module, got function"):
        sc.tune_convs(lambda x: x)
    with pytest.raises(TypeError, match="db=3: expected a file path"):
        sc.tune_convs(torch.nn.Conv2d(1, 1, 1), db=3)
    with pytest.raises(ValueError, match="workspace_cap=0.5: expected bytes"):
        sc.tune_convs(torch.nn.Conv2d(1, 1, 1), db=False, workspace_cap=0.5)
    with pytest.raises(ValueError, match="tune_convs=True needs an nn.Module"):
        sc.cached(lambda x: x, tune_convs=True)


def test_cached_with_tuned_convs_charges_the_workspace_to_the_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("SHAPECACHE_TUNING_DB", str(tmp_path / "tuning.json"))
    net = ConvNet().eval()
    x = torch.randn(1, 3, 32, 32)
    expected = net(x)
    sc.cached(net, tune_convs=True)
    with torch.no_grad():
        torch.testing.assert_close(net(x), expected, rtol=1e-4, atol=1e-4)
    st = sc.stats(net)
    arena = _C.workspace_stats(torch.device("cpu"))["bytes"]
    # The arena is the process's, one per device: what it held when this cache charged it, at
    # most what it holds now (another test's cache, or its build still running, may grow it).
    assert 0 < st["workspace_bytes"] <= arena and st["bytes"] == st["entry_bytes"] + st["workspace_bytes"]
    assert all(type(m.forward).__name__ == "method" for m in net.layers if isinstance(m, torch.nn.Conv2d))
    sc.uncached(net)
    assert all("forward" not in m.__dict__ for m in net.layers)


def test_cpu_tuning_never_initializes_cuda(tmp_path):
    program = RUN_TUNED_NET + "\nprint('initialized' if torch.cuda.is_initialized() else 'not initialized')\n"
    env = {"SHAPECACHE_TUNING_DB": str(tmp_path / "t.json"), "PATH": "/usr/bin:/bin", **_python_env()}
    result = subprocess.run([sys.executable, "-c", program, "8"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "not initialized"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_tuned_op_matches_f_conv2d(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # restored after the test
    x = torch.randn(2, 64, 32, 32, device="cuda", dtype=dtype)
    w = torch.randn(32, 64, 3, 3, device="cuda", dtype=dtype)
    b = torch.randn(32, device="cuda", dtype=dtype)
    result = _C.tune_conv2d(x, w, b, [1, 1], [1, 1], [1, 1], 1)
    assert any(c["algorithm"].startswith("cudnn:") and c["microseconds"] for c in result["candidates"])
    expected = torch.nn.functional.conv2d(x, w, b, padding=1)
    # Algorithms sum in other orders (FFT, Winograd, split reductions): their error scales with the
    # output's magnitude, not with each element's. Measured on an H200: 4.9e-4 against outputs up
    # to about 100 in float32 (2e-5 of the scale allows 2e-3), two float16 ulps at 2.4.
    scale = expected.abs().max().item()
    tolerance = dict(rtol=2e-3, atol=1e-3 * scale) if dtype == torch.float16 else dict(rtol=1e-5, atol=2e-5 * scale)
    for c in result["candidates"]:
        if c["microseconds"] is not None:
            out = _C._testing.conv2d_algorithm(c["algorithm"], x, w, b, [1, 1], [1, 1], [1, 1], 1)
            torch.testing.assert_close(out, expected, **tolerance, msg=lambda m, a=c["algorithm"]: f"{a}: {m}")


@pytest.mark.cuda
def test_cuda_tuning_allocates_only_on_the_inputs_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    x = torch.randn(1, 32, 64, 64, device="cuda:1")
    w = torch.randn(32, 32, 3, 3, device="cuda:1")
    before = torch.cuda.memory_reserved(0)
    _C.tune_conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    torch.ops.shapecache.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    torch.cuda.synchronize(1)
    assert torch.cuda.memory_reserved(0) == before
    assert _C.workspace_stats(torch.device("cuda:0"))["bytes"] == 0
