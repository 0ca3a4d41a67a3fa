"""shapecache::conv2d: numerics, registration, the tuner's choice and the workspace arena."""

import threading

import pytest
import torch
import torch.nn.functional as F

import shapecache as sc
from shapecache._extension import _C
from shapecache.ops import conv2d  # noqa: F401  (the ops' fake and autograd registrations)

CPU = torch.device("cpu")
ALGORITHMS = ["aten", "aten_channels_last", "im2col_gemm"]

# (input shape, weight shape, stride, padding, dilation, groups)
PROBLEMS = [
    ((2, 4, 9, 11), (6, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((1, 6, 16, 16), (6, 3, 3, 3), (2, 2), (1, 1), (1, 1), 2),
    ((3, 8, 7, 7), (8, 1, 3, 3), (1, 1), (2, 2), (2, 2), 8),  # depthwise, dilated
    ((1, 4, 12, 10), (5, 4, 1, 1), (1, 1), (0, 0), (1, 1), 1),  # 1x1
    ((2, 3, 10, 13), (4, 3, 5, 3), (2, 1), (2, 0), (1, 2), 1),  # rectangular everything
]
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-10, atol=1e-10),
              torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def make(problem, dtype, channels_last, bias=True):
    shape, weight_shape, stride, padding, dilation, groups = problem
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = torch.randn(weight_shape, generator=g).to(dtype)
    b = torch.randn(weight_shape[0], generator=g).to(dtype) if bias else None
    return x, w, b, list(stride), list(padding), list(dilation), groups


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("channels_last", [False, True])
def test_every_algorithm_and_the_tuned_op_match_f_conv2d(problem, dtype, channels_last):
    x, w, b, stride, padding, dilation, groups = make(problem, dtype, channels_last)
    expected = F.conv2d(x, w, b, stride, padding, dilation, groups)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for algorithm in ALGORITHMS:
        out = _C._testing.conv2d_algorithm(algorithm, x, w, b, stride, padding, dilation, groups)
        torch.testing.assert_close(out, expected, **TOLERANCES[dtype], msg=lambda m: f"{algorithm}: {m}")
        assert out.is_contiguous(memory_format=layout), algorithm
    tuned = torch.ops.shapecache.conv2d(x, w, b, stride, padding, dilation, groups)
    torch.testing.assert_close(tuned, expected, **TOLERANCES[dtype])
    assert tuned.is_contiguous(memory_format=layout)


def test_no_bias_and_unbatched_inputs_through_tune_convs():
    conv = torch.nn.Conv2d(3, 4, 3, padding="same", bias=False)
    x = torch.randn(3, 8, 8)  # unbatched
    expected = conv(x)
    handle = sc.tune_convs(conv, db=False)
    assert handle.routed == [""]
    torch.testing.assert_close(conv(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("channels_last", [False, True])
def test_opcheck(channels_last):
    x, w, b, stride, padding, dilation, groups = make(PROBLEMS[1], torch.float32, channels_last)
    torch.library.opcheck(torch.ops.shapecache.conv2d.default, (x, w, b, stride, padding, dilation, groups))
    grad_args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), stride, padding, dilation, groups)
    torch.library.opcheck(torch.ops.shapecache.conv2d.default, grad_args)


def test_runs_inside_torch_compile_fullgraph():
    x, w, b, *_ = make(PROBLEMS[0], torch.float32, False)

    def f(x):
        return sc.ops.conv2d(x, w, b, padding=1).relu() * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), F.conv2d(x, w, b, padding=1).relu() * 2, rtol=1e-4, atol=1e-4)


def test_bad_arguments_name_what_was_received():
    x = torch.randn(1, 4, 8, 8)
    with pytest.raises(RuntimeError, match=r"input has 4 channels but weight expects 3 x groups=1"):
        torch.ops.shapecache.conv2d(x, torch.randn(2, 3, 3, 3), None, [1, 1], [0, 0], [1, 1], 1)
    with pytest.raises(RuntimeError, match=r"input should be a 4-D \(N, C, H, W\) tensor, got 3-D"):
        torch.ops.shapecache.conv2d(x[0], torch.randn(2, 4, 3, 3), None, [1, 1], [0, 0], [1, 1], 1)
    with pytest.raises(RuntimeError, match=r"bias should have shape \(2,\), got \[3\]"):
        torch.ops.shapecache.conv2d(x, torch.randn(2, 4, 3, 3), torch.randn(3), [1, 1], [0, 0], [1, 1], 1)
    with pytest.raises(RuntimeError, match=r"no algorithm 'winograd' on cpu; there are: aten aten_channels_last"):
        _C._testing.conv2d_algorithm("winograd", x, torch.randn(2, 4, 3, 3), None, [1, 1], [0, 0], [1, 1], 1)


def test_tuner_picks_the_measured_fastest_that_fits():
    for problem in PROBLEMS:
        result = _C.tune_conv2d(*make(problem, torch.float32, False))
        timed = [c for c in result["candidates"] if c["microseconds"] is not None]
        assert [c["algorithm"] for c in result["candidates"]] == ALGORITHMS
        fastest = min(timed, key=lambda c: c["microseconds"])
        assert result["algorithm"] == fastest["algorithm"]
        assert result["microseconds"] == fastest["microseconds"]


def test_the_arena_grows_for_chosen_algorithms_only():
    # im2col_gemm needs 4 * 9 * 40 * 40 * 64 bytes here, more than earlier tests grew the arena to
    x, w = torch.randn(1, 64, 40, 40), torch.randn(8, 64, 3, 3)
    before = _C.workspace_stats(CPU)["bytes"]
    result = _C.tune_conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    im2col = next(c for c in result["candidates"] if c["algorithm"] == "im2col_gemm")
    assert im2col["workspace_bytes"] > before and im2col["microseconds"] is not None  # timed, on scratch
    assert _C.workspace_stats(CPU)["bytes"] == before  # tuning alone grows nothing
    torch.ops.shapecache.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    assert _C.workspace_stats(CPU)["bytes"] == max(before, result["workspace_bytes"])


def test_leases_are_counted_per_thread_so_a_capture_knows_whether_its_kernels_took_the_arena():
    # What a CUDA graph capture reads (cuda_graph_runner.cpp): a graph whose kernels never
    # took the arena's buffer stays valid when the arena grows.
    x, w = torch.randn(1, 8, 12, 12), torch.randn(4, 8, 3, 3)

    def leases_around(run):
        before = _C._testing.workspace_leases_on_this_thread()
        run()
        return _C._testing.workspace_leases_on_this_thread() - before

    def im2col():
        _C._testing.conv2d_algorithm("im2col_gemm", x, w, None, [1, 1], [1, 1], [1, 1], 1)

    assert leases_around(im2col) == 1
    assert leases_around(lambda: F.conv2d(x, w, padding=1)) == 0  # no tuned convolution
    other = threading.Thread(target=im2col)
    assert leases_around(lambda: (other.start(), other.join())) == 0  # another thread's lease


@pytest.fixture
def workspace_cap():
    before = _C.workspace_stats(CPU)["cap"]
    yield lambda cap: _C.set_workspace_cap(CPU, cap)
    _C.set_workspace_cap(CPU, before)


def test_a_workspace_above_the_cap_is_never_chosen(workspace_cap):
    workspace_cap(0)
    result = _C.tune_conv2d(*make(PROBLEMS[0], torch.float32, False))
    im2col = next(c for c in result["candidates"] if c["algorithm"] == "im2col_gemm")
    assert im2col["skipped"] == "workspace above the cap" and im2col["microseconds"] is None
    assert result["algorithm"] != "im2col_gemm" and result["workspace_bytes"] == 0


def test_the_arena_only_grows_within_its_cap(workspace_cap):
    def run_needing(extra_bytes):
        # A 1x1 convolution of one channel over a 1 x W image: im2col needs exactly 4 * W bytes.
        width = (start + extra_bytes) // 4
        x, w = torch.randn(1, 1, 1, width), torch.randn(2, 1, 1, 1)
        out = _C._testing.conv2d_algorithm("im2col_gemm", x, w, None, [1, 1], [0, 0], [1, 1], 1)
        torch.testing.assert_close(out, F.conv2d(x, w), rtol=1e-5, atol=1e-5)
        return _C.workspace_stats(CPU)

    start = _C.workspace_stats(CPU)["bytes"]
    cap = start + 200_000
    workspace_cap(cap)
    generation = _C.workspace_stats(CPU)["generation"]
    steps = [run_needing(extra) for extra in (40_000, 10_000, 120_000, 80_000, 200_000, 400_000)]
    assert [s["bytes"] for s in steps] == [start + 40_000] * 2 + [start + 120_000] * 2 + [cap] * 2
    # growth (and only growth) bumps the generation; above the cap ATen's path ran instead
    assert [s["generation"] - generation for s in steps] == [1, 1, 2, 2, 3, 3]
