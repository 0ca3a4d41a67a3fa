"""What the code a build ran wrote of the globals it read (shapecache/_backends/called_code.py):
a write of the call's is found and put back; what a module's own import writes is not the
call's."""

import sys

from shapecache._backends import called_code

HELPER = """\
COUNT = 0
TABLE = {"scale": 2}
try:  # defined once, kept across reloads: the module reads a global its import then writes
    REGISTRY
except NameError:
    REGISTRY = {}


def bump():
    global COUNT
    COUNT += 1
    return COUNT * TABLE["scale"]
"""


def call_through_a_helper_imported_on_first_use():
    import lazy_helper_for_recording  # imported by the call itself, as a lazy import is

    return lazy_helper_for_recording.bump()


def test_a_module_imported_by_the_call_is_not_its_write_but_what_the_call_writes_there_is(tmp_path, monkeypatch):
    (tmp_path / "lazy_helper_for_recording.py").write_text(HELPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_helper_for_recording", raising=False)
    with called_code.recording_calls() as recorded:
        assert call_through_a_helper_imported_on_first_use() == 2
    helper = sys.modules["lazy_helper_for_recording"]
    assert helper.COUNT == 1
    # The import defined COUNT, TABLE, REGISTRY and bump (not the call's writes); bump's increment is.
    assert recorded.put_back() == ["lazy_helper_for_recording.COUNT"]
    assert helper.COUNT == 0  # put back
    with called_code.recording_calls() as recorded:  # imported already: recorded as any module
        assert call_through_a_helper_imported_on_first_use() == 2
    assert recorded.put_back() == ["lazy_helper_for_recording.COUNT"]
