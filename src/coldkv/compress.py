"""Compress: prompt -> capture -> codes -> store. The step the CLI and the flows share.

* :func:`ensure_codebooks` calibrates once per (model, calibration texts, codebook settings)
  and stores the codebook set content-addressed, with a named ref ``cal-<key>`` to find it again.
* :func:`compress_tokens` captures a prompt, encodes it with a codebook set and writes the cache.
  The cache id is derived from everything that determines its content (model, tokens, codec
  settings, codebooks), so an unchanged input maps to the same id and re-running is a no-op.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import coldkv  # noqa: F401

from coldkv import calibrate, codec
from coldkv.calibrate import CodebookSet
from coldkv.capture import Capture, capture
from coldkv.config import CodecSettings, Config, StorageConfig
from coldkv.store import Manifest, Store

_BOOKS: dict[tuple[str, str], CodebookSet] = {}  # (store root, sha) -> loaded set


def open_store(storage: StorageConfig) -> Store:
    return Store(storage.root, zstd_level=storage.zstd_level, shard_bytes=int(storage.shard_mb * (1 << 20)))


def load_codebooks(store: Store, sha: str) -> CodebookSet:
    """Codebook set ``sha`` from the store (memoised per process)."""
    key = (store.root, sha)
    if key not in _BOOKS:
        tensors, meta = store.get_codebook(sha)
        _BOOKS[key] = CodebookSet.from_store(tensors, meta)
    return _BOOKS[key]


@dataclass
class CodebookRef:
    sha: str
    book: CodebookSet
    trained: bool  # False when an existing set was reused
    seconds: float


def ensure_codebooks(
    lm,
    store: Store,
    settings: CodecSettings,
    texts: Sequence[str],
    max_tokens: int = 2048,
    query_sample: int | str = "all",
    progress: Callable[[str], None] | None = None,
) -> CodebookRef:
    """The codebook set for this model, calibration set and settings; trained if not stored yet."""
    t0 = time.perf_counter()
    ref = "cal-" + calibrate.calibration_key(lm.model_id, texts, settings, max_tokens)[:40]
    sha = store.get_ref(ref)
    if sha is not None:
        return CodebookRef(sha, load_codebooks(store, sha), False, time.perf_counter() - t0)
    if progress:
        progress(f"calibrating on {len(texts)} prompts (up to {max_tokens} tokens each)")
    data = calibrate.collect(lm, texts, max_tokens=max_tokens, query_sample=query_sample)
    if progress:
        progress(f"training codebooks for {data.keys.shape[0]} (layer, KV head) groups")
    book = calibrate.train_codebooks(lm, data, settings)
    tensors, meta = book.to_store()
    meta["calibration"] = {"ref": ref, "prompts": len(texts), "tokens": int(data.keys.shape[1])}
    sha = store.put_codebook(tensors, meta)
    store.set_ref(ref, sha)
    _BOOKS[(store.root, sha)] = book
    return CodebookRef(sha, book, True, time.perf_counter() - t0)


def cache_id_for(model_id: str, tokens: Sequence[int], settings: CodecSettings, book_sha: str) -> str:
    """Content-derived cache id: equal inputs -> equal id."""
    h = hashlib.sha256()
    for part in (model_id, book_sha, json.dumps(settings.model_dump(), sort_keys=True), json.dumps(list(tokens))):
        h.update(part.encode())
        h.update(b"\0")
    return "c" + h.hexdigest()[:23]


def fp16_file_bytes(n_layers: int, n_kv: int, head_dim: int, T: int) -> int:
    """Payload of mlx-lm's prompt-cache file with float16 keys and values (header excluded)."""
    return n_layers * 2 * n_kv * T * head_dim * 2


def compress_tokens(
    lm,
    store: Store,
    ref: CodebookRef,
    tokens: Sequence[int],
    settings: CodecSettings,
    *,
    cache_id: str | None = None,
    name: str | None = None,
    overwrite: bool = False,
    chunk: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Capture ``tokens``, encode them with ``ref``'s codebooks and store the cache."""
    t0 = time.perf_counter()
    queries = "last:16" if settings.retrieval_fraction > 0 else False
    cap = capture(lm.model, tokens, chunk=chunk, queries=queries, context_length=lm.context_length, progress=progress)
    prefill_s = time.perf_counter() - t0
    return store_capture(lm, store, ref, cap, settings, cache_id=cache_id, name=name, overwrite=overwrite,
                         timings={"prefill_s": round(prefill_s, 4)})  # fmt: skip


def store_capture(
    lm,
    store: Store,
    ref: CodebookRef,
    cap: Capture,
    settings: CodecSettings,
    *,
    cache_id: str | None = None,
    name: str | None = None,
    overwrite: bool = False,
    timings: dict | None = None,
) -> Manifest:
    """Encode a captured (or imported) cache and write it to the store."""
    tokens = [int(t) for t in cap.tokens]
    cache_id = cache_id or cache_id_for(lm.model_id, tokens, settings, ref.sha)
    t1 = time.perf_counter()
    tensors, codec_meta = codec.encode(cap, ref.book, settings)
    book = ref.book
    meta = {
        "name": name or cache_id,
        "model": {"id": lm.model_id, "name": lm.name, "source": lm.source},
        "tokenizer_id": lm.tokenizer_id,
        "tokens": tokens,
        "n_tokens": len(tokens),
        "geometry": {"n_layers": book.n_layers, "n_kv_heads": book.n_kv_heads, "head_dim": book.head_dim},
        "codec": settings.model_dump(),
        "codec_meta": codec_meta,
        "codebook": ref.sha,
        "fp16_file_bytes": fp16_file_bytes(book.n_layers, book.n_kv_heads, book.head_dim, len(tokens)),
        "timings": {**(timings or {}), "encode_s": round(time.perf_counter() - t1, 4)},
    }
    return store.put_cache(cache_id, tensors, meta, overwrite=overwrite, codebooks=[ref.sha])


def ensure_codebooks_for_config(lm, store: Store, cfg: Config, progress=None) -> CodebookRef:
    from coldkv.config import read_prompts

    texts = [t for _, t in read_prompts(cfg.calibration.prompts)]
    return ensure_codebooks(
        lm, store, cfg.codec, texts, cfg.calibration.max_tokens_per_prompt, cfg.calibration.query_sample, progress
    )
