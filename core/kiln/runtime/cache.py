"""The on-disk kernel cache.

Entries are content-addressed: the key hashes the source, the compiler and its version, the
flags and the target architecture. An entry is the built file plus a record of its key and of
the checksum of Kiln's own build output: `ROOT/KIND/KEY[:2]/KEY.SUFFIX` and `KEY.json`. The
checksum is the output's sha256, or for an output of more than 4 MiB the sha256 of its 4 MiB
parts' sha256 digests (the parts hashed at once, on several threads).

An entry is built once, however many processes (test workers, the ranks of a distributed run)
or threads miss it at the same time: a builder holds an exclusive lock on `KEY.lock` (an empty
file beside the entry, `flock`, released by the system if the builder dies) while it builds and
publishes, and the others wait for the lock, then find the entry and use it.

Nothing in the cache is trusted beyond what Kiln checked itself:

- The root is created private (mode 0700) and must belong to the user. Every folder under it
  is opened without following symbolic links and must belong to the user and be writable by
  no one else; a symbolic link, a foreign folder or an open one is refused with an
  `UnsafeCacheError` that says which and what to do.
- A build runs in a private temporary folder (`mkdtemp`, outside the shared folders); its
  output's checksum is computed there, from those bytes, before they are published (written to
  a temporary file and renamed into place, so that a reader never sees a torn file).
- An entry is read through one file descriptor, opened without following links, and used only
  if that file is a regular file of the user, its record names the same key and its checksum
  matches the bytes read. Those verified bytes (or the build's own output) are what the caller
  loads: `lookup_or_build` returns a copy in a private per-process folder of the root, never a
  path in the shared folders that someone could change between the check and the load.

Other stores keep entries of their own kind in the same root, with the same checks and
locks: `write_entry` publishes one, `read_entry` returns its verified bytes, and `evict` keeps
a kind within a size, removing the least recently used entries first (the whole-graph cache,
`kiln.frontend.torch.graph_cache`, is the kind `graphs`).

A cache that cannot be used (KILN_CACHE_DIR is a file, or the disk is full) raises `CacheError`
saying so, and leaves no temporary file behind. A read-only cache (a read-only file system, or
folders the user may not write) still serves its verified entries; an entry it lacks is built
for the process alone, neither locked nor published, with one warning a process. Its private
copies then go to a private folder of the system's temporary directory.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import json
import mmap
import os
import secrets
import shutil
import stat
import tempfile
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kiln.log import current_record, logger
from kiln.runtime.threads import each_at_once
from kiln.settings import current

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_CREATE_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_OPEN_LOCK = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | _CLOEXEC
# memory of the process's own, its pages present at once (fewer faults than page by page)
_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
_NOT_ENTRIES = (".json", ".lock")    # beside each entry: its record and its build lock
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class CacheError(OSError):
    """The kernel cache cannot be used: its directory is a file, is read-only, or is full."""


class ReadOnlyCacheError(CacheError):
    """The kernel cache refuses writes: its file system or a folder of it is read-only."""


class UnsafeCacheError(PermissionError):
    """A folder of the kernel cache could let another user change Kiln's kernels."""


def _root_path() -> Path:
    return Path(current().cache_dir)


def _unusable(path: Path, exc: OSError, doing: str) -> CacheError:
    """A CacheError explaining `exc`, raised while `doing` at `path` (a ReadOnlyCacheError where
    writing was refused)."""
    setting = "set KILN_CACHE_DIR to a directory of your own"
    error = CacheError
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why = f"no space left on the device (or quota exceeded) while {doing}; free some space or {setting}"
    elif exc.errno in _READ_ONLY:
        why = f"it is read-only ({exc.strerror}) while {doing}; {setting} that is writable"
        error = ReadOnlyCacheError
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR):
        why = f"it (or a folder on its path) is a file, not a directory; remove the file or {setting}"
    elif exc.errno == errno.EISDIR:
        why = f"it is a directory where Kiln keeps a file, found while {doing}; remove it"
    else:
        why = f"{exc.strerror or exc} while {doing}"
    return error(exc.errno, f"Kiln's kernel cache {path} cannot be used: {why}")


def cache_dir() -> Path:
    """The cache root: $KILN_CACHE_DIR, else ~/.cache/kiln; created private (mode 0700).

    A root that belongs to another user is refused: whoever owns it could swap kernels.
    """
    with _root_fd() as _:
        return _root_path()


@contextmanager
def _root_fd():
    """A descriptor of the checked, private cache root."""
    path = _root_path()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError as exc:
        raise _unusable(path, exc, "creating it") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise UnsafeCacheError(f"the kernel cache {path} belongs to another user (uid {info.st_uid}); "
                                   "set KILN_CACHE_DIR to a directory of your own")
        if info.st_mode & 0o077:
            try:
                os.fchmod(fd, 0o700)
            except OSError as exc:
                if exc.errno != errno.EROFS:      # no one changes a read-only file system
                    raise _unusable(path, exc, "making it private") from None
        yield fd
    finally:
        os.close(fd)


def _check_folder(fd: int, path: Path) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.getuid():
        raise UnsafeCacheError(f"the kernel cache folder {path} belongs to another user (uid {info.st_uid}); "
                               f"Kiln will not use it: remove it (or run `kiln cache clear` after removing it)")
    if info.st_mode & 0o022:
        raise UnsafeCacheError(f"the kernel cache folder {path} is writable by other users (mode "
                               f"{stat.S_IMODE(info.st_mode):o}); Kiln will not use it: remove it")


def _open_folder(parent_fd: int, name: str, path: Path) -> int:
    """A descriptor of the private folder `name` in `parent_fd` (created if missing)."""
    refused = None
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in _READ_ONLY:
            raise _unusable(path, exc, "creating a folder") from None
        refused = exc          # a read-only cache: the folder may be there already
    try:
        fd = os.open(name, _OPEN_DIR, dir_fd=parent_fd)
    except OSError as exc:
        if refused is not None and exc.errno == errno.ENOENT:
            raise _unusable(path, refused, "creating a folder") from None
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            link = stat.S_ISLNK(os.lstat(name, dir_fd=parent_fd).st_mode)
            raise UnsafeCacheError(f"the kernel cache folder {path} is "
                                   f"{'a symbolic link' if link else 'not a directory'}; Kiln follows no "
                                   "links in its cache: remove it") from None
        raise _unusable(path, exc, "opening a folder") from None
    try:
        _check_folder(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _entry_folder(kind: str, key: str):
    """(descriptor, path) of the checked folder ROOT/kind/key[:2]."""
    path = _root_path()
    fds = []
    try:
        with _root_fd() as fd:
            for name in (kind, key[:2]):
                path = path / name
                fd = _open_folder(fd, name, path)
                fds.append(fd)
            yield fd, path
    finally:
        for fd in fds:
            os.close(fd)


def content_key(*parts: str) -> str:
    """A hex key over all the parts that determine a build's result."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


_PART = 1 << 22


def checksum(data) -> str:
    """The hex sha256 of `data`; for more than `_PART` bytes, "parts " and the sha256 of the
    sha256 digests of its `_PART`-byte parts, hashed at once on torch's threads
    (`kiln.runtime.threads`)."""
    view = memoryview(data)
    if len(view) <= _PART:
        return hashlib.sha256(view).hexdigest()
    parts = [view[k:k + _PART] for k in range(0, len(view), _PART)]
    digests = each_at_once(lambda part: hashlib.sha256(part).digest(), parts, len(view))
    return "parts " + hashlib.sha256(b"".join(digests)).hexdigest()


class FileBytes(mmap.mmap):
    """A file's bytes in private memory (`read_file`, `_filled`): a buffer, and a file object
    reading them."""

    def seekable(self) -> bool:
        return True


def read_file(path) -> FileBytes:
    """The bytes of the file at `path` in new private memory (`_filled`); OSError where it
    cannot be read whole, ValueError where it is empty."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError(f"{path} is empty")
        return _filled(f.fileno(), size, path)


def _filled(fd: int, size: int, path) -> FileBytes:
    """The first `size` (> 0) bytes of the open file `fd` (at `path`) in new page-aligned
    private memory, read in `_PART`-byte pieces, at once on torch's threads where they are
    enough bytes (`kiln.runtime.threads.each_at_once`); OSError where the file holds fewer."""
    memory = FileBytes(-1, size, flags=_ANONYMOUS)
    view = memoryview(memory)

    def read(start: int) -> None:
        piece = view[start:start + _PART]
        while len(piece):
            got = os.preadv(fd, [piece], start)
            if got == 0:
                raise OSError(f"{path} became shorter while it was read")
            piece, start = piece[got:], start + got
    each_at_once(read, range(0, size, _PART), size)
    return memory


def _read_own_file(dir_fd: int, name: str) -> memoryview | None:
    """The bytes of regular file `name` in `dir_fd`, read through one descriptor into new
    page-aligned memory (`_filled`), if it is the user's own and writable by no one else; else
    None (missing, a link, a directory, foreign, or shorter than it was when opened)."""
    try:
        fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            return None
        return memoryview(_filled(fd, info.st_size, name) if info.st_size else b"")
    except OSError:
        return None
    finally:
        os.close(fd)


def _verified(dir_fd: int, key: str, suffix: str) -> memoryview | None:
    """The entry's bytes if its record names `key` and their checksum; else None."""
    data = _read_own_file(dir_fd, key + suffix)
    record = _read_own_file(dir_fd, key + ".json")
    if data is None or record is None:
        return None
    try:
        fields = json.loads(bytes(record))
        ok = fields["key"] == key and fields["sha256"] == checksum(data)
    except (ValueError, KeyError, TypeError):
        return None
    return data if ok else None


def _write_bytes(f, data: bytes) -> None:
    f.write(data)


def _write_new(dir_fd: int, name: str, data: bytes) -> None:
    """Write `data` to `name` in `dir_fd` atomically: a new private temporary file, renamed."""
    tmp = f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, _CREATE_FILE, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_bytes(f, data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


_private_lock = threading.Lock()
_private: dict[tuple[int, Path], Path] = {}      # (pid, root) -> this process's private folder
_warned_read_only: set[Path] = set()            # roots found read-only, warned about
PRIVATE_PREFIX = ".private-"


def _private_dir() -> Path:
    """A folder that only this process writes (mode 0700, named after the process id), removed
    when the process exits. It lies in the cache root rather than in /tmp, which may forbid
    loading code; in the system's temporary directory only where the root is read-only."""
    with _private_lock:
        key = (os.getpid(), _root_path())
        if key not in _private:
            path = _new_private_dir(f"{PRIVATE_PREFIX}{key[0]}-")
            _private[key] = path
            atexit.register(lambda: os.getpid() == key[0] and shutil.rmtree(path, ignore_errors=True))
        return _private[key]


def _new_private_dir(prefix: str) -> Path:
    """A new private folder named `prefix` and a random tail: in the cache root, or in the
    system's temporary directory where the root is read-only."""
    try:
        with _root_fd():
            root = _root_path()
            try:
                return Path(tempfile.mkdtemp(dir=root, prefix=prefix))
            except OSError as exc:
                raise _unusable(root, exc, "creating a private folder") from None
    except ReadOnlyCacheError:
        temporary = tempfile.gettempdir()
        try:
            return Path(tempfile.mkdtemp(dir=temporary, prefix=f"kiln{prefix}"))
        except OSError as exc:
            raise _unusable(Path(temporary), exc, "creating a private folder") from None


def _private_copy(key: str, suffix: str, data: bytes) -> Path:
    """`data` as a file of the private directory, for the caller to load."""
    folder = _private_dir()
    fd = os.open(folder, _OPEN_DIR)
    try:
        _write_new(fd, key + suffix, data)
    except OSError as exc:
        raise _unusable(folder, exc, "writing a verified kernel") from None
    finally:
        os.close(fd)
    return folder / (key + suffix)


def _build_privately(build: Callable[[Path], None], suffix: str) -> bytes:
    """The output of `build(path)`, run on a path of a fresh private directory (removed after)."""
    work = Path(tempfile.mkdtemp(dir=_private_dir(), prefix="build-"))
    try:
        out = work / f"kernel{suffix}"
        try:
            build(out)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _unusable(work, exc, "building a kernel") from None
            raise
        return out.read_bytes()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def _build_lock(dir_fd: int, key: str, folder: Path):
    """Hold the exclusive build lock of entry `key` (see the module's docstring), waiting for
    whoever holds it."""
    try:
        fd = os.open(key + ".lock", _OPEN_LOCK, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise _unusable(folder / (key + ".lock"), exc, "opening a build lock") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def lookup_or_build(kind: str, key: str, suffix: str, build: Callable[[Path], None]) -> Path:
    """The path of a private copy of the artifact `key`, taken from a verified cache entry or,
    when the entry is missing or untrustworthy, built by `build(path)` (which writes the
    artifact to the path it is given) and published to the cache. Callers that miss the same
    entry at once build it once: one builds, the others wait and take its entry. A read-only
    cache serves its entries and builds the others for this process alone (one warning)."""
    data = None
    try:
        with _entry_folder(kind, key) as (fd, folder):
            data = _verified(fd, key, suffix)
            if data is not None:
                logger.debug("kernel cache hit: %s/%s%s", kind, key, suffix)
                current_record().add_cache_lookup(kind, hit=True)
            else:
                with _build_lock(fd, key, folder):
                    data = _verified(fd, key, suffix)      # published while this caller waited
                    if data is None:
                        logger.info("kernel cache miss: building %s/%s%s", kind, key, suffix)
                        current_record().add_cache_lookup(kind, hit=False)
                        data = _build_privately(build, suffix)
                        _publish(fd, folder, key, suffix, data)
    except ReadOnlyCacheError as exc:
        _warn_read_only(exc)
        if data is None:
            logger.info("kernel cache miss: building %s/%s%s, not cached (read-only)", kind, key, suffix)
            current_record().add_cache_lookup(kind, hit=False)
            data = _build_privately(build, suffix)
    return _private_copy(key, suffix, data)


def read_entry(kind: str, key: str, suffix: str) -> memoryview | None:
    """The bytes of the entry `key` of `kind` where it is there and verified (see the module's
    docstring), in new page-aligned writable memory of the caller's own, else None. A hit refreshes the entry's time, so that `evict` removes the least
    recently used entries first."""
    try:
        with _entry_folder(kind, key) as (fd, _):
            data = _verified(fd, key, suffix)
            if data is not None:
                try:
                    os.utime(key + suffix, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    pass           # a read-only cache: its entries age as they are
            return data
    except ReadOnlyCacheError:     # the folder is not there, and cannot be made
        return None


def has_entry(kind: str, key: str, suffix: str) -> bool:
    """Whether the entry `key` of `kind` is there (neither read nor verified: `read_entry` does
    that); False where the cache cannot be used."""
    try:
        with _entry_folder(kind, key) as (fd, _):
            return stat.S_ISREG(os.stat(key + suffix, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:      # not there, or a cache that cannot be used (`read_entry` says why)
        return False


def write_entry(kind: str, key: str, suffix: str, data: bytes) -> None:
    """Store `data` as the entry `key` of `kind`, with its record, under the entry's lock (the
    build lock of `lookup_or_build`), each file atomically. A read-only cache stores nothing
    (one warning a process)."""
    try:
        with _entry_folder(kind, key) as (fd, folder):
            with _build_lock(fd, key, folder):
                _publish(fd, folder, key, suffix, data)
    except ReadOnlyCacheError as exc:
        _warn_read_only(exc)


def evict(kind: str, limit: int) -> int:
    """Remove the least recently used entries of `kind` (with their records and locks) until
    those left take at most `limit` bytes; return how many were removed. Entries that other
    processes remove or read meanwhile are no harm: a reader verifies what it reads."""
    found = []
    for path in _entries(cache_dir() / kind):
        try:
            info = path.lstat()
        except OSError:
            continue
        found.append((info.st_mtime, info.st_size, path))
    total, removed = sum(size for _, size, _ in found), 0
    for _, size, path in sorted(found):
        if total <= limit:
            break
        for name in (path, path.with_suffix(".json"), path.with_suffix(".lock")):
            try:
                name.unlink()
            except OSError:
                pass
        total -= size
        removed += 1
    return removed


def _warn_read_only(exc: ReadOnlyCacheError) -> None:
    """Warn, once a process for each cache root, that kernels it lacks are not cached."""
    root = _root_path()
    with _private_lock:
        if root in _warned_read_only:
            return
        _warned_read_only.add(root)
    warnings.warn(f"Kiln's kernel cache {root} is read-only ({os.strerror(exc.errno)}): its kernels "
                  "are used, and those it lacks are built for this process alone, not cached; set "
                  "KILN_CACHE_DIR to a writable directory of your own to keep them", stacklevel=2)


def _publish(dir_fd: int, folder: Path, key: str, suffix: str, data: bytes) -> None:
    """Store the entry `key` and its record, each atomically."""
    record = json.dumps({"key": key, "sha256": checksum(data)}).encode()
    for name, content in ((key + suffix, data), (key + ".json", record)):
        try:
            _write_new(dir_fd, name, content)
        except OSError as exc:
            raise _unusable(folder / name, exc, "storing an entry") from None


def _is_entry(name: str) -> bool:
    """Whether a file so named is a built file: no record, lock or temporary file."""
    return not name.endswith(_NOT_ENTRIES) and not name.startswith(".")


def _entries(folder: Path) -> list[Path]:
    """The built files under `folder`: no records, locks or temporary files, no links followed."""
    found = []
    for parent, dirs, files in os.walk(folder, followlinks=False):
        for name in files:
            path = Path(parent) / name
            if _is_entry(name) and not path.is_symlink():
                found.append(path)
    return found


def _kinds(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _abandoned_private_dirs(root: Path) -> list[Path]:
    """Private folders of processes that ended without removing them."""
    found = []
    for p in root.iterdir():
        if p.name.startswith(PRIVATE_PREFIX) and p.is_dir() and not p.is_symlink():
            pid = p.name[len(PRIVATE_PREFIX):].split("-")[0]
            if pid.isdigit() and not _process_alive(int(pid)):
                found.append(p)
    return found


def status() -> dict:
    """Counts and sizes of the cache's entries, by kind."""
    root = cache_dir()
    out = {"path": str(root), "kinds": {}}
    for kind in _kinds(root):
        files = _entries(kind)
        out["kinds"][kind.name] = {"entries": len(files), "bytes": sum(f.lstat().st_size for f in files)}
    return out


@dataclass
class Cleared:
    """What `clear` did: the entries it removed, and the paths it could not remove."""
    removed: int = 0
    failed: list[str] = field(default_factory=list)


def clear(kind: str | None = None) -> Cleared:
    """Delete every entry, record, build lock and leftover temporary file (links are removed,
    never followed), and the private folders of processes that ended; count only the entries
    actually removed. With `kind`, only the entries of that kind."""
    root = cache_dir()
    result = Cleared()
    if kind is None:
        tops = [p for p in root.iterdir() if p.is_symlink()] + _kinds(root)
        for folder in _abandoned_private_dirs(root):
            shutil.rmtree(folder, onerror=lambda _f, path, exc: result.failed.append(f"{path} ({exc[1]})"))
    else:
        tops = [p for p in _kinds(root) if p.name == kind]
    for top in tops:
        if top.is_symlink():
            _remove(top, result, counted=False)
            continue
        for parent, dirs, files in os.walk(top, topdown=False, followlinks=False):
            for name in files + [d for d in dirs if (Path(parent) / d).is_symlink()]:
                _remove(Path(parent) / name, result, counted=_is_entry(name) and not (Path(parent) / name).is_symlink())
            try:
                os.rmdir(parent)
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY:
                    result.failed.append(f"{parent} ({exc.strerror})")
    return result


def _remove(path: Path, result: Cleared, counted: bool) -> None:
    try:
        path.unlink()
    except OSError as exc:
        result.failed.append(f"{path} ({exc.strerror})")
        return
    result.removed += counted
