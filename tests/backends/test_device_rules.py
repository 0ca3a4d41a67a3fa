"""Rules of the CUDA layer that hold for every line of the library, checked by reading it (no
GPU here). A device-wide synchronisation (``torch.cuda.synchronize``) or the device's memory
figures taken around one (``torch.cuda.mem_get_info``) on one thread while another captures a
CUDA graph on the device waits on, or breaks, that capture (so does ``torch.cuda.empty_cache``,
whose cudaFree synchronises): each runs under the device's capture lock
(``_C.cuda_device_lock``, or ``graph_pool.device_lock`` / ``every_device_lock`` over it), or
is timed by CUDA events on one stream (``_timing.stream_seconds``). The scenarios are left
out: they run alone, as a benchmark does. Not seen: such a call in a function or lambda only
defined inside a locked ``with`` and called after it."""

import ast
from pathlib import Path

import shapecache

LIBRARY = [path for path in Path(shapecache.__file__).parent.rglob("*.py") if "scenarios" not in path.parts]
GUARDED = {"torch.cuda.synchronize", "torch.cuda.mem_get_info", "torch.cuda.empty_cache"}  # (cudaFree synchronises)
LOCKS = {"cuda_device_lock", "device_lock", "every_device_lock"}


def dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def takes_a_lock(with_node) -> bool:
    """Whether a `with` enters a device lock (also as one branch of a conditional expression)."""
    for item in with_node.items:
        for node in ast.walk(item.context_expr):
            if isinstance(node, ast.Call) and dotted(node.func).rsplit(".", 1)[-1] in LOCKS:
                return True
    return False


def unguarded(sources) -> list[str]:
    found = []
    for path in sources:
        tree = ast.parse(path.read_text())
        locked = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.With) and takes_a_lock(node):
                locked.update(id(inner) for inner in ast.walk(node))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and dotted(node.func) in GUARDED and id(node) not in locked:
                found.append(f"{path.name}:{node.lineno} {dotted(node.func)}")
            elif isinstance(node, ast.ImportFrom) and node.module == "torch.cuda":  # then called by a bare name
                found += [f"{path.name}:{node.lineno} imports torch.cuda.{alias.name}" for alias in node.names
                          if f"torch.cuda.{alias.name}" in GUARDED]
    return sorted(found, key=lambda hit: (hit.split(":")[0], int(hit.split(":")[1].split()[0])))


def test_every_device_wide_synchronisation_holds_the_device_lock():
    assert unguarded(LIBRARY) == []


def test_the_check_sees_an_unguarded_synchronisation(tmp_path):
    source = tmp_path / "timing.py"
    source.write_text("import torch\n"
                      "def seconds(device):\n"
                      "    torch.cuda.synchronize(device)\n"
                      "    with _C.cuda_device_lock(device) if has else nullcontext():\n"
                      "        torch.cuda.synchronize(device)\n"
                      "    with device_lock(device):\n"
                      "        free, _ = torch.cuda.mem_get_info(device)\n"
                      "    return torch.cuda.mem_get_info(device)\n"
                      "from torch.cuda import empty_cache\n")
    assert unguarded([source]) == ["timing.py:3 torch.cuda.synchronize", "timing.py:8 torch.cuda.mem_get_info",
                                   "timing.py:9 imports torch.cuda.empty_cache"]
