"""A process forked while a background build runs: the child never hangs, and its compiled
buckets run uncached with a warning (what the build had half made has no thread to finish it
in the child); forked between builds, the child builds as any process does. Each scenario
runs in a subprocess of its own under a timeout."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"), pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time, warnings
    import torch
    import shapecache as sc
    from shapecache import _background
    from shapecache._backends import compile_process

    def compiler_pid():
        running = compile_process._compiler["process"]
        return running.process.pid if running is not None else None

    torch.manual_seed(0)
    frozen_before = __import__("gc").get_freeze_count()  # 375 of the interpreter's own on 3.12.1
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
    x, y = torch.randn(1, 3, 16, 16), torch.randn(1, 3, 24, 24)
    with torch.no_grad():
        expected = model(y)  # before caching: sc.cached caches the module in place
    frozen = {"options": {"freezing": True}} if len(sys.argv) > 2 else {}  # compiled in the compiler's process
    f = sc.cached(model, backend="compile", build="background", compile_options=frozen)
    with torch.no_grad():
        f(x)
        if sys.argv[1] == "mid-build":  # the first build imports the compiler: seconds
            deadline = time.monotonic() + 60
            while not _background._build_changes["builds"] and time.monotonic() < deadline:
                time.sleep(0.001)
            assert _background._build_changes["builds"], "the build never started"
        else:
            assert sc.wait(f, timeout=120)
        parent_compiler = compiler_pid()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first = f(y)
                waited = sc.wait(f, timeout=120)
                again = f(y)
            st = sc.stats(f)
            report = {"waited": waited, "first_equal": bool(torch.equal(first, expected)),
                      "again_close": bool(torch.allclose(again, expected, rtol=1e-4, atol=1e-5)),
                      "backends": sorted(e["backend"] for e in st["entries"]), "fallbacks": st["fallbacks"],
                      "switch_interval": sys.getswitchinterval(), "frozen": __import__("gc").get_freeze_count() - frozen_before,
                      "warnings": [str(w.message) for w in caught], "compiler": compiler_pid()}
            os.write(write, json.dumps(report).encode())
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        child = json.loads(os.read(read, 1 << 20) or b"null")
        parent_waited = sc.wait(f, timeout=120)
        f(torch.randn(1, 3, 20, 20))  # a size of the parent's own, after the child
        parent_waited = parent_waited and sc.wait(f, timeout=120)
        print(json.dumps({"status": status, "child": child, "parent_waited": parent_waited,
                          "parent_backends": [e["backend"] for e in sc.stats(f)["entries"]],
                          "parent_compiler": [parent_compiler, compiler_pid()]}))
""")


def run(*when):
    out = subprocess.run([sys.executable, "-c", SCRIPT, *when], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_child_forked_mid_build_runs_its_compiled_buckets_uncached_with_a_warning_and_never_hangs():
    result = run("mid-build")
    child = result["child"]
    assert result["status"] == 0 and child["waited"] and child["first_equal"] and child["again_close"]
    assert "compile" not in child["backends"] and child["fallbacks"] == 1
    assert any("was forked from process" in w and "while a build ran there" in w for w in child["warnings"])
    assert child["switch_interval"] == 0.005 and child["frozen"] == 0  # what the build had set is undone
    assert result["parent_waited"] and result["parent_backends"] == ["compile", "compile"]  # the parent's build went on
    assert any("shapecache.wait on the parent's cached objects before forking avoids it" in w for w in child["warnings"])


def test_a_child_forked_between_builds_builds_as_any_process_through_a_compilers_process_of_its_own():
    # The first call ran uncached (its build is queued); the second hit the compiled entry. The
    # parent's compiler process, kept warm, is the parent's: the child starts its own for its
    # frozen build, and the parent's keeps serving the parent's builds.
    result = run("between-builds", "frozen")
    child = result["child"]
    assert result["status"] == 0 and child["waited"] and child["first_equal"] and child["again_close"]
    assert child["backends"] == ["compile", "compile"] and child["fallbacks"] == 0 and child["warnings"] == []
    before, after = result["parent_compiler"]
    assert before is not None and before == after and child["compiler"] not in (None, before), (result, child)
    assert result["parent_waited"] and result["parent_backends"] == ["compile", "compile"]  # x, then its own size
