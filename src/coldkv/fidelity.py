"""How much quality a restored KV cache loses, measured on the real model (DESIGN §3).

Everything here compares an *exact* mlx-lm prompt cache with a *restored* one (coded,
stored, loaded back) by running the same tokens on top of each and comparing the model's
next-token distributions.

Scoring scheme (one scheme, used for every cache)
-------------------------------------------------
The cache holds the **whole prompt** ``P`` (exactly what a user stores and what mlx-lm's
``save_prompt_cache`` / ``generate(prompt_cache=...)`` work with). The continuation tokens
``c[0..C-1]`` are fed on top of it in one teacher-forced forward pass. Row ``i`` of the
result is ``log p(. | P, c[:i+1])``, i.e. the model's prediction of ``c[i+1]``:

* NLL is scored on the ``C - 1`` targets ``c[1:]`` (rows ``0..C-2``); ``c[0]`` itself is not
  scored because its prediction comes from the prompt's last logits, which a stored cache
  does not hold.
* KL and top-1 agreement need no target, so they use all ``C`` rows.

To score every continuation token instead, prefill ``prompt[:-1]`` and pass
``prompt[-1:] + continuation``: the scheme is the same, only the split moves.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Sequence

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

Tokens = Sequence[int] | mx.array


def _as_tokens(tokens: Tokens) -> mx.array:
    """Token ids as a 1-D ``int32`` array."""
    arr = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
    return arr.reshape(-1).astype(mx.int32)


# --------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------


def prefill(model: nn.Module, tokens: Tokens, chunk: int = 512) -> list:
    """Exact mlx-lm prompt cache for ``tokens``, filled ``chunk`` tokens at a time.

    Returns ``make_prompt_cache(model)`` (one ``KVCache`` per layer for llama models) with
    ``offset == len(tokens)``.
    """
    toks = _as_tokens(tokens)
    if toks.size == 0:
        raise ValueError("prefill needs at least one token")
    cache = make_prompt_cache(model)
    for start in range(0, toks.size, chunk):
        model(toks[None, start : start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def cache_arrays(cache: list) -> list[tuple[mx.array, mx.array]]:
    """Per-layer ``(keys, values)``, each ``[1, n_kv, T, d]``, trimmed to the cache offset.

    mlx-lm's ``KVCache`` over-allocates in steps of 256 positions; only the first
    ``offset`` positions are real.
    """
    out = []
    for c in cache:
        if c.keys is None:
            raise ValueError("cache layer is empty")
        n = c.offset
        out.append((c.keys[..., :n, :], c.values[..., :n, :]))
    return out


def cache_from_arrays(arrays: Sequence[tuple[mx.array, mx.array]], dtype: mx.Dtype | None = None) -> list:
    """A fresh mlx-lm ``KVCache`` per layer holding ``arrays`` (``[1, n_kv, T, d]`` each).

    This is how a restored cache re-enters mlx-lm. ``dtype`` casts keys and values (e.g. to
    the model's compute dtype). The buffers are exactly ``T`` long, so the first update on
    the cache concatenates new storage instead of writing into the caller's arrays.
    """
    cache = []
    for k, v in arrays:
        if k.ndim == 3:
            k, v = k[None], v[None]
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"keys {k.shape} and values {v.shape} disagree")
        if dtype is not None:
            k, v = k.astype(dtype), v.astype(dtype)
        c = KVCache()
        c.keys, c.values, c.offset = k, v, k.shape[-2]
        cache.append(c)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def copy_cache(cache: list) -> list:
    """Deep copy of a prompt cache (any mlx-lm cache type), safe to run the model on."""
    return copy.deepcopy(cache)


def cache_dtype(cache: list) -> mx.Dtype:
    """The dtype of the cache's keys (first layer)."""
    return cache[0].keys.dtype


# --------------------------------------------------------------------------------------
# Teacher-forced scoring
# --------------------------------------------------------------------------------------


def teacher_forced_logprobs(model: nn.Module, cache: list, tokens: Tokens) -> mx.array:
    """Log-softmax of the model over ``tokens`` fed on top of a copy of ``cache``.

    Args:
        cache: prompt cache holding the context (never mutated: a deep copy is used).
        tokens: ``C`` token ids fed after the context.

    Returns:
        ``[C, vocab]`` float32; row ``i`` is ``log p(. | context, tokens[:i+1])``, the
        prediction of ``tokens[i+1]`` (the last row predicts the token after ``tokens``).
    """
    toks = _as_tokens(tokens)
    logits = model(toks[None], cache=copy_cache(cache))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return logprobs


@dataclass
class FidelityResult:
    """Restored vs exact cache on one teacher-forced continuation.

    ``nll_*`` are mean nats/token over ``n_tokens`` scored targets; ``kl_mean`` and
    ``top1_agreement`` are means over ``n_positions`` next-token distributions.
    """

    nll_exact: float
    nll_restored: float
    delta_nll: float  # restored - exact (signed, noisy)
    ppl_ratio: float  # exp(delta_nll)
    top1_agreement: float  # fraction of positions with the same argmax
    kl_mean: float  # mean over positions of KL(exact || restored), nats
    kl_max: float
    n_tokens: int  # scored targets (C - 1)
    n_positions: int  # compared distributions (C)

    def as_dict(self) -> dict:
        return asdict(self)


def compare_logprobs(lp_exact: mx.array, lp_restored: mx.array, tokens: Tokens) -> FidelityResult:
    """:class:`FidelityResult` from two ``[C, vocab]`` log-prob arrays (see module doc)."""
    toks = _as_tokens(tokens)
    C = toks.size
    if lp_exact.shape != lp_restored.shape or lp_exact.shape[0] != C:
        raise ValueError(f"shapes {lp_exact.shape}, {lp_restored.shape} vs {C} tokens")
    if C < 2:
        raise ValueError("need at least 2 continuation tokens (the first is not scored)")
    targets = toks[1:, None]
    nll_e = -mx.take_along_axis(lp_exact[:-1], targets, axis=-1).mean()
    nll_r = -mx.take_along_axis(lp_restored[:-1], targets, axis=-1).mean()
    kl = (mx.exp(lp_exact) * (lp_exact - lp_restored)).sum(axis=-1)  # [C]
    kl = mx.maximum(kl, 0.0)  # rounding can give tiny negatives
    top1 = (mx.argmax(lp_exact, axis=-1) == mx.argmax(lp_restored, axis=-1)).astype(mx.float32).mean()
    mx.eval(nll_e, nll_r, kl, top1)
    delta = nll_r.item() - nll_e.item()
    return FidelityResult(
        nll_exact=nll_e.item(),
        nll_restored=nll_r.item(),
        delta_nll=delta,
        ppl_ratio=float(mx.exp(mx.array(delta)).item()),
        top1_agreement=top1.item(),
        kl_mean=kl.mean().item(),
        kl_max=kl.max().item(),
        n_tokens=C - 1,
        n_positions=C,
    )


def compare(model: nn.Module, exact_cache: list, restored_cache: list, continuation: Tokens) -> FidelityResult:
    """Score ``continuation`` on top of both caches identically and compare (module doc)."""
    lp_e = teacher_forced_logprobs(model, exact_cache, continuation)
    lp_r = teacher_forced_logprobs(model, restored_cache, continuation)
    return compare_logprobs(lp_e, lp_r, continuation)


# --------------------------------------------------------------------------------------
# Greedy decoding
# --------------------------------------------------------------------------------------


@dataclass
class GreedyResult:
    """Two greedy decodes of ``n`` tokens, from the exact and the restored cache."""

    prefix_agreement: float  # matching positions before the first divergence / n
    agreement: float  # matching positions overall / n
    first_divergence: int | None  # index of the first differing token, None if all equal
    tokens_exact: list[int]
    tokens_restored: list[int]
    text_exact: str
    text_restored: str


def greedy_decode(model: nn.Module, cache: list, start_tokens: Tokens, n: int) -> list[int]:
    """Feed ``start_tokens`` on a copy of ``cache``, then greedily decode ``n`` tokens.

    No stop on EOS: exactly ``n`` tokens come back, so two decodes align position by position.
    """
    cache = copy_cache(cache)
    y = _as_tokens(start_tokens)
    out: list[int] = []
    for _ in range(n):
        logits = model(y[None], cache=cache)[0, -1]
        y = mx.argmax(logits, axis=-1).reshape(1).astype(mx.int32)
        out.append(y.item())
    return out


def greedy_agreement(
    model: nn.Module,
    tokenizer,
    exact_cache: list,
    restored_cache: list,
    n: int = 32,
    *,
    start_tokens: Tokens,
) -> GreedyResult:
    """Greedy-decode ``n`` tokens after each cache and compare them position by position.

    ``start_tokens`` (at least one) are fed first, since a stored cache of the whole prompt
    holds no logits to pick the first token from: pass the continuation's first token(s),
    or prefill ``prompt[:-1]`` and pass ``prompt[-1:]``.
    """
    a = greedy_decode(model, exact_cache, start_tokens, n)
    b = greedy_decode(model, restored_cache, start_tokens, n)
    same = [x == y for x, y in zip(a, b)]
    first = next((i for i, s in enumerate(same) if not s), None)
    prefix = n if first is None else first
    return GreedyResult(
        prefix_agreement=prefix / n,
        agreement=sum(same) / n,
        first_divergence=first,
        tokens_exact=a,
        tokens_restored=b,
        text_exact=tokenizer.decode(a),
        text_restored=tokenizer.decode(b),
    )


# --------------------------------------------------------------------------------------
# Attention scores
# --------------------------------------------------------------------------------------


@dataclass
class AttentionScoreError:
    """Scores ``q·kᵀ`` vs ``q·k̂ᵀ`` over all (query head, query, key) triples."""

    rel_mse: float  # sum (s - ŝ)² / sum s², all heads together
    rel_mse_per_head: list[float]  # per query head
    topk_recall: float  # mean over (head, query) of |topK(s) ∩ topK(ŝ)| / K
    top_k: int


def attention_score_error(
    queries: mx.array, keys: mx.array, keys_hat: mx.array, top_k: int = 32
) -> AttentionScoreError:
    """Attention-score error of approximate keys, with GQA.

    Args:
        queries: ``[n_heads, Q, d]`` (post-RoPE, same frame as the keys; a leading batch
            dimension of 1 is accepted).
        keys, keys_hat: ``[n_kv, T, d]`` exact and approximate keys.
        top_k: K for the recall of each query's K highest-scoring keys (clipped to ``T``).

    Query head ``h`` attends with KV head ``h // (n_heads // n_kv)``. Scores are raw dot
    products (no 1/sqrt(d), no mask): both metrics are scale-invariant. A key counts as
    recalled when its approximate score is at least the K-th largest approximate score.
    """
    if queries.ndim == 4:
        queries = queries[0]
    if keys.ndim == 4:
        keys, keys_hat = keys[0], keys_hat[0]
    n_heads, Q, d = queries.shape
    n_kv, T, _ = keys.shape
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv} KV heads")
    group = n_heads // n_kv
    q = queries.astype(mx.float32).reshape(n_kv, group * Q, d)
    s = (q @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(n_heads, Q, T)
    s_hat = (q @ keys_hat.astype(mx.float32).swapaxes(-1, -2)).reshape(n_heads, Q, T)

    err = ((s - s_hat) ** 2).sum(axis=(1, 2))  # [n_heads]
    ref = (s**2).sum(axis=(1, 2))
    rel_total = err.sum() / mx.maximum(ref.sum(), 1e-30)
    rel_head = err / mx.maximum(ref, 1e-30)

    k = min(top_k, T)
    top_idx = mx.argpartition(-s, kth=k - 1, axis=-1)[..., :k]  # exact top-K keys
    kth_hat = -mx.partition(-s_hat, kth=k - 1, axis=-1)[..., k - 1 : k]  # K-th largest ŝ
    hit = mx.take_along_axis(s_hat, top_idx, axis=-1) >= kth_hat
    recall = hit.astype(mx.float32).mean()
    mx.eval(rel_total, rel_head, recall)
    return AttentionScoreError(
        rel_mse=rel_total.item(),
        rel_mse_per_head=rel_head.tolist(),
        topk_recall=recall.item(),
        top_k=k,
    )
