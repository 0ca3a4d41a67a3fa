"""Background builds of frozen graphs on the CPU compile in a process of their own
(shapecache/_backends/compile_process.py): the serving process traces, a new process compiles
with AOTInductor, the serving process loads the package."""

import contextlib
import copy
import gc
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings

import pytest
import torch

import shapecache as sc

pytestmark = pytest.mark.slow

FROZEN = {"options": {"freezing": True}}


def conv_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 32, 3, padding=1), torch.nn.SiLU(),
                               torch.nn.Conv2d(32, 4, 3, padding=1)).eval()


def loaded_compiled_modules() -> int:
    """How many generated modules inductor has loaded in this process (an in-process compile
    loads its graph's wrapper there; a package loads none)."""
    from torch._inductor.codecache import PyCodeCache

    return len(PyCodeCache.modules)


@pytest.mark.parametrize("compiler", ["process", "thread"])
def test_a_frozen_background_build_compiles_where_it_is_told_and_answers_as_the_model(compiler, monkeypatch, tmp_path):
    from shapecache._backends import compile_process, package_extractions

    assert not compile_process.PROCESS.failed, compile_process.PROCESS.failed  # no earlier test ended the route here
    monkeypatch.setenv("SHAPECACHE_BACKGROUND_COMPILER", compiler)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the package is made and extracted
    monkeypatch.setattr(tempfile, "tempdir", None)
    # A module in the working directory named as one the compiler imports is never imported there.
    planted = tmp_path / "cwd"
    planted.mkdir()
    (planted / "json.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    monkeypatch.chdir(planted)
    net = conv_net()
    weights = sum(p.nbytes for p in net.parameters())
    x, y = torch.randn(1, 4, 12, 12), torch.randn(1, 4, 12, 12)
    with torch.no_grad():
        expected, expected_y = net(x), net(y)
        cached = sc.cached(net, backend="compile", build="background", compile_options=FROZEN)
        try:
            modules = loaded_compiled_modules()
            torch.testing.assert_close(cached(x), expected)  # the miss: the plain call
            assert sc.wait(cached, timeout=300)
            modules = loaded_compiled_modules() - modules
            hit = cached(x)
            torch.testing.assert_close(hit, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cached(y), expected_y, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hit, expected, rtol=1e-5, atol=1e-5)  # still valid after a later hit
            st = sc.stats(cached)
            # While the entry lives: its extracted library, but no second copy of its constants.
            extracted = sorted(p.name for p in tmp_path.glob("aotinductor_*/**/*") if p.is_file())
            # marked as shapecache's, which a later process sweeps if this one were killed now; and
            # a live entry whose directory another process removed answers on (package_extractions)
            ours = [package_extractions._holds_ours(d) for d in tmp_path.glob("aotinductor_*")]
            for directory in tmp_path.glob("aotinductor_*"):
                shutil.rmtree(directory)
            torch.testing.assert_close(cached(x), expected, rtol=1e-5, atol=1e-5)
        finally:
            sc.uncached(net)
        gc.collect()
    assert st["hits"] == 2 and st["background_builds"] == 1
    [entry] = st["entries"]
    assert entry["backend"] == "compile"
    # Charged its frozen weights: the package's constants, or the compiled module's tensors.
    assert entry["bytes"] >= 0.8 * weights, (entry["bytes"], weights)
    if compiler == "process":
        assert modules == 0  # compiled elsewhere: nothing of the compiler's loaded here
        assert any(name.endswith(".so") for name in extracted), extracted
        assert ours == [True]
        assert not any(name.endswith("_weights.blob") for name in extracted), extracted
    else:
        assert modules >= 1
    # The entry gone, neither the build's files nor the extracted package are left behind.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("shapecache-build-", "aotinductor_"))] == []
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("build", ["inline", "background", "background, shared directory"])
def test_a_build_compiles_under_the_inductor_configuration_of_the_call_that_asked_for_it(build, monkeypatch, tmp_path):
    # Differential: a custom graph pass set around the call (here one that doubles the output)
    # gives the answer torch.compile gives under it, inline, in the background (inductor keeps
    # a thread's settings in context variables: the worker runs each job in a copy of its
    # caller's context), and where packages would be shared (the pass is code: the build
    # stays in this process, and nothing is published).
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    ran = []

    class Doubles(CustomGraphPass):
        def __call__(self, graph):
            ran.append(threading.current_thread().name)
            output = next(node for node in graph.nodes if node.op == "output")
            result, *rest = output.args[0]
            with graph.inserting_before(output):
                doubled = graph.call_function(torch.ops.aten.mul.Tensor, (result, 2.0))
            output.args = ((doubled, *rest),)

        def uuid(self):
            return "shapecache-test-doubles-1"

    if build.endswith("shared directory"):
        monkeypatch.setenv("SHAPECACHE_SHARED_DIR", str(tmp_path / "shared"))
    net = conv_net()
    x = torch.randn(1, 4, 9, 9)
    with torch.no_grad():
        expected = 2 * net(x)
        with inductor_config.patch(post_grad_custom_post_pass=Doubles()):
            if build == "inline":
                torch.testing.assert_close(torch.compile(net)(x), expected, rtol=1e-5, atol=1e-5)  # the anchor
                ran.clear()
            cached = sc.cached(net, backend="compile", build=build.partition(",")[0], compile_options=FROZEN)
            cached(x)
        try:
            assert sc.wait(cached, timeout=300)
            torch.testing.assert_close(cached(x), expected, rtol=1e-5, atol=1e-5)
            assert [e["backend"] for e in sc.stats(cached)["entries"]] == ["compile"]
        finally:
            sc.uncached(net)
    assert ran, build
    if build != "inline":
        assert threading.current_thread().name not in ran  # in the worker, under the caller's setting
    assert inductor_config.post_grad_custom_post_pass is None  # and the caller's context is as it was
    assert not (tmp_path / "shared" / "packages").exists() or not list((tmp_path / "shared" / "packages").iterdir())


def test_without_a_shared_directory_an_inline_build_and_an_unfrozen_one_compile_in_the_serving_process():
    net = conv_net()
    x = torch.randn(1, 4, 10, 10)
    with torch.no_grad():
        for build, options in (("inline", FROZEN), ("background", {})):
            cached = sc.cached(net, backend="compile", build=build, compile_options=options)
            try:
                modules = loaded_compiled_modules()
                cached(x)
                assert sc.wait(cached, timeout=300)
                assert loaded_compiled_modules() > modules, build
                torch.testing.assert_close(cached(x), net(x), rtol=1e-5, atol=1e-5)
            finally:
                sc.uncached(net)


# An operator the serving process defines at run time: a new process cannot load a program
# that calls it, so the compile there fails and the build falls back to this process.
_library = torch.library.Library("shapecache_test_only", "DEF")
_library.define("scale(Tensor x) -> Tensor")
_library.impl("scale", lambda x: x * 2, "CompositeExplicitAutograd")
_library.impl("scale", lambda x: torch.empty_like(x), "Meta")


class UsesALocalOperator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return torch.ops.shapecache_test_only.scale(self.conv(x))


def test_a_compile_that_fails_in_its_process_is_compiled_here_with_a_warning():
    # An operator the compiler's process cannot load fails the call's graphs there: its later
    # builds compile here at once (test_shared_packages.py), and the route stays open for
    # other calls' builds.
    from shapecache._backends import compile_process

    torch.manual_seed(0)
    net = UsesALocalOperator().eval()
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        expected = net(x)
        cached = sc.cached(net, backend="compile", build="background", compile_options=FROZEN)
        try:
            with pytest.warns(RuntimeWarning, match=r"in a process of its own failed \(.*\); it and this graph's later builds, at "
                              r"any size, compile in the serving"):
                cached(x)
                assert sc.wait(cached, timeout=300)
            torch.testing.assert_close(cached(x), expected, rtol=1e-5, atol=1e-5)
            st = sc.stats(cached)
        finally:
            sc.uncached(net)
    assert st["hits"] == 1 and [e["backend"] for e in st["entries"]] == ["compile"]
    assert not compile_process.PROCESS.failed


STARTS_A_COMPILE = textwrap.dedent("""
    import atexit, sys, time
    compilers = []
    # Registered first, so run last: after shapecache's own exit handler.
    atexit.register(lambda: [print("compiler ended", process.wait(), flush=True) for process in compilers])
    import torch
    import shapecache as sc
    from shapecache import _background

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Conv2d(8, 8, 3, padding=1) for _ in range(6)]).eval()
    cached = sc.cached(net, backend="compile", build="background", compile_options={"options": {"freezing": True}})
    with torch.no_grad():
        cached(torch.randn(1, 8, 16, 16))
    deadline = time.monotonic() + 120
    while not _background._processes and time.monotonic() < deadline:  # the worker traces, then starts it
        time.sleep(0.01)
    compilers.extend(_background._processes)
    print(compilers[0].pid if compilers else -1, flush=True)
    time.sleep(float(sys.argv[1]))
""")


def gone(pid: int, within: float) -> bool:
    """Whether process `pid` ends within `within` seconds (a zombie has ended: an orphan's is
    reaped by whichever process adopted it, which in a container may be none)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes' states from /proc")
def test_the_compilers_process_ends_with_the_serving_process_at_exit_and_when_killed():
    # At exit the compile is stopped, not waited for; a serving process killed outright closes
    # the pipe the compiler's process watches, and it ends too. No process is left behind.
    environment = {**os.environ, "SHAPECACHE_BACKGROUND_COMPILER": "process"}
    exits = subprocess.Popen([sys.executable, "-c", STARTS_A_COMPILE, "0"], stdout=subprocess.PIPE, text=True,
                             env=environment)
    killed = subprocess.Popen([sys.executable, "-c", STARTS_A_COMPILE, "600"], stdout=subprocess.PIPE, text=True,
                              env=environment)
    try:
        compiler_of_exiting = int(exits.stdout.readline())
        compiler_of_killed = int(killed.stdout.readline())
        assert compiler_of_exiting > 0 and compiler_of_killed > 0  # each started a compiler's process
        killed.send_signal(signal.SIGKILL)
        assert exits.wait(timeout=120) == 0
        assert exits.stdout.read().split() == ["compiler", "ended", str(-signal.SIGKILL)]  # stopped, not waited for
        assert gone(compiler_of_exiting, within=30)
        assert gone(compiler_of_killed, within=30)
    finally:
        for process in (exits, killed):
            process.kill()
            process.wait()


def test_a_graph_that_updates_its_buffers_is_not_compiled_into_a_package_of_copies():
    # BatchNorm in training under no_grad updates its running statistics: a package would update
    # its own copies, the model's would stay. The model's statistics end as the plain calls leave them.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.BatchNorm2d(8)).train()
    reference = copy.deepcopy(net)
    inputs = [torch.randn(2, 4, 8, 8) for _ in range(4)]
    cached = sc.cached(net, backend="compile", build="background", compile_options=FROZEN)
    try:
        with torch.no_grad():
            for x in inputs:
                torch.testing.assert_close(cached(x), reference(x), rtol=1e-5, atol=1e-5)
                assert sc.wait(cached, timeout=300)
    finally:
        sc.uncached(net)
    torch.testing.assert_close(net[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(net[1].running_var, reference[1].running_var)
    assert net[1].num_batches_tracked == reference[1].num_batches_tracked == len(inputs)


def test_the_compilers_place_is_checked_when_a_background_cache_is_made(monkeypatch):
    monkeypatch.setenv("SHAPECACHE_BACKGROUND_COMPILER", "fork")
    with pytest.raises(ValueError, match=r"SHAPECACHE_BACKGROUND_COMPILER='fork': expected 'process' .* or 'thread'"):
        sc.cached(conv_net(), backend="compile", build="background")
    monkeypatch.setenv("SHAPECACHE_BACKGROUND_COMPILER", "process")
    for idle in ("soon", "0", "-5", "inf"):
        monkeypatch.setenv("SHAPECACHE_COMPILER_IDLE_S", idle)
        with pytest.raises(ValueError, match=rf"SHAPECACHE_COMPILER_IDLE_S='{idle}': expected a positive number of "
                                             r"seconds .* \(default 300\)"):
            sc.cached(conv_net(), backend="compile", build="background")
    net = conv_net()
    monkeypatch.delenv("SHAPECACHE_SHARED_DIR", raising=False)
    sc.cached(net, backend="compile")  # an inline cache compiles in the serving process: not read
    sc.uncached(net)
    # ... but where packages are shared, an inline build compiles its package there
    monkeypatch.setenv("SHAPECACHE_SHARED_DIR", "/nonexistent/shared")
    with pytest.raises(ValueError, match=r"SHAPECACHE_COMPILER_IDLE_S='inf'"):
        sc.cached(net, backend="compile")


def test_the_build_directories_of_processes_that_ended_are_removed_and_others_kept(monkeypatch, tmp_path):
    # A process killed mid-build (Ray stops a replica with SIGKILL) leaves its saved program
    # behind; the next process that saves one removes what processes no longer running left
    # over an hour ago.
    from shapecache._backends import compile_process

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(compile_process, "_swept", False)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = ended.stdout.strip()
    dead = tmp_path / f"shapecache-build-{gone}-abc"
    recent = tmp_path / f"shapecache-build-{gone}-def"  # dead here, or alive in another PID namespace
    alive = tmp_path / f"shapecache-build-{os.getppid()}-abc"
    other = tmp_path / "shapecache-build-abc-def"  # not named by a process
    for folder in (dead, recent, alive, other):
        folder.mkdir()
        (folder / "program.pt2").write_bytes(b"weights")
        if folder != recent:
            os.utime(folder, (time.time() - 7200, time.time() - 7200))
    with torch.no_grad():
        program = torch.export.export(conv_net(), (torch.randn(1, 4, 8, 8),), strict=False)
    saved = compile_process.save(program)
    assert os.path.basename(saved).startswith(f"shapecache-build-{os.getpid()}-")
    assert not dead.exists()
    assert recent.exists() and alive.exists() and other.exists() and os.path.exists(saved)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes' states from /proc")
@pytest.mark.parametrize("how", ["stopped", "past its deadline"])
def test_a_compiler_that_stays_stopped_or_runs_past_its_deadline_is_killed_and_its_graph_compiled_here(
        monkeypatch, how):
    # A compiler stopped by SIGSTOP (a frozen cgroup, a debugger) would never end its build:
    # after STOPPED_LIMIT_S it is killed, and the build compiles in the serving process. So is
    # one that runs past its deadline (here the user's ceiling: no compile is measured yet).
    from shapecache import _background
    from shapecache._backends import compile_process

    monkeypatch.setenv("SHAPECACHE_BACKGROUND_COMPILER", "process")
    monkeypatch.setattr(compile_process, "STOPPED_LIMIT_S", 2.0)
    if how == "stopped":
        why = r"it was stopped \(SIGSTOP.*\) for 2 s, and was killed"
    else:
        monkeypatch.setenv("SHAPECACHE_COMPILE_DEADLINE_S", "1.5")
        monkeypatch.setitem(compile_process._compiler, "slowest", 0.0)
        why = r"its compile ran 1.5 s, its deadline \(SHAPECACHE_COMPILE_DEADLINE_S or 8 times the slowest .*\), and " \
              r"was killed"
    net = conv_net()
    x = torch.randn(1, 4, 10, 10)
    with torch.no_grad():
        expected = net(x)
        cached = sc.cached(net, backend="compile", build="background", compile_options=FROZEN)
        try:
            with pytest.warns(RuntimeWarning, match=rf"gave no reply: {why}\); it compiles in the serving process"):
                cached(x)
                deadline = time.monotonic() + 120
                while not _background._processes and time.monotonic() < deadline:  # the worker traces, then starts it
                    time.sleep(0.01)
                [compiler] = list(_background._processes)
                if how == "stopped":
                    os.kill(compiler.pid, signal.SIGSTOP)
                assert sc.wait(cached, timeout=300)
            torch.testing.assert_close(cached(x), expected, rtol=1e-5, atol=1e-5)
            st = sc.stats(cached)
        finally:
            sc.uncached(net)
    assert compiler.returncode == -signal.SIGKILL
    assert st["hits"] == 1 and [e["backend"] for e in st["entries"]] == ["compile"]
    assert not compile_process.PROCESS.failed  # one build's failure: the route stays open
    if how != "stopped":  # a larger graph than those measured: the next deadline is longer
        assert compile_process._compiler["slowest"] == 1.5


def test_the_compilers_process_skips_the_users_site_directory_unless_this_process_imports_from_it(monkeypatch,
                                                                                                  tmp_path):
    # Its usercustomize would run in the compiler's process at start-up; where torch itself
    # is installed there (pip --user), the process needs it.
    import site

    from shapecache._backends import compile_process

    monkeypatch.setattr(site, "ENABLE_USER_SITE", True)
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(tmp_path / "user-site"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not p.startswith(str(tmp_path))])
    assert compile_process._without_user_site() == ["-s"]
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "user-site")])
    assert compile_process._without_user_site() == []
    monkeypatch.setattr(site, "ENABLE_USER_SITE", False)
    assert compile_process._without_user_site() == ["-s"]


def test_the_compilers_process_starts_with_only_the_environment_a_compile_reads(monkeypatch, tmp_path):
    from shapecache._backends import compile_process

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not for the compiler")
    monkeypatch.setenv("PYTHONSTARTUP", str(tmp_path / "startup.py"))
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "0")
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # inductor picks its vector ISA from it
    monkeypatch.setenv("AOT_INDUCTOR_DEBUG_COMPILE", "0")  # a default of AOTInductor's configuration
    compiler = compile_process.CompilerProcess(str(tmp_path))
    try:
        # Popen returns once the exec has begun; the kernel fills in the new program's
        # environment and arguments a moment later (they read empty until then).
        deadline = time.monotonic() + 30
        while True:
            with open(f"/proc/{compiler.process.pid}/environ", "rb") as f:
                names = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if item)
            with open(f"/proc/{compiler.process.pid}/cmdline", "rb") as f:
                arguments = f.read().split(b"\0")
            if names or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        compiler.end()
    assert b"AWS_SECRET_ACCESS_KEY" not in names and b"PYTHONSTARTUP" not in names
    assert names[b"TORCHINDUCTOR_MAX_AUTOTUNE"] == b"0" and names[b"CXX"] == b"g++"
    assert names[b"OMP_NUM_THREADS"] == b"1" and names[b"PATH"] == os.environ["PATH"].encode()
    assert names[b"ATEN_CPU_CAPABILITY"] == b"avx2" and names[b"AOT_INDUCTOR_DEBUG_COMPILE"] == b"0"
    assert names[b"TMPDIR"] == str(tmp_path).encode()  # where its precompiled headers stay between builds
    assert b"-P" in arguments


def test_a_compiles_deadline_follows_the_slowest_compile_measured_within_the_users_ceiling(monkeypatch):
    from shapecache._backends import compile_process

    monkeypatch.delenv("SHAPECACHE_COMPILE_DEADLINE_S", raising=False)
    monkeypatch.setitem(compile_process._compiler, "slowest", 0.0)
    assert compile_process.deadline_seconds() == 3600  # none measured: the ceiling
    monkeypatch.setitem(compile_process._compiler, "slowest", 5.0)
    assert compile_process.deadline_seconds() == 300  # the floor
    monkeypatch.setitem(compile_process._compiler, "slowest", 100.0)
    assert compile_process.deadline_seconds() == 800
    monkeypatch.setenv("SHAPECACHE_COMPILE_DEADLINE_S", "600")
    assert compile_process.deadline_seconds() == 600
    for value in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("SHAPECACHE_COMPILE_DEADLINE_S", value)
        with pytest.raises(ValueError, match=rf"SHAPECACHE_COMPILE_DEADLINE_S='{value}': expected a positive number "
                                             r"of seconds a compile in the compiler's process may take \(default 3600\)"):
            sc.cached(conv_net(), backend="compile", build="background")


class MakesAFactoryTensor(torch.nn.Module):
    """Its graph makes a tensor of the default dtype: 1.0 in float64, 0.0 in float32 (and its
    output is of the default dtype)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x) + (torch.full((x.shape[-1],), 16777217.0) - 16777216.0)


def test_the_compilers_process_compiles_under_the_serving_processs_default_dtype(monkeypatch):
    monkeypatch.setenv("SHAPECACHE_BACKGROUND_COMPILER", "process")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        net = MakesAFactoryTensor().float().eval()  # float32 weights (freezing packs no float64 convolution)
        x = torch.randn(1, 4, 8, 8, dtype=torch.float32)
        with torch.no_grad():
            expected = net(x)
            cached = sc.cached(net, backend="compile", build="background", compile_options=FROZEN)
            try:
                cached(x)
                assert sc.wait(cached, timeout=300)
                got = cached(x)
                st = sc.stats(cached)
            finally:
                sc.uncached(net)
    finally:
        torch.set_default_dtype(previous)
    assert st["hits"] == 1 and st["fallbacks"] == 0 and [e["backend"] for e in st["entries"]] == ["compile"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # float64, and 1.0 added (float32: 0.0)


def compiler():
    """This process's compiler process (compile_process.CompilerProcess), or None."""
    from shapecache._backends import compile_process

    return compile_process._compiler["process"]


@pytest.fixture
def no_compiler_running():
    """No compiler process runs when the test starts (an earlier test's, kept warm, is ended)."""
    if (running := compiler()) is not None:
        from shapecache._backends import compile_process

        compile_process._compiler["process"] = None
        running.end()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes' states from /proc")
def test_the_compilers_process_takes_every_later_build_is_started_anew_when_it_crashes_and_ends_idle(
        monkeypatch, no_compiler_running):
    # One process for the builds: the second build starts none. Crashed during a build
    # (SIGSEGV), the build is sent to a new one, which builds it: no warning, nothing compiled
    # here. Idle for its time, it ends (the next build then starts another, as after any end).
    # Each one started reuses the directory of the first (its compiles are warm).
    monkeypatch.setenv("SHAPECACHE_BACKGROUND_COMPILER", "process")
    net = conv_net()
    plain = copy.deepcopy(net)  # net itself is cached in place
    pids, compiler_bytes = [], []
    with torch.no_grad(), warnings_recorded() as caught:
        cached = sc.cached(net, backend="compile", build="background", compile_options=FROZEN)
        try:
            modules = loaded_compiled_modules()
            for size in (8, 10, 12):
                x = torch.randn(1, 4, size, size)
                cached(x)  # the miss: the plain call, and the build queued
                if size == 12:
                    monkeypatch.setenv("SHAPECACHE_COMPILER_IDLE_S", "3")  # read by the next process started
                    running = compiler()
                    deadline = time.monotonic() + 120
                    while running.builds < 2 and time.monotonic() < deadline:  # its request was sent
                        time.sleep(0.002)
                    os.kill(running.process.pid, signal.SIGSEGV)
                assert sc.wait(cached, timeout=300)
                pids.append(compiler().process.pid)
                compiler_bytes.append(sc.stats(cached)["compiler_bytes"])
                torch.testing.assert_close(cached(x), plain(x), rtol=1e-5, atol=1e-5)
            modules = loaded_compiled_modules() - modules
            assert gone(pids[-1], within=60)  # 3 s without a build
            st = sc.stats(cached)
            idle = compiler()
        finally:
            sc.uncached(net)
    assert pids[0] == pids[1] != pids[2], pids
    assert st["background_builds"] == 3 and st["hits"] == 3 and st["fallbacks"] == 0
    assert [e["backend"] for e in st["entries"]] == ["compile"] * 3
    assert modules == 0 and not [str(w.message) for w in caught if "shapecache" in str(w.message)]
    assert min(compiler_bytes) > 64 << 20, compiler_bytes  # torch and inductor imported there
    assert st["compiler_bytes"] == 0
    # Its directory (inductor's cache, the precompiled headers) stays for the next one, private.
    assert os.stat(idle.directory).st_mode & 0o777 == 0o700 and any(os.scandir(idle.directory))
    # What each build wrote to inductor's cache there went with it (the package holds it): the
    # directory does not grow with the builds of a long-lived server.
    left = [str(p) for p in pathlib.Path(idle.directory).rglob("*") if p.suffix in (".so", ".cpp", ".o", ".blob")]
    assert left == [], left


@contextlib.contextmanager
def warnings_recorded():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_a_compile_asked_at_a_higher_priority_never_runs_in_a_compiler_started_at_a_lower_one(monkeypatch):
    # A background build's worker starts the compiler's process at its lower priority, which an
    # unprivileged process cannot raise again; an inline build's request, which waits on the
    # compile, gets a process at its own thread's priority. (Here the process is a stand-in
    # that answers each request at once: what is tested is which process takes it.)
    from shapecache import _background
    from shapecache._backends import compile_process

    started = []

    class Answering:
        def __init__(self, directory):
            self.niceness, self.builds, self.gave_up, self.ended_ = compile_process.thread_niceness(), 0, "", False
            started.append(self)

        def running(self):
            return not self.ended_

        def request(self, deadline_s, **request):
            self.builds += 1
            return {"id": self.builds}

        def end(self):
            self.ended_ = True

        ended = end

    monkeypatch.setattr(compile_process, "CompilerProcess", Answering)
    monkeypatch.setitem(compile_process._compiler, "process", None)
    settings = compile_process.CompileSettings.of_this_thread()

    def background_build():
        _background.lower_priority()
        compile_process._run_compiler("saved", "package", {}, settings)

    worker = threading.Thread(target=background_build)
    worker.start()
    worker.join(60)
    here = compile_process.thread_niceness()
    [low] = started
    if here is None or low.niceness is None or low.niceness <= here:
        pytest.skip("thread priorities cannot be lowered here")
    compile_process._run_compiler("saved", "package", {}, settings)  # an inline build's
    assert len(started) == 2 and low.ended_ and started[1].niceness == here
    worker = threading.Thread(target=background_build)
    worker.start()
    worker.join(60)
    assert len(started) == 2 and started[1].builds == 2  # a lower-priority build takes the one that runs
    compile_process._compiler["process"] = None


def test_a_compile_failed_by_the_machine_is_transient_and_one_failed_by_the_graph_lasting(monkeypatch):
    # What the compiler's process replies for a failed compile decides whether the graph's later
    # builds try the process again (compilers.Route.failures): the C++ compiler killed by the
    # out-of-memory killer, a full disk or no memory say nothing of the graph.
    from shapecache._backends import compile_process

    class CompileError(Exception):
        pass

    def raised(error):
        try:
            raise error
        except Exception as caught:  # noqa: BLE001 - the traceback's text is what is read
            return caught

    killed = raised(CompileError("C++ compile error\n\ng++: fatal error: Killed signal terminated program cc1plus"))
    try:  # the compiler's driver itself killed: only the cause says so
        try:
            raise subprocess.CalledProcessError(-9, ["g++"], output=b"")
        except subprocess.CalledProcessError as cause:
            raise CompileError("C++ compile error") from cause
    except CompileError as error:
        assert compile_process.machines_failure(error)
    assert compile_process.machines_failure(killed)
    assert compile_process.machines_failure(raised(OSError(28, "No space left on device")))
    assert compile_process.machines_failure(raised(MemoryError()))
    assert not compile_process.machines_failure(raised(CompileError("error: 'x' was not declared in this scope")))
    assert not compile_process.machines_failure(raised(FileNotFoundError(2, "No such file", "program.pt2")))

    replies = []

    class Replying:
        def __init__(self, directory):
            self.niceness, self.builds, self.gave_up = compile_process.thread_niceness(), 0, ""
            self.ran_past_deadline = False

        def running(self):
            return True

        def request(self, deadline_s, **request):
            self.builds += 1
            reply = replies.pop(0)
            if reply == "deadline":  # killed at its deadline, as CompilerProcess.request does
                self.gave_up, self.ran_past_deadline = f"its compile ran {deadline_s:g} s", True
                return None
            return reply

        def end(self):
            pass

        ended = end

    monkeypatch.setattr(compile_process, "CompilerProcess", Replying)
    monkeypatch.setitem(compile_process._compiler, "process", None)
    settings = compile_process.CompileSettings.of_this_thread()
    replies.extend([{"id": 1, "error": "g++: fatal error: Killed signal", "transient": True},
                    {"id": 2, "error": "error: 'x' was not declared", "transient": False}])
    with pytest.raises(compile_process.Transient):
        compile_process._run_compiler("saved", "package", {}, settings)
    with pytest.raises(compile_process.Failed) as lasting:
        compile_process._run_compiler("saved", "package", {}, settings)
    assert not isinstance(lasting.value, compile_process.Transient)

    # Killed at its deadline: transient (a cold start, a starved machine), and the next build
    # gets a longer deadline.
    monkeypatch.setenv("SHAPECACHE_COMPILE_DEADLINE_S", "1000")
    monkeypatch.setitem(compile_process._compiler, "slowest", 10.0)  # a deadline of 300 s
    replies.append("deadline")
    with pytest.raises(compile_process.Transient, match="ran 300 s"):
        compile_process._run_compiler("saved", "package", {}, settings)
    assert compile_process.deadline_seconds() == 1000  # 8 x 300 s, at most the ceiling
