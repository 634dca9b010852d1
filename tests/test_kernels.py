"""The chunked MLX H-weighted assignment kernel."""

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)

import mlx.core as mx
import numpy as np
import pytest

from coldkv import kernels
from coldkv.kernels import (
    auto_chunk,
    chunk_plan,
    h_weighted_assign,
    nearest_centroid,
    transform_centroids,
)

try:
    from helpers_a2ats import assert_argmin_matches, h_dist, random_spd
except ImportError:  # tests/ imported as a package
    from tests.helpers_a2ats import assert_argmin_matches, h_dist, random_spd


def _data(n=1500, k=48, d=16, cond=1e3, seed=0):
    rng = np.random.default_rng(seed)
    h = random_spd(d, cond=cond, seed=seed)
    ell = np.linalg.cholesky(h)
    x = rng.normal(size=(n, d)).astype(np.float32)
    c = rng.normal(size=(k, d)).astype(np.float32)
    return x, c, h, ell.astype(np.float32)


def test_argmin_matches_brute_force_h_metric():
    x, c, h, ell = _data()
    idx, dist = h_weighted_assign(x, transform_centroids(c, ell), ell, return_distance=True)
    assert idx.dtype == mx.int32 and idx.shape == (1500,)
    assert dist.dtype == mx.float32 and dist.shape == (1500,)
    ref = h_dist(x, c, h)
    assert_argmin_matches(idx, ref)
    np.testing.assert_allclose(np.array(dist), ref.min(1), rtol=1e-4, atol=1e-4 * ref.max())


def test_any_square_root_of_h_gives_same_assignment():
    """M = L·U (U orthogonal) has M Mᵀ = H, so it must assign like L."""
    x, c, h, ell = _data(seed=1)
    u, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(16, 16)))
    m = (ell.astype(np.float64) @ u).astype(np.float32)
    a = h_weighted_assign(x, transform_centroids(c, ell), ell)
    b = h_weighted_assign(x, transform_centroids(c, m), m)
    assert_argmin_matches(b, h_dist(x, c, h))
    assert np.mean(np.array(a) == np.array(b)) >= 0.99


def test_identity_h_is_plain_nearest_centroid():
    x, c, _, _ = _data(seed=2)
    ref = h_dist(x, c, np.eye(16))
    a = nearest_centroid(x, c)
    b = h_weighted_assign(x, c, np.eye(16, dtype=np.float32))
    assert_argmin_matches(a, ref)
    assert np.array_equal(np.array(a), np.array(b))
    idx, dist = nearest_centroid(x, c, return_distance=True)
    np.testing.assert_allclose(np.array(dist), ref.min(1), rtol=1e-4, atol=1e-4 * ref.max())


@pytest.mark.parametrize("chunk", [1, 7, 256, 100_000])
def test_chunked_equals_unchunked(chunk):
    x, c, _, ell = _data(n=1000, seed=3)
    cz = transform_centroids(c, ell)
    whole = np.array(h_weighted_assign(x, cz, ell, chunk=1000))
    part = np.array(h_weighted_assign(x, cz, ell, chunk=chunk))
    if chunk == 1:  # a 1-row GEMM may round differently: allow float32 near-ties only
        assert np.mean(part == whole) >= 0.999
    else:
        assert np.array_equal(part, whole)


def test_batched_equals_per_group():
    rng = np.random.default_rng(4)
    g, n, k, d = 3, 600, 32, 8
    x = rng.normal(size=(g, n, d)).astype(np.float32)
    c = rng.normal(size=(g, k, d)).astype(np.float32)
    ells = np.stack([np.linalg.cholesky(random_spd(d, 300, seed=s)) for s in range(g)]).astype(np.float32)
    cz = np.array(transform_centroids(c, ells))
    batched, bdist = h_weighted_assign(x, cz, ells, chunk=100, return_distance=True)
    assert batched.shape == (g, n) and bdist.shape == (g, n)
    for i in range(g):
        one, odist = h_weighted_assign(x[i], cz[i], ells[i], return_distance=True)
        assert np.array_equal(np.array(batched[i]), np.array(one))
        np.testing.assert_allclose(np.array(bdist[i]), np.array(odist), rtol=1e-5, atol=1e-5)
    # shared centroids / no L broadcast over groups
    shared = nearest_centroid(x, c[0])
    for i in range(g):
        assert np.array_equal(np.array(shared[i]), np.array(nearest_centroid(x[i], c[0])))


def test_chunk_plan_bounds_memory():
    budget = kernels.DEFAULT_CHUNK_BYTES
    assert budget <= 64 * 2**20
    for n, k, g in [(10_000_000, 256, 1), (10_000_000, 4096, 1), (65536, 256, 16), (4096, 256, 1440), (5, 4096, 90)]:
        rows, gb = chunk_plan(n, k, g)
        assert 1 <= rows <= n and 1 <= gb <= g
        assert rows * gb * k * 4 <= budget, (n, k, g, rows, gb)
        assert auto_chunk(n, k, g) == rows
    assert chunk_plan(4096, 256, 1440)[0] == kernels.MIN_CHUNK_ROWS  # split groups, not rows
    with pytest.raises(ValueError, match=r"chunk must be >= 1"):
        chunk_plan(10, 4, 1, chunk=0)


def test_many_groups_split_into_blocks():
    """More groups than one block holds: result must equal the per-group computation."""
    rng = np.random.default_rng(6)
    g, n, k, d = 40, 300, 256, 2
    assert chunk_plan(n, k, g) == (256, 16)  # blocks of 16, 16, 8 groups x rows 256 + 44
    x = rng.normal(size=(g, n, d)).astype(np.float32)
    c = rng.normal(size=(g, k, d)).astype(np.float32)
    ells = np.stack([np.linalg.cholesky(random_spd(d, 50, seed=s)) for s in range(g)]).astype(np.float32)
    idx, dist = h_weighted_assign(x, c, ells, return_distance=True)
    assert idx.shape == (g, n) and dist.shape == (g, n)
    for i in range(g):
        one, od = h_weighted_assign(x[i], c[i], ells[i], return_distance=True)
        assert np.array_equal(np.array(idx[i]), np.array(one))
        np.testing.assert_allclose(np.array(dist[i]), np.array(od), rtol=1e-5, atol=1e-5)


def test_large_n_many_chunks():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(50_000, 4)).astype(np.float32)
    c = rng.normal(size=(16, 4)).astype(np.float32)
    idx = np.array(nearest_centroid(x, c, chunk=4096))
    ref = ((x[:, None, :] - c[None]) ** 2).sum(-1).argmin(1)
    assert np.mean(idx == ref) >= 0.9999


def test_edge_cases_and_errors():
    x = np.ones((5, 4), np.float32)
    assert np.array_equal(np.array(nearest_centroid(x, np.ones((1, 4), np.float32))), np.zeros(5))
    empty = nearest_centroid(np.zeros((0, 4), np.float32), np.ones((3, 4), np.float32))
    assert empty.shape == (0,) and empty.dtype == mx.int32
    with pytest.raises(ValueError, match=r"x must be \[N, d\] or \[G, N, d\]"):
        nearest_centroid(np.ones(4, np.float32), np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"centroid width 3 != x width 4"):
        nearest_centroid(x, np.ones((3, 3), np.float32))
    with pytest.raises(ValueError, match=r"at least one centroid"):
        nearest_centroid(x, np.ones((0, 4), np.float32))
    with pytest.raises(ValueError, match=r"L must be \[d, d\]"):
        h_weighted_assign(x, np.ones((3, 4), np.float32), np.eye(3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"groups differ"):
        nearest_centroid(np.ones((2, 5, 4), np.float32), np.ones((3, 3, 4), np.float32))
    with pytest.raises(ValueError, match=r"batched L"):
        h_weighted_assign(x, np.ones((3, 4), np.float32), np.ones((2, 4, 4), np.float32))
