"""Calibration: captured queries -> H per (layer, KV head) -> key and value codebooks.

One :class:`CodebookSet` serves every cache of one model with one codec setting. It holds two
batched PQ codebooks with ``G = n_layers * n_kv_heads`` groups (group ``g = layer * n_kv + head``):

* keys, trained in z = x M with M Mᵀ = H (A2ATS, DESIGN §1). The key space is either
  ``post_rope`` (keys as mlx-lm stores them, H = E[q̃ᵀq̃] of post-RoPE queries) or ``wrope``
  (pre-RoPE keys, so one codebook serves every position and prompt; H averaged over the
  rotations that a stored key at position j meets: H = E_{i, j<=i}[(q̃_i R_{-j})ᵀ(q̃_i R_{-j})],
  DESIGN §5 lesson 3).
* values, plain PQ (``plain``) or weighted by what a value error does to the layer output
  (``output``: H_v = Σ_h W_o,hᵀ W_o,h over the query heads of the group).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Sequence

import coldkv  # noqa: F401
import mlx.core as mx
import numpy as np

from coldkv import codebooks as cbk
from coldkv.capture import Capture, capture
from coldkv.config import CodecSettings
from coldkv.rope import RopeSpec, rotate, unrotate

#: Queries per group used for the rotation-averaged (WRoPE) H, and sampled key offsets per query.
WROPE_QUERIES = 4096
WROPE_OFFSETS = 8


@dataclass
class CalibrationData:
    """Vectors pooled over calibration prompts, grouped by (layer, KV head).

    keys:    [G, N, d] post-RoPE keys.   positions: [N] their token positions.
    values:  [G, N, d].
    queries: [G, M, d] post-RoPE queries of each group's query heads (stacked), with
             query_positions [M].
    """

    keys: mx.array
    values: mx.array
    positions: mx.array
    queries: mx.array
    query_positions: mx.array
    n_layers: int
    n_kv_heads: int
    n_heads: int
    head_dim: int
    rope: RopeSpec | None


def grouped(cap: Capture) -> tuple[mx.array, mx.array]:
    """Keys and values of a capture as [G, T, d] (G = layers * kv_heads)."""
    k = mx.stack([layer.keys for layer in cap.layers])  # [L, n_kv, T, d]
    v = mx.stack([layer.values for layer in cap.layers])
    L, n_kv, T, d = k.shape
    return k.reshape(L * n_kv, T, d), v.reshape(L * n_kv, T, d)


def grouped_queries(cap: Capture) -> mx.array:
    """Queries of a capture as [G, group * Tq, d]: each KV head's query heads stacked."""
    q = mx.stack([layer.queries for layer in cap.layers])  # [L, n_heads, Tq, d]
    L, H, Tq, d = q.shape
    grp = H // cap.n_kv_heads
    return q.reshape(L * cap.n_kv_heads, grp * Tq, d)


def collect(
    lm,
    texts: Sequence[str],
    max_tokens: int = 2048,
    query_sample: int | str = "all",
    progress: Callable[[int, int], None] | None = None,
) -> CalibrationData:
    """Capture each calibration text (truncated to ``max_tokens``) and pool keys/values/queries."""
    if not texts:
        raise ValueError("calibration needs at least one prompt")
    ks, vs, ps, qs, qps = [], [], [], [], []
    cap = None
    for i, text in enumerate(texts):
        tokens = lm.tokenizer.encode(text)[:max_tokens]
        cap = capture(lm.model, tokens, queries=query_sample, context_length=lm.context_length)
        k, v = grouped(cap)
        ks.append(k)
        vs.append(v)
        ps.append(mx.arange(cap.num_tokens))
        q = grouped_queries(cap)
        grp = cap.n_heads // cap.n_kv_heads
        qs.append(q)
        qps.append(mx.tile(cap.query_positions, (grp,)))
        if progress:
            progress(i + 1, len(texts))
    return CalibrationData(
        keys=mx.concatenate(ks, axis=1),
        values=mx.concatenate(vs, axis=1),
        positions=mx.concatenate(ps),
        queries=mx.concatenate(qs, axis=1),
        query_positions=mx.concatenate(qps),
        n_layers=len(cap.layers),
        n_kv_heads=cap.n_kv_heads,
        n_heads=cap.n_heads,
        head_dim=cap.head_dim,
        rope=cap.rope,
    )


def key_vectors(keys: mx.array, positions: mx.array, key_space: str, rope: RopeSpec | None) -> mx.array:
    """Keys in the codec's key space: [G, N, d] post-RoPE -> same, or pre-RoPE for ``wrope``."""
    if key_space == "post_rope":
        return keys
    if rope is None:
        raise ValueError("key_space 'wrope' needs the model's RoPE settings")
    return unrotate(keys, positions, rope)


def second_moment(x: mx.array, ridge: float = 1e-4) -> mx.array:
    """E[xᵀx] per group with a relative ridge: x [G, M, d] -> [G, d, d] SPD."""
    h = (x.swapaxes(1, 2) @ x) / x.shape[1]
    return cbk._add_trace_ridge(h, ridge)


def wrope_h(
    queries: mx.array, query_positions: mx.array, rope: RopeSpec, seed: int = 0, ridge: float = 1e-4
) -> mx.array:
    """Rotation-averaged key metric for pre-RoPE key codes.

    A pre-RoPE key error e at position j shifts the score of post-RoPE query q̃_i by
    q̃_i R_{-j} eᵀ, so H = E_{i, j<=i}[(q̃_i R_{-j})ᵀ (q̃_i R_{-j})]. Estimated with up to
    ``WROPE_QUERIES`` queries per group and ``WROPE_OFFSETS`` random key positions j <= i each.

    Args:
        queries: [G, M, d] post-RoPE queries; query_positions: [M] their positions i.
    Returns:
        [G, d, d] SPD metric.
    """
    G, M, d = queries.shape
    rng = np.random.default_rng(seed)
    take = np.sort(rng.choice(M, size=min(M, WROPE_QUERIES), replace=False))
    q = queries[:, mx.array(take)]  # [G, m, d]
    pos_i = np.array(query_positions)[take].astype(np.float64)
    j = np.floor(rng.random((WROPE_OFFSETS, take.size)) * (pos_i + 1))  # [P, m], 0 <= j <= i
    xs = mx.broadcast_to(q[:, None], (G, WROPE_OFFSETS, take.size, d)).reshape(G, -1, d)
    rotated = rotate(xs, -mx.array(j.reshape(-1), dtype=mx.float32), rope)
    return second_moment(rotated, ridge)


def key_metric(data: CalibrationData, s: CodecSettings) -> mx.array | None:
    """H for the key codebooks ([G, d, d]), or None for plain (Euclidean) PQ."""
    if s.key_metric == "plain":
        return None
    if s.key_space == "post_rope":
        return second_moment(data.queries)
    return wrope_h(data.queries, data.query_positions, data.rope, seed=s.seed)


def value_metric(lm, data: CalibrationData, s: CodecSettings) -> mx.array | None:
    """H_v for the value codebooks ([G, d, d]), or None for plain PQ."""
    if s.value_metric == "plain":
        return None
    hs = [
        cbk.output_aware_h(
            layer.self_attn.o_proj.weight, data.n_heads, data.n_kv_heads, data.head_dim
        )
        for layer in lm.model.layers
    ]
    return mx.concatenate(hs, axis=0)


@dataclass
class CodebookSet:
    """Key + value codebooks for one model and codec setting (batched over G groups)."""

    keys: cbk.PQCodebook
    values: cbk.PQCodebook
    settings: dict  # CodecSettings.codebook_fields()
    n_layers: int
    n_kv_heads: int
    head_dim: int
    rope: dict | None
    model_id: str

    def to_store(self) -> tuple[dict[str, np.ndarray], dict]:
        """Tensors and metadata for ``Store.put_codebook``."""
        tensors = {}
        for part, cb in (("keys", self.keys), ("values", self.values)):
            # contiguous copies: np.array of a transposed mx.array is strided
            tensors[f"{part}.M"] = np.ascontiguousarray(cb.M, dtype=np.float32)
            tensors[f"{part}.M_inv"] = np.ascontiguousarray(cb.M_inv, dtype=np.float32)
            tensors[f"{part}.centroids"] = np.ascontiguousarray(cb.centroids, dtype=np.float32)
            tensors[f"{part}.perm"] = np.ascontiguousarray(cb.perm, dtype=np.int32)
        meta = {
            "kind": "coldkv.codebook-set",
            "settings": self.settings,
            "n_layers": self.n_layers,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "rope": self.rope,
            "model_id": self.model_id,
            "keys": {"sub_dim": self.keys.sub_dim, "bits": self.keys.bits, "stages": self.keys.stages,
                     "rotate": self.keys.rotate, "h_weighted": self.keys.h_weighted},
            "values": {"sub_dim": self.values.sub_dim, "bits": self.values.bits, "stages": self.values.stages,
                       "rotate": self.values.rotate, "h_weighted": self.values.h_weighted},
        }  # fmt: skip
        return tensors, meta

    @classmethod
    def from_store(cls, tensors: dict[str, np.ndarray], meta: dict) -> "CodebookSet":
        if meta.get("kind") != "coldkv.codebook-set":
            raise ValueError("not a coldkv codebook set")
        parts = {}
        for part in ("keys", "values"):
            m = meta[part]
            parts[part] = cbk.PQCodebook(
                M=mx.array(tensors[f"{part}.M"]),
                M_inv=mx.array(tensors[f"{part}.M_inv"]),
                centroids=mx.array(tensors[f"{part}.centroids"]),
                perm=mx.array(tensors[f"{part}.perm"]),
                sub_dim=m["sub_dim"], bits=m["bits"], stages=m["stages"],
                rotate=m["rotate"], h_weighted=m["h_weighted"],
            )  # fmt: skip
        return cls(
            parts["keys"], parts["values"], meta["settings"], meta["n_layers"],
            meta["n_kv_heads"], meta["head_dim"], meta["rope"], meta["model_id"],
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.to_store()[0].values())


def train_codebooks(lm, data: CalibrationData, s: CodecSettings) -> CodebookSet:
    """Train key and value PQ codebooks for every (layer, KV head) from calibration data."""
    for what, sub in (("key", s.key_sub_dim), ("value", s.value_sub_dim)):
        if data.head_dim % sub:
            raise ValueError(f"{what}_sub_dim={sub} does not divide head_dim={data.head_dim}")
    kx = key_vectors(data.keys, data.positions, s.key_space, data.rope)
    keys_cb = cbk.train_pq(
        kx, key_metric(data, s), s.key_sub_dim, s.key_bits, s.key_stages, s.rotate,
        iters=s.kmeans_iters, seed=s.seed,
    )  # fmt: skip
    values_cb = cbk.train_pq(
        data.values, value_metric(lm, data, s), s.value_sub_dim, s.value_bits, s.value_stages,
        s.rotate, iters=s.kmeans_iters, seed=s.seed + 1000,
    )  # fmt: skip
    return CodebookSet(
        keys_cb, values_cb, s.codebook_fields(), data.n_layers, data.n_kv_heads, data.head_dim,
        data.rope.to_dict() if data.rope else None, lm.model_id,
    )  # fmt: skip


def calibration_key(model_id: str, texts: Sequence[str], s: CodecSettings, max_tokens: int) -> str:
    """Deterministic key of a calibration run: same inputs -> same codebooks (for caching)."""
    h = hashlib.sha256()
    h.update(model_id.encode())
    h.update(json.dumps(s.codebook_fields(), sort_keys=True).encode())
    h.update(str(max_tokens).encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()
