"""CallModes (csrc/cache/call_modes.h): the grad, inference and autocast modes a CUDA graph is
recaptured under when another call rebuilds its device's pool. The same class runs on the CPU."""

import pytest
import torch

from shapecache._extension import _C


def test_a_recapture_runs_under_the_modes_recorded_at_build_whatever_the_triggering_calls_are():
    # The scope a CUDA graph's recapture runs in (csrc/cache/call_modes.h), exercised on the CPU:
    # modes recorded under no_grad and bfloat16 autocast come back inside `run` whatever the
    # calling thread has set, and the caller's come back after, also when the function raises.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        recorded = _C._testing.CallModes.of_this_thread("cpu")
    assert (recorded.grad, recorded.inference, recorded.autocast, recorded.autocast_dtype) == \
        (False, False, True, torch.bfloat16)
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def seen():
        out = linear(x)
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
                out.dtype, out.requires_grad)

    with torch.enable_grad():
        assert recorded.run(seen) == (False, False, True, torch.bfloat16, False)
        assert seen() == (True, False, False, torch.float32, True)  # the caller's own, back
        with torch.inference_mode():
            assert recorded.run(seen) == (False, False, True, torch.bfloat16, False)
            assert torch.is_inference_mode_enabled()
        with torch.autocast("cpu", dtype=torch.float16):
            with pytest.raises(ValueError, match="inside"):
                recorded.run(lambda: (_ for _ in ()).throw(ValueError("inside")))
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    with torch.inference_mode():
        inference = _C._testing.CallModes.of_this_thread("cpu")
    assert (inference.grad, inference.inference) == (False, True)
    assert inference.run(lambda: torch.is_inference_mode_enabled() and not torch.is_grad_enabled())
