"""What AOTInductor's package loader leaves on disk (shapecache/_backends/package_extractions.py):
the directories of shapecache's packages whose processes were killed before their loader was
freed are swept; nothing a live process maps, nothing young, no other program's package,
nothing that is not this user's directory."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time

from shapecache._backends import package_extractions
from shapecache._backends.package_extractions import MARKER, ORPHANED_AFTER_S, PREFIX, marked, remove_orphaned
from shapecache._backends.package_store import KEY_METADATA


def extracted(root, name: str, age_s: float, metadata: dict | None = None):
    """A directory as the loader extracts a package into it (torch 2.13)."""
    directory = root / f"{PREFIX}{name}"
    model = directory / "p" / "data" / "aotinductor" / "model"
    model.mkdir(parents=True)
    library = model / "w.wrapper.so"
    library.write_bytes(b"\0" * 4096)
    (model / "w_metadata.json").write_text(json.dumps({MARKER: "1"} if metadata is None else metadata))
    then = time.time() - age_s
    os.utime(directory, (then, then))
    return directory, library


def test_only_old_directories_no_process_maps_are_removed(tmp_path):
    old = ORPHANED_AFTER_S + 60
    orphan, _ = extracted(tmp_path, "orphan", old)
    young, _ = extracted(tmp_path, "young", ORPHANED_AFTER_S - 60)  # a loader may be extracting it now
    in_use, library = extracted(tmp_path, "in_use", old)
    elsewhere, _ = extracted(tmp_path / "elsewhere", "target", old)
    (tmp_path / f"{PREFIX}link").symlink_to(elsewhere)  # a link is left, and what it points to
    (tmp_path / f"{PREFIX}file").write_bytes(b"x")
    published, _ = extracted(tmp_path, "published", old, {KEY_METADATA: "ab12"})  # the store's: ours
    foreign, _ = extracted(tmp_path, "foreign", old, {"AOTI_DEVICE_KEY": "cuda"})  # another program's
    mapper = mapped_elsewhere(library)  # as a live loader maps its library
    try:
        os.utime(in_use, (time.time() - old,) * 2)
        assert remove_orphaned(tmp_path) == 2
    finally:
        mapper.communicate("")
    assert not orphan.exists() and not published.exists()
    assert young.exists() and in_use.exists() and elsewhere.exists() and (tmp_path / f"{PREFIX}link").is_symlink()
    assert foreign.exists()
    assert (tmp_path / f"{PREFIX}file").exists()
    # once that process has ended, its directory is an orphan too
    assert remove_orphaned(tmp_path) == 1 and not in_use.exists()


def mapped_elsewhere(library):
    """A process of this user that maps `library`, as a live loader maps its package's."""
    mapper = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys\n"
        f"f = open({str(library)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "print('mapped', flush=True); sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert mapper.stdout.readline().strip() == "mapped"
    return mapper


def test_the_sweep_runs_once_per_process_on_a_thread_in_the_temporary_directory_as_the_maps_name_it(
        tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)  # TMPDIR through a link: the maps name the resolved path
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "link"))
    monkeypatch.setattr(package_extractions, "_sweep_lock", threading.Lock())
    old = ORPHANED_AFTER_S + 60
    orphan, _ = extracted(real, "orphan", old)
    in_use, library = extracted(real, "in_use", old)
    mapper = mapped_elsewhere(library)
    try:
        os.utime(in_use, (time.time() - old,) * 2)
        package_extractions.remove_orphaned_once()
        [sweep] = [t for t in threading.enumerate() if t.name == "shapecache-sweep"]
        sweep.join(60)
        assert not orphan.exists() and in_use.exists()
        later, _ = extracted(real, "later", old)
        package_extractions.remove_orphaned_once()  # once per process
        assert later.exists()
    finally:
        mapper.communicate("")


def test_nothing_is_removed_where_others_may_write_without_the_sticky_bit_or_of_another_user(tmp_path):
    orphan, _ = extracted(tmp_path, "orphan", ORPHANED_AFTER_S + 60)
    tmp_path.chmod(0o777)
    try:
        assert remove_orphaned(tmp_path) == 0 and orphan.exists()
        tmp_path.chmod(0o1777)  # as /tmp
        if os.geteuid() == 0:
            os.chown(orphan, 65534, 65534)
            assert remove_orphaned(tmp_path) == 0 and orphan.exists()  # another user's
            os.chown(orphan, 0, 0)
        assert remove_orphaned(tmp_path) == 1 and not orphan.exists()
    finally:
        tmp_path.chmod(0o755)


def test_nothing_is_removed_without_proc(tmp_path, monkeypatch):
    orphan, _ = extracted(tmp_path, "orphan", ORPHANED_AFTER_S + 60)
    monkeypatch.setattr(package_extractions, "_mapped_by_this_user", lambda: None)
    assert remove_orphaned(tmp_path) == 0 and orphan.exists()


def test_packages_shapecache_compiles_are_marked():
    configs = marked({"freezing": True, "aot_inductor.metadata": {KEY_METADATA: "ab12"}})
    assert configs == {"freezing": True, "aot_inductor.metadata": {KEY_METADATA: "ab12", MARKER: "1"}}


def test_the_constants_file_beside_a_library_this_process_maps_is_removed(tmp_path):
    library = tmp_path / "model.so"
    library.write_bytes(b"\0" * 4096)
    blob = tmp_path / "model_weights.blob"
    blob.write_bytes(b"w")
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        package_extractions.remove_extracted_constants({"model_weights.blob"})
    assert not blob.exists() and library.exists()
