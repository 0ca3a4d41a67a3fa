"""A trace on one thread leaves other threads' module calls alone (tracing_threads.py)."""

import threading

import torch

from shapecache._backends import tracing_threads


class WaitsWhileTraced(torch.nn.Module):
    def __init__(self, inside, leave):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.inside, self.leave = inside, leave

    def forward(self, x):
        self.inside.set()  # the tracer's patches are in place from here
        assert self.leave.wait(30)
        return self.linear(x)


def test_a_module_called_on_another_thread_during_a_trace_runs_as_itself():
    tracing_threads.install()
    inside, leave = threading.Event(), threading.Event()
    traced = []
    thread = threading.Thread(target=lambda: traced.append(torch.fx.symbolic_trace(WaitsWhileTraced(inside, leave))))
    thread.start()
    try:
        assert inside.wait(30)
        other = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
        x = torch.ones(1, 2)
        out = other(x)  # without the install: NameError, module is not installed as a submodule
        assert torch.equal(out, torch.relu(torch.nn.functional.linear(x, other[0].weight, other[0].bias)))
        assert isinstance(other[0].weight, torch.nn.Parameter)  # __getattr__ is the module's own here
    finally:
        leave.set()
        thread.join(30)
    # The trace itself still saw its submodule as a call of it, and the patches are gone after.
    assert [n.op for n in traced[0].graph.nodes] == ["placeholder", "call_module", "output"]
    assert torch.nn.Module.__call__ is torch.fx._symbolic_trace._orig_module_call
