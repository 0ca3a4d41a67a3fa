"""A real local Ray Serve app (tests/ray_serve/two_replicas.py) in a process of its own, under a
hard timeout: a replica that cannot be scheduled makes serve.run wait forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed")
psutil = pytest.importorskip("psutil")

SCRIPT = Path(__file__).with_name("two_replicas.py")
TIMEOUT_S = 240
RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "dashboard", "log_monitor", "monitor.py", "runtime_env")


def ray_processes() -> set[int]:
    found = set()
    for process in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            text = " ".join([process.info["name"] or "", *(process.info["cmdline"] or [])])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(marker in text for marker in RAY_PROCESSES):
            found.add(process.info["pid"])
    return found


@pytest.mark.slow
def test_two_replicas_each_size_served_by_one_replica_and_nothing_left_behind():
    before = ray_processes()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)
    try:
        out, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"the Ray app did not finish in {TIMEOUT_S} s:\n{err[-3000:]}")
    assert process.returncode == 0, err[-3000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))

    served, sizes = result["served"], {tuple(s) for s, *_ in result["served"]}
    assert len(served) == 24 and len(sizes) == 4
    warm = served[len(sizes):]  # after each size's first request
    replica_of = {}
    for size, replica, _ in warm:
        assert replica_of.setdefault(tuple(size), replica) == replica, f"{size} went to two replicas: {served}"
    assert len(set(replica_of.values())) == 2, f"the sizes were not spread over both replicas: {replica_of}"
    # what each replica says it holds (its routing stats' sizes) is what it was sent
    for _size, replica, held in served[-len(sizes):]:
        assert sorted(tuple(s) for s in held) == sorted(s for s, r in replica_of.items() if r == replica)
    # a router that made none of the choices routes by the published stats alone
    for size, replica, _ in result["served_by_a_new_router"]:
        assert replica == replica_of[tuple(size)], f"{replica_of}, a new router: {result['served_by_a_new_router']}"

    # the fleet view through Serve's handle: each replica, the sizes it was sent, and its hits
    view = result["fleet_view"]
    assert len(view) == 2, view
    for full_id in set(replica_of.values()):
        (rid,) = [rid for rid in view if full_id.endswith(rid)]
        assert [tuple(s) for s in view[rid]["sizes"]] == sorted(s for s, r in replica_of.items() if r == full_id)
        assert view[rid]["hits"] > 0
    # awaited in an event loop: the same replicas and sizes; the blocking form names the awaited one
    in_a_loop = result["fleet_view_async"]
    assert {rid: [tuple(s) for s in sizes] for rid, sizes in in_a_loop["view"].items()} == {
        rid: [tuple(s) for s in v["sizes"]] for rid, v in view.items()}
    assert "await fleet_view_async(handle=...)" in (in_a_loop["refused"] or ""), in_a_loop

    # a killed replica: no request lost, none sent to it, its sizes served by the others
    victim, after_kill = result["killed"], result["after_kill"]
    errors = [row for row in after_kill if row[1] is None]
    assert not errors, f"requests failed after a replica was killed: {errors}"
    assert all(replica != victim for _, replica, *_ in after_kill)
    victim_sizes = {size for size, replica in replica_of.items() if replica == victim}
    assert victim_sizes and victim_sizes <= {tuple(size) for size, *_ in after_kill}

    # deleted: each replica Serve stopped published its last stats, marked so; the killed one could not
    stopped = result["stopped"]
    killed = [rid for rid in stopped if victim.endswith(rid)]
    assert len(killed) == 1 and not stopped[killed[0]], (victim, stopped)
    others = {rid: s for rid, s in stopped.items() if rid not in killed}
    assert others and all(others.values()), stopped

    deadline = time.monotonic() + 30
    while (left := ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left after shutdown: {[psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]}"
