"""A2ATS query-aware vector quantization: the seed API.

Implements the five functions of ``veloxquant_mlx.quantizers.a2ats`` (same names, parameters,
defaults, shapes and semantics) for A2ATS: "Retrieval-Based KV Cache Reduction via Windowed
Rotary Position Embedding and Query-Aware Vector Quantization" (He, Xing, Wang, Xu, Wu, Zhou,
Liu, Xue, Li; ACL 2025 Findings, arXiv 2502.12665).

The paper's objective: replacing key ``k`` by centroid ``c`` perturbs attention scores by
``E_q[(q kᵀ - q cᵀ)²] = (k - c) H (k - c)ᵀ`` with ``H = E[qᵀq]`` (Eq. 10/13). With the Cholesky
factor ``H = L Lᵀ`` (Eq. 15) this is the Euclidean distance ``‖kL - cL‖²`` (Eq. 17), so the
H-weighted assignment is an ordinary nearest-centroid search in ``z = kL``, done here by the
GEMM-shaped kernel :func:`coldkv.kernels.h_weighted_assign`.

Public API:

* :func:`a2ats_query_second_moment`    ``[M, d] -> [d, d]``  ``H = qᵀq / M + ridge·I``
* :func:`a2ats_cholesky_factor`        ``[d, d] -> [d, d]``  lower-triangular ``L``, ``H = L Lᵀ``
* :func:`a2ats_h_weighted_assignment`  ``[N, d], [K, d], [d, d] -> [N]`` (Eq. 14, exact)
* :func:`a2ats_query_aware_assignment` ``[N, d], [K, d], [d] -> [N]`` cosine-blend substitute
* :func:`a2ats_select_retrieval_set`   ``[N, D], [D] -> ([R], [N-R])`` top-cosine split

Differences from the reference implementation, all deliberate:

* inputs are validated: wrong ranks or widths, NaN/Inf, a non-symmetric or non-positive-definite
  ``H``, ``beta`` or ``retrieval_fraction`` outside ``[0, 1]`` raise ``ValueError`` (the reference
  clamps pivots to ``1e-12`` and factors garbage silently);
* the Cholesky factor is LAPACK's (float64 numpy), not a Python double loop;
* :func:`a2ats_select_retrieval_set` uses ``mx.argpartition`` instead of a Python heap, and the
  retrieval set has exactly ``ceil(fraction·N)`` members (the reference forces at least one, so
  ``fraction=0`` still retrieved a token); ``fraction·N`` within float rounding of an integer
  counts as that integer (``0.7 · 10 -> 7``, not 8).
"""

from __future__ import annotations

import math

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from coldkv import kernels

_EPS = 1e-8
#: Relative tolerance for ``H`` being symmetric: ``max|H - Hᵀ| <= SYM_RTOL · max|H|``.
SYM_RTOL = 1e-4


# ----------------------------------------------------------------------------- validation


def as_float32(a, name: str, ndim: int | tuple[int, ...] | None = None) -> mx.array:
    """``a`` as an mx float32 array, checked for rank and for NaN/Inf (``ValueError``)."""
    if not isinstance(a, mx.array):
        a = mx.array(np.asarray(a))
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if a.ndim not in allowed:
            want = " or ".join(f"{n}-D" for n in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(a.shape)}")
    if a.dtype != mx.float32:
        a = a.astype(mx.float32)
    # A finite sum proves there is no NaN/Inf (one fast reduction); only a non-finite sum
    # (NaN/Inf present, or float32 overflow) pays for the exact elementwise check.
    if a.size and not math.isfinite(mx.sum(a).item()) and not mx.all(mx.isfinite(a)).item():
        raise ValueError(f"{name} contains NaN or Inf")
    return a


def spd_cholesky(h, name: str = "H") -> np.ndarray:
    """Validate symmetric positive-definite ``h`` ``[..., d, d]``; return float64 ``L`` (lower).

    ``h`` is symmetrised (``(H + Hᵀ)/2``) after the symmetry check, so float32 round-off in a
    computed ``qᵀq`` is harmless. Raises ``ValueError`` for a non-square, non-finite,
    non-symmetric or non-positive-definite input (the message gives the smallest eigenvalue).
    """
    a = np.asarray(h.astype(mx.float32) if isinstance(h, mx.array) else h, dtype=np.float64)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or a.shape[-1] == 0:
        raise ValueError(f"{name} must be square [d, d] (or [G, d, d]), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or Inf")
    at = np.swapaxes(a, -1, -2)
    scale = max(float(np.abs(a).max()), np.finfo(np.float64).tiny)
    asym = float(np.abs(a - at).max())
    if asym > SYM_RTOL * scale:
        raise ValueError(f"{name} is not symmetric: max|H - Hᵀ| = {asym:.3g} (max|H| = {scale:.3g})")
    a = 0.5 * (a + at)
    try:
        return np.linalg.cholesky(a)
    except np.linalg.LinAlgError:
        lam = float(np.linalg.eigvalsh(a).min())
        raise ValueError(
            f"{name} is not positive definite (smallest eigenvalue {lam:.3g}); "
            "add a ridge (e.g. a2ats_query_second_moment(..., ridge=1e-4))"
        ) from None


def _retrieval_count(fraction: float, n: int) -> int:
    """``ceil(fraction·n)``, reading a product within float rounding of an integer as it."""
    r = fraction * n
    nearest = round(r)
    if abs(r - nearest) <= 1e-9 * max(1.0, r):
        return int(min(n, nearest))
    return int(min(n, math.ceil(r)))


def _check_unit_interval(value: float, name: str) -> float:
    value = float(value)
    if not (0.0 <= value <= 1.0):  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


# ----------------------------------------------------------------------------- seed API


def a2ats_query_second_moment(queries, ridge: float = 1e-4) -> mx.array:
    """Second-moment matrix ``H = E[qᵀq]`` of query states (paper Eq. 10).

    Args:
        queries: ``[M, d]`` post-PE query states from a calibration set (a single ``[d]``
            query is read as ``M = 1``).
        ridge: added to the diagonal (absolute) so ``H`` is positive definite, which the
            Cholesky factor needs when ``M < d`` or the queries are rank-deficient. ``>= 0``.

    Returns:
        ``[d, d]`` float32 symmetric matrix ``qᵀq / M + ridge·I``.
    """
    q = as_float32(queries, "queries", ndim=(1, 2))
    if q.ndim == 1:
        q = q[None, :]
    m, d = q.shape
    if m == 0 or d == 0:
        raise ValueError(f"queries must have at least one row and column, got {tuple(q.shape)}")
    ridge = float(ridge)
    if not (math.isfinite(ridge) and ridge >= 0.0):
        raise ValueError(f"ridge must be finite and >= 0, got {ridge}")
    h = (q.T @ q) / float(m)
    h = 0.5 * (h + h.T) + ridge * mx.eye(d, dtype=mx.float32)
    mx.eval(h)
    return h


def a2ats_cholesky_factor(h) -> mx.array:
    """Lower-triangular Cholesky factor ``L`` with ``H = L Lᵀ`` (paper Eq. 15).

    Factored in float64 by LAPACK (``numpy.linalg.cholesky``), then cast to float32.

    Args:
        h: ``[d, d]`` symmetric positive-definite matrix.

    Returns:
        ``[d, d]`` float32 lower-triangular ``L``.

    Raises:
        ValueError: ``h`` not 2-D square, has NaN/Inf, is not symmetric, or not positive definite.
    """
    a = h if isinstance(h, mx.array) else np.asarray(h)
    if a.ndim != 2:
        raise ValueError(f"h must be [d, d], got shape {tuple(a.shape)}")
    return mx.array(spd_cholesky(a, "h").astype(np.float32))


def a2ats_h_weighted_assignment(x, codebook, cholesky_factor) -> mx.array:
    """The paper's query-aware assignment (Eq. 14/17), exact.

    ``f(k) = argmin_j (k - c_j) H (k - c_j)ᵀ = argmin_j ‖kL - c_jL‖²`` with ``H = L Lᵀ``.

    Args:
        x: ``[N, d]`` vectors to quantize.
        codebook: ``[K, d]`` centroids in the original (untransformed) space.
        cholesky_factor: ``[d, d]`` ``L`` from :func:`a2ats_cholesky_factor` (any ``M`` with
            ``M Mᵀ = H`` gives the same assignment).

    Returns:
        ``[N]`` int32 centroid indices.
    """
    x = as_float32(x, "x", ndim=2)
    cb = as_float32(codebook, "codebook", ndim=2)
    ell = as_float32(cholesky_factor, "cholesky_factor", ndim=2)
    d = x.shape[1]
    if cb.shape[1] != d:
        raise ValueError(f"codebook width {cb.shape[1]} != x width {d}")
    if cb.shape[0] == 0:
        raise ValueError("codebook is empty (K = 0)")
    if tuple(ell.shape) != (d, d):
        raise ValueError(f"cholesky_factor must be [{d}, {d}], got {tuple(ell.shape)}")
    if x.shape[0] == 0:
        return mx.zeros((0,), dtype=mx.int32)
    return kernels.h_weighted_assign(x, kernels.transform_centroids(cb, ell), ell)


def a2ats_query_aware_assignment(x, codebook, query, beta: float = 0.5) -> mx.array:
    """Cosine-blend query-aware assignment: a *substitute* for Eq. (14), not the paper's method.

    ``score(c) = beta · (1 - ‖x - c‖² / max_c ‖x - c‖²) + (1 - beta) · (cos(query, c) + 1) / 2``,
    maximised per row. ``beta = 1`` is plain nearest-centroid VQ (computed exactly as such);
    ``beta = 0`` picks the centroid best aligned with ``query`` for every row. The cosine term is
    a per-centroid bias shared by all rows, and the error term is normalised per row, so ``beta``
    is scale-dependent; use :func:`a2ats_h_weighted_assignment` for the paper's objective.

    Args:
        x: ``[N, d]`` vectors to quantize.
        codebook: ``[K, d]`` candidate centroids.
        query: ``[d]`` current (proxy) query.
        beta: blend coefficient in ``[0, 1]``.

    Returns:
        ``[N]`` int32 centroid indices.
    """
    beta = _check_unit_interval(beta, "beta")
    x = as_float32(x, "x", ndim=2)
    cb = as_float32(codebook, "codebook", ndim=2)
    q = as_float32(query, "query", ndim=1)
    d = x.shape[1]
    if cb.shape[1] != d or q.shape[0] != d:
        raise ValueError(f"widths differ: x {d}, codebook {cb.shape[1]}, query {q.shape[0]}")
    if cb.shape[0] == 0:
        raise ValueError("codebook is empty (K = 0)")
    n, k = x.shape[0], cb.shape[0]
    if n == 0:
        return mx.zeros((0,), dtype=mx.int32)
    if beta == 1.0:
        return kernels.nearest_centroid(x, cb)

    cb_sq = mx.sum(cb * cb, axis=-1)  # [K]
    denom = mx.maximum(mx.sqrt(cb_sq) * mx.sqrt(mx.sum(q * q)), _EPS)
    cos01 = mx.clip(((cb @ q) / denom + 1.0) * 0.5, 0.0, 1.0)  # [K]
    bias = (1.0 - beta) * cos01[None, :]
    cb_t = cb.T
    step = kernels.auto_chunk(n, k)
    parts = []
    for start in range(0, n, step):
        xs = x[start : start + step]
        sq = mx.addmm(cb_sq[None, :], xs, cb_t, alpha=-2.0, beta=1.0)
        sq = mx.maximum(sq + mx.sum(xs * xs, axis=-1, keepdims=True), 0.0)  # ‖x - c‖²
        max_err = mx.maximum(mx.max(sq, axis=-1, keepdims=True), _EPS)
        score = beta * (1.0 - sq / max_err) + bias
        idx = mx.argmax(score, axis=-1).astype(mx.int32)
        mx.eval(idx)
        parts.append(idx)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def a2ats_select_retrieval_set(
    keys, query, retrieval_fraction: float = 0.2
) -> tuple[mx.array, mx.array]:
    """Split token indices into a high-fidelity retrieval set and the bulk.

    The retrieval set is the ``ceil(retrieval_fraction · N)`` tokens whose keys have the largest
    cosine similarity with ``query`` (selected with ``mx.argpartition``, ``O(N)``); ties at the
    boundary are broken arbitrarily. A zero key has similarity 0.

    Args:
        keys: ``[N, D]`` key vectors.
        query: ``[D]`` current (proxy) query.
        retrieval_fraction: fraction of tokens routed to the retrieval set, in ``[0, 1]``.

    Returns:
        ``(retrieval_idx, bulk_idx)``: int32 index arrays, each sorted ascending, disjoint,
        together covering ``0..N-1`` exactly once.
    """
    fraction = _check_unit_interval(retrieval_fraction, "retrieval_fraction")
    k = as_float32(keys, "keys", ndim=2)
    q = as_float32(query, "query", ndim=1)
    if q.shape[0] != k.shape[1]:
        raise ValueError(f"query width {q.shape[0]} != key width {k.shape[1]}")
    n = k.shape[0]
    n_ret = _retrieval_count(fraction, n)
    if n_ret == 0:
        return mx.zeros((0,), dtype=mx.int32), mx.arange(n, dtype=mx.int32)
    if n_ret == n:
        return mx.arange(n, dtype=mx.int32), mx.zeros((0,), dtype=mx.int32)
    k_norm = mx.sqrt(mx.sum(k * k, axis=-1))
    q_norm = mx.sqrt(mx.sum(q * q))
    sim = (k @ q) / mx.maximum(k_norm * q_norm, _EPS)  # [N]
    order = mx.argpartition(-sim, kth=n_ret - 1)
    retrieval = mx.sort(order[:n_ret]).astype(mx.int32)
    bulk = mx.sort(order[n_ret:]).astype(mx.int32)
    mx.eval(retrieval, bulk)
    return retrieval, bulk


__all__ = [
    "a2ats_query_second_moment",
    "a2ats_cholesky_factor",
    "a2ats_h_weighted_assignment",
    "a2ats_query_aware_assignment",
    "a2ats_select_retrieval_set",
    "as_float32",
    "spd_cholesky",
]
