"""The out-of-memory scenario of diffusion services, runnable: a model asked for many image
sizes in a loop, under a strategy (``size_loop``), and the command line built on it
(``python -m shapecache demo|repro|serve``). Nothing in the library proper imports this
package."""

from shapecache.scenarios._child_process import why_it_failed
from shapecache.scenarios._cli import main
from shapecache.scenarios._models import build_model
from shapecache.scenarios._naive import capture_per_size_graph, naive_forward
from shapecache.scenarios._size_loop import ORDERS, STRATEGIES, SizeRecord, parse_sizes, size_loop

__all__ = [
    "ORDERS",
    "STRATEGIES",
    "SizeRecord",
    "build_model",
    "capture_per_size_graph",
    "main",
    "naive_forward",
    "parse_sizes",
    "size_loop",
    "why_it_failed",
]
