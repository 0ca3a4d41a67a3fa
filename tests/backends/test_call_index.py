"""The call index (shapecache/_backends/call_index.py): a call whose package another process (or
cached object) published is served from it without a trace, where the model is in the state
that package was traced from, and traced as before where anything differs."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import shapecache as sc
from shapecache import _background
from shapecache._backends import call_index, disk_cache_counts, disk_cache_state, guards, package_store

pytestmark = pytest.mark.slow

FROZEN = {"options": {"freezing": True}}
MODEL = textwrap.dedent("""
    import torch

    SCALE = 1.0  # a global the forward reads


    class Net(torch.nn.Module):
        def __init__(self, seed=0):
            super().__init__()
            torch.manual_seed(seed)
            self.conv = torch.nn.Conv2d(4, 16, 3, padding=1)
            self.norm = torch.nn.GroupNorm(4, 16)
            self.out = torch.nn.Conv2d(16, 4, 3, padding=1)
            self.shift = 0.5  # an attribute the forward reads

        def forward(self, x):
            return self.out(torch.nn.functional.silu(self.norm(self.conv(x)))) * SCALE + self.shift
""")


X = (1, 4, 12, 12)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The model's module (importable by name here and in a child process), and a shared
    directory where its call at X's shape was built (in the background: the compiler's
    process makes the package) and indexed."""
    directory = tmp_path_factory.mktemp("indexed")
    (directory / "indexed_net.py").write_text(MODEL)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(directory))
        patch.setenv("PYTHONPATH", os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")]))
        patch.setenv("SHAPECACHE_SHARED_DIR", str(directory / "shared"))
        import indexed_net

        torch.manual_seed(0)
        x = torch.randn(X)
        first = sc.cached(indexed_net.Net(), backend="compile", compile_options=FROZEN, build="background")
        with torch.no_grad():
            first(x)
        assert sc.wait(first, timeout=300)
        yield indexed_net, x, directory / "shared" / "packages"
        sys.modules.pop("indexed_net", None)
        deadline = time.monotonic() + 300
        while _background._publishing and time.monotonic() < deadline:
            time.sleep(0.01)


def served(model, x) -> tuple[str | None, int]:
    """How a cached copy of `model` found its graph for `x` (disk_cache_state), and how many
    traces that took, once it answers as `model` does."""
    exports = []
    export = torch.export.export

    def counted(*args, **kwargs):
        exports.append(1)
        return export(*args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.export, "export", counted)
        plain = model(x)
        cached = sc.cached(model, backend="compile", compile_options=FROZEN, build="background")
        before = disk_cache_counts()
        cached(x)  # (uncached: the build is queued)
        assert sc.wait(cached, timeout=300)
        torch.testing.assert_close(cached(x), plain, rtol=1e-4, atol=1e-5)
        assert sc.stats(cached)["hits"] == 1
    return disk_cache_state(before), len(exports)


def records(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(call_index.SUFFIX))


def indexed(model, x) -> bool:
    """Whether the call index serves `model`'s call of `x` (as the compile backend asks it)."""
    store = package_store.PackageStore.from_environment()
    forward = type(model).forward
    sc.cached(model, backend="compile", compile_options=FROZEN)  # (it holds its cache, as every model indexed did)
    with torch.no_grad():
        return call_index.find(store, forward, (model, x), {}, (x,), {"self": model}, FROZEN) is not None


def test_a_model_in_the_state_traced_is_served_untraced_and_any_change_is_traced(published, caplog):
    net, x, directory = published
    assert len(records(directory)) == 1
    assert served(net.Net(), x) == ("shared package, not traced", 0)
    assert indexed(net.Net(), x)
    changed = net.Net()
    changed.shift = 0.25  # an attribute the forward reads
    assert not indexed(changed, x)
    other = net.Net()
    other.training = False  # one it does not read: the guard holds every attribute of a module run
    assert not indexed(other, x)
    assert not indexed(net.Net(seed=1), x)  # other weights
    net.SCALE = 2.0  # a global the forward reads
    try:
        assert not indexed(net.Net(), x)
    finally:
        net.SCALE = 1.0
    updated = net.Net()
    with torch.no_grad():
        updated.norm.weight.add_(1.0)  # in place: the same tensor, another version and other bytes
    assert served(updated, x) == ("compiled in the compiler's process", 1)  # traced and compiled: another program
    # One record a call: the last state traced wrote it. The first state is traced again (its
    # package found by its key), and serves untraced after.
    assert served(net.Net(), x) == ("shared package", 1)
    assert served(net.Net(), x) == ("shared package, not traced", 0)
    assert len(records(directory)) == 1

    [name] = records(directory)
    with open(directory / name, "r+b") as record:  # a byte changed after it was sealed
        record.seek(40)
        byte = record.read(1)
        record.seek(40)
        record.write(bytes([byte[0] ^ 1]))
    assert served(net.Net(), x) == ("shared package", 1)
    assert "is not read: its bytes are not those it was sealed with" in caplog.text


CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import shapecache as sc
    from shapecache._backends import disk_cache_counts, disk_cache_state
    import indexed_net

    model = indexed_net.Net()
    torch.manual_seed(0)
    x = torch.randn(*json.loads(sys.argv[1]))
    build = "background" if sys.argv[2] == "publish" else "inline"
    with torch.no_grad():
        plain = model(x)
        cached = sc.cached(model, backend="compile", compile_options={"options": {"freezing": True}}, build=build)
        before = disk_cache_counts()
        out = cached(x)
        assert sc.wait(cached, timeout=300)
        out = cached(x)
    # (torch imports export's tracer at a process's first trace)
    print(json.dumps({"state": disk_cache_state(before), "traced": "torch.export._trace" in sys.modules,
                      "max_diff": float((out - plain).abs().max())}))
""")


def test_with_a_deployment_secret_that_cannot_be_used_no_record_is_read(published, monkeypatch, tmp_path):
    # Owner-trusted records and packages are shared only where no secret is set: one that is
    # set but unusable (unreadable, too short, readable by others) shares nothing.
    net, x, directory = published
    assert indexed(net.Net(), x)
    monkeypatch.setenv("SHAPECACHE_SHARED_SECRET_FILE", str(tmp_path / "missing"))
    assert not indexed(net.Net(), x)


def test_another_process_serves_the_call_without_a_trace(tmp_path):
    (tmp_path / "indexed_net.py").write_text(MODEL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "SHAPECACHE_SHARED_DIR": str(tmp_path / "shared")}

    def run(role: str) -> dict:
        # (Two new processes: one of the test's would compile under what earlier tests set.)
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(X), role], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    published = run("publish")
    assert published["traced"] and published["max_diff"] < 1e-4
    read = run("read")
    assert (read["state"], read["traced"]) == ("shared package, not traced", False)
    assert read["max_diff"] < 1e-4


def test_what_cannot_be_compared_between_processes_is_not_indexed():
    class Opaque:  # an object the guard walks no deeper into: held by identity
        __slots__ = ("value",)

        def __init__(self):
            self.value = 1

    record = guards.GuardRecord()
    held = {"setting": Opaque()}
    record.dicts.append((held, "held", None))
    with pytest.raises(call_index.NotPortable, match="Opaque"):
        call_index.fingerprint(record)
    held["setting"] = (1, "a", None, torch.float16)
    before = call_index.fingerprint(record)
    assert call_index.fingerprint(record) == before
    held["setting"] = (1, "a", None, torch.float32)
    assert call_index.fingerprint(record) != before


def test_a_tensor_is_fingerprinted_by_its_bytes_once_per_version():
    weight = torch.arange(16.0).reshape(4, 4)
    record = guards.GuardRecord()
    record.tensors.append((weight, "weight", weight._version))
    first = call_index.fingerprint(record)
    assert call_index.fingerprint(record) == first
    weight[0, 0] = 1.0
    assert call_index.fingerprint(record) != first
    weight[0, 0] = 0.0
    assert call_index.fingerprint(record) == first  # the same bytes again, at another version
    weight.data = weight.data.t()  # the same storage, version and shape; the matrix transposed
    assert call_index.fingerprint(record) != first
    with torch.inference_mode():
        frozen = torch.zeros(4, 4)
    record.tensors[0] = (frozen, "weight", None)
    with pytest.raises(call_index.NotPortable, match="inference"):
        call_index.fingerprint(record)


class Config:  # a global class whose attribute a forward reads
    scale = 1.0


class Held:
    def __init__(self, scale):
        self.scale = scale


class Twice(torch.nn.Module):
    def forward(self, x):
        return x[..., :] * 2


class Variants(torch.nn.Module):
    """A model whose state each case below changes in one place."""

    settings = Held(2.0)  # a class attribute holding an object

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(6, 6)
        self.inner = Twice()
        self.extras = torch.nn.ModuleList([torch.nn.Identity()])
        self.extras[0].gain = 1.0  # an attribute of a module that never runs, nor is a child of one that does
        self.first, self.second = Held(1.0), Held(3.0)
        self.chosen = self.first
        self.table = {"a": 1.0, "b": 2.0}

    def forward(self, x, y):
        out = self.inner(self.linear(x) + y) * self.chosen.scale * type(self).settings.scale * Config.scale
        for value in self.table.values():
            out = out * 2 + value
        return out * self.extras[0].gain


def variant(change):
    model = Variants().eval()
    if change is not None:
        change(model)
    return model


def prepared(model, x, y):
    """The call index's name and record of `model`'s call, as a build that traces it makes them."""
    from shapecache._backends import trace

    function, args = Variants.forward, (model, x, y)
    roots = guards.call_roots(args, {}, True, ("x", "y"))
    tensors = (x, y)  # (the key's: one a position, aliased or not)
    with _background.build_lock(), trace.dropping_tracing_leftovers():
        traced = trace.trace_call(function, args, {}, tensors, roots, ("x", "y"), True)
        return call_index.prepare(traced, function, args, {}, {"freezing": True})


def patched_method(model):
    class Thrice(torch.nn.Module):
        def forward(self, x):
            return x[..., :] * 3

    model.inner.__class__ = Thrice


def weights_through_data(model):
    with torch.no_grad():
        model.linear.weight.data.copy_(model.linear.weight.data * 2)  # (no version bump)


def reordered_table(model):
    model.table = {"b": 2.0, "a": 1.0}


CHANGES = {
    "a method's code (with an ellipsis)": patched_method,
    "another object of the same class": lambda model: setattr(model, "chosen", model.second),
    "a class attribute's object": lambda model: setattr(type(model), "settings", Held(5.0)),
    "a global class's attribute": lambda model: setattr(Config, "scale", 4.0),
    "a dict's order": reordered_table,
    "a weight written through .data": weights_through_data,
    "an attribute of a module that never runs": lambda model: setattr(model.extras[0], "gain", 2.0),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_each_change_of_what_the_graph_was_traced_from_is_another_state(change, monkeypatch):
    monkeypatch.setattr(Config, "scale", 1.0)
    monkeypatch.setattr(Variants, "settings", Variants.settings)
    x, y = torch.randn(2, 6), torch.randn(2, 6)
    with torch.no_grad():
        name, record = prepared(variant(None), x, y)
        again = prepared(variant(None), x, y)
        assert again == (name, record)  # an equal model in an equal state: its call is served from the record
        changed = prepared(variant(CHANGES[change]), x, y)
    assert changed is None or changed[1]["guard"] != record["guard"] or changed[0] != name


def test_arguments_that_alias_are_another_call():
    x, y = torch.randn(2, 6), torch.randn(2, 6)
    with torch.no_grad():
        apart, aliased = prepared(variant(None), x, y), prepared(variant(None), x, x)
    assert apart[0] != aliased[0]
