"""Each subpackage of shapecache is used from outside only through its seam: the names its
``__init__`` exports (``__all__``), never a private module of it. Checked over the library and
the benchmarks, by reading their imports."""

import ast
import importlib
from pathlib import Path

import shapecache

ROOT = Path(shapecache.__file__).parent
SOURCES = [*ROOT.rglob("*.py"), *(Path(__file__).parents[2] / "benchmarks").glob("*.py")]
SUBPACKAGES = ["_backends", "diffusers", "ops", "ray_serve", "scenarios"]


def owner(path: Path) -> str | None:
    """The subpackage `path` belongs to, if any."""
    try:
        parts = path.relative_to(ROOT).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else None


def reach_ins(sources=SOURCES):
    found = []
    for path in sources:
        inside = owner(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [(node.module, [alias.name for alias in node.names])]
            elif isinstance(node, ast.Import):
                modules = [(alias.name, []) for alias in node.names]
            else:
                continue
            for module, names in modules:
                parts = module.split(".")
                if parts[0] != "shapecache" or len(parts) < 2 or parts[1] not in SUBPACKAGES or parts[1] == inside:
                    continue
                if len(parts) > 2:
                    found.append(f"{path.name}:{node.lineno} imports {module}")
                    continue
                exported = importlib.import_module(module).__all__
                found += [f"{path.name}:{node.lineno} imports {module}.{name}" for name in names if name not in exported]
    return found


def test_no_module_reaches_into_another_subpackage():
    assert reach_ins() == []


def test_the_check_sees_a_reach_in(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from shapecache._backends.guards import record\nfrom shapecache._backends import _C\n")
    assert reach_ins([bad]) == ["bad.py:1 imports shapecache._backends.guards", "bad.py:2 imports shapecache._backends._C"]


def uses_of_test_bindings(sources):
    """Where a module reads ``_testing`` (``_C._testing``, the test-only bindings) off anything."""
    return [f"{path.name}:{node.lineno}" for path in sources for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "_testing"]


def test_the_library_never_uses_the_test_only_bindings(tmp_path):
    assert uses_of_test_bindings(ROOT.rglob("*.py")) == []
    bad = tmp_path / "bad.py"
    bad.write_text("from shapecache._extension import _C\nhandle = _C._testing.build_handle\n")
    assert uses_of_test_bindings([bad]) == ["bad.py:2"]


def reach_ins_through_sys_modules(sources):
    """Where a module reads one of shapecache's own modules out of ``sys.modules`` (a seam no
    import shows): ``sys.modules.get("shapecache...")`` or ``sys.modules["shapecache..."]``."""
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                target, keys = node.func.value, node.args[:1]
            elif isinstance(node, ast.Subscript):
                target, keys = node.value, [node.slice]
            else:
                continue
            if (isinstance(target, ast.Attribute) and target.attr == "modules" and isinstance(target.value, ast.Name)
                    and target.value.id == "sys" and keys and isinstance(keys[0], ast.Constant)
                    and str(keys[0].value).startswith("shapecache")):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_module_reads_shapecache_out_of_sys_modules(tmp_path):
    assert reach_ins_through_sys_modules(SOURCES) == []
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nm = sys.modules.get('shapecache._backends.compile_process')\n"
                   "n = sys.modules['shapecache._background']\nt = sys.modules.get('torch._dynamo')\n")
    assert reach_ins_through_sys_modules([bad]) == ["bad.py:2", "bad.py:3"]
