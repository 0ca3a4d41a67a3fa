import os

# The suite runs in two workers on two cores: each test process, and each it starts, runs torch
# with one intra-op thread. With two, OpenMP's threads of one worker spin on the core the other
# is using: a tiny UNet's call was measured at 2 s against 4 ms alone. (Set before torch is
# imported, here and in every worker; a value the caller set is kept.)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from shapecache.testing.models import SmallConvNet

pytest_plugins = ["pytester"]

# The property tests need hypothesis. Where it is not installed (a GPU machine without network),
# their modules are left out and the report's header says so, instead of failing collection.
PROPERTY_TEST_MODULES = ["backends/test_compile_guards.py", "cache/test_padding.py", "core/test_budgeted_lru.py",
                         "core/test_pool_generations.py", "core/test_destroy_after_capture.py",
                         "ray_serve/test_placement.py"]
try:
    import hypothesis  # noqa: F401
except ImportError:
    collect_ignore = PROPERTY_TEST_MODULES


def pytest_report_header(config):
    if "collect_ignore" in globals():
        return f"hypothesis is not installed: left out {', '.join(PROPERTY_TEST_MODULES)}"
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def conv_net():
    torch.manual_seed(0)
    return SmallConvNet().eval()


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Puts back the process's environment after each test: a replica with a shared directory
    sets SHAPECACHE_SHARED_DIR and inductor's cache variables (SharedDir.apply), which would make
    every later frozen build of the worker publish packages."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
