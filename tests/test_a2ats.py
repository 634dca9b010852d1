"""The A2ATS seed API: names, defaults, shapes, semantics, validation."""

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)

import inspect
import math

import mlx.core as mx
import numpy as np
import pytest

from coldkv.quantizers import a2ats
from coldkv.quantizers.a2ats import (
    a2ats_cholesky_factor,
    a2ats_h_weighted_assignment,
    a2ats_query_aware_assignment,
    a2ats_query_second_moment,
    a2ats_select_retrieval_set,
)

try:
    from helpers_a2ats import assert_argmin_matches, h_dist, random_spd
except ImportError:  # tests/ imported as a package
    from tests.helpers_a2ats import assert_argmin_matches, h_dist, random_spd


def _np(a) -> np.ndarray:
    return np.array(a)


# ----------------------------------------------------------------------------- API surface


def test_seed_signatures_and_defaults():
    sig = {n: inspect.signature(getattr(a2ats, n)) for n in a2ats.__all__[:5]}
    assert list(sig["a2ats_query_second_moment"].parameters) == ["queries", "ridge"]
    assert sig["a2ats_query_second_moment"].parameters["ridge"].default == 1e-4
    assert list(sig["a2ats_cholesky_factor"].parameters) == ["h"]
    assert list(sig["a2ats_h_weighted_assignment"].parameters) == [
        "x",
        "codebook",
        "cholesky_factor",
    ]
    p = sig["a2ats_query_aware_assignment"].parameters
    assert list(p) == ["x", "codebook", "query", "beta"] and p["beta"].default == 0.5
    p = sig["a2ats_select_retrieval_set"].parameters
    assert list(p) == ["keys", "query", "retrieval_fraction"]
    assert p["retrieval_fraction"].default == 0.2


# ----------------------------------------------------------------------------- H and L


def test_second_moment_matches_definition():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(300, 8)).astype(np.float32)
    h = a2ats_query_second_moment(mx.array(q), ridge=1e-3)
    assert h.shape == (8, 8) and h.dtype == mx.float32
    ref = q.astype(np.float64).T @ q / 300 + 1e-3 * np.eye(8)
    np.testing.assert_allclose(_np(h), ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(_np(h), _np(h).T)
    assert np.linalg.eigvalsh(_np(h)).min() > 0


def test_second_moment_ridge_makes_rank_deficient_pd():
    q = np.ones((3, 6), np.float32)  # rank 1, M < d
    h = a2ats_query_second_moment(q)
    assert np.linalg.eigvalsh(_np(h).astype(np.float64)).min() == pytest.approx(1e-4, rel=1e-2)
    a2ats_cholesky_factor(h)  # factorable


def test_cholesky_lower_triangular_and_reconstructs():
    h = random_spd(16, cond=1e3, seed=2)
    ell = a2ats_cholesky_factor(mx.array(h.astype(np.float32)))
    assert ell.shape == (16, 16) and ell.dtype == mx.float32
    ell = _np(ell).astype(np.float64)
    assert np.all(np.triu(ell, 1) == 0)
    assert np.all(np.diag(ell) > 0)
    np.testing.assert_allclose(ell @ ell.T, h, rtol=1e-5, atol=1e-5 * np.abs(h).max())


def test_h_metric_equals_euclidean_in_z():
    """(k - c) H (k - c)ᵀ == ‖kL - cL‖² (paper Eq. 17)."""
    rng = np.random.default_rng(3)
    h = random_spd(12, cond=500, seed=3)
    ell = _np(a2ats_cholesky_factor(h)).astype(np.float64)
    k = rng.normal(size=(50, 12))
    c = rng.normal(size=(20, 12))
    lhs = h_dist(k, c, h)
    zk, zc = k @ ell, c @ ell
    rhs = ((zk[:, None, :] - zc[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-5)


# ----------------------------------------------------------------------------- assignment


def test_h_weighted_assignment_is_h_metric_argmin():
    rng = np.random.default_rng(4)
    h = random_spd(16, cond=1e3, seed=4)
    x = rng.normal(size=(2000, 16)).astype(np.float32)
    cb = rng.normal(size=(64, 16)).astype(np.float32)
    idx = a2ats_h_weighted_assignment(x, cb, a2ats_cholesky_factor(h))
    assert idx.shape == (2000,) and idx.dtype == mx.int32
    assert_argmin_matches(idx, h_dist(x, cb, h))
    # ... and H matters: the plain Euclidean argmin is a different assignment here.
    plain = ((x[:, None, :] - cb[None]) ** 2).sum(-1).argmin(1)
    assert np.mean(_np(idx) == plain) < 0.8


def test_h_weighted_assignment_identity_h_is_nearest_centroid():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(500, 8)).astype(np.float32)
    cb = rng.normal(size=(32, 8)).astype(np.float32)
    idx = a2ats_h_weighted_assignment(x, cb, np.eye(8, dtype=np.float32))
    assert_argmin_matches(idx, h_dist(x, cb, np.eye(8)))


def test_query_aware_beta_one_is_nearest_centroid():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(700, 8)).astype(np.float32)
    cb = rng.normal(size=(40, 8)).astype(np.float32)
    q = rng.normal(size=8).astype(np.float32)
    idx = a2ats_query_aware_assignment(x, cb, q, beta=1.0)
    assert idx.dtype == mx.int32 and idx.shape == (700,)
    assert_argmin_matches(idx, h_dist(x, cb, np.eye(8)))


def test_query_aware_blend_matches_reference_formula():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(400, 8))
    cb = rng.normal(size=(24, 8))
    q = rng.normal(size=8)
    beta = 0.5
    sq = ((x[:, None, :] - cb[None]) ** 2).sum(-1)
    err = 1.0 - sq / np.maximum(sq.max(1, keepdims=True), 1e-8)
    cos = (cb @ q) / np.maximum(np.linalg.norm(cb, axis=1) * np.linalg.norm(q), 1e-8)
    score = beta * err + (1 - beta) * np.clip((cos + 1) / 2, 0, 1)
    idx = _np(a2ats_query_aware_assignment(x.astype(np.float32), cb.astype(np.float32), q.astype(np.float32), beta))
    ref = score.argmax(1)
    rows = np.arange(400)
    assert np.all(score[rows, ref] - score[rows, idx] <= 1e-5)
    assert np.mean(idx == ref) >= 0.99
    # beta = 0: the one centroid best aligned with the query, for every row.
    idx0 = _np(a2ats_query_aware_assignment(x.astype(np.float32), cb.astype(np.float32), q.astype(np.float32), 0.0))
    assert np.all(idx0 == np.argmax(cos))


# ----------------------------------------------------------------------------- retrieval set


def _check_split(ret, bulk, n):
    r, b = _np(ret), _np(bulk)
    assert ret.dtype == mx.int32 and bulk.dtype == mx.int32
    assert np.all(np.diff(r) > 0) and np.all(np.diff(b) > 0)  # sorted, no repeats
    assert np.intersect1d(r, b).size == 0
    assert np.array_equal(np.sort(np.concatenate([r, b])), np.arange(n))
    return r, b


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.5, 0.7])
def test_retrieval_set_is_top_cosine(fraction):
    rng = np.random.default_rng(8)
    n = 1000
    keys = rng.normal(size=(n, 16)).astype(np.float32) * rng.uniform(0.1, 10, size=(n, 1)).astype(np.float32)
    q = rng.normal(size=16).astype(np.float32)
    ret, bulk = a2ats_select_retrieval_set(keys, q, fraction)
    r, _ = _check_split(ret, bulk, n)
    assert r.size == math.ceil(round(fraction * n, 9))
    cos = (keys @ q) / (np.linalg.norm(keys, axis=1) * np.linalg.norm(q))
    assert set(r) == set(np.argsort(-cos)[: r.size])


def test_retrieval_set_edge_cases():
    rng = np.random.default_rng(9)
    keys = rng.normal(size=(10, 4)).astype(np.float32)
    q = rng.normal(size=4).astype(np.float32)
    r, b = _check_split(*a2ats_select_retrieval_set(keys, q, 0.0), 10)
    assert r.size == 0 and b.size == 10
    r, b = _check_split(*a2ats_select_retrieval_set(keys, q, 1.0), 10)
    assert r.size == 10 and b.size == 0
    r, _ = _check_split(*a2ats_select_retrieval_set(keys, q, 0.7), 10)
    assert r.size == 7  # 0.7 * 10 == 7.000000000000001 in floats; still 7
    r, _ = _check_split(*a2ats_select_retrieval_set(keys, q, 0.21), 10)
    assert r.size == 3
    r, b = _check_split(*a2ats_select_retrieval_set(keys[:1], q, 0.2), 1)
    assert r.tolist() == [0] and b.size == 0
    r, b = _check_split(*a2ats_select_retrieval_set(keys[:0], q, 0.5), 0)
    assert r.size == 0 and b.size == 0


# ----------------------------------------------------------------------------- validation


def test_errors_are_clear():
    rng = np.random.default_rng(10)
    x = rng.normal(size=(20, 8)).astype(np.float32)
    cb = rng.normal(size=(4, 8)).astype(np.float32)
    ell = np.eye(8, dtype=np.float32)
    q = rng.normal(size=8).astype(np.float32)

    with pytest.raises(ValueError, match=r"x must be 2-D"):
        a2ats_h_weighted_assignment(x[0], cb, ell)
    with pytest.raises(ValueError, match=r"codebook width 6 != x width 8"):
        a2ats_h_weighted_assignment(x, cb[:, :6], ell)
    with pytest.raises(ValueError, match=r"cholesky_factor must be \[8, 8\]"):
        a2ats_h_weighted_assignment(x, cb, np.eye(7, dtype=np.float32))
    with pytest.raises(ValueError, match=r"widths differ"):
        a2ats_query_aware_assignment(x, cb, q[:5])
    with pytest.raises(ValueError, match=r"query width 5 != key width 8"):
        a2ats_select_retrieval_set(x, q[:5])
    with pytest.raises(ValueError, match=r"queries must be 1-D or 2-D"):
        a2ats_query_second_moment(np.zeros((2, 3, 4), np.float32))

    with pytest.raises(ValueError, match=r"retrieval_fraction must be in \[0, 1\], got 1.5"):
        a2ats_select_retrieval_set(x, q, 1.5)
    with pytest.raises(ValueError, match=r"retrieval_fraction must be in \[0, 1\]"):
        a2ats_select_retrieval_set(x, q, float("nan"))
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\], got -0.1"):
        a2ats_query_aware_assignment(x, cb, q, beta=-0.1)
    with pytest.raises(ValueError, match=r"ridge must be finite and >= 0"):
        a2ats_query_second_moment(x, ridge=-1.0)

    bad = np.diag([1.0, 2.0, -0.5, 1.0]).astype(np.float32)  # one negative eigenvalue
    with pytest.raises(ValueError, match=r"not positive definite \(smallest eigenvalue -0.5\)"):
        a2ats_cholesky_factor(bad)
    asym = np.eye(4, dtype=np.float32)
    asym[0, 1] = 0.5
    with pytest.raises(ValueError, match=r"not symmetric"):
        a2ats_cholesky_factor(asym)
    with pytest.raises(ValueError, match=r"h must be \[d, d\]"):
        a2ats_cholesky_factor(np.eye(4, dtype=np.float32)[None])
    with pytest.raises(ValueError, match=r"must be square"):
        a2ats_cholesky_factor(np.ones((3, 4), np.float32))

    x_nan = x.copy()
    x_nan[3, 2] = np.nan
    with pytest.raises(ValueError, match=r"x contains NaN or Inf"):
        a2ats_h_weighted_assignment(x_nan, cb, ell)
    with pytest.raises(ValueError, match=r"queries contains NaN or Inf"):
        a2ats_query_second_moment(x_nan)
    x_inf = x.copy()
    x_inf[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"keys contains NaN or Inf"):
        a2ats_select_retrieval_set(x_inf, q)
    h_nan = np.eye(4, dtype=np.float32)
    h_nan[1, 1] = np.nan
    with pytest.raises(ValueError, match=r"h contains NaN or Inf"):
        a2ats_cholesky_factor(h_nan)


def test_empty_inputs():
    cb = np.ones((4, 8), np.float32)
    out = a2ats_h_weighted_assignment(np.zeros((0, 8), np.float32), cb, np.eye(8, dtype=np.float32))
    assert out.shape == (0,) and out.dtype == mx.int32
    out = a2ats_query_aware_assignment(np.zeros((0, 8), np.float32), cb, np.ones(8, np.float32))
    assert out.shape == (0,) and out.dtype == mx.int32


def test_finite_check_not_fooled_by_overflowing_sum():
    big = np.full((4, 8), 3e38, np.float32)  # finite, but the float32 sum overflows
    assert a2ats.as_float32(big, "keys").shape == (4, 8)
    ret, bulk = a2ats_select_retrieval_set(big, np.ones(8, np.float32), 0.5)
    assert ret.size == 2 and bulk.size == 2
    mixed = np.ones(8, np.float32)
    mixed[[1, 5]] = [np.inf, -np.inf]  # sum is NaN
    with pytest.raises(ValueError, match=r"mixed contains NaN or Inf"):
        a2ats.as_float32(mixed, "mixed")
