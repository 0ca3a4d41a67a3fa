"""The size loop and `python -m shapecache repro` on a tiny model, on CPU; the OOM scenario on a GPU."""

import json

import pytest
import torch

pytest.importorskip("diffusers")

from shapecache.scenarios import size_loop  # noqa: E402
from shapecache.testing import tiny_pipelines as tp  # noqa: E402

pytestmark = pytest.mark.slow

SIZES = [(32, 32), (48, 64), (32, 48)]


def test_shapecache_strategy_largest_first():
    unet = tp.stable_diffusion().unet
    records = size_loop(unet, SIZES, order="largest_first", strategy="shapecache", budget="1GiB",
                        compile_options={"backend": "eager"})
    assert [r.size for r in records] == [(48, 64), (32, 48), (32, 32)]
    assert all(r.error is None and r.build_seconds > 0 and r.call_seconds > 0 and r.reserved > 0 for r in records)
    assert "forward" not in unet.__dict__  # the strategy is undone


def test_naive_builds_a_new_graph_per_size():
    from torch._dynamo.utils import counters

    unet = tp.stable_diffusion().unet
    graphs = counters["stats"]["unique_graphs"]
    records = size_loop(unet, SIZES[:2], strategy="naive", compile_options={"backend": "eager"})
    assert [r.error for r in records] == [None, None]
    assert counters["stats"]["unique_graphs"] - graphs >= 2  # its own code copy per size: never a cache hit
    assert "forward" not in unet.__dict__


def test_torch_compile_strategy_runs_and_is_undone():
    # torch.compile of the module's forward shares Dynamo's cache with every UNet in the process,
    # so whether it compiles anew depends on what ran before; that it runs and is undone does not.
    unet = tp.stable_diffusion().unet
    records = size_loop(unet, SIZES[:2], strategy="torch_compile", compile_options={"backend": "eager"})
    assert [r.error for r in records] == [None, None] and all(r.call_seconds > 0 for r in records)
    assert "forward" not in unet.__dict__


def test_the_loop_stops_at_the_first_out_of_memory_error():
    class Fussy(torch.nn.Module):
        def forward(self, x):
            if x.shape[-1] > 40:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
            return x * 2

    def inputs(size):
        return (torch.ones(1, 1, *size),), {}

    fussy = Fussy()
    fussy.register_parameter("w", torch.nn.Parameter(torch.ones(1)))  # size_loop reads the device from it
    records = size_loop(fussy, SIZES, strategy="naive", inputs=inputs, compile_options={"backend": "eager"})
    assert [r.size for r in records] == [(32, 32), (48, 64)]
    assert records[-1].error == "OutOfMemoryError: CUDA out of memory. Tried to allocate 9.00 GiB"


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy='fast': expected one of"):
        size_loop(torch.nn.Linear(1, 1), SIZES, strategy="fast")
    with pytest.raises(ValueError, match="order='smallest_first'"):
        size_loop(torch.nn.Linear(1, 1), SIZES, order="smallest_first")


def test_repro_runs_each_strategy_and_draws_the_plot(tmp_path):
    from shapecache.scenarios import _cli, _repro

    png, out = tmp_path / "memory.png", tmp_path / "out.json"
    args = _cli.parse_arguments(["repro", "--model", "res-convnet", "--sizes", "64x64", "--strategies",
                                 "torch_compile,shapecache", "--budget", "2GiB", "--plot", str(png), "--json", str(out)])
    results = _repro.run(args)
    assert {s: _repro.verdict(r, 1) for s, r in results.items()} == {"torch_compile": "completed",
                                                                       "shapecache": "completed"}
    for result in results.values():
        assert [r["size"] for r in result["records"]] == [[64, 64]]
        assert all(r["build_seconds"] > 0 and r["call_seconds"] > 0 for r in result["records"])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert json.loads(out.read_text())["results"] == results


@pytest.mark.cuda
@pytest.mark.vram_budget("24GiB")
def test_sdxl_size_loop_naive_grows_with_every_size_and_shapecache_completes():
    from shapecache.scenarios import build_model

    sizes = [(1024, 1024), (1024, 1152), (1360, 1536), (1536, 1360), (1536, 1536)]
    unet = build_model("sdxl", torch.device("cuda"))
    naive = size_loop(unet, sizes, strategy="naive")
    # Each size's graph keeps a pool of its own: measured on an H200, 6.7 GiB after the first
    # size and 10.6 GiB after the fifth, which these five sizes keep under the 24 GiB cap.
    assert [r.error for r in naive] == [None] * len(sizes)
    assert all(later.reserved > earlier.reserved for earlier, later in zip(naive, naive[1:]))
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    ours = size_loop(unet, sizes, strategy="shapecache", budget="20GiB")
    assert [r.error for r in ours] == [None] * len(sizes)
    assert max(r.reserved for r in ours) <= 24 * 2**30


def record(size, resident, error=None):
    return {"size": list(size), "build_seconds": 1.0, "call_seconds": 0.01, "allocated": resident,
            "reserved": resident, "peak": resident, "evictions": 0, "fallbacks": 0, "error": error}


def test_verdicts_say_out_of_memory_only_for_a_failed_allocation_and_over_the_budget_without_a_limit():
    from shapecache.scenarios import _repro

    mib = 1 << 20
    sizes = [(64, 64), (64, 96), (96, 96)]
    failed = {"records": [record(sizes[0], 500 * mib), record(sizes[1], 600 * mib, "RuntimeError: can't allocate")],
              "limit": {"set": True}}
    assert _repro.verdict(failed, 3, 160 * mib) == "out of memory at 64x96"
    grown = [record(s, (500 + 200 * i) * mib) for i, s in enumerate(sizes)]
    assert _repro.verdict({"records": grown, "limit": {"set": False}}, 3, 160 * mib) == "over the budget at 96x96"
    assert _repro.verdict({"records": grown, "limit": {"set": True}}, 3, 160 * mib) == "completed"
    flat = {"records": [record(s, 500 * mib) for s in sizes], "limit": {"set": False}}
    assert _repro.shown({"naive": {"records": grown, "limit": {"set": False}}, "shapecache": flat}, 3, 160 * mib) is None
    assert "did not exceed" in _repro.shown({"naive": flat, "shapecache": flat}, 3, 160 * mib)
    assert "shapecache did not complete" in _repro.shown({"naive": failed, "shapecache": failed}, 3, 160 * mib)


LIMITED = """
import json, torch
from shapecache.scenarios._repro import limit_data_segment
from shapecache.testing.memory_cap import out_of_memory
limit = limit_data_segment(64 << 20)
small = torch.ones(16 << 20, dtype=torch.uint8)  # within the limit
try:
    torch.ones(256 << 20, dtype=torch.uint8)
    outcome = "allocated"
except BaseException as error:
    outcome = f"{type(error).__name__} {out_of_memory(error)}"
print(json.dumps({"limit": limit, "outcome": outcome}))
"""


def test_the_cpu_memory_limit_makes_torchs_allocator_fail_cleanly():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LIMITED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["limit"]["set"]:
        pytest.skip(f"no data-segment limit can be set here: {result['limit']['why']}")
    assert result["outcome"] == "RuntimeError True"


def test_a_failed_allocation_wrapped_by_the_compiler_is_still_out_of_memory():
    from torch._dynamo.exc import InternalTorchDynamoError

    from shapecache.testing.memory_cap import out_of_memory

    def wrapped(cause):  # as Dynamo raises what a compile raised: the cause chained
        try:
            raise InternalTorchDynamoError(f"{type(cause).__name__}: {cause}") from cause
        except InternalTorchDynamoError as error:
            return error

    assert out_of_memory(wrapped(MemoryError("std::bad_alloc")))  # as the naive strategy met it
    assert out_of_memory(InternalTorchDynamoError("MemoryError: std::bad_alloc"))  # the text alone
    assert not out_of_memory(wrapped(ValueError("a bug")))
    assert not out_of_memory(RuntimeError("shape mismatch"))
