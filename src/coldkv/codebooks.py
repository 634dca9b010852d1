"""z-space codebooks: H calibration, k-means++ / Lloyd, product quantization, save/load.

A2ATS's objective for replacing a key ``x`` by ``x̂`` is ``(x - x̂) H (x - x̂)ᵀ`` with
``H = E[qᵀq]``. For any ``M`` with ``M Mᵀ = H`` (the Cholesky ``L``, or ``L·U`` for an orthogonal
``U``) that equals ``‖xM - x̂M‖²``: in ``z = x M`` the objective is plain Euclidean. So

* ordinary k-means in z-space minimises the H-weighted error exactly;
* product quantization of z (split z into sub-vectors, one codebook per sub-vector, optional
  residual stages) is exact too: the squared error is the sum of the sub-vector errors;
* with ``rotate=True`` we take ``M = L·U`` with ``U`` the principal axes of ``cov(xL)`` and deal
  the axes round-robin (by descending variance) to the sub-vectors, so every sub-vector mixes
  high- and low-variance axes (the OPQ idea; DESIGN §5 lesson 1, the largest gain measured).

``H = None`` gives plain PQ (``M = I``, or the PCA rotation of x when ``rotate=True``).

Shapes: a codebook is for one (layer, KV head), or batched with a leading group axis ``G``
(``layers × kv_heads``); every function accepts both. ``d`` = head_dim, ``n_sub = d / sub_dim``,
``K = 2**bits``:

* ``PQCodebook.M``, ``M_inv``   ``[d, d]`` / ``[G, d, d]`` float32, ``z = x @ M``
* ``PQCodebook.perm``           ``[d]`` / ``[G, d]`` int32: sub-vector ``j`` holds the z axes
  ``perm[j*sub_dim:(j+1)*sub_dim]``
* ``PQCodebook.centroids``      ``[stages, n_sub, K, sub_dim]`` / ``[G, stages, n_sub, K, sub_dim]``
  (z-space, sub-vector coordinates)
* codes                         ``[N, stages, n_sub]`` / ``[G, N, stages, n_sub]`` uint8 (bits ≤ 8)
  or uint16
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

from coldkv import kernels
from coldkv.quantizers.a2ats import as_float32, spd_cholesky

FORMAT = "coldkv.pq"
FORMAT_VERSION = 1
_META_KEY = "coldkv.codebook"  # one metadata key: safetensors orders several keys at random


# ----------------------------------------------------------------------------- H matrices


def _add_trace_ridge(h: mx.array, ridge: float) -> mx.array:
    """``(H + Hᵀ)/2 + ridge · (trace(H)/d) · I`` for ``h`` ``[..., d, d]`` (scale 1 if trace 0)."""
    ridge = float(ridge)
    if not (np.isfinite(ridge) and ridge >= 0.0):
        raise ValueError(f"ridge must be finite and >= 0, got {ridge}")
    d = h.shape[-1]
    h = 0.5 * (h + h.swapaxes(-1, -2))
    scale = mx.trace(h, axis1=-2, axis2=-1) / d
    scale = mx.where(scale > 0, scale, mx.ones_like(scale))
    out = h + (ridge * scale)[..., None, None] * mx.eye(d, dtype=mx.float32)
    mx.eval(out)
    return out


def calibrate_h(queries, n_kv_heads: int, ridge: float = 1e-4) -> mx.array:
    """Per-KV-head query second moment for GQA.

    ``H_j = Σ_{h in group j} E[q_hᵀ q_h] + ridge · (trace/d) · I``: query head ``h`` reads KV head
    ``h // (n_heads // n_kv_heads)``; the ridge is relative to the mean eigenvalue
    ``trace/d``, so ``ridge=1e-4`` bounds the condition number near ``1e4 · d`` whatever the
    scale of the queries.

    Args:
        queries: ``[n_heads, M, d]`` (post-RoPE or pre-RoPE, as the codec needs) query states.
        n_kv_heads: number of KV heads; must divide ``n_heads``.
        ridge: relative ridge, ``>= 0``.

    Returns:
        ``[n_kv_heads, d, d]`` float32 symmetric positive-definite ``H``.
    """
    q = as_float32(queries, "queries", ndim=3)
    n_heads, m, d = q.shape
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
    if m == 0:
        raise ValueError("queries has no rows (M = 0)")
    per_head = (q.swapaxes(1, 2) @ q) / float(m)  # [n_heads, d, d]
    h = per_head.reshape(n_kv_heads, n_heads // n_kv_heads, d, d).sum(axis=1)
    return _add_trace_ridge(h, ridge)


def output_aware_h(
    o_proj_weight, n_heads: int, n_kv_heads: int, head_dim: int, ridge: float = 1e-4
) -> mx.array:
    """Metric for value codes: the error a value error ``e`` causes in the layer output.

    Head ``h``'s attention output ``o_h`` ``[head_dim]`` enters the residual stream as
    ``o_h W_hᵀ`` with ``W_h = W_o[:, h·hd:(h+1)·hd]`` ``[hidden, hd]``, so a value error ``e``
    costs ``‖e W_hᵀ‖² = e (W_hᵀ W_h) eᵀ``. ``H_v`` for KV head ``j`` sums ``W_hᵀ W_h`` over the
    query heads of its GQA group, plus ``ridge · (trace/d) · I``.

    Args:
        o_proj_weight: ``[hidden, n_heads·head_dim]`` o_proj weight (mlx ``nn.Linear`` layout,
            dequantized).
        n_heads, n_kv_heads, head_dim: attention geometry; ``n_kv_heads`` divides ``n_heads``.
        ridge: relative ridge, ``>= 0``.

    Returns:
        ``[n_kv_heads, head_dim, head_dim]`` float32 symmetric positive-definite ``H_v``.
    """
    w = as_float32(o_proj_weight, "o_proj_weight", ndim=2)
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
    hidden, cols = w.shape
    if cols != n_heads * head_dim:
        raise ValueError(
            f"o_proj_weight has {cols} columns, expected n_heads*head_dim = {n_heads * head_dim}"
        )
    wh = w.reshape(hidden, n_heads, head_dim).transpose(1, 0, 2)  # [n_heads, hidden, hd]
    per_head = wh.swapaxes(1, 2) @ wh  # [n_heads, hd, hd]
    h = per_head.reshape(n_kv_heads, n_heads // n_kv_heads, head_dim, head_dim).sum(axis=1)
    return _add_trace_ridge(h, ridge)


def condition_number(h) -> float | np.ndarray:
    """``λ_max / λ_min`` of symmetric ``h`` ``[d, d]`` (float) or ``[G, d, d]`` (array ``[G]``).

    ``inf`` when ``λ_min <= 0``.
    """
    a = np.asarray(h.astype(mx.float32) if isinstance(h, mx.array) else h, dtype=np.float64)
    lam = np.linalg.eigvalsh(0.5 * (a + np.swapaxes(a, -1, -2)))
    lo, hi = lam[..., 0], lam[..., -1]
    with np.errstate(divide="ignore", invalid="ignore"):
        cond = np.where(lo > 0, hi / np.where(lo > 0, lo, 1.0), np.inf)
    return float(cond) if cond.ndim == 0 else cond


def h_weighted_error(x, x_hat, h) -> mx.array:
    """Per-row ``(x - x̂) H (x - x̂)ᵀ``: ``x``, ``x_hat`` ``[..., N, d]``, ``h`` ``[..., d, d]`` -> ``[..., N]``."""
    e = as_float32(x, "x") - as_float32(x_hat, "x_hat")
    return mx.sum((e @ as_float32(h, "h")) * e, axis=-1)


# ----------------------------------------------------------------------------- k-means


@dataclass
class KMeansResult:
    """Output of :func:`kmeans_fit`.

    ``centroids`` ``[k, d]`` / ``[G, k, d]``; ``assignments`` ``[N]`` / ``[G, N]`` int32 (against
    the returned centroids); ``inertia`` final sum of squared errors (float / ``[G]``);
    ``history`` inertia after each assignment step (``[T]`` / ``[T, G]``, non-increasing);
    ``n_iter`` Lloyd updates run.
    """

    centroids: mx.array
    assignments: mx.array
    inertia: float | np.ndarray
    history: np.ndarray
    n_iter: int


_PP_BLOCK = 64  # D² sampling: pick a block of 64 points by its weight, then a point inside it


def _sample_d2(dmin: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row of ``dmin`` ``[G, S]`` (S a multiple of 64), with probability ∝ ``dmin``.

    Two-level inverse-CDF sampling: block sums (one fast reduction) pick a block, a cumsum over
    that block's 64 weights picks the point, so no full-length cumsum per step. Rows whose
    weights are all zero get a uniform pick.
    """
    g, s = dmin.shape
    rows = np.arange(g)
    blocks = dmin.reshape(g, s // _PP_BLOCK, _PP_BLOCK)
    cum_b = np.cumsum(blocks.sum(axis=2, dtype=np.float64), axis=1)  # [G, S/64]
    total = cum_b[:, -1]
    u = rng.random(g) * total
    b = np.minimum(np.count_nonzero(cum_b <= u[:, None], axis=1), s // _PP_BLOCK - 1)
    u_in = u - np.where(b > 0, cum_b[rows, np.maximum(b - 1, 0)], 0.0)
    cum_in = np.cumsum(blocks[rows, b].astype(np.float64), axis=1)  # [G, 64]
    j = np.minimum(np.count_nonzero(cum_in <= u_in[:, None], axis=1), _PP_BLOCK - 1)
    pick = b * _PP_BLOCK + j
    degenerate = total <= 0  # every point already coincides with a center
    if degenerate.any():
        pick = np.where(degenerate, rng.integers(0, s, size=g), pick)
    return pick


def _kmeans_pp(zs: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding (D² sampling), vectorised over groups. ``zs`` ``[G, S, d]`` -> ``[G, k, d]``."""
    g, s, d = zs.shape
    rows = np.arange(g)
    sq = np.einsum("gsd,gsd->gs", zs, zs)
    centers = np.empty((g, k, d), dtype=zs.dtype)
    pad = (-s) % _PP_BLOCK  # padded points carry weight 0 and are never drawn

    def dist_to(c: np.ndarray) -> np.ndarray:  # c [G, d] -> [G, S + pad]
        dist = np.matmul(zs, c[:, :, None])[..., 0]
        dist *= -2.0
        dist += sq
        dist += np.einsum("gd,gd->g", c, c)[:, None]
        np.maximum(dist, 0.0, out=dist)
        return np.pad(dist, ((0, 0), (0, pad))) if pad else dist

    pick = rng.integers(0, s, size=g)
    centers[:, 0] = zs[rows, pick]
    dmin = dist_to(centers[:, 0])
    for j in range(1, k):
        pick = np.minimum(_sample_d2(dmin, rng), s - 1)
        centers[:, j] = zs[rows, pick]
        np.minimum(dmin, dist_to(centers[:, j]), out=dmin)
    return centers


def _gather_rows(c: mx.array, a: mx.array) -> mx.array:
    """``c[g, a[g, n]]`` for ``c`` ``[G, k, d]``, ``a`` ``[G, N]`` -> ``[G, N, d]``."""
    g, k, d = c.shape
    flat = a + (mx.arange(g, dtype=mx.int32) * k)[:, None]
    return c.reshape(g * k, d)[flat]


def _assign(z: mx.array, c: mx.array, chunk: int | None) -> tuple[mx.array, mx.array]:
    """Assignments ``[G, N]`` and exact squared errors ``[G, N]`` (recomputed from the gather)."""
    a = kernels.nearest_centroid(z, c, chunk=chunk)
    diff = z - _gather_rows(c, a)
    err = mx.sum(diff * diff, axis=-1)
    mx.eval(err)
    return a, err


def _update(z: mx.array, a: mx.array, c_old: mx.array) -> tuple[mx.array, np.ndarray]:
    """Lloyd update by scatter-add. Returns new centroids (empty clusters keep the old) and counts."""
    g, n, d = z.shape
    k = c_old.shape[1]
    flat = (a + (mx.arange(g, dtype=mx.int32) * k)[:, None]).reshape(-1)
    sums = mx.zeros((g * k, d), dtype=mx.float32).at[flat].add(z.reshape(g * n, d))
    counts = mx.zeros((g * k,), dtype=mx.float32).at[flat].add(1.0)
    sums, counts = sums.reshape(g, k, d), counts.reshape(g, k)
    safe = mx.maximum(counts, 1.0)[..., None]
    c_new = mx.where(counts[..., None] > 0, sums / safe, c_old)
    mx.eval(c_new, counts)
    return c_new, np.array(counts)


def _repair_empty(
    z: mx.array, c: mx.array, counts: np.ndarray, err: mx.array
) -> tuple[mx.array, int]:
    """Re-seed empty clusters on the points with the largest current error (distinct points)."""
    empty_groups = np.flatnonzero((counts == 0).any(axis=1))
    if empty_groups.size == 0:
        return c, 0
    c_np = np.array(c)
    err_np = np.array(err)
    repaired = 0
    for g in empty_groups:  # a loop over groups that have an empty cluster (rare)
        empties = np.flatnonzero(counts[g] == 0)
        e = min(empties.size, err_np.shape[1])
        worst = np.argpartition(-err_np[g], e - 1)[:e]
        worst = worst[np.argsort(-err_np[g][worst], kind="stable")]
        c_np[g, empties[:e]] = np.array(z[int(g)][mx.array(worst.astype(np.int32))])
        repaired += e
    return mx.array(c_np), repaired


def kmeans_fit(
    z,
    k: int,
    iters: int = 50,
    tol: float = 1e-4,
    seed: int = 0,
    init: str = "k-means++",
    *,
    init_sample: int | None = None,
    chunk: int | None = None,
) -> KMeansResult:
    """k-means (k-means++ seeding, Lloyd iterations in MLX), optionally over ``G`` groups.

    Args:
        z: ``[N, d]`` or ``[G, N, d]`` points (already in z-space; Euclidean metric).
        k: clusters per group, ``1 <= k <= N``.
        iters: maximum Lloyd updates.
        tol: stop when every group's relative inertia decrease is below ``tol``.
        seed: seeds the initialisation; the result is deterministic for a given seed.
        init: ``"k-means++"`` (D² sampling) or ``"random"`` (k distinct points).
        init_sample: k-means++ runs on a random subsample of this many points per group
            (default ``min(N, max(4096, 16·k))``).
        chunk: rows per chunk for the assignment kernel (default: automatic).

    Empty clusters are re-seeded on the points with the largest error, so none stays empty
    (given ``N >= k`` distinct points). Inertia is non-increasing from one assignment to the next.
    """
    zz = as_float32(z, "z", ndim=(2, 3))
    single = zz.ndim == 2
    if single:
        zz = zz[None]
    g, n, d = zz.shape
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, N={n}], got {k}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    rng = np.random.default_rng(seed)

    if init == "k-means++":
        s = min(n, int(init_sample) if init_sample else max(4096, 16 * k))
        s = max(s, k)
        sub = np.sort(rng.choice(n, size=s, replace=False)) if s < n else np.arange(n)
        zs = np.array(zz[:, mx.array(sub.astype(np.int32))]) if s < n else np.array(zz)
        c = mx.array(_kmeans_pp(zs, k, rng))
    elif init == "random":
        picks = np.stack([np.sort(rng.choice(n, size=k, replace=False)) for _ in range(g)])
        c = _gather_rows(zz, mx.array(picks.astype(np.int32)))
    else:
        raise ValueError(f"init must be 'k-means++' or 'random', got {init!r}")

    history = []
    n_iter = 0
    a, err = _assign(zz, c, chunk)
    history.append(np.array(err, dtype=np.float64).sum(axis=-1))
    for _ in range(iters):
        c_new, counts = _update(zz, a, c)
        c_new, _ = _repair_empty(zz, c_new, counts, err)
        c = c_new
        n_iter += 1
        a, err = _assign(zz, c, chunk)
        history.append(np.array(err, dtype=np.float64).sum(axis=-1))
        prev, cur = history[-2], history[-1]
        rel = (prev - cur) / np.maximum(prev, np.finfo(np.float64).tiny)
        if np.all(rel < tol):
            break
    hist = np.stack(history)
    inertia = hist[-1]
    if single:
        return KMeansResult(c[0], a[0], float(inertia[0]), hist[:, 0], n_iter)
    return KMeansResult(c, a, inertia, hist, n_iter)


def kmeans(
    z,
    k: int,
    iters: int = 50,
    tol: float = 1e-4,
    seed: int = 0,
    init: str = "k-means++",
    *,
    init_sample: int | None = None,
    chunk: int | None = None,
) -> mx.array:
    """Centroids ``[k, d]`` (or ``[G, k, d]`` for ``z`` ``[G, N, d]``); see :func:`kmeans_fit`."""
    return kmeans_fit(
        z, k, iters, tol, seed, init, init_sample=init_sample, chunk=chunk
    ).centroids


# ----------------------------------------------------------------------------- PQ codebook


@dataclass
class PQCodebook:
    """Product-quantization codebook in z-space (``z = x @ M``, ``M Mᵀ = H``).

    See the module docstring for shapes. ``rotate``/``h_weighted`` record how ``M`` was
    built; ``info`` carries free-form provenance (model hash, layer, "keys"/"values", ...) and is
    part of the serialized content and so of :func:`codebook_hash`.
    """

    M: mx.array
    M_inv: mx.array
    centroids: mx.array
    perm: mx.array
    sub_dim: int
    bits: int
    stages: int = 1
    rotate: bool = True
    h_weighted: bool = False
    info: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        batched = self.M.ndim == 3
        want_c = 5 if batched else 4
        if self.M.ndim not in (2, 3) or self.M_inv.shape != self.M.shape:
            raise ValueError(f"bad M/M_inv shapes {tuple(self.M.shape)} {tuple(self.M_inv.shape)}")
        if self.centroids.ndim != want_c:
            raise ValueError(f"centroids must be {want_c}-D, got {tuple(self.centroids.shape)}")
        d = self.M.shape[-1]
        if d % self.sub_dim or self.centroids.shape[-3:] != (
            d // self.sub_dim,
            2**self.bits,
            self.sub_dim,
        ):
            raise ValueError(
                f"centroids {tuple(self.centroids.shape)} do not match d={d}, "
                f"sub_dim={self.sub_dim}, bits={self.bits}"
            )
        if self.centroids.shape[-4] != self.stages:
            raise ValueError(f"centroids {tuple(self.centroids.shape)} != stages={self.stages}")
        if self.perm.shape != self.M.shape[:-1]:
            raise ValueError(f"perm shape {tuple(self.perm.shape)} != {tuple(self.M.shape[:-1])}")

    @property
    def d(self) -> int:
        return int(self.M.shape[-1])

    @property
    def n_sub(self) -> int:
        return self.d // self.sub_dim

    @property
    def n_centroids(self) -> int:
        return 2**self.bits

    @property
    def groups(self) -> int | None:
        """``G`` for a batched codebook, ``None`` for a single one."""
        return int(self.M.shape[0]) if self.M.ndim == 3 else None

    @property
    def code_dtype(self) -> mx.Dtype:
        return mx.uint8 if self.bits <= 8 else mx.uint16

    def group(self, g: int) -> "PQCodebook":
        """The single codebook of group ``g`` of a batched codebook."""
        if self.groups is None:
            raise ValueError("not a batched codebook")
        return PQCodebook(
            self.M[g], self.M_inv[g], self.centroids[g], self.perm[g], self.sub_dim, self.bits,
            self.stages, self.rotate, self.h_weighted, dict(self.info),
        )  # fmt: skip

    def subset(self, groups) -> "PQCodebook":
        """The batched codebook of some groups (a slice or an index array) of a batched codebook."""
        if self.groups is None:
            raise ValueError("not a batched codebook")
        return PQCodebook(
            self.M[groups], self.M_inv[groups], self.centroids[groups], self.perm[groups], self.sub_dim,
            self.bits, self.stages, self.rotate, self.h_weighted, dict(self.info),
        )  # fmt: skip

    def encode(self, x, *, chunk: int | None = None) -> mx.array:
        return encode(self, x, chunk=chunk)

    def decode(self, codes) -> mx.array:
        return decode(self, codes)


def bits_per_element(cb: PQCodebook) -> float:
    """Code bits per stored element: ``stages · bits / sub_dim``."""
    return cb.stages * cb.bits / cb.sub_dim


def round_robin_perm(d: int, sub_dim: int) -> np.ndarray:
    """Deal axes ``0..d-1`` (sorted by descending variance) to ``d/sub_dim`` sub-vectors in turn.

    Sub-vector ``j`` gets axes ``j, j + n_sub, j + 2·n_sub, ...``. Returns ``[d]`` int32.
    """
    n_sub = d // sub_dim
    return np.concatenate([np.arange(j, d, n_sub) for j in range(n_sub)]).astype(np.int32)


def _batched(cb: PQCodebook):
    """``(M_perm [G,d,d], M_perm_inv [G,d,d], centroids [G,S,n_sub,K,sub])`` with perm folded in.

    ``x @ M[..., perm]`` lists z's axes sub-vector by sub-vector, and
    ``(M[..., perm])⁻¹ = M_inv[perm, :]``.
    """
    m, m_inv, cents, perm = cb.M, cb.M_inv, cb.centroids, cb.perm
    if cb.groups is None:
        m, m_inv, cents, perm = m[None], m_inv[None], cents[None], perm[None]
    g, d, _ = m.shape
    p = perm.astype(mx.int32)
    m_p = mx.take_along_axis(m, mx.broadcast_to(p[:, None, :], (g, d, d)), axis=2)
    m_inv_p = mx.take_along_axis(m_inv, mx.broadcast_to(p[:, :, None], (g, d, d)), axis=1)
    return m_p, m_inv_p, cents


def _to_groups(x, cb: PQCodebook, name: str) -> mx.array:
    want = 2 if cb.groups is None else 3
    xx = as_float32(x, name, ndim=want)
    if xx.shape[-1] != cb.d:
        raise ValueError(f"{name} width {xx.shape[-1]} != codebook d={cb.d}")
    if cb.groups is not None and xx.shape[0] != cb.groups:
        raise ValueError(f"{name} has {xx.shape[0]} groups, codebook has {cb.groups}")
    return xx[None] if want == 2 else xx


def _split(zp: mx.array, sub_dim: int) -> mx.array:
    """``[G, N, d]`` (sub-vector order) -> ``[G·n_sub, N, sub_dim]``."""
    g, n, d = zp.shape
    n_sub = d // sub_dim
    return zp.reshape(g, n, n_sub, sub_dim).transpose(0, 2, 1, 3).reshape(g * n_sub, n, sub_dim)


def encode(cb: PQCodebook, x, *, chunk: int | None = None) -> mx.array:
    """Codes ``[N, stages, n_sub]`` (or ``[G, N, stages, n_sub]``) for ``x`` ``[N, d]`` / ``[G, N, d]``.

    Stage ``s`` quantizes the residual ``z - Σ_{t<s} ẑ_t`` of each sub-vector to its nearest
    centroid (Euclidean in z-space = H-weighted in x-space).
    """
    xx = _to_groups(x, cb, "x")
    g, n, d = xx.shape
    m_p, _, cents = _batched(cb)
    k, n_sub = cb.n_centroids, cb.n_sub
    resid = _split(xx @ m_p, cb.sub_dim)  # [G·n_sub, N, sub]
    codes = []
    for s in range(cb.stages):
        c_s = cents[:, s].reshape(g * n_sub, k, cb.sub_dim)
        a = kernels.nearest_centroid(resid, c_s, chunk=chunk)  # [G·n_sub, N]
        codes.append(a)
        if s + 1 < cb.stages:
            resid = resid - _gather_rows(c_s, a)
    out = mx.stack(codes, axis=1).reshape(g, n_sub, cb.stages, n)
    out = out.transpose(0, 3, 2, 1).astype(cb.code_dtype)  # [G, N, stages, n_sub]
    mx.eval(out)
    return out[0] if cb.groups is None else out


def decode_z(cb: PQCodebook, codes) -> mx.array:
    """Reconstruction in the codebook's sub-vector-ordered z-space, ``[..., N, d]`` (``x @ M[..., perm]``)."""
    want = 3 if cb.groups is None else 4
    c = codes if isinstance(codes, mx.array) else mx.array(np.asarray(codes))
    if c.ndim != want or tuple(c.shape[-2:]) != (cb.stages, cb.n_sub):
        raise ValueError(
            f"codes must be [{'G, ' if want == 4 else ''}N, {cb.stages}, {cb.n_sub}], "
            f"got {tuple(c.shape)}"
        )
    c = c[None] if want == 3 else c
    g, n = c.shape[0], c.shape[1]
    if cb.groups is not None and g != cb.groups:
        raise ValueError(f"codes have {g} groups, codebook has {cb.groups}")
    _, _, cents = _batched(cb)
    k, n_sub, st = cb.n_centroids, cb.n_sub, cb.stages
    table = cents.reshape(g * st * n_sub * k, cb.sub_dim)
    offset = (mx.arange(g * st * n_sub, dtype=mx.int32) * k).reshape(g, 1, st, n_sub)
    vals = table[c.astype(mx.int32) + offset]  # [G, N, stages, n_sub, sub]
    zp = vals.sum(axis=2).reshape(g, n, cb.d)
    return zp[0] if cb.groups is None else zp


def decode(cb: PQCodebook, codes) -> mx.array:
    """``x̂`` ``[N, d]`` / ``[G, N, d]`` in the original x-space: ``x̂ = ẑ M⁻¹``."""
    zp = decode_z(cb, codes)
    _, m_inv_p, _ = _batched(cb)
    out = (zp[None] if cb.groups is None else zp) @ m_inv_p
    mx.eval(out)
    return out[0] if cb.groups is None else out


def _principal_axes(z: mx.array) -> np.ndarray:
    """``U`` ``[G, d, d]`` (float64): eigenvectors of each group's covariance, descending variance."""
    n = z.shape[1]
    mean = mx.mean(z, axis=1)  # [G, d]
    second = (z.swapaxes(1, 2) @ z) / float(n)
    cov = np.array(second, dtype=np.float64) - np.einsum(
        "gi,gj->gij", np.array(mean, dtype=np.float64), np.array(mean, dtype=np.float64)
    )
    _, vecs = np.linalg.eigh(0.5 * (cov + np.swapaxes(cov, 1, 2)))
    return vecs[:, :, ::-1]


def train_pq(
    x,
    H=None,
    sub_dim: int = 4,
    bits: int = 8,
    stages: int = 1,
    rotate: bool = True,
    iters: int = 25,
    seed: int = 0,
    *,
    tol: float = 1e-4,
    init_sample: int | None = None,
    info: dict[str, str] | None = None,
) -> PQCodebook:
    """Train a z-space PQ codebook (one, or one per group).

    Args:
        x: ``[N, d]`` or ``[G, N, d]`` calibration vectors (keys or values), ``N >= 2**bits``.
        H: ``[d, d]`` / ``[G, d, d]`` SPD metric (e.g. :func:`calibrate_h`), or ``None`` for
            plain PQ (``M = I``).
        sub_dim: sub-vector width; divides ``d``.
        bits: ``2**bits`` centroids per sub-vector per stage (1..16).
        stages: residual stages.
        rotate: ``M = L·U`` (principal axes of ``xL``), axes dealt round-robin by descending
            variance; otherwise ``M = L`` and contiguous sub-vectors.
        iters, seed, tol, init_sample: k-means settings (stage ``s`` uses ``seed + s``).
        info: provenance strings stored with the codebook.

    Returns:
        A :class:`PQCodebook`; ``M Mᵀ = H`` (to float32 precision) whenever ``H`` is given.
    """
    xx = as_float32(x, "x", ndim=(2, 3))
    single = xx.ndim == 2
    if single:
        xx = xx[None]
    g, n, d = xx.shape
    if sub_dim < 1 or d % sub_dim:
        raise ValueError(f"sub_dim={sub_dim} must divide d={d}")
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in [1, 16], got {bits}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    k = 2**bits
    if n < k:
        raise ValueError(f"need at least 2**bits = {k} training vectors, got N={n}")

    if H is None:
        m = np.broadcast_to(np.eye(d), (g, d, d)).copy()
    else:
        h = H if isinstance(H, mx.array) else np.asarray(H)
        if h.ndim != (2 if single else 3) or tuple(h.shape[-2:]) != (d, d):
            raise ValueError(f"H must be [{'' if single else 'G, '}{d}, {d}], got {tuple(h.shape)}")
        if not single and h.shape[0] != g:
            raise ValueError(f"H has {h.shape[0]} groups, x has {g}")
        m = spd_cholesky(h[None] if single else h)  # [G, d, d] float64, lower
    if rotate:
        u = _principal_axes(xx @ mx.array(m.astype(np.float32)))
        m = m @ u
        perm = np.broadcast_to(round_robin_perm(d, sub_dim), (g, d)).copy()
    else:
        perm = np.broadcast_to(np.arange(d, dtype=np.int32), (g, d)).copy()
    m_inv = np.linalg.inv(m)

    m_p = mx.array(np.take_along_axis(m, perm[:, None, :], axis=2).astype(np.float32))
    resid = _split(xx @ m_p, sub_dim)  # [G·n_sub, N, sub]
    cents = []
    for s in range(stages):
        res = kmeans_fit(resid, k, iters=iters, tol=tol, seed=seed + s, init_sample=init_sample)
        cents.append(res.centroids)  # [G·n_sub, K, sub]
        if s + 1 < stages:
            resid = resid - _gather_rows(res.centroids, res.assignments)
    n_sub = d // sub_dim
    centroids = mx.stack(cents, axis=1).reshape(g, n_sub, stages, k, sub_dim)
    centroids = mx.contiguous(centroids.transpose(0, 2, 1, 3, 4))  # [G, stages, n_sub, K, sub]
    cb = PQCodebook(
        M=mx.array(m.astype(np.float32)),
        M_inv=mx.array(m_inv.astype(np.float32)),
        centroids=centroids,
        perm=mx.array(perm.astype(np.int32)),
        sub_dim=sub_dim,
        bits=bits,
        stages=stages,
        rotate=bool(rotate),
        h_weighted=H is not None,
        info=dict(info or {}),
    )
    return cb.group(0) if single else cb


# ----------------------------------------------------------------------------- save / load


def _settings(cb: PQCodebook) -> dict:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "sub_dim": cb.sub_dim,
        "bits": cb.bits,
        "stages": cb.stages,
        "rotate": cb.rotate,
        "h_weighted": cb.h_weighted,
        "groups": cb.groups,
        "d": cb.d,
        "info": {str(k): str(v) for k, v in cb.info.items()},
    }


def codebook_bytes(cb: PQCodebook) -> bytes:
    """The codebook serialized as safetensors bytes (deterministic for equal content).

    Tensors ``M``, ``M_inv``, ``centroids`` (float32) and ``perm`` (int32); settings as one
    sorted-key JSON string under the metadata key ``coldkv.codebook``.
    """
    # np.array of a strided mx view is a strided numpy view; safetensors needs C order.
    tensors = {
        "M": np.ascontiguousarray(np.array(cb.M), dtype=np.float32),
        "M_inv": np.ascontiguousarray(np.array(cb.M_inv), dtype=np.float32),
        "centroids": np.ascontiguousarray(np.array(cb.centroids), dtype=np.float32),
        "perm": np.ascontiguousarray(np.array(cb.perm), dtype=np.int32),
    }
    meta = {_META_KEY: json.dumps(_settings(cb), sort_keys=True, separators=(",", ":"))}
    return _st_save(tensors, metadata=meta)


def codebook_from_bytes(data: bytes) -> PQCodebook:
    """Inverse of :func:`codebook_bytes`."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    meta = header.get("__metadata__", {})
    if _META_KEY not in meta:
        raise ValueError("not a coldkv codebook (metadata key missing)")
    s = json.loads(meta[_META_KEY])
    if s.get("format") != FORMAT or s.get("version") != FORMAT_VERSION:
        raise ValueError(f"unsupported codebook format {s.get('format')} v{s.get('version')}")
    t = _st_load(data)
    return PQCodebook(
        M=mx.array(t["M"]),
        M_inv=mx.array(t["M_inv"]),
        centroids=mx.array(t["centroids"]),
        perm=mx.array(t["perm"]),
        sub_dim=int(s["sub_dim"]),
        bits=int(s["bits"]),
        stages=int(s["stages"]),
        rotate=bool(s["rotate"]),
        h_weighted=bool(s["h_weighted"]),
        info=dict(s.get("info", {})),
    )


def codebook_hash(cb: PQCodebook) -> str:
    """sha256 (hex) of :func:`codebook_bytes` — also the sha256 of the file :func:`save_codebook` writes."""
    return hashlib.sha256(codebook_bytes(cb)).hexdigest()


def save_codebook(path, cb: PQCodebook) -> str:
    """Write ``cb`` to ``path`` as safetensors (atomically: temp file + rename). Returns its hash."""
    data = codebook_bytes(cb)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return hashlib.sha256(data).hexdigest()


def load_codebook(path) -> PQCodebook:
    """Read a codebook written by :func:`save_codebook`."""
    return codebook_from_bytes(Path(path).read_bytes())


__all__ = [
    "KMeansResult",
    "PQCodebook",
    "bits_per_element",
    "calibrate_h",
    "codebook_bytes",
    "codebook_from_bytes",
    "codebook_hash",
    "condition_number",
    "decode",
    "decode_z",
    "encode",
    "h_weighted_error",
    "kmeans",
    "kmeans_fit",
    "load_codebook",
    "output_aware_h",
    "round_robin_perm",
    "save_codebook",
    "train_pq",
]
