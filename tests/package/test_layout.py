"""The package's shape: import without side effects, no import cycles, the library proper
never importing the scenarios, one typed definition of the stats keys."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shapecache as sc

PACKAGE = Path(sc.__file__).parent


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_loads_neither_torch_nor_the_extension():
    out = run_python("""
        import sys
        import shapecache
        import shapecache.testing.pytest_plugin
        print(sorted(m for m in ("torch", "shapecache._C") if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_caching_and_guarding_leave_no_process_wide_hooks():
    out = run_python("""
        import torch
        from torch.nn.modules import module
        import shapecache as sc
        from shapecache._backends import guards
        net = sc.cached(torch.nn.Linear(2, 2), backend="eager")
        net(torch.ones(1, 2))
        from shapecache._extension import _C
        record = guards.record({"net": net})
        kinds = [kind for kind, _ in record.describe()]
        print(_C.StateGuard(record).check(), kinds.count("dicts") > 0, kinds.count("tensors"))
        print(len(module._global_parameter_registration_hooks), len(module._global_module_registration_hooks),
              len(module._global_forward_pre_hooks))
    """)
    assert out.split() == ["True", "True", "2", "0", "0", "0"]


def test_another_torch_than_the_one_built_against_is_refused_by_name():
    pytest.importorskip("shapecache._build_info")
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import shapecache._build_info as built
        built.TORCH_VERSION = "2.0.0+other"
        import shapecache._extension
    """)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert (f"built against torch 2.0.0+other, but torch {torch.__version__} is installed" in result.stderr), result.stderr


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """The shapecache modules `path` imports when it is imported (not inside functions)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks do not run
            continue
        for child in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else []:
            if isinstance(child, ast.Import):
                found |= {a.name for a in child.names if a.name.startswith("shapecache")}
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("shapecache"):
                found |= {f"{child.module}.{a.name}" for a in child.names}  # a module, or a name of one
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in top_level_imports(path):
            # `from shapecache.x import y` may name a module y or a name y of module x.
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name and imported != "shapecache":
                targets.add(imported)
        graph[name] = targets
    return graph


def test_no_import_cycles():
    graph = import_graph()
    visiting, done, cycles = [], set(), []

    def visit(name):
        if name in done:
            return
        if name in visiting:
            cycles.append(visiting[visiting.index(name):] + [name])
            return
        visiting.append(name)
        for target in sorted(graph[name]):
            # A package's __init__ importing its own submodules is how packages export names.
            if not target.startswith(name + "."):
                visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert cycles == []


def test_the_library_proper_never_imports_the_scenarios_or_the_test_tools():
    graph = import_graph()
    library = [n for n in graph if not n.startswith(("shapecache.scenarios", "shapecache.testing", "shapecache.__main__"))]
    offending = {n: sorted(t for t in graph[n] if t.startswith(("shapecache.scenarios", "shapecache.testing")))
                 for n in library}
    assert {n: t for n, t in offending.items() if t} == {}


def test_stats_keys_are_the_typed_definition(conv_net):
    sc.cached(conv_net, backend="eager")
    conv_net(torch.ones(1, 3, 8, 8))
    st = sc.stats(conv_net)
    assert set(st) == set(sc.CacheStats.__annotations__)
    assert set(st["devices"]["cpu"]) == set(sc.DeviceStats.__annotations__)
    assert set(st["entries"][0]) == set(sc.EntryStats.__annotations__)


def test_the_counters_and_figures_are_defined_once_in_cpp_and_typed_in_the_same_order(conv_net):
    # A counter or figure added to one list only (C++ or the TypedDicts) fails here, and one
    # added to both but left out of the dicts fails test_stats_keys_are_the_typed_definition.
    from shapecache._extension import _C

    counters, figures = list(_C.FUNCTION_COUNTERS), list(_C.DEVICE_FIGURES)
    assert counters[:2] == ["calls", "hits"] and len(counters) == len(set(counters))
    assert list(sc.DeviceStats.__annotations__) == ["budget", *figures]
    assert list(sc.EntryStats.__annotations__) == list(_C.ENTRY_FIGURES)
    sc.cached(conv_net, backend="eager")
    conv_net(torch.ones(1, 3, 8, 8))
    st = sc.stats(conv_net)
    totals = [key for key in st if key in figures and isinstance(st[key], int)]  # summed over devices (entries: a list)
    assert list(sc.CacheStats.__annotations__)[:len(counters) + 1 + len(totals)] == [*counters, "pending_builds", *totals]


def test_pipeline_stats_keys_are_the_typed_definition():
    pytest.importorskip("diffusers")
    from shapecache.testing import tiny_pipelines

    pipe = sc.wrap(tiny_pipelines.stable_diffusion(), sizes=[(32, 32)], progress=False)
    st = sc.stats(pipe)
    assert set(st) == set(sc.PipelineStats.__annotations__) | set(sc.CacheStats.__annotations__)
    assert all(set(c) == set(sc.CacheStats.__annotations__) for c in st["components"].values())
    assert set(st["prewarmed"][0]) == {"size", "batch", "seconds", "bytes", "inductor_cache"}


def test_every_test_module_that_imports_hypothesis_is_left_out_where_it_is_missing():
    import re

    tests = Path(__file__).parents[1]
    importing = {str(p.relative_to(tests)) for p in tests.rglob("test_*.py")
                 if re.search(r"^(from|import) hypothesis", p.read_text(), flags=re.MULTILINE)}
    listed = set(re.findall(r'"([\w/]+\.py)"', (tests / "conftest.py").read_text()))
    assert importing == listed
