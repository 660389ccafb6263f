"""The on-disk kernel cache.

Entries are content-addressed: the key hashes the source, the compiler and its version, the
flags and the target architecture. An entry is the built file plus a small record of its
checksum; both are written to temporary files and renamed into place, so a reader never sees
a torn file. An entry whose record is missing, unreadable, owned by another user or does not
match the file's checksum is rebuilt, never trusted. The directory is private to its user.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from kiln.log import logger


def cache_dir() -> Path:
    """The cache root: $KILN_CACHE_DIR, else ~/.cache/kiln; created private (mode 0700).

    A root that belongs to another user is refused: whoever owns it could swap kernels.
    """
    root = os.environ.get("KILN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"the kernel cache {path} belongs to another user; "
                              "set KILN_CACHE_DIR to a directory of your own")
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def content_key(*parts: str) -> str:
    """A hex key over all the parts that determine a build's result."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def lookup_or_build(kind: str, key: str, suffix: str, build: Callable[[Path], None]) -> Path:
    """Return the path of the cached artifact `key`, building it with `build(path)` if the
    entry is missing or untrustworthy. `build` writes the artifact to the path it is given."""
    folder = cache_dir() / kind / key[:2]
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    target = folder / f"{key}{suffix}"
    record = folder / f"{key}.json"
    if _valid(target, record):
        logger.debug("kernel cache hit: %s/%s", kind, target.name)
        return target
    logger.info("kernel cache miss: building %s/%s", kind, target.name)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=suffix)
    os.close(fd)
    try:
        build(Path(tmp))
        digest = _checksum(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _atomic_write(record, json.dumps({"sha256": digest}).encode())
    if not _valid(target, record):
        # Another builder replaced the file between our rename and our record; theirs is
        # complete too, so record what is there now.
        _atomic_write(record, json.dumps({"sha256": _checksum(target)}).encode())
    return target


def _valid(target: Path, record: Path) -> bool:
    try:
        if target.stat().st_uid != os.getuid():
            return False
        expected = json.loads(record.read_text())["sha256"]
        return _checksum(target) == expected
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _entries(folder: Path) -> list[Path]:
    """The built files under `folder`: no records, no temporary files of builds in progress."""
    return [f for f in folder.rglob("*")
            if f.is_file() and not f.name.endswith(".json") and not f.name.startswith(".")]


def status() -> dict:
    """Counts and sizes of the cache's entries, by kind."""
    root = cache_dir()
    out = {"path": str(root), "kinds": {}}
    for kind in sorted(p for p in root.iterdir() if p.is_dir()):
        files = _entries(kind)
        out["kinds"][kind.name] = {"entries": len(files), "bytes": sum(f.stat().st_size for f in files)}
    return out


def clear() -> int:
    """Delete every entry; return how many were removed."""
    root = cache_dir()
    removed = 0
    for kind in [p for p in root.iterdir() if p.is_dir()]:
        removed += len(_entries(kind))
        shutil.rmtree(kind, ignore_errors=True)
    return removed
