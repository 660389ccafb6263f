"""The on-disk kernel cache: corrupt entries, concurrent builders, privacy, and `kiln cache`."""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from kiln.cli import main
from kiln.runtime import cache
from kiln.runtime.cpu import build_shared_library

# A kernel whose result shows it ran: out[i] = 2 * in[i] + 1.
SOURCE = """
void kiln_test_kernel(const float* in, float* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = 2.0f * in[i] + 1.0f;
}
"""


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "kiln-cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    return root


def check_kernel(path: Path, tag: str = "") -> None:
    """Load the built library at `path` and check that its kernel computes 2x + 1."""
    lib = ctypes.CDLL(str(path))
    fn = getattr(lib, "kiln_test_kernel" + tag)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    values = (ctypes.c_float * 4)(1.0, -2.0, 0.5, 3.0)
    out = (ctypes.c_float * 4)()
    fn(values, out, 4)
    assert list(out) == [3.0, -3.0, 2.0, 7.0]


def entry_files(root: Path, suffix: str) -> list[Path]:
    """The shared entries: no temporary files, no private copies (all in '.'-named places)."""
    return sorted(p for p in root.rglob(f"*{suffix}")
                  if not any(part.startswith(".") for part in p.relative_to(root).parts))


def only_entry(root: Path, suffix: str = ".so") -> Path:
    """The one cache entry of `suffix` under `root` (the shared copy, not the private one)."""
    found = entry_files(root, suffix)
    assert len(found) == 1, found
    return found[0]


def record_of(path: Path) -> Path:
    return path.with_suffix(".json")


def fresh_source(tag: str) -> str:
    """A kernel source unique to one test (ctypes caches libraries by path within a process)."""
    return SOURCE.replace("kiln_test_kernel", f"kiln_test_kernel{tag}")


def test_build_is_cached_with_a_checksum_record(cache_root):
    source = fresh_source("_cached")
    path = build_shared_library(source, "kiln_test_kernel_cached")
    entry = only_entry(cache_root)
    assert entry.parent.parent.parent == cache_root and path.suffix == ".so"
    assert path.parent == cache._private_dir(), "the caller loads a private copy, not the shared entry"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.read_bytes() == entry.read_bytes()
    record = json.loads(record_of(entry).read_text())
    assert record == {"key": entry.stem, "sha256": hashlib.sha256(entry.read_bytes()).hexdigest()}
    mtime = entry.stat().st_mtime_ns
    assert build_shared_library(source, "kiln_test_kernel_cached") == path
    assert entry.stat().st_mtime_ns == mtime, "a valid entry is reused, not rebuilt"
    check_kernel(path, "_cached")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


def break_record(path: Path) -> None:
    record_of(path).write_text("{not json")


def drop_record(path: Path) -> None:
    record_of(path).unlink()


def foreign_record(path: Path) -> None:
    record_of(path).write_text(json.dumps({"key": path.stem, "sha256": "0" * 64}))


@pytest.mark.parametrize("damage", [truncate, garble, break_record, drop_record, foreign_record])
def test_corrupt_entry_is_rebuilt(damage, cache_root):
    tag = f"_{damage.__name__}"
    source = fresh_source(tag)
    build_shared_library(source, "k")
    entry = only_entry(cache_root)
    good = entry.read_bytes()
    damage(entry)
    rebuilt = build_shared_library(source, "k")
    assert len(rebuilt.read_bytes()) == len(good) and len(entry.read_bytes()) == len(good)
    assert json.loads(record_of(entry).read_text())["sha256"] == hashlib.sha256(entry.read_bytes()).hexdigest()
    check_kernel(rebuilt, tag)


def _slow_build(out: Path) -> None:
    """Write a payload in many small pieces (a window for torn reads), ending in its own hash."""
    payload = os.urandom(64 * 1024)
    with open(out, "wb") as f:
        for k in range(0, len(payload), 1024):
            f.write(payload[k:k + 1024])
            f.flush()
            time.sleep(0.0005)
        f.write(hashlib.sha256(payload).digest())


def _builder(root: str, barrier, rounds: int, results) -> None:
    os.environ["KILN_CACHE_DIR"] = root
    barrier.wait()
    for _ in range(rounds):
        data = cache.lookup_or_build("test", "ab" * 32, ".bin", _slow_build).read_bytes()
        results.put(hashlib.sha256(data[:-32]).digest() == data[-32:] and len(data) == 64 * 1024 + 32)


def _corrupter(root: str, barrier, rounds: int) -> None:
    """Keep damaging the entry, so that builders see invalid entries and rebuild concurrently."""
    os.environ["KILN_CACHE_DIR"] = root
    barrier.wait()
    target = Path(root) / "test" / "ab" / ("ab" * 32 + ".json")
    for _ in range(rounds):
        try:
            target.write_text("{}")
        except OSError:
            pass
        time.sleep(0.01)


def test_concurrent_builders_never_see_a_torn_file(cache_root):
    ctx = multiprocessing.get_context("fork")
    builders, rounds = 4, 5
    barrier, results = ctx.Barrier(builders + 1), ctx.Queue()
    procs = [ctx.Process(target=_builder, args=(str(cache_root), barrier, rounds, results))
             for _ in range(builders)]
    procs.append(ctx.Process(target=_corrupter, args=(str(cache_root), barrier, 30)))
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(builders * rounds)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert outcomes == [True] * (builders * rounds)
    leftovers = [p.name for p in (cache_root / "test").rglob(".*")]
    assert leftovers == [], "temporary files are cleaned up"


def _build_and_run(root: str, barrier, results) -> None:
    os.environ["KILN_CACHE_DIR"] = root
    barrier.wait()
    try:
        path = build_shared_library(fresh_source("_concurrent"), "k")
        check_kernel(path, "_concurrent")
        results.put("ok")
    except Exception as exc:  # report any failure to the parent
        results.put(f"{type(exc).__name__}: {exc}")


def test_concurrent_compilers_of_one_kernel_all_succeed(cache_root):
    ctx = multiprocessing.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_build_and_run, args=(str(cache_root), barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=180) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
    assert outcomes == ["ok"] * n
    assert len(entry_files(cache_root, ".so")) == 1


def _counted_slow_build(log: Path):
    """A build that appends a line to `log` each time it runs, and takes a while (a window in
    which the other process misses the entry too)."""
    def build(out: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        out.write_bytes(b"built by " + str(os.getpid()).encode())
    return build


def _build_once(root: str, log: str, barrier, results) -> None:
    os.environ["KILN_CACHE_DIR"] = root
    barrier.wait()
    results.put(cache.lookup_or_build("test", "cd" * 32, ".bin", _counted_slow_build(Path(log))).read_bytes())


def test_processes_missing_one_entry_at_once_build_it_once(cache_root, tmp_path):
    """Two processes (two test workers, two ranks) that need the same kernel at the same time:
    one builds it, the other waits for its build lock and uses its entry."""
    ctx = multiprocessing.get_context("fork")
    log = tmp_path / "builds.log"
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_once, args=(str(cache_root), str(log), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    builders = log.read_text().split()
    assert len(builders) == 1, f"built by processes {builders}"
    assert outcomes == [f"built by {builders[0]}".encode()] * 2
    assert cache.status()["kinds"]["test"]["entries"] == 1, "the build lock is no entry"


def test_cache_directory_is_private(tmp_path, monkeypatch):
    root = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    old = os.umask(0o022)
    try:
        path = build_shared_library(fresh_source("_private"), "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    entry = only_entry(root)
    assert stat.S_IMODE(entry.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.parent.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_existing_cache_directory_is_made_private(tmp_path, monkeypatch):
    root = tmp_path / "open"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    assert cache.cache_dir() == root
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_cache_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    with pytest.raises(PermissionError, match=r"belongs to another user \(uid 65534\); set KILN_CACHE_DIR"):
        build_shared_library(fresh_source("_theirs"), "k")


def test_kiln_cache_status_and_clear(cache_root, capsys):
    for tag in ("_s1", "_s2"):
        build_shared_library(fresh_source(tag), "k")
    (next(cache_root.rglob("*.so")).parent / ".build-leftover.so").write_bytes(b"partial")
    size = sum(p.stat().st_size for p in entry_files(cache_root, ".so"))

    assert main(["cache", "status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"kernel cache: {cache_root}"
    assert lines[1].split() == ["kind", "entries", "size"]
    assert lines[2].split()[:2] == ["cpu", "2"] and lines[3].split()[:2] == ["total", "2"]
    assert cache.status()["kinds"]["cpu"] == {"entries": 2, "bytes": size}

    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 2 entries from {cache_root}"
    assert entry_files(cache_root, ".so") == [] and cache_root.is_dir()

    assert main(["cache"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split() == ["total", "0", "0", "B"]
    assert lines[-1] == "graph cache (kind graphs): off (KILN_GRAPH_CACHE=0), at most 1.0 GiB (KILN_GRAPH_CACHE_MB)"
    check_kernel(build_shared_library(fresh_source("_s1"), "k"), "_s1")


def test_entries_of_another_kind_are_verified_when_read(cache_root):
    key = "cd" * 32
    assert cache.read_entry("graphs", key, ".plan") is None
    cache.write_entry("graphs", key, ".plan", b"a plan")
    assert cache.read_entry("graphs", key, ".plan") == b"a plan"
    only_entry(cache_root, ".plan").write_bytes(b"a changed plan")
    assert cache.read_entry("graphs", key, ".plan") is None
    assert cache.status()["kinds"]["graphs"]["entries"] == 1


def test_an_entry_is_read_into_writable_page_aligned_memory_of_its_own(cache_root):
    key, payload = "ab" * 32, bytes(range(256)) * 300
    cache.write_entry("graphs", key, ".plan", payload)
    first, second = (cache.read_entry("graphs", key, ".plan") for _ in range(2))
    assert first == payload and not first.readonly
    memory = [torch.frombuffer(data, dtype=torch.uint8) for data in (first, second)]
    assert memory[0].data_ptr() % mmap.PAGESIZE == 0 and memory[0].data_ptr() != memory[1].data_ptr()
    only_entry(cache_root / "graphs", ".plan").write_bytes(payload[:-1])
    assert cache.read_entry("graphs", key, ".plan") is None


def test_a_large_entry_is_checked_in_parts_and_a_change_in_any_part_is_found(cache_root):
    key, payload = "ba" * 32, os.urandom(3 * cache._PART + 1000)
    cache.write_entry("graphs", key, ".plan", payload)
    record = json.loads(only_entry(cache_root / "graphs", ".json").read_text())
    parts = b"".join(hashlib.sha256(payload[k:k + cache._PART]).digest() for k in range(0, len(payload), cache._PART))
    assert record["sha256"] == "parts " + hashlib.sha256(parts).hexdigest()
    assert cache.read_entry("graphs", key, ".plan") == payload
    for at in (0, 2 * cache._PART + 5, len(payload) - 1):
        changed = bytearray(payload)
        changed[at] ^= 1
        only_entry(cache_root / "graphs", ".plan").write_bytes(changed)
        assert cache.read_entry("graphs", key, ".plan") is None
    only_entry(cache_root / "graphs", ".plan").write_bytes(payload + b"x")
    assert cache.read_entry("graphs", key, ".plan") is None


@pytest.mark.parametrize("size", [1, cache._PART, 3 * cache._PART + 1000])
def test_read_file_reads_a_whole_file_into_page_aligned_memory_in_pieces_at_once(tmp_path, size):
    path = tmp_path / "file"
    payload = os.urandom(size)
    path.write_bytes(payload)
    data = cache.read_file(path)
    assert data[:] == payload and memoryview(data)[-1] == payload[-1]
    assert torch.frombuffer(data, dtype=torch.uint8).data_ptr() % mmap.PAGESIZE == 0
    data.seek(-1, os.SEEK_END)
    assert data.seekable() and data.read() == payload[-1:]


def test_read_file_refuses_an_empty_file(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        cache.read_file(tmp_path / "empty")


def test_evict_removes_the_least_recently_used_entries_beyond_a_size(cache_root):
    keys = [f"{k:02d}" * 32 for k in range(4)]
    for age, key in enumerate(keys):
        cache.write_entry("graphs", key, ".plan", b"x" * 1000)
        path = only_entry(cache_root / "graphs" / key[:2], ".plan")
        os.utime(path, (1000 + age, 1000 + age))
    assert cache.read_entry("graphs", keys[0], ".plan") is not None    # the oldest, used now
    assert cache.evict("graphs", 2500) == 2
    assert [cache.read_entry("graphs", key, ".plan") is not None for key in keys] == [True, False, False, True]
    assert not list(cache_root.rglob(f"{keys[1]}.*"))                 # record and lock gone too


def _write_and_read(key: str, payload: bytes, rounds: int, queue) -> None:
    seen = set()
    for _ in range(rounds):
        cache.write_entry("graphs", key, ".plan", payload)
        data = cache.read_entry("graphs", key, ".plan")
        seen.add(None if data is None else bytes(data))
    queue.put(seen)


def test_processes_writing_one_entry_at_once_leave_readers_whole_entries(cache_root):
    key, payloads = "ef" * 32, [bytes([k]) * (50_000 + 1000 * k) for k in range(4)]
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_write_and_read, args=(key, p, 20, queue)) for p in payloads]
    for w in workers:
        w.start()
    seen = set().union(*(queue.get(timeout=120) for _ in workers))
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    assert seen <= {None, *payloads} and seen & set(payloads)
    assert cache.read_entry("graphs", key, ".plan") in payloads
