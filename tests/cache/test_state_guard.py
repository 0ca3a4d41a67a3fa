"""The guard a compiled entry is checked against (csrc/cache/state_guard.h): each kind of change
is seen and named, writing the same value again is not a change, and a stale guard stays stale."""

from __future__ import annotations

import pytest
import torch

from shapecache._backends import guards
from shapecache._extension import _C


class Settings:
    def __init__(self):
        self.scale = 1.0
        self.mode = "a"


def dict_guard(d: dict, keys=None) -> _C.StateGuard:
    record = guards.GuardRecord()
    record.dicts.append((d, "d", keys))
    return _C.StateGuard(record)


@pytest.mark.parametrize("change,named", [
    (lambda d: d.__setitem__("x", 2), "d.x changed"),
    (lambda d: d.__setitem__("new", 1), "d gained or lost an entry"),
    (lambda d: d.pop("y"), "d gained or lost an entry"),
    (lambda d: d.__setitem__("t", (1.0, "b")), "d.t changed"),
])
def test_a_changed_dict_is_seen_and_named(change, named):
    d = {"x": 1, "y": "text", "t": (1.0, "a")}
    guard = dict_guard(d)
    assert guard.check()
    change(d)
    assert not guard.check()
    assert guard.changed == named
    assert not guard.check()  # stale stays stale


def test_writing_equal_values_again_is_no_change():
    d = {"x": 1.5, "s": "text", "t": (2.0, "a"), "n": None}
    guard = dict_guard(d)
    d["x"] = float("1.5")  # another object, the same value
    d["s"] = "".join(["te", "xt"])
    d["t"] = (float("2.0"), "a")
    d["n"] = None
    assert guard.check()
    d["x"] = 1.25
    assert not guard.check()


def test_an_object_compares_by_identity():
    d = {"processor": Settings()}
    guard = dict_guard(d)
    d["processor"] = Settings()  # equal contents, another object
    assert not guard.check() and guard.changed == "d.processor changed"


def test_only_the_keys_given_are_guarded_and_an_absent_key_must_stay_absent():
    d = {"model": 1, "counter": 0}
    guard = dict_guard(d, ["model", "missing"])
    d["counter"] += 1
    assert guard.check()
    d["missing"] = 1
    assert not guard.check() and guard.changed == "d.missing changed"


@pytest.mark.parametrize("change,named", [
    (lambda t: t.add_(1), "was updated in place"),
    (lambda t: setattr(t, "data", torch.zeros(3)), "was given other memory"),
    (lambda t: t.set_(torch.zeros(3)), "was given other memory"),
    (lambda t: torch.utils.swap_tensors(t, torch.nn.Parameter(torch.ones(3))), "was swapped for another tensor"),
])
def test_a_changed_tensor_is_seen_and_named(change, named):
    weight = torch.nn.Parameter(torch.ones(3))
    record = guards.GuardRecord()
    record.tensors.append((weight, "w", weight._version))
    guard = _C.StateGuard(record)
    assert guard.check()
    with torch.no_grad():
        change(weight)
    assert not guard.check()
    assert guard.changed.startswith("w ") and named in guard.changed


def test_a_tensors_version_is_the_one_recorded_not_the_one_when_the_guard_is_made():
    # A record is made into its guard when the cache reads the built entry: an update in place
    # between the two is a change.
    t = torch.ones(3)
    record = guards.GuardRecord()
    record.tensors.append((t, "t", t._version))
    t.add_(1)
    guard = _C.StateGuard(record)
    assert not guard.check() and guard.changed == "t was updated in place"


def test_an_inference_tensor_is_guarded_without_its_version():
    with torch.inference_mode():
        t = torch.ones(3)
    record = guards.GuardRecord()
    record.tensors.append((t, "t", None))  # no version to record
    guard = _C.StateGuard(record)
    assert guard.check()


def test_a_list_is_guarded_item_by_item():
    holder = {"merged": ["a"], "scales": [1.0, 2.0]}
    recorded = guards.Guarded()
    recorded._value(holder, "layer", 1)
    guard = _C.StateGuard(recorded.record)
    holder["scales"][1] = float("2.0")  # the same value
    assert guard.check()
    holder["merged"].pop()  # what peft's unmerge does
    assert not guard.check() and guard.changed == "layer['merged'] (a list) changed"


def test_a_closure_cell_is_guarded_by_what_it_holds():
    scale = 2.0

    def f(x):
        return x * scale

    record = guards.GuardRecord()
    record.cells.append((f.__closure__[0], "f.<scale>"))
    guard = _C.StateGuard(record)
    scale = 2.0  # noqa: F841  (the same value again)
    assert guard.check()
    scale = 3.0  # noqa: F841
    assert not guard.check() and guard.changed == "f.<scale> (a closure variable) changed"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.settings = Settings()

    def forward(self, x):
        return self.linear(x) * self.settings.scale


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = Block()
        self.unused = Block()

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("change", [
    lambda m: setattr(m.used.settings, "scale", 2.0),  # a plain object hanging from a module
    lambda m: m.used.train(),
    lambda m: m.used.register_forward_hook(lambda *a: None),
    lambda m: setattr(m.used, "linear", torch.nn.Linear(2, 2)),
    lambda m: setattr(m.used.linear, "weight", torch.nn.Parameter(torch.ones(2, 2))),
    lambda m: setattr(m.used.linear.bias, "data", torch.zeros(2)),
    lambda m: HOOKS.append(torch.nn.modules.module.register_module_forward_hook(lambda *a: None)),
])
def test_a_module_tree_guard_sees_attributes_flags_hooks_submodules_and_weights(change):
    holder = Holder().eval()
    guard = guards.guard({"holder": holder})
    assert guard.check()
    change(holder)
    try:
        assert not guard.check(), "the change was not seen"
    finally:
        while HOOKS:
            HOOKS.pop().remove()


HOOKS = []


def test_a_swapped_class_or_a_method_patched_on_a_class_is_a_change():
    class Merged(Block):  # what token-merging libraries do to a block
        pass

    holder = Holder().eval()
    guard = guards.guard({"holder": holder})
    holder.used.__class__ = Merged
    assert not guard.check() and guard.changed == "holder.used changed class"

    class Patched(torch.nn.Module):
        def forward(self, x):
            return x

    patched = Patched()
    guard = guards.guard({"m": patched})
    Patched.forward = lambda self, x: x * 2
    assert not guard.check() and "Patched" in guard.changed


def test_an_object_whose_class_derives_from_a_builtin_type_is_guarded():
    # peft's PeftType is a (str, Enum): its classes reach str, whose dict Python 3.12 keeps
    # outside the type object (tp_dict is NULL there), and the guard raised TypeError.
    import enum

    class Kind(str, enum.Enum):  # noqa: UP042  (as peft writes it)
        LORA = "LORA"

    holder = Holder().eval()
    holder.used.settings.kind = Kind.LORA
    guard = guards.guard({"holder": holder})
    assert guard.check()
    holder.used.settings.kind = "LOHA"
    assert not guard.check() and "kind" in guard.changed


def test_only_the_modules_that_ran_are_guarded_with_their_ancestors():
    holder = Holder().eval()
    reached = {id(holder.used), id(holder.used.linear)}
    guard = guards.guard({"holder": holder}, reached=reached)
    holder.unused.settings.scale = 5.0  # not read by the call
    holder.unused.train()
    assert guard.check()
    holder.used.settings.scale = 5.0
    assert not guard.check() and guard.changed == "holder.used.settings.scale changed"


def test_a_child_of_a_module_that_ran_is_guarded_though_it_did_not_run():
    holder = Holder().eval()
    guard = guards.guard({"holder": holder}, reached={id(holder)})  # its forward reads holder.used
    holder.used.settings.scale = 4.0
    assert not guard.check() and guard.changed == "holder.used.settings.scale changed"


def test_a_function_is_guarded_by_the_globals_it_names_and_the_trees_they_hold():
    global MODEL
    MODEL = Block()

    def f(x):
        return MODEL(x)

    guard = guards.guard({}, functions=[f])
    MODEL.settings.scale = 3.0
    assert not guard.check()
    guard = guards.guard({}, functions=[f])
    MODEL = Block()
    assert not guard.check() and "MODEL changed" in guard.changed


MODEL = None


def test_a_record_is_typed_item_by_item_and_an_object_of_another_kind_is_named():
    d = {"scale": 2.0}
    t = torch.ones(2)
    record = guards.GuardRecord()
    record.dicts.append((d, "d", None))
    record.tensors.append((t, "t", t._version))
    record.types.append((t, "t"))
    assert record.describe() == [("dicts", "d"), ("tensors", "t"), ("types", "t")]
    guard = _C.StateGuard(record)
    assert guard.check()
    t.add_(1)
    assert not guard.check() and guard.changed == "t was updated in place"
    # never a copy, which would never change: a mapping that is not a dict, a sequence that is not a list
    import types

    def refused(kind, item):
        bad = guards.GuardRecord()
        getattr(bad, kind).append(item)
        return bad

    for kind, item, message in [
        ("dicts", (types.MappingProxyType(d), "d", None), "d is a mappingproxy, not a dict"),
        ("lists", ((1.0, 2.0), "scales"), "scales is a tuple, not a list"),
        ("tensors", ([1.0], "w", None), "w is a list, not a tensor"),
        ("cells", (3, "f.<x>"), "f.<x> is a int, not a closure cell"),
        ("class_dicts", (Settings(), "Settings"), "Settings is a Settings, not a class"),
        ("snapshots", ({1}, "s", None), "s's snapshot function is a NoneType, not a callable"),
        ("dicts", (d, "d"), r"each item of record.dicts is a tuple of 3, got \(\{'scale': 2.0\}, 'd'\)"),
    ]:
        with pytest.raises(TypeError, match=message):
            _C.StateGuard(refused(kind, item))
    with pytest.raises(TypeError, match="BuiltEntry.guard must be a GuardRecord or None, got list"):
        from shapecache._backends import BuiltEntry

        _C.ShapeDispatcher(lambda x: x, lambda a, k, h: BuiltEntry(lambda x: x, 0, guard=[("dict", d, "d", None)]),
                           _C.ShapeCache(lambda device: 10**9, None), [], ["x"], None, False)(torch.ones(1))


def test_a_snapshot_is_compared_on_every_check_and_a_failing_one_counts_as_a_change():
    active = {0, 1}
    record = guards.GuardRecord()
    record.snapshots.append((active, "block.active", frozenset))
    guard = _C.StateGuard(record)
    active.discard(1)
    active.add(1)  # the same items again
    assert guard.check()
    active.add(2)
    assert not guard.check() and guard.changed == "block.active changed"

    def broken(_):
        raise RuntimeError("no snapshot")

    def snapshot_guard(path, snapshot_of):
        record = guards.GuardRecord()
        record.snapshots.append((active, path, snapshot_of))
        return _C.StateGuard(record)

    calls = []
    guard = snapshot_guard("x", lambda v: calls.append(v) or len(calls))
    assert not guard.check() and guard.changed == "x changed"  # 1 when recorded, 2 now
    guard = snapshot_guard("y", lambda v: broken(v) if calls.append(v) or len(calls) > 3 else 0)
    assert not guard.check() and guard.changed == "y changed"  # the snapshot raised: a change, no error


def test_every_modules_own_set_costs_no_snapshot_but_a_set_of_its_own_does():
    layer = torch.nn.Linear(2, 2)
    recorded = guards.Guarded()
    recorded.module(layer, "layer")
    assert [item for item in recorded.record.describe() if item[0] == "snapshots"] == []  # _non_persistent_buffers_set
    layer.active = {1}
    recorded = guards.Guarded()
    recorded.module(layer, "layer")
    assert [item for item in recorded.record.describe() if item[0] == "snapshots"] == [("snapshots", "layer.active")]
