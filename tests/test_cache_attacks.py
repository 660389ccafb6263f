"""The kernel cache against another user who can write somewhere under it, and its errors.

These tests run as root on CI machines, so "another user" is uid 65534 (nobody), given files
with os.chown. A planted shared object's constructor writes a marker file: it must never run.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.runtime import cache
from kiln.runtime.cpu import build_shared_library
from tests.test_cache import check_kernel, entry_files, fresh_source, only_entry, record_of

OTHER = 65534
EVIL_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE* f = fopen("MARKER", "w");
    if (f) { fputs("foreign code ran", f); fclose(f); }
}
void NAME(const float* in, float* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = -1000.0f;
}
"""


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "kiln-cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    return root


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "planted-code-ran"


def evil_library(tmp_path: Path, marker: Path, name: str) -> bytes:
    """A shared object whose constructor writes `marker` and whose kernel `name` returns -1000."""
    src = tmp_path / "evil.c"
    src.write_text(EVIL_SOURCE.replace("MARKER", str(marker)).replace("NAME", name))
    out = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out.read_bytes()


def plant(entry: Path, data: bytes, owner: int = OTHER) -> None:
    """Replace `entry` and its record by `data` with a matching record, owned by `owner`."""
    entry.unlink()
    entry.write_bytes(data)
    record_of(entry).write_text(json.dumps({"key": entry.stem, "sha256": hashlib.sha256(data).hexdigest()}))
    for path in (entry, record_of(entry)):
        os.chown(path, owner, owner)


def test_symlinked_kind_folder_is_refused_and_nothing_is_written_through_it(cache_root, tmp_path):
    theirs = tmp_path / "theirs" / "cpu"
    theirs.mkdir(parents=True)
    cache_root.mkdir(mode=0o700)
    (cache_root / "cpu").symlink_to(theirs)
    with pytest.raises(cache.UnsafeCacheError, match=r"cpu is a symbolic link.*remove it"):
        build_shared_library(fresh_source("_link"), "k")
    assert list(theirs.iterdir()) == []


def test_symlinked_key_folder_is_refused(cache_root, tmp_path):
    build_shared_library(fresh_source("_keylink"), "k")
    folder = only_entry(cache_root).parent
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    folder.symlink_to(tmp_path)
    with pytest.raises(cache.UnsafeCacheError, match="is a symbolic link"):
        build_shared_library(fresh_source("_keylink"), "k")


def test_planted_shared_object_with_a_matching_record_never_runs(cache_root, tmp_path, marker):
    source = fresh_source("_planted")
    build_shared_library(source, "k")
    entry = only_entry(cache_root)
    plant(entry, evil_library(tmp_path, marker, "kiln_test_kernel_planted"))
    path = build_shared_library(source, "k")
    check_kernel(path, "_planted")
    assert not marker.exists(), "the planted shared object's constructor ran"
    assert entry.stat().st_uid == os.getuid(), "the foreign entry was rebuilt"
    assert hashlib.sha256(entry.read_bytes()).hexdigest() == json.loads(record_of(entry).read_text())["sha256"]


def test_swapped_entries_and_records_are_rebuilt_not_loaded(cache_root):
    doubled = fresh_source("_swap")
    tripled = doubled.replace("2.0f * in[i] + 1.0f", "3.0f * in[i]")
    build_shared_library(doubled, "k")
    first = set(entry_files(cache_root, ".so"))
    build_shared_library(tripled, "k")
    (a,), (b,) = first, set(entry_files(cache_root, ".so")) - first
    for x, y in ((a, b), (record_of(a), record_of(b))):       # the whole entries change places
        tmp = x.with_name("swap")
        x.rename(tmp)
        y.rename(x)
        tmp.rename(y)
    check_kernel(build_shared_library(doubled, "k"), "_swap")
    assert json.loads(record_of(a).read_text())["key"] == a.stem


def test_file_replaced_between_check_and_load_is_not_what_is_loaded(cache_root, tmp_path, marker, monkeypatch):
    source = fresh_source("_race")
    build_shared_library(source, "k")
    entry = only_entry(cache_root)
    evil = evil_library(tmp_path, marker, "kiln_test_kernel_race")
    verified = cache._verified

    def verify_then_swap(*args):
        data = verified(*args)
        assert data is not None                   # the entry was good when checked...
        plant(entry, evil, owner=os.getuid())     # ...and is replaced right after
        return data

    monkeypatch.setattr(cache, "_verified", verify_then_swap)
    path = build_shared_library(source, "k")
    check_kernel(path, "_race")
    assert not marker.exists()


@pytest.mark.parametrize("level", ["kind", "key"])
def test_foreign_owned_subfolder_is_refused(cache_root, level):
    build_shared_library(fresh_source("_foreign"), "k")
    folder = only_entry(cache_root).parent
    os.chown(folder if level == "key" else folder.parent, OTHER, OTHER)
    with pytest.raises(cache.UnsafeCacheError, match=r"belongs to another user \(uid 65534\)"):
        build_shared_library(fresh_source("_foreign"), "k")


def test_group_or_world_writable_subfolder_is_refused(cache_root):
    build_shared_library(fresh_source("_open"), "k")
    only_entry(cache_root).parent.chmod(0o777)
    with pytest.raises(cache.UnsafeCacheError, match="is writable by other users"):
        build_shared_library(fresh_source("_open"), "k")


# ---------------------------------------------------------------- errors that say what is wrong

def leftovers(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("*")
            if p.name.startswith((".tmp-", ".build-", "build-")) or p.suffix == ".c"]


def test_cache_dir_that_is_a_file_is_reported(tmp_path, monkeypatch):
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    monkeypatch.setenv("KILN_CACHE_DIR", str(target))
    with pytest.raises(cache.CacheError, match="is a file, not a directory"):
        build_shared_library(fresh_source("_file"), "k")


def read_only(root: Path, monkeypatch, existing: int = errno.EEXIST) -> None:
    """Refuse every creation or change under `root` as a read-only file system does (EROFS):
    the tests run as root, whom a folder's mode does not stop. Making a folder that exists
    fails with `existing` (Linux says EEXIST; some file systems check writability first)."""
    def inside(path, dir_fd) -> bool:
        if dir_fd is not None:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        path = Path(os.path.abspath(path))
        return path == root or root in path.parents

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_open, real_mkdir, real_replace, real_fchmod = os.open, os.mkdir, os.replace, os.fchmod

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path, dir_fd):
            refuse(path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if inside(path, dir_fd):
            if os.path.lexists(path if dir_fd is None else f"/proc/self/fd/{dir_fd}/{path}"):
                raise OSError(existing, os.strerror(existing), str(path))
            refuse(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if inside(dst, dst_dir_fd):
            refuse(dst)
        return real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def fchmod(fd, mode):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if inside(path, None):
            refuse(path)
        return real_fchmod(fd, mode)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fchmod", fchmod)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("existing, mode", [(errno.EEXIST, 0o700), (errno.EROFS, 0o755)],
                         ids=["private-root", "open-root"])
def test_a_read_only_cache_serves_its_entries_and_builds_the_others_uncached(cache_root, monkeypatch, caplog,
                                                                             existing, mode):
    """A warm cache on a read-only file system (issue 30), its root private or readable by
    others (Kiln cannot make it private then): a hit loads without a warning or a build; a
    miss is built for the process alone, not cached, and warned about once."""
    cached = fresh_source("_ro_hit")
    build_shared_library(cached, "k")
    entries = entry_files(cache_root, ".so")
    cache_root.chmod(mode)
    monkeypatch.delitem(cache._private, (os.getpid(), cache_root))    # as if filled by another process
    read_only(cache_root, monkeypatch, existing)
    caplog.set_level(logging.INFO, logger="kiln")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hit = build_shared_library(cached, "k")
    check_kernel(hit, "_ro_hit")
    assert cache_root not in hit.parents
    assert not [r for r in caplog.records if "kernel cache miss" in r.getMessage()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tag in ("_ro_miss", "_ro_miss_again"):
            check_kernel(build_shared_library(fresh_source(tag), "k"), tag)
    assert len(caught) == 1 and f"kernel cache {cache_root} is read-only" in str(caught[0].message)
    assert len([r for r in caplog.records if "kernel cache miss" in r.getMessage()]) == 2
    assert entry_files(cache_root, ".so") == entries


def test_a_kernel_with_nowhere_to_go_is_reported(cache_root, monkeypatch):
    """Where even the process's private folder refuses the kernel, the error says read-only."""
    def refused(*_):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(cache, "_write_new", refused)
    with pytest.warns(UserWarning, match="is read-only"), pytest.raises(cache.CacheError, match="is read-only"):
        build_shared_library(fresh_source("_ro"), "k")


@pytest.mark.parametrize("suffix", [".so", ".json", ".lock"])
def test_a_directory_in_place_of_an_entry_its_record_or_its_lock_is_named(cache_root, suffix):
    source = fresh_source(f"_dir_{suffix[1:]}")
    build_shared_library(source, "k")
    entry = only_entry(cache_root)
    record_of(entry).unlink()          # a miss, whatever stands in the way
    path = entry.with_suffix(suffix)
    path.unlink(missing_ok=True)
    path.mkdir()
    with pytest.raises(cache.CacheError, match=re.escape(str(path)) + ".* is a directory .*remove it"):
        build_shared_library(source, "k")


@pytest.mark.parametrize("where", ["cache", "private"])
def test_full_disk_is_reported_and_leaves_no_temporary_files(cache_root, monkeypatch, where):
    original = cache._write_bytes

    def half_then_full(f, data):
        if where == "private" or cache_root in Path(os.readlink(f"/proc/self/fd/{f.fileno()}")).parents:
            f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(f, data)

    monkeypatch.setattr(cache, "_write_bytes", half_then_full)
    with pytest.raises(cache.CacheError, match="no space left on the device"):
        build_shared_library(fresh_source(f"_full_{where}"), "k")
    assert leftovers(cache_root, cache._private_dir()) == []
    assert entry_files(cache_root, ".so") == []


def test_full_disk_while_compiling_is_reported_and_leaves_no_source_files(cache_root, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(cache.CacheError, match="no space left on the device"):
        build_shared_library(fresh_source("_full_cc"), "k")
    monkeypatch.undo()
    assert leftovers(cache_root, cache._private_dir()) == []


def test_cache_clear_reports_only_what_it_removed(cache_root, tmp_path, capsys, monkeypatch):
    build_shared_library(fresh_source("_c1"), "k")
    build_shared_library(fresh_source("_c2"), "k")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.so").write_bytes(b"not the cache's")
    (cache_root / "linked").symlink_to(outside)
    stuck = entry_files(cache_root, ".so")[0]
    unlink = Path.unlink

    def refuse(self, *args, **kwargs):
        if self == stuck:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refuse)
    assert main(["cache", "clear"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"removed 1 entries from {cache_root}"
    assert out[1] == "could not remove 1 paths:" and str(stuck) in out[2]
    assert (outside / "precious.so").exists(), "clear never follows links"
    assert not (cache_root / "linked").exists() and stuck.exists()


def test_private_copies_load_and_are_not_in_the_shared_folders(cache_root):
    path = build_shared_library(fresh_source("_copy"), "k")
    private = cache._private_dir()
    assert path.parent == private and private.parent == cache_root and private.name.startswith(".private-")
    assert oct(private.stat().st_mode & 0o777) == oct(0o700)
    lib = ctypes.CDLL(str(path))
    assert hasattr(lib, "kiln_test_kernel_copy")
    assert main(["cache", "status"]) == 0         # the private folder is no kind of entries


def test_cache_clear_removes_private_folders_of_ended_processes_only(cache_root):
    build_shared_library(fresh_source("_ended"), "k")
    mine = cache._private_dir()
    ended = cache_root / ".private-999999999-abc"
    ended.mkdir()
    (ended / "x.so").write_bytes(b"old copy")
    cache.clear()
    assert not ended.exists() and mine.exists()
