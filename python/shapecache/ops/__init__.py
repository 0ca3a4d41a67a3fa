"""shapecache's ops: ``conv2d`` (``torch.ops.shapecache.conv2d``, the algorithm tuned per exact
problem) and ``tune_convs``, which routes a module's ``Conv2d`` layers through it and keeps
the chosen algorithms in a ``TuningDb`` file."""

from shapecache.ops._conv2d import conv2d
from shapecache.ops._tuning import TunedConvs, TuningDb, tune_convs

__all__ = ["TunedConvs", "TuningDb", "conv2d", "tune_convs"]
