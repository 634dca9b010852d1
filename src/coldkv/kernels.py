"""The MLX H-weighted assignment kernel.

A2ATS assigns a key ``x`` to ``argmin_j (x - c_j) H (x - c_j)ᵀ``. With ``H = L Lᵀ`` this is the
plain squared distance between ``z = x L`` and ``c'_j = c_j L``:

    ‖z - c'_j‖² = ‖z‖² - 2 z·c'_j + ‖c'_j‖²

``‖z‖²`` is the same for every centroid of a row, so the argmin only needs
``score_j = ‖c'_j‖² - 2 z·c'_j``. We also fold ``L`` into the centroids once,
``z·c'_j = x L (c_j L)ᵀ = x · (c'_j Lᵀ)``, so each chunk of rows costs exactly one GEMM
``x @ Wᵀ`` with ``W = c' Lᵀ`` (``[K, d]``) plus an ``argmin`` over ``K``, the same shape as a
plain ``mx.matmul``. Rows are processed in chunks so the ``[chunk, K]`` score block stays under
a fixed byte budget however many rows there are (millions of tokens are fine).

Shapes (``G`` optional groups, e.g. layers x KV heads, or PQ sub-vectors):

* ``x``            ``[N, d]`` or ``[G, N, d]``
* ``centroids_z``  ``[K, d]`` or ``[G, K, d]``   (already transformed: ``c' = c L``)
* ``L``            ``None``, ``[d, d]`` or ``[G, d, d]``
* result           ``[N]`` or ``[G, N]`` int32 (plus float32 min distances on request)

Everything is float32. Measured in ``bench/bench_kernel.py`` (2 cores, N=65536, d=64): the
kernel runs at 1.0-1.2x the rate of a plain ``mx.matmul`` of the same shapes for K=256 and
K=4096, because the chunked score block stays in cache.
"""

from __future__ import annotations

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

#: Byte budget of the float32 score block ``[G, chunk, K]`` computed per chunk. Measured on
#: 2 cores (N=65536, d=64): 4 MiB blocks run at 0.9-1.1x plain ``mx.matmul``'s rate for K=256
#: and K=4096, 32-64 MiB blocks at 0.5-0.8x (the block falls out of cache before ``argmin``
#: reads it back), 1 MiB blocks pay per-chunk overhead.
DEFAULT_CHUNK_BYTES = 4 * 2**20

#: Fewest rows per chunk when many groups share a block: below this the per-chunk overhead
#: (one batched GEMM call per group) dominates; such blocks are split over groups instead.
MIN_CHUNK_ROWS = 256


def chunk_plan(
    n: int,
    k: int,
    groups: int = 1,
    chunk: int | None = None,
    budget_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[int, int]:
    """``(rows, group_block)``: work in float32 ``[group_block, rows, k]`` score blocks.

    Rows per chunk shrink as ``groups`` grows, but not below :data:`MIN_CHUNK_ROWS` (or what a
    single group's budget allows); past that point the groups are split into blocks instead, so
    ``group_block · rows · k · 4 <= budget_bytes`` whenever one group's ``rows · k · 4`` fits.
    An explicit ``chunk`` fixes the rows.
    """
    n, k, groups = max(1, n), max(1, k), max(1, groups)
    if chunk is not None:
        if int(chunk) < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        rows = int(chunk)
    else:
        rows = budget_bytes // (4 * k * groups)
        if rows < MIN_CHUNK_ROWS:
            rows = min(MIN_CHUNK_ROWS, budget_bytes // (4 * k))
        rows = max(1, min(n, rows))
    group_block = max(1, min(groups, budget_bytes // (4 * k * rows)))
    return rows, group_block


def auto_chunk(n: int, k: int, groups: int = 1, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk of :func:`chunk_plan` (automatic mode)."""
    return chunk_plan(n, k, groups, None, budget_bytes)[0]


# Not wrapped in ``mx.compile``: a chunk is one GEMM (``addmm``) and one reduction, there is
# nothing to fuse, and compiled vs plain measured the same (within noise) for d=64/K=256 and
# for PQ shapes (16 groups, d=4, K=256). For tiny sub-vectors (d=4) the ``argmin`` over K,
# not the GEMM, is the cost (MLX's CPU argmin runs at ~1e9 elements/s); a pairwise-tournament
# argmin in MLX ops was 10x slower, and alternating chunks over two CPU streams gained nothing.


def _argmin_chunk(x: mx.array, w_t: mx.array, c_sq: mx.array) -> mx.array:
    """``argmin_K (‖c'‖² - 2 x Wᵀ)`` for one chunk. x ``[..., n, d]`` -> ``[..., n]`` int32."""
    scores = mx.addmm(c_sq, x, w_t, alpha=-2.0, beta=1.0)
    return mx.argmin(scores, axis=-1).astype(mx.int32)


def _argmin_dist_chunk(
    x: mx.array, w_t: mx.array, c_sq: mx.array, l: mx.array
) -> tuple[mx.array, mx.array]:
    """As :func:`_argmin_chunk`, also returning ``min_j ‖xL - c'_j‖²`` (clamped at 0)."""
    scores = mx.addmm(c_sq, x, w_t, alpha=-2.0, beta=1.0)
    idx = mx.argmin(scores, axis=-1)
    best = mx.take_along_axis(scores, idx[..., None], axis=-1)[..., 0]
    z = x @ l
    dist = mx.maximum(best + mx.sum(z * z, axis=-1), 0.0)
    return idx.astype(mx.int32), dist


def _argmin_dist_chunk_plain(
    x: mx.array, w_t: mx.array, c_sq: mx.array
) -> tuple[mx.array, mx.array]:
    """As :func:`_argmin_dist_chunk` with ``L = I``."""
    scores = mx.addmm(c_sq, x, w_t, alpha=-2.0, beta=1.0)
    idx = mx.argmin(scores, axis=-1)
    best = mx.take_along_axis(scores, idx[..., None], axis=-1)[..., 0]
    dist = mx.maximum(best + mx.sum(x * x, axis=-1), 0.0)
    return idx.astype(mx.int32), dist


def _as_f32(a) -> mx.array:
    a = a if isinstance(a, mx.array) else mx.array(a)
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def _check_shapes(x: mx.array, c: mx.array, L: mx.array | None) -> None:
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be [N, d] or [G, N, d], got shape {tuple(x.shape)}")
    if c.ndim not in (2, x.ndim):
        raise ValueError(
            f"centroids must be [K, d] or [G, K, d] matching x {tuple(x.shape)}, got {tuple(c.shape)}"
        )
    d = x.shape[-1]
    if c.shape[-1] != d:
        raise ValueError(f"centroid width {c.shape[-1]} != x width {d}")
    if c.shape[-2] == 0:
        raise ValueError("need at least one centroid (K >= 1)")
    if x.ndim == 3 and c.ndim == 3 and c.shape[0] != x.shape[0]:
        raise ValueError(f"groups differ: x has {x.shape[0]}, centroids have {c.shape[0]}")
    if L is not None:
        if L.ndim not in (2, 3) or L.shape[-2:] != (d, d):
            raise ValueError(f"L must be [d, d] or [G, d, d] with d={d}, got {tuple(L.shape)}")
        if L.ndim == 3 and (x.ndim != 3 or L.shape[0] != x.shape[0]):
            raise ValueError(f"batched L {tuple(L.shape)} needs x [G, N, d] with the same G")


def h_weighted_assign(
    x,
    centroids_z,
    L=None,
    *,
    chunk: int | None = None,
    return_distance: bool = False,
):
    """Nearest centroid under the H-metric, ``argmin_j ‖x L - c'_j‖²``.

    Args:
        x: ``[N, d]`` or ``[G, N, d]`` rows in the original space.
        centroids_z: ``[K, d]`` or ``[G, K, d]`` centroids already in z-space (``c' = c L``).
            A 2-D array is shared by all groups.
        L: ``[d, d]`` / ``[G, d, d]`` transform with ``H = L Lᵀ`` (any square root of H works),
            or ``None`` for the identity (plain Euclidean nearest centroid).
        chunk: rows per chunk; default from :func:`chunk_plan`, which keeps each float32
            score block (``[groups in block, rows, K]``) under :data:`DEFAULT_CHUNK_BYTES`.
        return_distance: also return the float32 min squared distance ``‖xL - c'‖²``.

    Returns:
        ``idx`` ``[N]`` / ``[G, N]`` int32, or ``(idx, dist)`` when ``return_distance``.
    """
    x = _as_f32(x)
    c = _as_f32(centroids_z)
    L = None if L is None else _as_f32(L)
    _check_shapes(x, c, L)
    n, k = x.shape[-2], c.shape[-2]
    groups = x.shape[0] if x.ndim == 3 else 1

    # W = c' Lᵀ so that x·Wᵀ = (xL)·c'ᵀ; one GEMM per chunk, no per-chunk transform.
    w = c if L is None else c @ L.swapaxes(-1, -2)
    w_t = w.swapaxes(-1, -2)  # [..., d, K]
    c_sq = mx.sum(c * c, axis=-1)[..., None, :]  # [..., 1, K]
    mx.eval(w_t, c_sq)

    if n == 0:
        idx = mx.zeros(x.shape[:-1], dtype=mx.int32)
        return (idx, mx.zeros(x.shape[:-1], dtype=mx.float32)) if return_distance else idx

    rows, group_block = chunk_plan(n, k, groups, chunk)
    batched = x.ndim == 3
    idx_blocks, dist_blocks = [], []
    for g0 in range(0, groups, group_block):
        # per-group operands of this block (shared 2-D ones are used as they are)
        sel = slice(g0, g0 + group_block)
        xg = x[sel] if batched else x
        wg = w_t[sel] if w_t.ndim == 3 else w_t
        cg = c_sq[sel] if c_sq.ndim == 3 else c_sq
        lg = L[sel] if L is not None and L.ndim == 3 else L
        idx_parts, dist_parts = [], []
        for start in range(0, n, rows):
            xs = xg[..., start : start + rows, :]
            if return_distance:
                if lg is None:
                    i, dd = _argmin_dist_chunk_plain(xs, wg, cg)
                else:
                    i, dd = _argmin_dist_chunk(xs, wg, cg, lg)
                mx.eval(i, dd)
                dist_parts.append(dd)
            else:
                i = _argmin_chunk(xs, wg, cg)
                mx.eval(i)
            idx_parts.append(i)
        idx_blocks.append(_cat(idx_parts, -1))
        if return_distance:
            dist_blocks.append(_cat(dist_parts, -1))
    idx = _cat(idx_blocks, 0)
    if not return_distance:
        return idx
    return idx, _cat(dist_blocks, 0)


def _cat(parts: list[mx.array], axis: int) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def nearest_centroid(x, centroids, *, chunk: int | None = None, return_distance: bool = False):
    """Plain Euclidean nearest centroid: :func:`h_weighted_assign` with ``L=None``.

    ``x`` ``[N, d]`` / ``[G, N, d]``, ``centroids`` ``[K, d]`` / ``[G, K, d]`` ->
    ``[N]`` / ``[G, N]`` int32 (and min squared distances when ``return_distance``).
    """
    return h_weighted_assign(x, centroids, None, chunk=chunk, return_distance=return_distance)


def transform_centroids(centroids, L) -> mx.array:
    """``c' = c L``: centroids ``[..., K, d]`` from the original space into z-space."""
    return _as_f32(centroids) @ _as_f32(L)


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MIN_CHUNK_ROWS",
    "auto_chunk",
    "chunk_plan",
    "h_weighted_assign",
    "nearest_centroid",
    "transform_centroids",
]
