"""Every public module of shapecache declares what it exports (``__all__``), and every name it
exports is documented in the README or docs/: a user finds what the package offers there, and
nothing half-public is left to be imported by accident."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import shapecache

REPO = Path(__file__).parents[2]
DOCUMENTED = "\n".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
PUBLIC_MODULES = ["shapecache"] + [
    info.name for info in pkgutil.walk_packages(shapecache.__path__, "shapecache.")
    if not any(part.startswith("_") for part in info.name.split("."))
]


def undocumented(names, text=DOCUMENTED):
    """The names that no code of `text` names: a fenced block, or a span (`name`,
    `sc.name(...)`, `module.name`)."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```.*?```", " ", text, flags=re.S)
    spans = " ".join([*fenced, *re.findall(r"`([^`]+)`", prose)])
    return [name for name in names if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", spans)]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_a_public_module_declares_its_exports_and_each_is_documented(module):
    loaded = importlib.import_module(module)
    exported = getattr(loaded, "__all__", None)
    assert exported is not None, f"{module} has no __all__"
    for name in exported:
        assert hasattr(loaded, name), f"{module}.__all__ names {name}, which it lacks"
    assert undocumented(exported) == [], f"{module} exports names documented nowhere in README.md or docs/"


def test_the_check_sees_an_undocumented_name():
    text = "`sc.wrap(pipe)` and `shapecache.Budget`; unwrap, cached\n```python\nsc.stats(f)\n```\n"
    assert undocumented(["wrap", "unwrap", "Budget", "stats", "cached"], text) == ["unwrap", "cached"]
