"""Frozen graphs shared as packages through the shared directory
(the package store, shapecache/_backends/package_store.py): a process that traces a program
another process compiled loads that package instead of compiling it, and never one built from
other weights."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import zipfile

import pytest
import torch

import shapecache as sc
from shapecache import _background
from shapecache._backends import compile_process, package_store, package_trust
from shapecache._backends.disk_cache import disk_cache_counts, disk_cache_state

pytestmark = pytest.mark.slow

FROZEN = {"options": {"freezing": True}}


def conv_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 32, 3, padding=1), torch.nn.GroupNorm(8, 32), torch.nn.SiLU(),
                               torch.nn.Conv2d(32, 4, 3, padding=1)).eval()


def published(timeout: float) -> bool:
    """Waits until no publication is waiting or running in this process (of any cached function:
    ``sc.wait`` waits for one's)."""
    deadline = time.monotonic() + timeout
    while _background._publishing and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _background._publishing


def loaded_count() -> int:
    """The packages this process loaded from the shared directory."""
    return disk_cache_counts()[3]


@pytest.fixture
def shared(monkeypatch, tmp_path):
    """A shared directory for this test, and no publication left at its end."""
    monkeypatch.setenv("SHAPECACHE_SHARED_DIR", str(tmp_path / "shared"))
    yield tmp_path / "shared" / "packages"
    assert published(300)


def packages(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("*.pt2")) if directory.is_dir() else []


def a_key(net, x, options=FROZEN["options"]) -> str:
    with torch.no_grad():
        program = torch.export.export(net, (x,), strict=False)
    saved = compile_process.save(program)
    try:
        return package_store.key(saved, options)
    finally:
        import shutil

        shutil.rmtree(saved)


def test_the_key_is_the_program_and_its_weights_not_the_call_that_traced_it():
    net = conv_net()
    x = torch.randn(1, 4, 8, 8)
    key = a_key(net, x)
    assert a_key(net, torch.randn(1, 4, 8, 8)) == key  # other inputs of the same shape: the same program
    assert a_key(conv_net(), x) == key  # the same weights in another module
    assert a_key(net, torch.randn(1, 4, 8, 12)) != key  # another shape
    assert a_key(conv_net(seed=1), x) != key  # other weights
    assert a_key(net, x, {**FROZEN["options"], "cpp.weight_prepack": False}) != key  # other options
    changed = conv_net()
    with torch.no_grad():
        changed[3].bias[0] += 1e-3  # one number of one weight
    assert a_key(changed, x) != key


def test_a_second_process_loads_the_package_the_first_published_and_compiles_nothing(shared, tmp_path):
    net = conv_net()
    x = torch.randn(1, 4, 12, 12)
    with torch.no_grad():
        expected = net(x)
        cached = sc.cached(net, backend="compile", compile_options=FROZEN)
        torch.testing.assert_close(cached(x), expected, rtol=1e-5, atol=1e-5)
    assert sc.stats(cached)["builds"] == 1
    # The inline build's package is the entry: in the directory as the call returns, nothing left
    # to compile later
    assert len(packages(shared)) == 1 and not _background._publishing  # the model's graph, not the warm-up's
    torch.save({"x": x, "expected": expected}, tmp_path / "call.pt")
    script = textwrap.dedent(f"""
        import torch
        import shapecache as sc
        from shapecache._backends import disk_cache_counts, disk_cache_state
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(4, 32, 3, padding=1), torch.nn.GroupNorm(8, 32), torch.nn.SiLU(),
                                  torch.nn.Conv2d(32, 4, 3, padding=1)).eval()
        call = torch.load({str(tmp_path / "call.pt")!r})
        cached = sc.cached(net, backend="compile", compile_options={FROZEN!r})
        before = disk_cache_counts()
        with torch.no_grad():
            out = cached(call["x"])
            torch.testing.assert_close(out, call["expected"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cached(call["x"]), call["expected"], rtol=1e-5, atol=1e-5)  # the hit
        from torch._dynamo.utils import counters
        print(disk_cache_state(before), sc.stats(cached)["hits"], sum(counters["inductor"].values()))
    """)
    env = {**os.environ, "SHAPECACHE_SHARED_DIR": str(shared.parent), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    state, hits, inductor_events = done.stdout.strip().splitlines()[-1].rsplit(" ", 2)
    assert state == "shared package, not traced"  # the call index named it (test_call_index.py)
    assert hits == "1"
    assert inductor_events == "0"  # nothing compiled: no FX graph cache hit, miss or bypass
    assert len(packages(shared)) == 1  # nothing published again


def test_weights_changed_in_place_make_another_key_and_the_answer_stays_the_models(shared):
    net = conv_net()
    x = torch.randn(1, 4, 12, 12)
    with torch.no_grad():
        cached = sc.cached(net, backend="compile", compile_options=FROZEN)
        cached(x)
        assert sc.wait(cached, 300)
        first = packages(shared)
        loaded = loaded_count()
        net.load_state_dict(conv_net(seed=1).state_dict())  # the entry goes stale; its package is of the old weights
        torch.testing.assert_close(cached(x), conv_net(seed=1)(x), rtol=1e-5, atol=1e-5)
        assert loaded_count() == loaded  # compiled again, not read from the old weights' package
        assert sc.wait(cached, 300)
        assert len(packages(shared)) == 2 and set(first) < set(packages(shared))
        net.load_state_dict(conv_net(seed=0).state_dict())  # back to the first weights: their package serves
        torch.testing.assert_close(cached(x), conv_net(seed=0)(x), rtol=1e-5, atol=1e-5)
        assert loaded_count() == loaded + 1


def test_a_package_that_does_not_load_costs_a_warning_and_is_compiled_and_replaced(shared, caplog):
    x = torch.randn(1, 4, 12, 12)
    with torch.no_grad():
        sc.cached(conv_net(), backend="compile", compile_options=FROZEN)(x)
    assert published(300)
    [name] = packages(shared)
    # A sealed package of its key whose library does not load here (another host's C++ runtime)
    unloadable = shared.parent / "unloadable.pt2"
    with zipfile.ZipFile(unloadable, "w") as archive:
        archive.writestr("p/data/aotinductor/model/w_metadata.json",
                         json.dumps({"shapecache_key": name.removesuffix(".pt2")}))
        archive.writestr("p/data/aotinductor/model/w.wrapper.so", b"\x7fELF cut short")
    with open(unloadable, "r+b") as f:
        package_trust.seal(f, None)
    os.replace(unloadable, shared / name)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="shapecache"):
        loaded = loaded_count()
        cached = sc.cached(conv_net(), backend="compile", compile_options=FROZEN)
        torch.testing.assert_close(cached(x), conv_net()(x), rtol=1e-5, atol=1e-5)
        assert sc.stats(cached)["builds"] == 1
        assert loaded_count() == loaded
    assert any("does not load" in r.getMessage() and name in r.getMessage() for r in caplog.records)
    assert published(300)
    with zipfile.ZipFile(shared / name) as archive:  # replaced by a whole package
        assert any(n.endswith(".so") for n in archive.namelist())


def served_by_a_new_cache(x, caplog, seed=0):
    """A new cache of a new conv_net(seed) serves `x`: (its answer's max difference from the
    model's, whether it loaded a package, the warnings logged)."""
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="shapecache"):
        caplog.clear()
        loaded = loaded_count()
        net = conv_net(seed)
        expected = conv_net(seed)(x)
        cached = sc.cached(net, backend="compile", compile_options=FROZEN)
        try:
            difference = (cached(x) - expected).abs().max().item()
            assert sc.wait(cached, 300)  # (its package, published over the one that failed)
        finally:
            sc.uncached(net)
    return difference, loaded_count() > loaded, [r.getMessage() for r in caplog.records]


def test_a_package_is_loaded_only_where_it_is_this_users_own_and_was_built_for_its_key(shared, caplog, tmp_path):
    # A package's library runs its code in the process that loads it, and its constants answer
    # for the model: only a regular file of this user's that no one else may write, with no
    # other name, whose metadata names this key, is loaded. Anything else is compiled here (the
    # answer is the model's) and published in its place.
    x = torch.randn(1, 4, 12, 12)
    assert served_by_a_new_cache(x, caplog, seed=0)[:2] == (pytest.approx(0, abs=1e-5), False)
    [name] = packages(shared)
    package, key = shared / name, name.removesuffix(".pt2")
    served_by_a_new_cache(x, caplog, seed=1)
    [other] = [shared / n for n in packages(shared) if n != name]
    own = package.read_bytes()
    store = package_store.PackageStore(shared)

    def refused(because: str) -> None:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shapecache"):
            assert store.lookup(key) is None
        assert any(because in r.getMessage() and name in r.getMessage() for r in caplog.records), caplog.text

    package.chmod(0o666)
    refused("is not loaded: users other than its owner may write it (mode 666)")
    package.chmod(0o600)
    (tmp_path / "elsewhere.pt2").write_bytes(own)
    package.unlink()
    package.symlink_to(tmp_path / "elsewhere.pt2")
    refused("cannot be read")
    package.unlink()
    package.mkdir()  # a directory under the package's name
    refused("is not loaded: it is not a regular file")
    package.rmdir()
    os.link(other, package)  # another package of this user's, under this key's name too
    refused("it has 2 names (hard links)")
    package.unlink()
    package.write_bytes(own)
    if os.getuid() == 0:  # a file of another user's (only root can give one away)
        os.chown(package, 12345, -1)
        refused("it belongs to user id 12345")
        os.chown(package, 0, -1)
    assert store.lookup(key) is not None  # its own package, as published
    # Model 1's package in model 0's place (a misplaced file, a tool that renamed it): the key
    # is right, the weights are not. Model 0's answer is its own, and its package is put back.
    # Its own package with its weights zeroed in place, the archive otherwise whole.
    zeroed = tmp_path / "zeroed.pt2"
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(zeroed, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            target.writestr(info, bytes(len(data)) if info.filename.endswith("_weights.blob") else data)
        target.comment = source.comment
    package.write_bytes(zeroed.read_bytes())
    refused("its bytes are not those it was sealed with (changed or damaged since it was published)")
    package.write_bytes(own)
    # A directory another user may write: nothing in it is loaded, nor published to it.
    shared.chmod(0o775)
    refused_directory = "are not loaded: users other than its owner may write the directory (mode 775"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shapecache"):
        assert store.lookup(key) is None
        assert package_store.PackageStore(shared).lookup(key) is None  # warned of once
    assert [r.getMessage() for r in caplog.records if refused_directory in r.getMessage()] != []
    assert len(caplog.records) == 1, caplog.text
    shared.chmod(0o755)
    # Model 1's package in model 0's place (a misplaced file, a tool that renamed it): the key
    # is right, the weights are not. Model 0's answer is its own, and its package is put back.
    package.write_bytes(other.read_bytes())
    difference, loaded, logged = served_by_a_new_cache(x, caplog, seed=0)
    assert difference < 1e-5 and not loaded
    assert any("it was built for another program or other weights (its metadata names another key)" in m
               for m in logged), logged
    assert package.read_bytes() != other.read_bytes() and package.stat().st_mode & 0o777 == 0o600
    assert served_by_a_new_cache(x, caplog, seed=0)[:2] == (pytest.approx(0, abs=1e-5), True)  # and read from now on


def test_with_a_deployment_secret_a_package_is_loaded_only_when_sealed_under_it(shared, caplog, tmp_path,
                                                                                monkeypatch):
    # Where the operator shares the directory between users on purpose: the owner and mode
    # checks give way to a seal under the deployment's secret, and nothing else is loaded.
    x = torch.randn(1, 4, 12, 12)
    secret = tmp_path / "secret"
    secret.write_bytes(b"a deployment's secret, 32 bytes.")
    secret.chmod(0o600)
    monkeypatch.setenv("SHAPECACHE_SHARED_SECRET_FILE", str(secret))
    assert served_by_a_new_cache(x, caplog)[:2] == (pytest.approx(0, abs=1e-5), False)
    [name] = packages(shared)
    package, key = shared / name, name.removesuffix(".pt2")
    shared.chmod(0o777)
    package.chmod(0o666)
    assert package_store.PackageStore(shared).lookup(key) is not None

    def refused(because: str) -> None:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shapecache"):
            assert package_store.PackageStore(shared).lookup(key) is None
        assert any(because in r.getMessage() and name in r.getMessage() for r in caplog.records), caplog.text

    other = tmp_path / "other"
    other.write_bytes(b"another deployment's secret here")
    other.chmod(0o400)
    monkeypatch.setenv("SHAPECACHE_SHARED_SECRET_FILE", str(other))
    refused("its bytes are not those it was sealed with")
    monkeypatch.delenv("SHAPECACHE_SHARED_SECRET_FILE")
    shared.chmod(0o755)
    package.chmod(0o600)
    refused("it is sealed with a secret this process is not given")
    digest_sealed = package.read_bytes()[:-package_trust.SEAL_BYTES] + b"x" * package_trust.SEAL_BYTES
    package.write_bytes(digest_sealed)
    monkeypatch.setenv("SHAPECACHE_SHARED_SECRET_FILE", str(secret))
    refused("it carries no seal")
    secret.chmod(0o640)  # a secret others can read proves nothing: nothing is shared
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shapecache"):
        store = package_store.PackageStore.from_environment()
        with pytest.raises(package_store.Bypass, match=r"may be read or written by users other than its owner "
                                                       r"\(mode 640\); expected mode 600 or 400"):
            store.key(None, {})


def test_a_build_compiled_in_the_serving_process_is_published_later(shared, monkeypatch):
    # SHAPECACHE_BACKGROUND_COMPILER=thread: a background build compiles in this process, and a
    # worker compiles its package in the compiler's process afterwards, to share it. (A build
    # in the compiler's process, inline or in the background, shares the package it made.)
    monkeypatch.setenv("SHAPECACHE_BACKGROUND_COMPILER", "thread")
    net = conv_net()
    x = torch.randn(1, 4, 12, 12)
    with torch.no_grad():
        before = disk_cache_counts()
        cached = sc.cached(net, backend="compile", build="background", compile_options=FROZEN)
        cached(x)
        assert sc.wait(cached, timeout=300)  # its build, then its publication
        assert disk_cache_state(before) in ("not cached", "cold", "warm")  # compiled here by inductor
        assert len(packages(shared)) == 1
        torch.testing.assert_close(cached(x), conv_net()(x), rtol=1e-5, atol=1e-5)
    assert sc.stats(cached)["hits"] == 1


def test_publishers_of_one_key_leave_one_whole_file_their_owners_alone(shared, tmp_path):
    # ... and the copies a publisher killed mid-copy left over an hour ago are removed.
    shared.mkdir(parents=True)
    (shared / ".k.abandoned.tmp").write_bytes(b"half a package")
    os.utime(shared / ".k.abandoned.tmp", (time.time() - 7200, time.time() - 7200))
    (shared / ".k.copying.tmp").write_bytes(b"another process's copy in progress")
    made = []
    for i in range(4):
        package = tmp_path / f"package{i}.pt2"
        with zipfile.ZipFile(package, "w") as archive:
            archive.writestr("member", bytes([i]) * (4 << 20))
        made.append(package)
    threads = [threading.Thread(target=package_store.copy_in, args=("k", str(p), shared)) for p in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    content = (shared / "k.pt2").read_bytes()
    assert content[:-package_trust.SEAL_BYTES - 2] in {p.read_bytes()[:-2] for p in made}  # one whole, sealed
    with open(shared / "k.pt2", "rb") as f:
        assert package_trust.unsealed(f, None) is None
    assert sorted(os.listdir(shared)) == [".k.copying.tmp", "k.pt2"]  # none of theirs left, the abandoned one gone
    assert oct((shared / "k.pt2").stat().st_mode & 0o777) == "0o600"  # it holds a copy of the weights


def test_without_a_shared_directory_nothing_is_published(monkeypatch, tmp_path):
    monkeypatch.delenv("SHAPECACHE_SHARED_DIR", raising=False)
    net = conv_net()
    x = torch.randn(1, 4, 12, 12)
    with torch.no_grad():
        cached = sc.cached(net, backend="compile", compile_options=FROZEN)
        cached(x)
    assert package_store.PackageStore.from_environment() is None
    assert not _background._publishing  # nothing handed to the workers to publish


KEY_SCRIPT = """
import sys, shutil, torch
sys.path.insert(0, sys.argv[1])
from tracedmodel import Net
from shapecache import _background
from shapecache._backends import compile_process, package_store
from shapecache._backends.disk_cache import disk_cache_counts
torch.manual_seed(0)
net = Net().eval()
with torch.no_grad():
    program = torch.export.export(net, (torch.randn(1, 4, 8, 8),), strict=False)
saved = compile_process.save(program)
print(package_store.key(saved, {"freezing": True}))
shutil.rmtree(saved)
"""


def test_the_key_does_not_depend_on_where_the_models_code_is_installed(tmp_path):
    # The serialized graph names the source file of every node (its stack trace): replicas
    # whose code sits in other places (a Ray runtime_env, another node) trace the same program.
    keys = []
    for place in ("a", "b/deeper"):
        folder = tmp_path / place
        folder.mkdir(parents=True)
        (folder / "tracedmodel.py").write_text(
            "import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)\n\n    def forward(self, x):\n"
            "        return torch.nn.functional.silu(self.conv(x))\n")
        done = subprocess.run([sys.executable, "-c", KEY_SCRIPT, str(folder)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        keys.append(done.stdout.split()[-1])
    assert keys[0] == keys[1]


def test_a_shared_directory_that_cannot_be_written_costs_a_warning_never_the_build(monkeypatch, tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "packages").write_text("a file where the packages' directory would be")
    monkeypatch.setenv("SHAPECACHE_SHARED_DIR", str(shared))
    x = torch.randn(1, 4, 12, 12)
    before = disk_cache_counts()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="shapecache"):
        cached = sc.cached(conv_net(), backend="compile", compile_options=FROZEN)
        torch.testing.assert_close(cached(x), conv_net()(x), rtol=1e-5, atol=1e-5)
        assert sc.wait(cached, 300)
        cached(x)
    assert sc.stats(cached)["builds"] == 1 and sc.stats(cached)["hits"] == 1
    assert any("could not be shared" in r.getMessage() for r in caplog.records)
    # nothing to share: compiled here by inductor, as fast as it can be, not as a package for none
    assert disk_cache_state(before) in ("not cached", "cold", "warm")
    # The next program is still published.
    monkeypatch.setenv("SHAPECACHE_SHARED_DIR", str(tmp_path / "writable"))
    with torch.no_grad():
        sc.cached(conv_net(), backend="compile", compile_options=FROZEN)(torch.randn(1, 4, 8, 8))
    assert published(300)
    assert len(packages(tmp_path / "writable" / "packages")) == 1


def test_a_graph_the_compilers_process_fails_is_not_compiled_there_again_for_the_calls_next_sizes(shared,
                                                                                                 monkeypatch):
    # Where packages are shared an inline build compiles in the compiler's process; a compile
    # that fails there for the graph at its first size (an operator AOTInductor cannot compile)
    # is warned of once, and the graph's next sizes compile here at once: not failed again,
    # each build paying for both, nor stored (their packages would fail as that one did).
    tried = []

    def failing(directory, options, settings=None):
        tried.append(directory)
        raise compile_process.Failed("error: 'aoti_torch_cpu_unknown_op' was not declared in this scope")

    monkeypatch.setattr(compile_process, "compile_saved", failing)
    plain = conv_net()  # (the cached module's own calls are cached)
    sizes = [torch.randn(1, 4, 8, 8), torch.randn(1, 4, 12, 12), torch.randn(1, 4, 16, 8)]
    with torch.no_grad():
        cached = sc.cached(conv_net(), backend="compile", compile_options=FROZEN)
        with pytest.warns(RuntimeWarning, match="this graph's later builds, at any size, compile in the serving process"):
            torch.testing.assert_close(cached(sizes[0]), plain(sizes[0]), rtol=1e-5, atol=1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            for x in sizes[1:]:
                torch.testing.assert_close(cached(x), plain(x), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(cached(x), plain(x), rtol=1e-5, atol=1e-5)
    stats = sc.stats(cached)
    assert len(tried) == 1 and stats["builds"] == 3 and stats["hits"] == 2
    assert [e["backend"] for e in stats["entries"]] == ["compile"] * 3
    assert packages(shared) == []
