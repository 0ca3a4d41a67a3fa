"""The ``"eager"`` backend: the function itself. Its entry holds no memory; keys, buckets and
padding still apply."""

from __future__ import annotations

from shapecache._backends.entry import BuildContext, Builder, BuiltEntry, register


@register
class EagerBuilder(Builder):
    name = "eager"

    def build(self, function, args, kwargs, handle, context: BuildContext, asked: str) -> BuiltEntry:
        # The dispatcher runs the call (inline) once this returns: no frame of the builder lies
        # under it, so a recursive cached function costs one Python frame per level.
        return BuiltEntry(function, 0, None, "eager", ran_call=False)
