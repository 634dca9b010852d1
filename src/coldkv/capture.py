"""Capture a prefill: the KV cache and the post-RoPE query states, from any mlx-lm attention model.

mlx-lm attention modules call ``scaled_dot_product_attention(queries, keys, values, cache=...)``,
imported by name into each model module. :func:`capture` temporarily wraps that name in the
model's module (and ``mlx_lm.models.base``), attributes each call to a layer through the cache
object it is passed, records the queries (already rotated, as the model uses them), and restores
everything afterwards, even on error. mlx-lm itself is not edited.

The keys and values are the prompt cache exactly as mlx-lm builds it (keys post-RoPE).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import coldkv  # noqa: F401
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from coldkv.rope import RopeSpec, rope_spec


class CaptureError(ValueError):
    """Input that cannot be captured (empty prompt, too long, not an attention model...)."""


@dataclass
class LayerCapture:
    """One layer's prefill state.

    keys:    [n_kv_heads, T, head_dim] post-RoPE keys (mlx-lm's cache content).
    values:  [n_kv_heads, T, head_dim] values.
    queries: [n_heads, Tq, head_dim] post-RoPE queries at ``Capture.query_positions``.
    """

    keys: mx.array
    values: mx.array
    queries: mx.array | None


@dataclass
class Capture:
    """A captured prefill: per-layer KV + queries, GQA layout and RoPE settings.

    ``kv_head_of[h]`` is the KV head that query head ``h`` attends with (GQA).
    ``cache`` is the live mlx-lm prompt cache (list of KVCache) the prefill produced.
    """

    tokens: list[int]
    layers: list[LayerCapture]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    query_positions: mx.array  # [Tq] int32
    rope: RopeSpec | None
    cache: list = field(repr=False, default_factory=list)

    @property
    def kv_head_of(self) -> list[int]:
        group = self.n_heads // self.n_kv_heads
        return [h // group for h in range(self.n_heads)]

    @property
    def query_heads_of(self) -> list[list[int]]:
        """For each KV head, the query heads sharing it."""
        group = self.n_heads // self.n_kv_heads
        return [list(range(k * group, (k + 1) * group)) for k in range(self.n_kv_heads)]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The attention modules of an mlx-lm model, in layer order (raises if there are none)."""
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if not layers:
        raise CaptureError(f"{type(model).__name__} has no transformer layers to capture")
    attn = [getattr(layer, "self_attn", None) or getattr(layer, "attention", None) for layer in layers]
    if any(a is None for a in attn):
        raise CaptureError(
            f"{type(model).__module__} is not an attention model (state-space or hybrid layers "
            "have no KV cache to store)"
        )
    return attn


def query_positions(T: int, sample: int | str | None, seed: int = 0) -> mx.array:
    """Positions whose queries to keep: ``None``/"all" -> all T; int s>0 -> every s-th;
    "random:N" -> N random positions (sorted); "last:N" -> the last N. Returns [Tq] int32."""
    if sample in (None, "all"):
        return mx.arange(T, dtype=mx.int32)
    if isinstance(sample, int):
        if sample <= 0:
            raise CaptureError(f"query stride must be positive, got {sample}")
        return mx.arange(0, T, sample, dtype=mx.int32)
    if isinstance(sample, str) and sample.startswith("random:"):
        n = min(int(sample.split(":", 1)[1]), T)
        perm = mx.random.permutation(T, key=mx.random.key(seed))[:n]
        return mx.sort(perm).astype(mx.int32)
    if isinstance(sample, str) and sample.startswith("last:"):
        n = min(int(sample.split(":", 1)[1]), T)
        return mx.arange(T - n, T, dtype=mx.int32)
    raise CaptureError(
        f"query sample must be 'all', a positive stride, 'random:N' or 'last:N', got {sample!r}"
    )


@contextmanager
def _wrapped_sdpa(model: nn.Module, hook: Callable):
    """Wrap ``scaled_dot_product_attention`` where the model's module looks it up."""
    names = {type(model).__module__, "mlx_lm.models.base"}
    for layer in attention_layers(model):
        names.add(type(layer).__module__)
    patched = []
    try:
        for name in names:
            mod = sys.modules.get(name)
            orig = getattr(mod, "scaled_dot_product_attention", None) if mod else None
            if orig is None:
                continue

            def wrapper(queries, keys, values, cache, *args, _orig=orig, **kwargs):
                hook(queries, cache)
                return _orig(queries, keys, values, cache, *args, **kwargs)

            setattr(mod, "scaled_dot_product_attention", wrapper)
            patched.append((mod, orig))
        if not patched:
            raise CaptureError(
                f"{type(model).__module__} does not call mlx-lm's scaled_dot_product_attention; "
                "cannot capture its queries"
            )
        yield
    finally:
        for mod, orig in patched:
            setattr(mod, "scaled_dot_product_attention", orig)


def check_prompt(
    tokens: Sequence[int], context_length: int | None, vocab_size: int | None = None
) -> list[int]:
    """Validate a prompt's token ids (MLX would crash on out-of-range ids, not raise)."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise CaptureError("the prompt is empty: nothing to prefill")
    if vocab_size and (max(tokens) >= vocab_size or min(tokens) < 0):
        bad = next(t for t in tokens if t < 0 or t >= vocab_size)
        raise CaptureError(f"token id {bad} is outside the model's vocabulary of {vocab_size}")
    if context_length and len(tokens) > context_length:
        raise CaptureError(
            f"the prompt has {len(tokens)} tokens, longer than the model's context of {context_length}"
        )
    return tokens


def capture(
    model: nn.Module,
    tokens: Sequence[int],
    *,
    chunk: int = 512,
    queries: int | str | None = "all",
    seed: int = 0,
    context_length: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Capture:
    """Prefill ``tokens`` through ``model`` in chunks, recording KV cache and queries.

    Args:
        model: an mlx-lm attention model.
        tokens: [T] prompt token ids.
        chunk: prefill chunk size (mlx-lm's ``prefill_step_size``).
        queries: which query positions to keep ("all", a stride, "random:N", or
            ``False``/0 to keep none).
        context_length: refuse prompts longer than this (the model's context).
        progress: called as ``progress(done_tokens, total_tokens)`` after each chunk.

    Returns:
        A :class:`Capture`; keys/values are [n_kv, T, d], queries [n_heads, Tq, d].
    """
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    tokens = check_prompt(tokens, context_length, vocab)
    if chunk <= 0:
        raise CaptureError(f"chunk must be positive, got {chunk}")
    attn = attention_layers(model)
    cache = make_prompt_cache(model)
    if not all(isinstance(c, KVCache) for c in cache):
        kinds = sorted({type(c).__name__ for c in cache})
        raise CaptureError(f"model uses {kinds} caches; coldkv stores plain KV caches only")
    layer_of = {id(c): i for i, c in enumerate(cache)}
    T = len(tokens)
    keep = query_positions(T, queries, seed) if queries else mx.zeros((0,), mx.int32)
    want = np.zeros(T, dtype=bool)
    want[np.array(keep)] = True
    recorded: list[list[mx.array]] = [[] for _ in cache]

    def hook(q: mx.array, c) -> None:
        layer = layer_of.get(id(c))
        if layer is None:
            return
        L = q.shape[2]
        start = c.offset - L  # the cache was already updated with this chunk
        idx = np.flatnonzero(want[start : start + L])
        if idx.size:
            recorded[layer].append(mx.take(q[0], mx.array(idx), axis=1))

    arr = mx.array(tokens)[None]
    with _wrapped_sdpa(model, hook):
        for s in range(0, T, chunk):
            model(arr[:, s : s + chunk], cache=cache)
            mx.eval([c.keys for c in cache] + [c.values for c in cache] + [r[-1] for r in recorded if r])
            if progress:
                progress(min(s + chunk, T), T)
    if want.any() and not any(recorded):
        raise CaptureError(f"no attention calls were seen in {type(model).__module__}")

    first = attn[0]
    n_heads = int(getattr(first, "n_heads", getattr(first, "num_heads", 0)))
    n_kv = int(cache[0].keys.shape[1])
    head_dim = int(cache[0].keys.shape[-1])
    layers = []
    for c, qs in zip(cache, recorded):
        k, v = c.keys_and_values()
        q = mx.concatenate(qs, axis=1) if qs else None
        layers.append(LayerCapture(k[0], v[0], q))
    if n_heads == 0 and layers[0].queries is not None:
        n_heads = layers[0].queries.shape[0]
    spec = rope_spec(first.rope) if hasattr(first, "rope") else None
    return Capture(tokens, layers, n_heads, n_kv, head_dim, keep, spec, cache)
