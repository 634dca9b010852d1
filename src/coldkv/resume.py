"""Resume: a stored cache -> an mlx-lm prompt cache -> continue decoding.

:func:`load_cache` checks that the cache was built by this model and tokenizer, verifies and
decodes it, and returns a list of mlx-lm ``KVCache``. :func:`plan_resume` compares a new prompt
with the stored prefix and says how much of the cache is reused. :func:`generate` streams tokens
with mlx-lm's own generation loop (``stream_generate``) and sampling options.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, Sequence

import coldkv  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from coldkv import codec
from coldkv.compress import load_codebooks
from coldkv.config import CodecSettings
from coldkv.fidelity import cache_from_arrays
from coldkv.store import Manifest, Store


class ResumeError(ValueError):
    """A stored cache that cannot be used with this model or prompt."""


def model_dtype(lm) -> mx.Dtype:
    return lm.model.model.embed_tokens.weight.dtype if hasattr(lm.model, "model") else mx.float32


def check_identity(manifest: Manifest, lm) -> None:
    meta = manifest.meta
    model = meta.get("model", {})
    if model.get("id") != lm.model_id:
        raise ResumeError(
            f"cache {manifest.cache_id} was built by model {model.get('name')!r} "
            f"(id {str(model.get('id'))[:12]}), not by the loaded {lm.name!r} (id {lm.model_id[:12]})"
        )
    if meta.get("tokenizer_id") != lm.tokenizer_id:
        raise ResumeError(f"cache {manifest.cache_id} was built with another tokenizer")


def decode_manifest(store: Store, manifest: Manifest, progress=None) -> list[tuple[mx.array, mx.array]]:
    """Per-layer (keys, values) [n_kv, T, d] float32 of a stored cache (hashes verified)."""
    meta = manifest.meta
    book = load_codebooks(store, meta["codebook"])
    tensors, _ = store.get_cache(manifest.cache_id, progress=progress)
    return codec.decode(tensors, meta["codec_meta"], book, CodecSettings(**meta["codec"]))


def load_cache(store: Store, cache_id: str, lm, progress=None) -> tuple[list[KVCache], Manifest]:
    """Load, verify and decode a stored cache for ``lm``; raises ResumeError on a mismatch."""
    manifest = store.get_manifest(cache_id)
    check_identity(manifest, lm)
    arrays = decode_manifest(store, manifest, progress)
    cache = cache_from_arrays([(k[None], v[None]) for k, v in arrays], dtype=model_dtype(lm))
    return cache, manifest


@dataclass
class ResumePlan:
    reuse: int  # stored tokens kept
    feed: list[int]  # tokens to prefill on top of the kept cache (never empty)
    message: str


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:  # token lists, once per resume: not a hot path
        i += 1
    return i


def plan_resume(stored: Sequence[int], new: Sequence[int], strict: bool = False) -> ResumePlan:
    """How to continue from ``stored`` (the cache's tokens) to the prompt ``new``.

    Reuses the longest common prefix and prefills the rest. mlx-lm needs at least one token to
    run, so when ``new`` adds nothing the last cached token is re-fed. ``strict`` refuses a
    prompt that does not extend the whole stored prefix.
    """
    n = common_prefix(stored, new)
    if n == 0:
        raise ResumeError(
            "the prompt does not extend the stored prefix: they differ at the first token"
        )
    if n < len(stored):
        msg = f"prompt diverges from the stored prefix at token {n} of {len(stored)}: reusing {n} tokens"
        if strict:
            raise ResumeError(msg.replace(": reusing", "; refusing to reuse"))
    else:
        msg = f"reusing all {n} stored tokens"
    reuse = n
    if reuse == len(new):
        reuse -= 1  # re-feed the last token so there is something to run
    feed = list(new[reuse:])
    msg += f", prefilling {len(feed)} new token{'s' if len(feed) != 1 else ''}"
    return ResumePlan(reuse, feed, msg)


def trim(cache: list[KVCache], keep: int) -> None:
    for c in cache:
        c.trim(c.offset - keep)


def generate(lm, cache: list[KVCache], plan: ResumePlan, max_tokens: int = 128, temp: float = 0.0,
             top_p: float = 1.0, seed: int | None = None) -> Iterator:
    """Stream mlx-lm ``GenerationResponse`` items continuing from a loaded cache."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    trim(cache, plan.reuse)
    sampler = make_sampler(temp=temp, top_p=top_p)
    yield from stream_generate(
        lm.model, lm.tokenizer, mx.array(plan.feed), max_tokens=max_tokens, prompt_cache=cache, sampler=sampler
    )


# ----------------------------------------------------------------------------- mlx-lm files


def export_prompt_cache(path: str, cache: list[KVCache], lm, tokens: Sequence[int]) -> None:
    """Write a standard mlx-lm prompt-cache file (``mlx_lm.generate --prompt-cache-file``)."""
    meta = {"model": lm.source, "tokenizer_config": "{}", "coldkv_tokens": json.dumps(list(tokens))}
    save_prompt_cache(path, cache, meta)


def import_prompt_cache(path: str, tokens: Sequence[int] | None = None):
    """Read an mlx-lm prompt-cache file -> (per-layer (keys, values) [n_kv, T, d], tokens).

    Token ids come from coldkv's export metadata, or must be given (and must match its length).
    """
    cache, meta = load_prompt_cache(path, return_metadata=True)
    if not all(isinstance(c, KVCache) for c in cache):
        kinds = sorted({type(c).__name__ for c in cache})
        raise ResumeError(f"{path} holds {kinds} caches; only plain KVCache files can be imported")
    if tokens is None and "coldkv_tokens" in meta:
        tokens = json.loads(meta["coldkv_tokens"])
    T = cache[0].offset
    if tokens is None:
        raise ResumeError(f"{path} does not record its prompt: pass the prompt text it was built from")
    if len(tokens) != T:
        raise ResumeError(f"{path} holds {T} tokens but the given prompt has {len(tokens)}")
    layers = []
    for c in cache:
        k, v = c.keys_and_values()
        layers.append((k[0].astype(mx.float32), v[0].astype(mx.float32)))
    return layers, list(tokens)
