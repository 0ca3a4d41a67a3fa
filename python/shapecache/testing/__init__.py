"""Tools for testing code that uses shapecache: the pytest plugin (``vram_budget`` marker,
``vram_monitor`` fixture), memory figures per step (``memory``), and tiny models and
diffusers pipelines built offline with random weights (``models``, ``tiny_pipelines``).
Importing this package loads nothing else."""

__all__: list[str] = []  # each tool is imported from its module
