"""Tests for coldkv.store: round trips, sharding, fsspec roots, and injected faults."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as st_numpy
import zstandard

import coldkv
from coldkv import store as store_mod
from coldkv.store import (
    FORMAT_VERSION,
    CacheExistsError,
    CacheNotFoundError,
    CodebookNotFoundError,
    Store,
    StoreCorruptError,
    StoreError,
    StoreLockedError,
    StorePermissionError,
    TensorNotFoundError,
    UnsupportedFormatError,
)

# --------------------------------------------------------------------------- helpers


def mixed_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Tensors of every dtype the codec produces, plus 0-d, empty and odd values."""
    rng = np.random.default_rng(seed)
    f16 = rng.standard_normal((3, 5, 7)).astype(np.float16)
    f16.flat[:3] = [np.nan, np.inf, -0.0]  # bit-exactness, not just ==
    return {
        "k.f16": f16,
        "v.f32": rng.standard_normal((4, 9)).astype(np.float32),
        "codes.u8": rng.integers(0, 256, (6, 64), dtype=np.uint8),
        "idx.i32": rng.integers(-(2**31), 2**31 - 1, 50, dtype=np.int32),
        "ids.u16": rng.integers(0, 2**16, 33, dtype=np.uint16),
        "scalar": np.array(2.5, dtype=np.float32),
        "scalar.i32": np.int32(-7),  # numpy scalar, becomes a 0-d array
        "empty": np.zeros((0, 4), dtype=np.float16),
        "strided": np.arange(40, dtype=np.int32)[::3],  # non-contiguous view
        "flag": np.array([True, False, True]),
    }


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Same names in the same order, dtypes, shapes and bytes."""
    assert list(got) == list(want)
    for name, arr in want.items():
        arr = np.asarray(arr)
        assert got[name].dtype == arr.dtype, name
        assert got[name].shape == arr.shape, name
        assert got[name].tobytes() == np.ascontiguousarray(arr).tobytes(), name


def shard_tensors(n: int, seed: int) -> dict[str, np.ndarray]:
    """n tensors of 1 KiB each: with shard_bytes=1024 every tensor is its own shard."""
    return {f"t{i}": np.full(256, seed * 1000 + i, np.int32) for i in range(n)}


def cache_dir(root: Path, cache_id: str) -> Path:
    return root / "caches" / cache_id


def visible_entries(root: Path) -> list[str]:
    return sorted(os.listdir(root / "caches"))


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Store, dict[str, np.ndarray]]:
    """A local store holding cache 'abc' in 3 shards."""
    store = Store(tmp_path, shard_bytes=1024)
    tensors = shard_tensors(3, seed=1)
    store.put_cache("abc", tensors, {"model": "m"})
    return store, tensors


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("threads", [0, 2])
def test_round_trip_mixed_dtypes_bit_exact(tmp_path: Path, threads: int) -> None:
    store = Store(tmp_path, zstd_level=3, threads=threads)
    tensors = mixed_tensors()
    meta = {"model": {"sha256": "ab" * 32}, "prompt_ids": np.arange(5), "n": np.int64(3)}
    man = store.put_cache("run-1.a_b", tensors, meta)

    got, man2 = store.get_cache("run-1.a_b")
    assert_same(got, tensors)
    assert man2 == man == store.get_manifest("run-1.a_b")
    assert man.format_version == FORMAT_VERSION
    assert man.coldkv_version == coldkv.__version__
    assert man.meta == {"model": {"sha256": "ab" * 32}, "prompt_ids": [0, 1, 2, 3, 4], "n": 3}
    assert datetime.fromisoformat(man.created).utcoffset().total_seconds() == 0
    assert man.tensors["scalar"].shape == [] and man.tensors["empty"].shape == [0, 4]
    assert len(man.shards) == 1
    assert man.total_compressed_bytes == (cache_dir(tmp_path, "run-1.a_b") / man.shards[0].file).stat().st_size
    # nothing but the finished cache is left behind
    assert visible_entries(tmp_path) == ["run-1.a_b"]
    assert sorted(os.listdir(cache_dir(tmp_path, "run-1.a_b"))) == ["manifest.json", man.shards[0].file]
    assert json.loads((cache_dir(tmp_path, "run-1.a_b") / "manifest.json").read_text()) == man.model_dump()
    assert store.exists("run-1.a_b") and not store.exists("other")
    assert [m.cache_id for m in store.list_caches()] == ["run-1.a_b"]
    assert store.verify() == []


def test_shards_split_by_size_and_manifest_is_exact(tmp_path: Path) -> None:
    store = Store(tmp_path, shard_bytes=1000)
    tensors = {f"s{i}": np.full(100, i, np.int32) for i in range(5)}  # 400 B each
    tensors["big"] = np.arange(3000, dtype=np.int64).astype(np.uint8)  # > shard_bytes: never split
    tensors["tail"] = np.ones(10, np.float16)
    calls: list[tuple[int, int]] = []
    man = store.put_cache("sharded", tensors, progress=lambda done, total: calls.append((done, total)))

    assert [s.tensors for s in man.shards] == [["s0", "s1"], ["s2", "s3"], ["s4"], ["big"], ["tail"]]
    assert calls == [(i, 5) for i in range(1, 6)]
    for index, shard in enumerate(man.shards):
        assert shard.file == f"shard-{index:05d}.safetensors.zst"
        data = (cache_dir(tmp_path, "sharded") / shard.file).read_bytes()
        assert len(data) == shard.compressed_bytes
        assert hashlib.sha256(data).hexdigest() == shard.sha256
        raw = zstandard.ZstdDecompressor().decompress(data)
        assert len(raw) == shard.raw_bytes
        assert sorted(st_numpy.load(raw)) == sorted(shard.tensors)
        assert all(man.tensors[n].shard == index for n in shard.tensors)
    assert man.total_compressed_bytes == sum(s.compressed_bytes for s in man.shards)
    assert man.total_raw_bytes == sum(s.raw_bytes for s in man.shards)
    assert_same(store.get_cache("sharded")[0], tensors)

    # reading a subset touches only the shards it needs
    os.unlink(cache_dir(tmp_path, "sharded") / "shard-00000.safetensors.zst")
    got, _ = store.get_cache("sharded", names=["big", "s3"])
    assert_same(got, {"big": tensors["big"], "s3": tensors["s3"]})
    with pytest.raises(StoreCorruptError, match="shard-00000.safetensors.zst in cache sharded: missing"):
        store.get_cache("sharded", names=["s1"])
    with pytest.raises(TensorNotFoundError, match="no tensor"):
        store.get_cache("sharded", names=["nope"])


def test_rich_progress_bar_optional(tmp_path: Path) -> None:
    store = Store(tmp_path, shard_bytes=1024)
    tensors = shard_tensors(5, seed=3)
    store.put_cache("bar", tensors, progress=True)
    assert_same(store.get_cache("bar", progress=True)[0], tensors)


@pytest.mark.parametrize("kind", ["path", "file-url", "memory"])
def test_fsspec_roots_round_trip(tmp_path: Path, kind: str) -> None:
    if kind == "memory":
        root = f"memory://coldkv-test-{uuid.uuid4().hex}"
    elif kind == "file-url":
        root = (tmp_path / "s").as_uri()
    else:
        root = str(tmp_path / "s")
    store = Store(root, shard_bytes=1024)
    try:
        tensors = mixed_tensors(5) | shard_tensors(3, seed=5)
        man = store.put_cache("c1", tensors, {"where": kind})
        assert len(man.shards) > 1
        assert_same(store.get_cache("c1")[0], tensors)
        with pytest.raises(CacheExistsError):
            store.put_cache("c1", tensors)
        store.put_cache("c1", {"x": np.arange(3, dtype=np.uint8)}, overwrite=True)
        assert_same(store.get_cache("c1")[0], {"x": np.arange(3, dtype=np.uint8)})
        sha = store.put_codebook({"cb": np.eye(4, dtype=np.float32)}, {"k": 4})
        assert store.get_codebook(sha)[1] == {"k": 4}
        store.put_cache("c2", tensors, codebooks=[sha])
        assert [m.cache_id for m in store.list_caches()] == ["c1", "c2"]
        assert store.verify() == [] and store.gc() == []
        assert sorted(n for n in store._listdir(store._join("caches"))) == ["c1", "c2"]

        shard = store._join("caches", "c2", "shard-00001.safetensors.zst")
        data = bytearray(store.fs.cat_file(shard))
        data[len(data) // 2] ^= 0xFF
        store.fs.pipe_file(shard, bytes(data))
        with pytest.raises(StoreCorruptError, match="shard-00001.safetensors.zst in cache c2: sha256 mismatch"):
            store.get_cache("c2")
        store.remove("c2")
        assert not store.exists("c2") and store.exists("c1")
    finally:
        if kind == "memory":
            store.fs.rm(store.path, recursive=True)


def test_remote_lock_file_blocks_writers(tmp_path: Path) -> None:
    store = Store(f"memory://coldkv-test-{uuid.uuid4().hex}")
    try:
        store.fs.makedirs(store._join("caches"), exist_ok=True)
        lock = store._join("caches", ".lock-busy")
        store.fs.pipe_file(lock, json.dumps({"pid": 1, "host": "elsewhere", "time": "t"}).encode())
        with pytest.raises(StoreLockedError, match="busy is being written by pid 1 on elsewhere"):
            store.put_cache("busy", {"a": np.zeros(2)})
        assert [p.kind for p in store.verify()] == ["locked"]
        assert store.gc() == []  # another host's lock is never broken automatically
    finally:
        store.fs.rm(store.path, recursive=True)


# --------------------------------------------------------------------------- faults: reads


def test_truncated_shard(stored: tuple[Store, dict]) -> None:
    store, _ = stored
    path = cache_dir(Path(store.root), "abc") / "shard-00001.safetensors.zst"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(StoreCorruptError, match=r"shard-00001.safetensors.zst in cache abc: size mismatch"):
        store.get_cache("abc")
    problems = store.verify()
    assert len(problems) == 1 and problems[0].kind == "corrupt" and problems[0].path == str(path)


def test_flipped_byte_detected_before_decompressing(
    stored: tuple[Store, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, tensors = stored
    path = cache_dir(Path(store.root), "abc") / "shard-00001.safetensors.zst"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    expected = store.get_manifest("abc").shards[1].sha256
    actual = hashlib.sha256(bytes(data)).hexdigest()

    class NoDecompress:
        def decompress(self, *a, **k):  # pragma: no cover - must not run
            raise AssertionError("decompressed an unverified shard")

    monkeypatch.setattr(store_mod.zstandard, "ZstdDecompressor", NoDecompress)
    msg = f"shard-00001.safetensors.zst in cache abc: sha256 mismatch (expected {expected}, got {actual})"
    with pytest.raises(StoreCorruptError) as info:
        store.get_cache("abc", names=["t1"])
    assert str(info.value) == msg
    monkeypatch.undo()
    assert [str(p) for p in store.verify("abc")] == [msg]
    assert_same(store.get_cache("abc", names=["t0", "t2"])[0], {"t0": tensors["t0"], "t2": tensors["t2"]})


def test_missing_shard(stored: tuple[Store, dict]) -> None:
    store, _ = stored
    os.unlink(cache_dir(Path(store.root), "abc") / "shard-00002.safetensors.zst")
    with pytest.raises(StoreCorruptError, match="shard-00002.safetensors.zst in cache abc: missing"):
        store.get_cache("abc")
    assert ["missing" in str(p) for p in store.verify()] == [True]


def test_unknown_format_version(stored: tuple[Store, dict]) -> None:
    store, _ = stored
    path = cache_dir(Path(store.root), "abc") / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 99
    path.write_text(json.dumps(manifest))
    with pytest.raises(UnsupportedFormatError, match=r"format_version 99; .* reads format_version 1; upgrade"):
        store.get_cache("abc")
    assert store.list_caches() == []
    assert [p.kind for p in store.verify()] == ["unsupported"]


def test_corrupted_manifest_json(stored: tuple[Store, dict]) -> None:
    store, _ = stored
    path = cache_dir(Path(store.root), "abc") / "manifest.json"
    path.write_text(path.read_text()[:40])
    with pytest.raises(StoreCorruptError, match="manifest.json in cache abc: invalid JSON"):
        store.get_manifest("abc")
    assert store.list_caches() == []
    assert [p.kind for p in store.verify()] == ["corrupt"]


def test_manifest_with_unsafe_shard_name_rejected(stored: tuple[Store, dict]) -> None:
    store, _ = stored
    path = cache_dir(Path(store.root), "abc") / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["shards"][0]["file"] = "../../../etc/passwd"
    path.write_text(json.dumps(manifest))
    with pytest.raises(StoreCorruptError, match="invalid manifest .*bad shard file name"):
        store.get_cache("abc")


def test_missing_cache_and_manifest(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(CacheNotFoundError, match="no cache 'nope'"):
        store.get_cache("nope")
    with pytest.raises(CacheNotFoundError):
        store.verify("nope")
    (tmp_path / "caches" / "bare").mkdir(parents=True)
    with pytest.raises(StoreCorruptError, match="manifest.json in cache bare: missing"):
        store.get_manifest("bare")
    assert not store.exists("bare") and store.list_caches() == []


# --------------------------------------------------------------------------- faults: writes


def test_disk_full_during_write_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path, shard_bytes=1024)
    old, other = shard_tensors(3, seed=1), mixed_tensors(2)
    store.put_cache("target", old, {"v": 1})
    store.put_cache("other", other)
    written: list[str] = []
    real_write = Store._write_file

    def write_then_fill_disk(self: Store, path: str, data: bytes) -> None:
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_write(self, path, data)
        written.append(path)

    monkeypatch.setattr(Store, "_write_file", write_then_fill_disk)
    for cache_id, overwrite in [("target", True), ("fresh", False)]:
        written.clear()
        with pytest.raises(StoreError) as info:
            store.put_cache(cache_id, shard_tensors(4, seed=2), overwrite=overwrite)
        assert type(info.value) is StoreError
        assert str(info.value) == f"disk full while writing cache {cache_id}; nothing was changed"
        assert written[0].endswith("shard-00000.safetensors.zst")  # failed after the first shard
    monkeypatch.undo()

    assert visible_entries(tmp_path) == ["other", "target"]  # no temp dirs, no lock files
    assert not store.exists("fresh")
    tensors, man = store.get_cache("target")
    assert_same(tensors, old) and man.meta == {"v": 1}
    assert_same(store.get_cache("other")[0], other)
    assert store.verify() == []


@pytest.fixture
def deny_writes(monkeypatch: pytest.MonkeyPatch):
    """Make a directory tree unwritable: chmod 0o555 when not root; as root (permission
    bits are ignored) simulate it by making os.mkdir / writable os.open under it raise
    PermissionError, which is what the kernel would do."""
    restore: list[tuple[Path, int]] = []

    def deny(root: Path) -> None:
        if os.geteuid() != 0:
            for path in [root, *(p for p in root.rglob("*") if p.is_dir())]:
                restore.append((path, path.stat().st_mode))
                path.chmod(0o555)
            return
        real_mkdir, real_open = os.mkdir, os.open
        prefix = str(root)

        def denied(path) -> bool:
            return os.path.abspath(os.fspath(path)).startswith(prefix)

        def mkdir(path, *args, **kwargs):
            if denied(path):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real_mkdir(path, *args, **kwargs)

        def open_(path, flags, *args, **kwargs):
            if denied(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "open", open_)

    yield deny
    for path, mode in reversed(restore):
        path.chmod(mode)


def test_store_without_write_permission(tmp_path: Path, deny_writes) -> None:
    root = tmp_path / "ro"
    tensors = mixed_tensors()
    Store(root).put_cache("kept", tensors)
    empty = tmp_path / "empty"
    empty.mkdir()
    deny_writes(root)
    deny_writes(empty)

    store = Store(root)  # constructing and reading a read-only store works
    assert_same(store.get_cache("kept")[0], tensors)
    assert store.verify() == []
    with pytest.raises(StorePermissionError, match=f"no write permission in store {root}: cannot write {root}/caches"):
        store.put_cache("new", tensors)
    with pytest.raises(StorePermissionError, match=f"no write permission in store {empty}"):
        Store(empty).put_codebook({"a": np.zeros(3)})
    assert visible_entries(root) == ["kept"]


def test_overwrite_semantics(stored: tuple[Store, dict]) -> None:
    store, old = stored
    root = Path(store.root)
    new = {"only": np.arange(7, dtype=np.uint16)}
    with pytest.raises(CacheExistsError, match="cache 'abc' already exists .* overwrite=True"):
        store.put_cache("abc", new)
    assert_same(store.get_cache("abc")[0], old)

    man = store.put_cache("abc", new, {"v": 2}, overwrite=True)
    assert_same(store.get_cache("abc")[0], new)
    assert store.get_manifest("abc") == man
    assert sorted(os.listdir(cache_dir(root, "abc"))) == ["manifest.json", "shard-00000.safetensors.zst"]
    assert visible_entries(root) == ["abc"]

    store.remove("abc")
    assert not store.exists("abc") and visible_entries(root) == []
    with pytest.raises(CacheNotFoundError):
        store.remove("abc")


def test_gc_restores_interrupted_overwrite(stored: tuple[Store, dict]) -> None:
    store, tensors = stored
    caches = Path(store.root) / "caches"
    os.rename(caches / "abc", caches / ".old-abc-0123abcd")  # crash between the two renames
    assert not store.exists("abc")
    assert ["previous version" in str(p) for p in store.verify()] == [True]
    assert store.gc() == [f"restored cache abc from {caches}/.old-abc-0123abcd"]
    assert_same(store.get_cache("abc")[0], tensors)
    assert store.verify() == []


# --------------------------------------------------------------------------- processes

CHILD = """
import json, os, sys, time
import numpy as np
import coldkv
from coldkv import store as S

root, cache_id, seed, n, delay, go = sys.argv[1:]
seed, n, delay = int(seed), int(n), float(delay)
real_write = S.Store._write_file

def slow_write(self, path, data):
    real_write(self, path, data)
    time.sleep(delay)

S.Store._write_file = slow_write
tensors = {f"t{i}": np.full(256, seed * 1000 + i, np.int32) for i in range(n)}  # = shard_tensors
store = S.Store(root, shard_bytes=1024)
open(f"{go}.ready{seed}", "w").close()
while not os.path.exists(go):
    time.sleep(0.005)
try:
    store.put_cache(cache_id, tensors, {"seed": seed})
    print(json.dumps({"ok": True}), flush=True)
except S.StoreError as e:
    print(json.dumps({"ok": False, "error": type(e).__name__, "msg": str(e)}), flush=True)
"""


def spawn_writer(root: Path, cache_id: str, seed: int, n: int, delay: float, go: Path, **kw) -> subprocess.Popen:
    args = [sys.executable, "-c", CHILD, str(root), cache_id, str(seed), str(n), str(delay), str(go)]
    return subprocess.Popen(args, text=True, **kw)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_two_processes_writing_same_id(tmp_path: Path) -> None:
    root, go = tmp_path / "store", tmp_path / "go"
    seeds = (1, 2)
    procs = [spawn_writer(root, "same", s, n=4, delay=0.15, go=go, stdout=subprocess.PIPE) for s in seeds]
    wait_for(lambda: all(Path(f"{go}.ready{s}").exists() for s in seeds), 30, "writers to start")
    go.touch()  # release both at once; each holds the lock for ~0.6 s
    results = [json.loads(p.communicate(timeout=30)[0].strip().splitlines()[-1]) for p in procs]

    winners = [s for s, r in zip(seeds, results) if r["ok"]]
    losers = [r for r in results if not r["ok"]]
    assert len(winners) == 1, results
    assert losers[0]["error"] == "StoreLockedError" and "cache same is being written" in losers[0]["msg"]
    store = Store(root)
    tensors, man = store.get_cache("same")
    assert_same(tensors, shard_tensors(4, winners[0])) and man.meta == {"seed": winners[0]}
    assert store.verify() == [] and visible_entries(root) == ["same"]


def test_kill_9_during_write(tmp_path: Path) -> None:
    root, go = tmp_path / "store", tmp_path / "go"
    store = Store(root, shard_bytes=1024)
    keep = mixed_tensors(7)
    store.put_cache("keep", keep)
    go.touch()
    proc = spawn_writer(root, "big", 3, n=100, delay=0.05, go=go, stdout=subprocess.DEVNULL)
    try:
        wait_for(
            lambda: proc.poll() is None and any((root / "caches").glob(".tmp-big-*/shard-00002.safetensors.zst")),
            30,
            "the writer to be mid-way",
        )
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    problems = store.verify()
    assert [(p.kind, p.cache_id, p.safe_to_delete) for p in problems] == [("incomplete", "big", True)]
    assert "incomplete write of cache big" in str(problems[0]) and "safe to delete" in str(problems[0])
    assert [m.cache_id for m in store.list_caches()] == ["keep"] and not store.exists("big")
    assert_same(store.get_cache("keep")[0], keep)

    done = store.gc()
    assert any(".tmp-big-" in line for line in done)
    assert store.verify() == [] and visible_entries(root) == ["keep"]
    store.put_cache("big", shard_tensors(2, 4))  # the dead writer's lock is gone
    assert_same(store.get_cache("big")[0], shard_tensors(2, 4))


# --------------------------------------------------------------------------- codebooks, ids


def test_codebook_content_addressing(tmp_path: Path) -> None:
    store = Store(tmp_path)
    rng = np.random.default_rng(0)
    cb = {"centroids": rng.standard_normal((16, 8)).astype(np.float16), "perm": np.arange(8, dtype=np.int32)}
    sha = store.put_codebook(cb, {"k": 16, "stage": 0})
    path = tmp_path / "codebooks" / f"{sha}.safetensors.zst"
    stamp = path.stat().st_mtime_ns, path.stat().st_ino
    assert store.put_codebook(dict(reversed(cb.items())), {"stage": 0, "k": 16}) == sha
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == stamp  # a no-op, not a rewrite
    assert hashlib.sha256(zstandard.ZstdDecompressor().decompress(path.read_bytes())).hexdigest() == sha
    assert sorted(os.listdir(tmp_path / "codebooks")) == [path.name]

    tensors, meta = store.get_codebook(sha)
    assert_same({k: tensors[k] for k in cb}, cb) and meta == {"k": 16, "stage": 0}
    other = store.put_codebook(cb, {"k": 16, "stage": 1})
    assert other != sha and store.list_codebooks() == sorted([sha, other])

    store.put_cache("uses", {"codes": np.zeros(4, np.uint8)}, codebooks=[sha, "f" * 64])
    assert store.get_manifest("uses").codebooks == [sha, "f" * 64]
    assert [p.kind for p in store.verify("uses")] == ["missing-codebook"]
    with pytest.raises(CodebookNotFoundError, match="no codebook ffff"):
        store.get_codebook("f" * 64)

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptError, match=f"codebooks/{sha}.safetensors.zst"):
        store.get_codebook(sha)
    assert [p.kind for p in store.verify()] == ["missing-codebook", "corrupt"]


@pytest.mark.parametrize("bad", ["", ".hidden", "..", "a/b", "a b", "x" * 129, "ü", "../up", 5])
def test_invalid_cache_id(tmp_path: Path, bad) -> None:
    store = Store(tmp_path)
    for call in (
        lambda: store.put_cache(bad, {"a": np.zeros(1)}),
        lambda: store.get_cache(bad),
        lambda: store.exists(bad),
        lambda: store.remove(bad),
    ):
        with pytest.raises(ValueError, match="invalid cache id"):
            call()
    assert not (tmp_path / "caches").exists() or visible_entries(tmp_path) == []


def test_valid_edge_ids_and_bad_inputs(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for cache_id in ("x" * 128, "A.b_c-1", "a..b"):
        store.put_cache(cache_id, {"a": np.zeros(1)})
    assert len(store.list_caches()) == 3
    with pytest.raises(TypeError, match="tensor 'o' has dtype object"):
        store.put_cache("o", {"o": np.array([None])})
    with pytest.raises(TypeError, match="expected a numpy array"):
        store.put_cache("l", {"l": [1, 2]})
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        store.put_cache("m", {"a": np.zeros(1)}, {"bad": object()})
    assert len(store.list_caches()) == 3
