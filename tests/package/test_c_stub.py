"""_C.pyi declares what shapecache._C holds: the same top-level names and, for each class, the
same public members (the CUDA-only names where the build has CUDA code)."""

import ast
from pathlib import Path

import torch

import shapecache
from shapecache._extension import _C

STUB = Path(shapecache.__file__).parent / "_C.pyi"
CUDA_ONLY = {"CudaGraphRunner", "cuda_device_lock", "capture_cuda_graph", "cuda_graph_pool_bytes"}
STUB_ONLY = {"Builder"}  # a type alias of the stub's own


def declared():
    tree = ast.parse(STUB.read_text())
    names, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {
                (item.name if isinstance(item, ast.FunctionDef) else item.target.id)
                for item in node.body if isinstance(item, (ast.FunctionDef, ast.AnnAssign))
            }
    return names - STUB_ONLY, members


def test_the_stub_names_what_the_extension_holds():
    names, members = declared()
    present = {name for name in dir(_C) if not name.startswith("__")}
    expected = names if _C.has_cuda_graphs else names - CUDA_ONLY
    assert present == expected, f"in _C only: {sorted(present - expected)}; in _C.pyi only: {sorted(expected - present)}"
    for name, declared_members in members.items():
        cls = getattr(_C, name, None)
        if not isinstance(cls, type) or issubclass(cls, Exception):
            continue
        own = {member for member in vars(cls) if not member.startswith("_")}  # inherited ones are the base's
        if cls is _C.BuildHandle:  # its facts are attributes of each handle
            handle = _C._testing.build_handle(_C.ShapeCache(lambda device: 0), torch.device("cpu"))
            own |= {member for member in vars(handle) if not member.startswith("_")}
        assert own == {member for member in declared_members if not member.startswith("_")}, name
