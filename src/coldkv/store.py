"""Cold storage for named tensors: zstd-compressed safetensors shards plus a JSON manifest.

Layout under a store root (a local path or any fsspec URL such as ``memory://x``,
``file:///srv/kv`` or ``s3://bucket/kv``)::

    <root>/caches/<cache_id>/manifest.json
    <root>/caches/<cache_id>/shard-00000.safetensors.zst
    <root>/caches/<cache_id>/shard-00001.safetensors.zst ...
    <root>/codebooks/<sha256>.safetensors.zst        (content-addressed, shared by caches)

Guarantees
----------
* **Atomic publication.** A cache is written into ``caches/.tmp-<id>-<random>/`` (every
  file: temp file, flush, fsync, ``os.replace``; the manifest last), the directory is
  fsynced and only then renamed to ``caches/<id>``. A crash at any point leaves either
  the previous state or the complete new cache, never a cache that looks complete but
  is not. Leftovers of crashed writes are reported by :meth:`Store.verify` and removed
  by :meth:`Store.gc`.
* **One writer per cache id.** Writers take an exclusive lock (``fcntl.flock`` on a
  local file system, an exclusively created lock file elsewhere); a second writer gets
  :class:`StoreLockedError` at once instead of waiting.
* **Verified reads.** Each shard's size and sha256 (of the compressed bytes) are checked
  *before* it is decompressed; errors name the broken file.

On non-local file systems (object stores) a directory rename is not atomic, so a cache is
published by moving its shards first and its manifest last: a cache without a manifest is
never listed. Local stores get the full rename/fsync protocol.

Arrays returned by :meth:`Store.get_cache` are fresh numpy arrays in the stored dtypes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Union

import fsspec
import numpy as np
import safetensors.numpy as st_numpy
import zstandard
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

import coldkv

__all__ = [
    "FORMAT_VERSION",
    "SUPPORTED_FORMAT_VERSIONS",
    "CacheExistsError",
    "CacheNotFoundError",
    "CodebookNotFoundError",
    "Manifest",
    "Problem",
    "ShardInfo",
    "Store",
    "StoreCorruptError",
    "StoreError",
    "StoreLockedError",
    "StorePermissionError",
    "TensorInfo",
    "TensorNotFoundError",
    "UnsupportedFormatError",
    "validate_cache_id",
]

log = logging.getLogger(__name__)

#: Manifest format written by this version.
FORMAT_VERSION = 1
#: Manifest formats this version can read.
SUPPORTED_FORMAT_VERSIONS = (1,)

MANIFEST_NAME = "manifest.json"
CACHES_DIR = "caches"
CODEBOOKS_DIR = "codebooks"
REFS_DIR = "refs"
SHARD_SUFFIX = ".safetensors.zst"
#: Metadata key (in the safetensors header) holding a codebook's JSON meta.
CODEBOOK_META_KEY = "coldkv.codebook_meta"

_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_SHARD_RE = re.compile(r"shard-\d{5,}" + re.escape(SHARD_SUFFIX))
#: ``.tmp-<id>-<8 hex>`` (write in progress), ``.old-...`` (overwrite), ``.del-...`` (remove).
_LEFTOVER_RE = re.compile(r"\.(tmp|old|del)-(.+)-([0-9a-f]{8})")
_LOCK_PREFIX = ".lock-"
_PART_RE = re.compile(r"\.(.+)\.([0-9a-f]{8})\.part")
#: Dtypes that safetensors' numpy loader reads back (by ``np.dtype.name``).
STORABLE_DTYPES = (
    "float64", "float32", "float16", "complex64", "bool",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
)  # fmt: skip
#: Show a rich progress bar (``progress=True``) only above this many shards.
_RICH_MIN_SHARDS = 3

Progress = Union[None, bool, Callable[[int, int], None]]


# --------------------------------------------------------------------------- errors


class StoreError(Exception):
    """Base class of all store errors; ``str(err)`` is a one-line message."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class StoreCorruptError(StoreError):
    """A stored file is missing, truncated, or fails its checksum."""


class CacheNotFoundError(StoreError):
    """No cache with this id."""


class CodebookNotFoundError(StoreError):
    """No codebook with this hash."""


class TensorNotFoundError(StoreError, KeyError):
    """A requested tensor name is not in the cache."""


class CacheExistsError(StoreError):
    """The cache id is taken and ``overwrite`` was not requested."""


class StoreLockedError(StoreError):
    """Another writer holds the lock for this cache id."""


class UnsupportedFormatError(StoreError):
    """The manifest's ``format_version`` is not one this coldkv can read."""


class StorePermissionError(StoreError):
    """The store (or a path in it) is not writable."""


# --------------------------------------------------------------------------- manifest


class TensorInfo(BaseModel):
    """Dtype, shape and shard index of one stored tensor."""

    dtype: str
    shape: list[int]
    shard: int


class ShardInfo(BaseModel):
    """One shard file: its compressed size and sha256, raw (safetensors) size, tensors."""

    file: str
    compressed_bytes: int
    sha256: str
    raw_bytes: int
    tensors: list[str]

    @field_validator("file")
    @classmethod
    def _plain_shard_name(cls, v: str) -> str:
        if not _SHARD_RE.fullmatch(v):  # also rules out path traversal
            raise ValueError(f"bad shard file name {v!r}")
        return v

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        if not _SHA_RE.fullmatch(v):
            raise ValueError(f"bad sha256 {v!r}")
        return v


class Manifest(BaseModel):
    """Contents of ``caches/<id>/manifest.json``.

    ``meta`` holds the caller's JSON-able fields (model and tokenizer identity, prompt
    token ids, codec settings, ...); ``codebooks`` the sha256 of each shared codebook the
    cache needs. Unknown extra fields are kept (readers tolerate additions).
    """

    model_config = ConfigDict(extra="allow")

    format_version: int
    cache_id: str
    created: str
    coldkv_version: str
    zstd_level: int
    meta: dict[str, Any]
    codebooks: list[str]
    tensors: dict[str, TensorInfo]
    shards: list[ShardInfo]
    total_compressed_bytes: int
    total_raw_bytes: int

    def to_json(self) -> str:
        """The manifest as pretty JSON text."""
        return json.dumps(self.model_dump(), indent=2) + "\n"


@dataclass(frozen=True)
class Problem:
    """One finding of :meth:`Store.verify`; ``str(problem)`` is its message.

    ``kind`` is one of ``corrupt``, ``unsupported``, ``incomplete`` (a crashed write),
    ``leftover`` (debris of an overwrite/remove), ``missing-codebook``, ``locked``.
    """

    kind: str
    path: str
    message: str
    cache_id: str | None = None
    safe_to_delete: bool = False

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------- helpers


def validate_cache_id(cache_id: str) -> str:
    """Return ``cache_id`` if it is valid, else raise ``ValueError``."""
    if (
        not isinstance(cache_id, str)
        or not _ID_RE.fullmatch(cache_id)
        or cache_id.startswith(".")
    ):
        raise ValueError(
            f"invalid cache id {cache_id!r}: use 1-128 characters from [A-Za-z0-9._-],"
            " not starting with '.'"
        )
    return cache_id


def _validate_sha(sha: str) -> str:
    if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
        raise ValueError(f"invalid codebook hash {sha!r}: expected 64 lowercase hex digits")
    return sha


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _suffix() -> str:
    return secrets.token_hex(4)


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _json_default(obj: Any) -> Any:
    """Turn numpy scalars/arrays into JSON values; reject everything else."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"value of type {type(obj).__name__} is not JSON-serialisable")


def _jsonable(meta: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """Normalise caller metadata to plain JSON types (numpy values become lists/numbers)."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise TypeError(f"{what}: metadata must be a dict, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(dict(meta), default=_json_default))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: metadata is not JSON-serialisable: {e}") from None


def _prepare_tensors(tensors: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    """Check names and dtypes; return C-contiguous arrays (safetensors needs them)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{what}: tensors must be a dict of numpy arrays")
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"{what}: invalid tensor name {name!r}")
        if not isinstance(arr, (np.ndarray, np.generic)):
            raise TypeError(
                f"{what}: tensor {name!r} is a {type(arr).__module__}.{type(arr).__name__},"
                " expected a numpy array (convert with np.asarray)"
            )
        arr = np.asarray(arr)
        if arr.dtype.name not in STORABLE_DTYPES:
            raise TypeError(
                f"{what}: tensor {name!r} has dtype {arr.dtype}, which cannot be stored"
                f" (supported: {', '.join(STORABLE_DTYPES)})"
            )
        out[name] = arr if arr.flags.c_contiguous else arr.copy(order="C")
    return out


def _plan_shards(arrays: Mapping[str, np.ndarray], shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most ~shard_bytes (never split one)."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, arr in arrays.items():
        if current and size + arr.nbytes > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += arr.nbytes
    if current:
        groups.append(current)
    return groups


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}{SHARD_SUFFIX}"


def _safetensors_metadata(raw: bytes) -> dict[str, str]:
    """The ``__metadata__`` dict of a serialized safetensors blob."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return header.get("__metadata__", {}) or {}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_local_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory, fsync, rename."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{_suffix()}.part")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _progress(progress: Progress, total: int, description: str) -> Iterator[Callable[[], None]]:
    """Yield an ``advance()`` function: a callback ``progress(done, total)``, a rich bar
    (``progress=True`` and more than a few shards) or nothing."""
    if callable(progress):
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            progress(done, total)

        yield advance
    elif progress and total > _RICH_MIN_SHARDS:
        from rich.progress import Progress as RichProgress

        with RichProgress(transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda: bar.advance(task)
    else:
        yield lambda: None


# --------------------------------------------------------------------------- locks


@dataclass
class _Lock:
    path: str
    fd: int | None  # local flock descriptor; None for a remote lock file


class _LocalLocks:
    """``fcntl.flock`` locks on ``<dir>/.lock-<name>``; the file is unlinked on release.

    Unlinking while holding the lock is safe because acquirers re-check, after locking,
    that the path still names the inode they locked. A killed holder's lock is released
    by the kernel, so crashed writers never leave a stuck lock.
    """

    @staticmethod
    def acquire(path: str, what: str, blocking: bool = False) -> _Lock:
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = _LocalLocks._holder(fd)
                os.close(fd)
                raise StoreLockedError(
                    f"{what} is being written by another process{holder} (lock {path})"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return _Lock(path, fd)
            os.close(fd)  # the previous holder unlinked it; lock the new file instead

    @staticmethod
    def _holder(fd: int) -> str:
        with contextlib.suppress(OSError, ValueError):
            pid = int(os.pread(fd, 32, 0).decode().strip())
            return f" (pid {pid})"
        return ""

    @staticmethod
    def release(lock: _Lock) -> None:
        with contextlib.suppress(OSError):
            os.unlink(lock.path)
        if lock.fd is not None:
            os.close(lock.fd)

    @staticmethod
    def held(path: str) -> bool:
        """Whether some process holds the lock (no side effects)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False


# --------------------------------------------------------------------------- store


class Store:
    """A store of tensor caches and shared codebooks under ``root``.

    Args:
        root: local directory or fsspec URL. Nothing is created until the first write,
            so read-only stores can be read.
        zstd_level: zstd compression level (negative = fast, up to 22).
        shard_bytes: target raw size of one shard; a tensor is never split, so a shard
            holding one large tensor can be bigger.
        threads: zstd worker threads (0 = single-threaded, -1 = one per CPU); helps for
            shards of several MiB and more.
    """

    def __init__(
        self, root: str | os.PathLike, zstd_level: int = 10, shard_bytes: int = 64 << 20, threads: int = 0
    ) -> None:
        root = os.fspath(root)
        if "://" not in root:
            root = os.path.expanduser(root)
        if zstd_level > zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"zstd_level {zstd_level} > {zstandard.MAX_COMPRESSION_LEVEL}")
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        if threads < -1:
            raise ValueError(f"threads must be >= -1, got {threads}")
        self.root = root
        self.zstd_level = zstd_level
        self.shard_bytes = shard_bytes
        self.threads = threads
        self.fs, self.path = fsspec.core.url_to_fs(root)
        self.local = isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    # ----------------------------------------------------------------- paths

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def _cache_dir(self, cache_id: str) -> str:
        return self._join(CACHES_DIR, cache_id)

    def _codebook_path(self, sha: str) -> str:
        return self._join(CODEBOOKS_DIR, sha + SHARD_SUFFIX)

    # ----------------------------------------------------------------- file-system primitives

    def _compressor(self) -> zstandard.ZstdCompressor:
        return zstandard.ZstdCompressor(level=self.zstd_level, threads=self.threads, write_checksum=True)

    def _read(self, path: str) -> bytes:
        if self.local:
            with open(path, "rb") as f:
                return f.read()
        return self.fs.cat_file(path)

    def _write_file(self, path: str, data: bytes) -> None:
        """Write one file durably (locally: temp file + fsync + ``os.replace``)."""
        if self.local:
            _write_local_atomic(path, data)
        else:
            self.fs.pipe_file(path, data)

    def _makedirs(self, path: str) -> None:
        if self.local:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def _mkdir_new(self, path: str) -> None:
        if self.local:
            os.mkdir(path)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def _isdir(self, path: str) -> bool:
        return os.path.isdir(path) if self.local else self.fs.isdir(path)

    def _isfile(self, path: str) -> bool:
        return os.path.isfile(path) if self.local else self.fs.isfile(path)

    def _listdir(self, path: str) -> list[str]:
        """Entry names in ``path`` (empty if it does not exist), sorted."""
        try:
            if self.local:
                return sorted(os.listdir(path))
            return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _rmtree(self, path: str) -> None:
        if self.local:
            shutil.rmtree(path)
        else:
            self.fs.rm(path, recursive=True)

    def _rmtree_quiet(self, path: str) -> None:
        with contextlib.suppress(Exception):
            if self._isdir(path):
                self._rmtree(path)

    def _remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.local:
                os.unlink(path)
            else:
                self.fs.rm_file(path)

    def _sync_dir(self, path: str) -> None:
        if self.local:
            _fsync_dir(path)

    def _move_dir(self, src: str, dst: str, manifest_last: bool) -> None:
        """Rename a cache directory (atomic locally; file by file elsewhere).

        Remotely the manifest moves last when publishing (``dst`` becomes visible only
        once complete) and first when retiring (``src`` stops being visible at once).
        """
        if self.local:
            os.rename(src, dst)
            _fsync_dir(os.path.dirname(dst))
            return
        rel = sorted(posixpath.relpath(p, src) for p in self.fs.find(src))
        others = [r for r in rel if r != MANIFEST_NAME]
        manifest = [r for r in rel if r == MANIFEST_NAME]
        for r in (others + manifest) if manifest_last else (manifest + others):
            self.fs.mv(posixpath.join(src, r), posixpath.join(dst, r))
        self._rmtree_quiet(src)

    # ----------------------------------------------------------------- locks

    def _lock_path(self, directory: str, name: str) -> str:
        return posixpath.join(directory, _LOCK_PREFIX + name)

    def _acquire(self, directory: str, name: str, what: str, blocking: bool = False) -> _Lock:
        path = self._lock_path(directory, name)
        if self.local:
            return _LocalLocks.acquire(path, what, blocking)
        return self._acquire_remote(path, what, blocking)

    def _acquire_remote(self, path: str, what: str, blocking: bool) -> _Lock:
        """Exclusive-create a lock file holding pid/host (best effort where the file
        system cannot create exclusively)."""
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": _now_iso()})
        deadline = time.monotonic() + (60.0 if blocking else 0.0)
        while True:
            try:
                with self.fs.open(path, "xb") as f:
                    f.write(info.encode())
                return _Lock(path, None)
            except FileExistsError:
                pass
            except (ValueError, NotImplementedError):  # no exclusive mode: check, then write
                if not self.fs.exists(path):
                    self.fs.pipe_file(path, info.encode())
                    return _Lock(path, None)
            if time.monotonic() >= deadline:
                raise StoreLockedError(
                    f"{what} is being written by {self._remote_holder(path)} (lock {path});"
                    " if no writer is running, delete the lock file"
                )
            time.sleep(0.1)

    def _remote_lock_info(self, path: str) -> dict[str, Any]:
        with contextlib.suppress(Exception):
            info = json.loads(self.fs.cat_file(path))
            if isinstance(info, dict):
                return info
        return {}

    def _remote_holder(self, path: str) -> str:
        info = self._remote_lock_info(path)
        return f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {info.get('time', '?')}"

    def _remote_lock_stale(self, path: str) -> bool:
        """A remote lock is known stale only if it was taken on this host by a dead pid."""
        info = self._remote_lock_info(path)
        pid = info.get("pid")
        return info.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid)

    def _release(self, lock: _Lock) -> None:
        if self.local:
            _LocalLocks.release(lock)
        else:
            with contextlib.suppress(Exception):
                self._remove_file(lock.path)

    def _lock_held(self, directory: str, name: str) -> bool:
        path = self._lock_path(directory, name)
        if self.local:
            return _LocalLocks.held(path)
        return self._isfile(path) and not self._remote_lock_stale(path)

    @contextlib.contextmanager
    def _locked(self, directory: str, name: str, what: str, blocking: bool = False) -> Iterator[None]:
        lock = self._acquire(directory, name, what, blocking)
        try:
            yield
        finally:
            self._release(lock)

    @contextlib.contextmanager
    def _write_errors(self, what: str) -> Iterator[None]:
        """Translate OS errors during a write into one-line store errors."""
        try:
            yield
        except OSError as e:
            if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                raise StoreError(f"disk full while writing {what}; nothing was changed") from e
            if isinstance(e, PermissionError) or e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                where = e.filename or self.root
                raise StorePermissionError(
                    f"no write permission in store {self.root}: cannot write {where}"
                ) from e
            raise StoreError(f"I/O error while writing {what}: {e}; nothing was changed") from e

    # ----------------------------------------------------------------- caches: write

    def put_cache(
        self,
        cache_id: str,
        tensors: Mapping[str, np.ndarray],
        manifest: Mapping[str, Any] | None = None,
        progress: Progress = None,
        *,
        overwrite: bool = False,
        codebooks: Sequence[str] = (),
    ) -> Manifest:
        """Store ``tensors`` as cache ``cache_id`` and return the written manifest.

        Args:
            cache_id: ``[A-Za-z0-9._-]{1,128}``, not starting with '.'.
            tensors: name -> numpy array (see ``STORABLE_DTYPES``); order is kept.
            manifest: the caller's JSON-able fields, stored as ``Manifest.meta``.
            progress: ``progress(done, total)`` callback, or True for a rich bar.
            overwrite: replace an existing cache (atomically) instead of raising
                :class:`CacheExistsError`.
            codebooks: sha256 of the shared codebooks this cache refers to.
        """
        validate_cache_id(cache_id)
        what = f"cache {cache_id}"
        arrays = _prepare_tensors(tensors, what)
        meta = _jsonable(manifest, what)
        refs = [_validate_sha(s) for s in codebooks]
        caches = self._join(CACHES_DIR)
        with self._write_errors(what):
            self._makedirs(caches)
            with self._locked(caches, cache_id, what):
                final = self._cache_dir(cache_id)
                if self._isdir(final) and not overwrite:
                    raise CacheExistsError(
                        f"cache {cache_id!r} already exists in store {self.root};"
                        " pass overwrite=True to replace it"
                    )
                tmp = posixpath.join(caches, f".tmp-{cache_id}-{_suffix()}")
                try:
                    self._mkdir_new(tmp)
                    man = self._write_shards(tmp, cache_id, arrays, meta, refs, progress)
                    self._write_file(posixpath.join(tmp, MANIFEST_NAME), man.to_json().encode())
                    self._sync_dir(tmp)
                    self._publish(tmp, final, cache_id)
                except BaseException:
                    self._rmtree_quiet(tmp)
                    raise
        return man

    def _write_shards(
        self,
        tmp: str,
        cache_id: str,
        arrays: dict[str, np.ndarray],
        meta: dict[str, Any],
        codebooks: list[str],
        progress: Progress,
    ) -> Manifest:
        """Serialise, compress and write every shard into ``tmp``; return the manifest."""
        groups = _plan_shards(arrays, self.shard_bytes)
        cctx = self._compressor()
        shards: list[ShardInfo] = []
        infos: dict[str, TensorInfo] = {}
        with _progress(progress, len(groups), f"writing {cache_id}") as advance:
            for index, names in enumerate(groups):
                raw = st_numpy.save({n: arrays[n] for n in names})
                raw_bytes = len(raw)
                packed = cctx.compress(raw)
                del raw  # keep peak memory near one shard
                shard = ShardInfo(
                    file=_shard_name(index),
                    compressed_bytes=len(packed),
                    sha256=_sha256(packed),
                    raw_bytes=raw_bytes,
                    tensors=names,
                )
                self._write_file(posixpath.join(tmp, shard.file), packed)
                shards.append(shard)
                for n in names:
                    arr = arrays[n]
                    infos[n] = TensorInfo(dtype=arr.dtype.name, shape=list(arr.shape), shard=index)
                advance()
        return Manifest(
            format_version=FORMAT_VERSION,
            cache_id=cache_id,
            created=_now_iso(),
            coldkv_version=coldkv.__version__,
            zstd_level=self.zstd_level,
            meta=meta,
            codebooks=codebooks,
            tensors=infos,
            shards=shards,
            total_compressed_bytes=sum(s.compressed_bytes for s in shards),
            total_raw_bytes=sum(s.raw_bytes for s in shards),
        )

    def _publish(self, tmp: str, final: str, cache_id: str) -> None:
        """Move the finished temp dir into place, replacing (and then deleting) any old one."""
        if not self._isdir(final):
            self._move_dir(tmp, final, manifest_last=True)
            return
        old = self._join(CACHES_DIR, f".old-{cache_id}-{_suffix()}")
        self._move_dir(final, old, manifest_last=False)
        try:
            self._move_dir(tmp, final, manifest_last=True)
        except BaseException:
            self._move_dir(old, final, manifest_last=True)  # roll back
            raise
        try:
            self._rmtree(old)
        except OSError as e:  # the new cache is in place; gc() removes the rest
            log.warning("could not delete the replaced copy of cache %s at %s: %s", cache_id, old, e)

    # ----------------------------------------------------------------- caches: read

    def exists(self, cache_id: str) -> bool:
        """Whether a complete cache (one with a manifest) named ``cache_id`` exists."""
        validate_cache_id(cache_id)
        return self._isfile(posixpath.join(self._cache_dir(cache_id), MANIFEST_NAME))

    def get_manifest(self, cache_id: str) -> Manifest:
        """Read and validate a cache's manifest (format version first)."""
        validate_cache_id(cache_id)
        directory = self._cache_dir(cache_id)
        try:
            data = self._read(posixpath.join(directory, MANIFEST_NAME))
        except (FileNotFoundError, NotADirectoryError):
            if self._isdir(directory):
                raise StoreCorruptError(
                    f"{MANIFEST_NAME} in cache {cache_id}: missing"
                    f" (incomplete or damaged cache directory {directory})"
                ) from None
            raise CacheNotFoundError(f"no cache {cache_id!r} in store {self.root}") from None
        return _parse_manifest(data, cache_id)

    def get_cache(
        self, cache_id: str, names: Sequence[str] | None = None, progress: Progress = None
    ) -> tuple[dict[str, np.ndarray], Manifest]:
        """Read a cache (all tensors, or only ``names``) and its manifest.

        Only the shards holding the requested tensors are read; each is checked for size
        and sha256 before it is decompressed.
        """
        man = self.get_manifest(cache_id)
        wanted = list(man.tensors) if names is None else list(names)
        unknown = [n for n in wanted if n not in man.tensors]
        if unknown:
            raise TensorNotFoundError(f"cache {cache_id} has no tensor(s) {unknown}")
        shard_ids = sorted({man.tensors[n].shard for n in wanted})
        directory = self._cache_dir(cache_id)
        loaded: dict[str, np.ndarray] = {}
        with _progress(progress, len(shard_ids), f"reading {cache_id}") as advance:
            for index in shard_ids:
                loaded.update(self._load_shard(directory, cache_id, man, index))
                advance()
        return {n: loaded[n] for n in wanted}, man

    def _read_verified(self, directory: str, cache_id: str, shard: ShardInfo) -> bytes:
        """A shard's compressed bytes, after checking presence, size and sha256."""
        where = f"{shard.file} in cache {cache_id}"
        try:
            data = self._read(posixpath.join(directory, shard.file))
        except (FileNotFoundError, NotADirectoryError):
            raise StoreCorruptError(f"{where}: missing") from None
        if len(data) != shard.compressed_bytes:
            raise StoreCorruptError(
                f"{where}: size mismatch (expected {shard.compressed_bytes} bytes,"
                f" got {len(data)}; truncated?)"
            )
        digest = _sha256(data)
        if digest != shard.sha256:
            raise StoreCorruptError(f"{where}: sha256 mismatch (expected {shard.sha256}, got {digest})")
        return data

    def _load_shard(self, directory: str, cache_id: str, man: Manifest, index: int) -> dict[str, np.ndarray]:
        """Verify, decompress and deserialize shard ``index``; check it against the manifest."""
        shard = man.shards[index]
        where = f"{shard.file} in cache {cache_id}"
        data = self._read_verified(directory, cache_id, shard)
        try:
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=shard.raw_bytes)
            tensors = st_numpy.load(raw)
        except Exception as e:  # checksum passed, so this is a writer bug or a bad manifest
            raise StoreCorruptError(f"{where}: cannot decode ({type(e).__name__}: {e})") from e
        if len(raw) != shard.raw_bytes or set(tensors) != set(shard.tensors):
            raise StoreCorruptError(f"{where}: contents do not match the manifest")
        for name, arr in tensors.items():
            info = man.tensors.get(name)
            if info is None or info.dtype != arr.dtype.name or info.shape != list(arr.shape):
                raise StoreCorruptError(f"{where}: tensor {name!r} does not match the manifest")
        return tensors

    def list_caches(self) -> list[Manifest]:
        """Manifests of all complete, readable caches, sorted by id.

        Temp dirs of unfinished writes are skipped; unreadable caches are skipped too
        (and reported by :meth:`verify`).
        """
        found = []
        for name in self._listdir(self._join(CACHES_DIR)):
            if name.startswith(".") or not _ID_RE.fullmatch(name):
                continue
            try:
                found.append(self.get_manifest(name))
            except StoreError as e:
                log.debug("skipping cache %s: %s", name, e)
        return found

    # ----------------------------------------------------------------- caches: remove

    def remove(self, cache_id: str) -> None:
        """Delete a cache (it disappears atomically locally, manifest first elsewhere)."""
        validate_cache_id(cache_id)
        final = self._cache_dir(cache_id)
        if not self._isdir(final):
            raise CacheNotFoundError(f"no cache {cache_id!r} in store {self.root}")
        caches = self._join(CACHES_DIR)
        what = f"cache {cache_id}"
        with self._write_errors(what), self._locked(caches, cache_id, what):
            trash = posixpath.join(caches, f".del-{cache_id}-{_suffix()}")
            self._move_dir(final, trash, manifest_last=False)
            self._rmtree(trash)

    # ----------------------------------------------------------------- codebooks

    def put_codebook(self, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> str:
        """Store a codebook; return its sha256 (of the serialized safetensors bytes).

        Content-addressed: storing identical tensors and meta again is a no-op.
        """
        arrays = _prepare_tensors(tensors, "codebook")
        meta_json = json.dumps(_jsonable(meta, "codebook"), sort_keys=True, separators=(",", ":"))
        raw = st_numpy.save(arrays, metadata={CODEBOOK_META_KEY: meta_json})
        sha = _sha256(raw)
        path = self._codebook_path(sha)
        directory = self._join(CODEBOOKS_DIR)
        what = f"codebook {sha}"
        with self._write_errors(what):
            self._makedirs(directory)
            if self._isfile(path):
                return sha
            with self._locked(directory, sha, what, blocking=True):
                if not self._isfile(path):
                    self._write_file(path, self._compressor().compress(raw))
                    self._sync_dir(directory)
        return sha

    def get_codebook(self, sha: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Read a codebook, verifying that its content hashes to ``sha``."""
        _validate_sha(sha)
        where = f"{CODEBOOKS_DIR}/{sha}{SHARD_SUFFIX}"
        raw = self._read_codebook_raw(sha)
        try:
            tensors = st_numpy.load(raw)
            meta = json.loads(_safetensors_metadata(raw).get(CODEBOOK_META_KEY, "{}"))
        except Exception as e:
            raise StoreCorruptError(f"{where}: cannot decode ({type(e).__name__}: {e})") from e
        return tensors, meta

    def _read_codebook_raw(self, sha: str) -> bytes:
        where = f"{CODEBOOKS_DIR}/{sha}{SHARD_SUFFIX}"
        try:
            data = self._read(self._codebook_path(sha))
        except (FileNotFoundError, NotADirectoryError):
            raise CodebookNotFoundError(f"no codebook {sha} in store {self.root}") from None
        try:
            raw = zstandard.ZstdDecompressor().decompress(data)
        except zstandard.ZstdError as e:
            raise StoreCorruptError(f"{where}: cannot decompress ({e})") from e
        got = _sha256(raw)
        if got != sha:
            raise StoreCorruptError(f"{where}: sha256 mismatch (expected {sha}, got {got})")
        return raw

    def set_ref(self, name: str, sha: str) -> None:
        """Point the named reference ``refs/<name>`` at codebook ``sha`` (atomic overwrite).

        Used to find the codebooks of a calibration run again without reading them all.
        """
        validate_cache_id(name)
        _validate_sha(sha)
        with self._write_errors(f"ref {name}"):
            self._makedirs(self._join(REFS_DIR))
            self._write_file(self._join(REFS_DIR, name), sha.encode())

    def get_ref(self, name: str) -> str | None:
        """The codebook sha a named reference points at, or None (also if that codebook is gone)."""
        validate_cache_id(name)
        path = self._join(REFS_DIR, name)
        if not self._isfile(path):
            return None
        sha = self._read(path).decode().strip()
        return sha if self._isfile(self._codebook_path(sha)) else None

    def list_codebooks(self) -> list[str]:
        """Hashes of all stored codebooks."""
        names = self._listdir(self._join(CODEBOOKS_DIR))
        return [n[:64] for n in names if n[64:] == SHARD_SUFFIX and _SHA_RE.fullmatch(n[:64])]

    # ----------------------------------------------------------------- verify / gc

    def verify(self, cache_id: str | None = None) -> list[Problem]:
        """Check caches (all, or one) shard by shard; return the problems found.

        Also reports debris of crashed writes (``incomplete``/``leftover``, removable
        with :meth:`gc`) and, when checking everything, corrupt codebooks.
        """
        caches = self._join(CACHES_DIR)
        if cache_id is not None:
            validate_cache_id(cache_id)
            ids = [cache_id] if self._isdir(self._cache_dir(cache_id)) else []
        else:
            ids = [n for n in self._listdir(caches) if not n.startswith(".") and _ID_RE.fullmatch(n)]
        problems = [p for cid in ids for p in self._verify_cache(cid)]
        problems += self._verify_leftovers(cache_id)
        if cache_id is None:
            problems += self._verify_codebooks()
        elif not ids and not problems:
            raise CacheNotFoundError(f"no cache {cache_id!r} in store {self.root}")
        return problems

    def _verify_cache(self, cache_id: str) -> list[Problem]:
        directory = self._cache_dir(cache_id)
        try:
            man = self.get_manifest(cache_id)
        except UnsupportedFormatError as e:
            return [Problem("unsupported", directory, str(e), cache_id)]
        except StoreError as e:
            return [Problem("corrupt", directory, str(e), cache_id)]
        problems = []
        for shard in man.shards:
            try:
                self._read_verified(directory, cache_id, shard)
            except StoreCorruptError as e:
                problems.append(Problem("corrupt", posixpath.join(directory, shard.file), str(e), cache_id))
        for sha in man.codebooks:
            if not self._isfile(self._codebook_path(sha)):
                msg = f"cache {cache_id} refers to codebook {sha}, which is not in the store"
                problems.append(Problem("missing-codebook", self._codebook_path(sha), msg, cache_id))
        return problems

    def _leftovers(self) -> Iterator[tuple[str, str, str]]:
        """``(kind, cache_id, path)`` for each tmp/old/del directory in ``caches/``."""
        caches = self._join(CACHES_DIR)
        for name in self._listdir(caches):
            m = _LEFTOVER_RE.fullmatch(name)
            if m:
                yield m.group(1), m.group(2), posixpath.join(caches, name)

    def _verify_leftovers(self, only: str | None) -> list[Problem]:
        caches = self._join(CACHES_DIR)
        problems = []
        for kind, cid, path in self._leftovers():
            if (only is not None and cid != only) or self._lock_held(caches, cid):
                continue  # not asked for, or a writer is at work right now
            if kind == "tmp":
                msg = f"incomplete write of cache {cid} at {path} (crashed writer), safe to delete: run gc()"
                problems.append(Problem("incomplete", path, msg, cid, safe_to_delete=True))
            elif kind == "del" or self._isdir(self._cache_dir(cid)):
                action = "remove" if kind == "del" else "overwrite"
                msg = f"leftover copy of cache {cid} at {path} from an interrupted {action}, safe to delete: run gc()"
                problems.append(Problem("leftover", path, msg, cid, safe_to_delete=True))
            else:
                msg = f"interrupted overwrite of cache {cid}: previous version kept at {path}; gc() restores it"
                problems.append(Problem("leftover", path, msg, cid))
        if not self.local:
            problems += self._verify_remote_locks(caches, only)
        return problems

    def _verify_remote_locks(self, caches: str, only: str | None) -> list[Problem]:
        problems = []
        for name in self._listdir(caches):
            cid = name[len(_LOCK_PREFIX) :]
            if name.startswith(_LOCK_PREFIX) and (only is None or cid == only):
                path = posixpath.join(caches, name)
                stale = self._remote_lock_stale(path)
                hint = "that process is gone, gc() removes the lock" if stale else "delete it if no writer is running"
                msg = f"cache {cid} is locked by {self._remote_holder(path)} ({path}); {hint}"
                problems.append(Problem("locked", path, msg, cid, safe_to_delete=stale))
        return problems

    def _verify_codebooks(self) -> list[Problem]:
        problems = []
        directory = self._join(CODEBOOKS_DIR)
        for sha in self.list_codebooks():
            try:
                self._read_codebook_raw(sha)
            except StoreError as e:
                problems.append(Problem("corrupt", self._codebook_path(sha), str(e)))
        for name in self._listdir(directory):
            m = _PART_RE.fullmatch(name)
            if m and not self._lock_held(directory, m.group(1)[:64]):
                path = posixpath.join(directory, name)
                msg = f"incomplete codebook write {path}, safe to delete: run gc()"
                problems.append(Problem("incomplete", path, msg, safe_to_delete=True))
        return problems

    def gc(self) -> list[str]:
        """Delete debris of crashed writes; return what was done, one line per item.

        Skips anything a live writer holds. An interrupted overwrite whose new version
        never landed is rolled back (the previous version is restored).
        """
        caches = self._join(CACHES_DIR)
        done: list[str] = []
        with self._write_errors("garbage collection"):
            for kind, cid, path in list(self._leftovers()):
                with contextlib.suppress(StoreLockedError), self._locked(caches, cid, f"cache {cid}"):
                    done.append(self._gc_one(kind, cid, path))
            done += self._gc_locks(caches)
            done += self._gc_codebook_parts()
        return done

    def _gc_one(self, kind: str, cache_id: str, path: str) -> str:
        final = self._cache_dir(cache_id)
        if kind == "old" and not self._isdir(final) and self._isfile(posixpath.join(path, MANIFEST_NAME)):
            self._move_dir(path, final, manifest_last=True)
            return f"restored cache {cache_id} from {path}"
        self._rmtree(path)
        return f"deleted {path}"

    def _gc_locks(self, directory: str) -> list[str]:
        """Remove lock files nobody holds (local: taking and releasing unlinks them)."""
        done = []
        for name in self._listdir(directory):
            if not name.startswith(_LOCK_PREFIX):
                continue
            path = posixpath.join(directory, name)
            if self.local:
                with contextlib.suppress(StoreLockedError):
                    _LocalLocks.release(_LocalLocks.acquire(path, "lock"))
                    done.append(f"deleted unused lock {path}")
            elif self._remote_lock_stale(path):
                self._remove_file(path)
                done.append(f"deleted stale lock {path}")
        return done

    def _gc_codebook_parts(self) -> list[str]:
        directory = self._join(CODEBOOKS_DIR)
        done = []
        for name in self._listdir(directory):
            m = _PART_RE.fullmatch(name)
            if not m:
                continue
            sha = m.group(1)[:64]
            with contextlib.suppress(StoreLockedError), self._locked(directory, sha, f"codebook {sha}"):
                path = posixpath.join(directory, name)
                self._remove_file(path)
                done.append(f"deleted {path}")
        done += self._gc_locks(directory)
        return done


def _parse_manifest(data: bytes, cache_id: str) -> Manifest:
    """Decode manifest bytes: JSON, then format version, then schema."""
    where = f"{MANIFEST_NAME} in cache {cache_id}"
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreCorruptError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise StoreCorruptError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    version = raw.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise StoreCorruptError(f"{where}: format_version missing or not an integer ({version!r})")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        hint = "; upgrade coldkv to read it" if version > max(SUPPORTED_FORMAT_VERSIONS) else ""
        raise UnsupportedFormatError(
            f"cache {cache_id} has format_version {version}; coldkv {coldkv.__version__} reads"
            f" format_version {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}{hint}"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        details = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:3]
        )
        raise StoreCorruptError(f"{where}: invalid manifest ({details})") from None
