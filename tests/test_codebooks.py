"""z-space codebooks: H calibration, k-means, PQ, rotation, save/load."""

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)

import hashlib

import mlx.core as mx
import numpy as np
import pytest

from coldkv import codebooks as cbm
from coldkv.codebooks import (
    PQCodebook,
    bits_per_element,
    calibrate_h,
    codebook_bytes,
    codebook_hash,
    condition_number,
    decode,
    decode_z,
    encode,
    h_weighted_error,
    kmeans,
    kmeans_fit,
    load_codebook,
    output_aware_h,
    save_codebook,
    train_pq,
)

try:
    from helpers_a2ats import blobs, random_orthogonal, random_spd
except ImportError:  # tests/ imported as a package
    from tests.helpers_a2ats import blobs, random_orthogonal, random_spd


def _aniso_data(n=3000, d=16, seed=0):
    """Correlated keys and an H with condition number 1e3 (random eigenbasis)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(d, d)) * np.linspace(2.0, 0.2, d)
    x = (rng.normal(size=(n, d)) @ a).astype(np.float32)
    return x, random_spd(d, cond=1e3, seed=seed + 100)


def _mean_h_err(x, cb, h) -> float:
    return float(np.array(h_weighted_error(x, decode(cb, encode(cb, x)), h.astype(np.float32))).mean())


# ----------------------------------------------------------------------------- H matrices


def test_calibrate_h_sums_gqa_groups():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(6, 200, 8)).astype(np.float32)  # 6 query heads, 2 KV heads
    h = np.array(calibrate_h(q, n_kv_heads=2, ridge=1e-3), dtype=np.float64)
    assert h.shape == (2, 8, 8)
    q64 = q.astype(np.float64)
    for j in range(2):
        ref = sum(q64[i].T @ q64[i] / 200 for i in range(3 * j, 3 * j + 3))
        ref += 1e-3 * np.trace(ref) / 8 * np.eye(8)
        np.testing.assert_allclose(h[j], ref, rtol=1e-5, atol=1e-6)
    assert np.all(condition_number(h) < 1e4)
    with pytest.raises(ValueError, match=r"n_kv_heads=4 must divide n_heads=6"):
        calibrate_h(q, n_kv_heads=4)


def test_output_aware_h_is_output_error_metric():
    rng = np.random.default_rng(1)
    n_heads, n_kv, hd, hidden = 4, 2, 8, 24
    w = rng.normal(size=(hidden, n_heads * hd)).astype(np.float32)
    h = np.array(output_aware_h(w, n_heads, n_kv, hd, ridge=0.0), dtype=np.float64)
    assert h.shape == (n_kv, hd, hd)
    e = rng.normal(size=hd)
    for j in range(n_kv):
        # value error e in KV head j reaches the output through each query head of its group
        out_err = sum(
            np.sum((e @ w[:, qh * hd : (qh + 1) * hd].T.astype(np.float64)) ** 2)
            for qh in range(2 * j, 2 * j + 2)
        )
        assert e @ h[j] @ e == pytest.approx(out_err, rel=1e-5)
    with pytest.raises(ValueError, match=r"expected n_heads\*head_dim = 40"):
        output_aware_h(w, 5, 1, 8)


def test_condition_number():
    assert condition_number(np.diag([1.0, 10.0, 1000.0])) == pytest.approx(1000.0)
    assert condition_number(random_spd(8, cond=1e3)) == pytest.approx(1e3, rel=1e-6)
    assert np.isinf(condition_number(np.diag([1.0, 0.0])))
    assert condition_number(np.stack([np.eye(3), np.diag([1.0, 2, 4])])).tolist() == [1.0, 4.0]


# ----------------------------------------------------------------------------- k-means


def test_d2_sampling_follows_weights():
    rng = np.random.default_rng(0)
    w = np.abs(rng.normal(size=128)).astype(np.float32)
    w[5] = 0.0
    picks = cbm._sample_d2(np.tile(w, (40000, 1)), rng)
    freq = np.bincount(picks, minlength=128) / 40000
    assert freq[5] == 0
    np.testing.assert_allclose(freq, w / w.sum(), atol=0.004)
    zero = cbm._sample_d2(np.zeros((2000, 64), np.float32), rng)  # all weights 0: uniform
    assert 0 <= zero.min() and zero.max() < 64 and np.unique(zero).size > 50


def test_kmeans_deterministic_for_seed():
    x, _ = _aniso_data(n=2000, d=8)
    a = np.array(kmeans(x, 16, iters=10, seed=3))
    b = np.array(kmeans(x, 16, iters=10, seed=3))
    c = np.array(kmeans(x, 16, iters=10, seed=4))
    assert a.shape == (16, 8)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("init", ["k-means++", "random"])
def test_kmeans_inertia_non_increasing(init):
    x, _ = _aniso_data(n=3000, d=8, seed=1)
    res = kmeans_fit(x, 32, iters=40, tol=0.0, seed=0, init=init)
    hist = res.history
    assert hist.ndim == 1 and len(hist) == res.n_iter + 1 >= 10
    assert np.all(np.diff(hist) <= 1e-6 * hist[0]), np.diff(hist).max()
    assert hist[-1] < 0.9 * hist[0]
    assert res.inertia == pytest.approx(hist[-1])
    # assignments belong to the returned centroids
    ref = ((x[:, None, :] - np.array(res.centroids)[None]) ** 2).sum(-1).argmin(1)
    assert np.mean(np.array(res.assignments) == ref) >= 0.999


def test_kmeans_repairs_empty_clusters():
    rng = np.random.default_rng(2)
    dup = np.zeros((600, 4), np.float32)  # 600 copies of one point ...
    rest = rng.normal(size=(200, 4)).astype(np.float32) + 5.0  # ... and 200 distinct ones
    x = np.concatenate([dup, rest])
    # With random init, several centers land on the duplicated point: all but one start empty.
    start = kmeans_fit(x, 12, iters=0, seed=0, init="random")
    assert np.sum(np.bincount(np.array(start.assignments), minlength=12) == 0) >= 2
    res = kmeans_fit(x, 12, iters=10, seed=0, init="random")
    assert np.all(np.bincount(np.array(res.assignments), minlength=12) > 0)
    assert res.inertia < start.inertia


def test_kmeans_recovers_blobs_batched():
    rng = np.random.default_rng(3)
    groups = []
    for g in range(2):
        centers = rng.normal(size=(6, 8)) * 20.0
        pts, labels = blobs(150, centers, spread=0.5, seed=g)
        groups.append((pts, labels, centers))
    x = np.stack([p for p, _, _ in groups])
    res = kmeans_fit(x, 6, iters=30, seed=0)
    assert res.centroids.shape == (2, 6, 8) and res.assignments.shape == (2, 900)
    for g, (pts, labels, centers) in enumerate(groups):
        found = np.array(res.centroids[g])
        dist = np.linalg.norm(found[:, None, :] - centers[None], axis=-1)
        assert np.all(dist.min(axis=0) < 0.3)  # every true center found
        a = np.array(res.assignments[g])
        for b in range(6):  # every blob is one cluster
            assert np.unique(a[labels == b]).size == 1


def test_kmeans_errors():
    x = np.ones((10, 3), np.float32)
    with pytest.raises(ValueError, match=r"k must be in \[1, N=10\], got 11"):
        kmeans(x, 11)
    with pytest.raises(ValueError, match=r"init must be"):
        kmeans(x, 2, init="bogus")
    x[0, 0] = np.nan
    with pytest.raises(ValueError, match=r"z contains NaN or Inf"):
        kmeans(x, 2)


# ----------------------------------------------------------------------------- PQ


def test_pq_error_decreases_with_bits_and_stages():
    x, h = _aniso_data(n=2500, d=16, seed=4)
    errs_bits = [_mean_h_err(x, train_pq(x, h, sub_dim=4, bits=b, iters=15), h) for b in (2, 4, 6)]
    assert errs_bits[0] > errs_bits[1] > errs_bits[2]
    errs_stages = [
        _mean_h_err(x, train_pq(x, h, sub_dim=4, bits=4, stages=s, iters=15), h) for s in (1, 2, 3)
    ]
    assert errs_stages[0] > errs_stages[1] > errs_stages[2]


@pytest.mark.parametrize("rotate", [False, True])
def test_h_weighted_pq_beats_plain_pq_on_h_error(rotate):
    x, h = _aniso_data(n=3000, d=16, seed=5)
    assert condition_number(h) == pytest.approx(1e3, rel=1e-6)
    hw = train_pq(x, h, sub_dim=4, bits=4, rotate=rotate, iters=20)
    plain = train_pq(x, None, sub_dim=4, bits=4, rotate=rotate, iters=20)
    assert bits_per_element(hw) == bits_per_element(plain) == 1.0
    assert _mean_h_err(x, hw, h) < 0.8 * _mean_h_err(x, plain, h)


def test_rotation_beats_cholesky_basis():
    """DESIGN §5 lesson 1: principal axes dealt round-robin beat PQ in the Cholesky basis."""
    x, h = _aniso_data(n=3000, d=16, seed=6)
    rot = train_pq(x, h, sub_dim=4, bits=4, rotate=True, iters=20)
    chol = train_pq(x, h, sub_dim=4, bits=4, rotate=False, iters=20)
    assert _mean_h_err(x, rot, h) < 0.8 * _mean_h_err(x, chol, h)


def test_pq_transforms():
    x, h = _aniso_data(n=600, d=8, seed=7)
    rot = train_pq(x, h, sub_dim=2, bits=3, rotate=True, iters=5)
    chol = train_pq(x, h, sub_dim=2, bits=3, rotate=False, iters=5)
    for cb in (rot, chol):
        m, m_inv = np.array(cb.M, np.float64), np.array(cb.M_inv, np.float64)
        np.testing.assert_allclose(m @ m.T, h, rtol=1e-5, atol=1e-5 * np.abs(h).max())
        np.testing.assert_allclose(m @ m_inv, np.eye(8), atol=1e-4)
    assert np.all(np.triu(np.array(chol.M), 1) == 0)  # plain Cholesky factor
    assert np.array(chol.perm).tolist() == list(range(8))
    assert np.array(rot.perm).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # round-robin to 4 sub-vectors
    z = x @ np.array(rot.M)  # principal axes: variance descending
    var = z.var(axis=0)
    assert np.all(np.diff(var) <= 1e-3 * var[0])
    plain = train_pq(x, None, sub_dim=2, bits=3, rotate=False, iters=5)
    assert np.array_equal(np.array(plain.M), np.eye(8, dtype=np.float32))


def test_objective_exact_for_any_square_root():
    """With M Mᵀ = H (M = L·Q, Q any orthogonal), H-error in x == Σ sub-vector errors in z."""
    rng = np.random.default_rng(8)
    d, sub, k = 8, 2, 8
    h = random_spd(d, cond=1e3, seed=8)
    m = np.linalg.cholesky(h) @ random_orthogonal(d, seed=8)
    perm = rng.permutation(d).astype(np.int32)
    cb = PQCodebook(
        M=mx.array(m.astype(np.float32)),
        M_inv=mx.array(np.linalg.inv(m).astype(np.float32)),
        centroids=mx.array(rng.normal(size=(2, d // sub, k, sub)).astype(np.float32) * 3),
        perm=mx.array(perm),
        sub_dim=sub,
        bits=3,
        stages=2,
    )
    x = rng.normal(size=(400, d)).astype(np.float32) * 3
    codes = encode(cb, x)
    assert codes.shape == (400, 2, d // sub) and codes.dtype == mx.uint8
    x_hat = decode(cb, codes)
    z = (x.astype(np.float64) @ m)[:, perm]
    z_err = ((z - np.array(decode_z(cb, codes), np.float64)) ** 2).sum(-1)
    x_err = np.array(h_weighted_error(x, x_hat, h.astype(np.float32)), np.float64)
    np.testing.assert_allclose(x_err, z_err, rtol=2e-3, atol=1e-3 * z_err.mean())


def test_batched_pq_matches_per_group():
    rng = np.random.default_rng(9)
    g, n, d = 3, 800, 8
    x = rng.normal(size=(g, n, d)).astype(np.float32) * np.linspace(3, 0.3, d).astype(np.float32)
    h = np.stack([random_spd(d, 1e2, seed=s) for s in range(g)])
    cb = train_pq(x, h, sub_dim=4, bits=5, stages=2, iters=8)
    assert cb.groups == g and cb.centroids.shape == (g, 2, 2, 32, 4)
    codes = encode(cb, x)
    assert codes.shape == (g, n, 2, 2)
    x_hat = np.array(decode(cb, codes))
    for i in range(g):
        one = cb.group(i)
        c1 = encode(one, x[i])
        assert np.array_equal(np.array(c1), np.array(codes[i]))
        np.testing.assert_allclose(np.array(decode(one, c1)), x_hat[i], rtol=1e-5, atol=1e-5)


def test_code_dtype_and_bit_rate():
    rng = np.random.default_rng(10)
    x = rng.normal(size=(600, 4)).astype(np.float32)
    cb = train_pq(x, None, sub_dim=2, bits=9, iters=2)
    assert cb.encode(x).dtype == mx.uint16 and cb.decode(cb.encode(x)).shape == (600, 4)
    assert bits_per_element(cb) == 4.5
    cb3 = train_pq(x, None, sub_dim=4, bits=4, stages=3, iters=2)
    assert bits_per_element(cb3) == 3.0 and cb3.encode(x).dtype == mx.uint8


def test_train_pq_errors():
    x = np.random.default_rng(11).normal(size=(100, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"sub_dim=3 must divide d=8"):
        train_pq(x, None, sub_dim=3, bits=2)
    with pytest.raises(ValueError, match=r"need at least 2\*\*bits = 256 training vectors, got N=100"):
        train_pq(x, None, sub_dim=4, bits=8)
    with pytest.raises(ValueError, match=r"H is not positive definite"):
        train_pq(x, np.diag([1.0] * 7 + [-1.0]), sub_dim=4, bits=2)
    with pytest.raises(ValueError, match=r"H must be \[8, 8\]"):
        train_pq(x, np.eye(4), sub_dim=4, bits=2)
    cb = train_pq(x, None, sub_dim=4, bits=2, iters=2)
    with pytest.raises(ValueError, match=r"x width 4 != codebook d=8"):
        encode(cb, x[:, :4])
    with pytest.raises(ValueError, match=r"codes must be \[N, 1, 2\]"):
        decode(cb, np.zeros((5, 2), np.uint8))


# ----------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("batched", [False, True])
def test_save_load_round_trip(tmp_path, batched):
    rng = np.random.default_rng(12)
    shape = (2, 500, 8) if batched else (500, 8)
    x = rng.normal(size=shape).astype(np.float32)
    h = np.stack([random_spd(8, 50, seed=s) for s in range(2)]) if batched else random_spd(8, 50)
    cb = train_pq(x, h, sub_dim=4, bits=4, stages=2, iters=5, info={"layer": "3", "kind": "keys"})
    path = tmp_path / "cb.safetensors"
    digest = save_codebook(path, cb)
    assert digest == codebook_hash(cb) == hashlib.sha256(path.read_bytes()).hexdigest()
    back = load_codebook(path)
    assert codebook_hash(back) == codebook_hash(cb)
    assert codebook_bytes(back) == codebook_bytes(cb)
    assert (back.sub_dim, back.bits, back.stages, back.rotate, back.h_weighted, back.groups) == (
        4, 4, 2, True, True, 2 if batched else None,
    )  # fmt: skip
    assert back.info == {"layer": "3", "kind": "keys"}
    assert np.array_equal(np.array(encode(back, x)), np.array(encode(cb, x)))
    # the hash depends on content
    changed = PQCodebook(
        cb.M, cb.M_inv, cb.centroids + 1e-3, cb.perm, cb.sub_dim, cb.bits, cb.stages,
        cb.rotate, cb.h_weighted, dict(cb.info),
    )  # fmt: skip
    assert codebook_hash(changed) != codebook_hash(cb)


def test_save_load_strided_arrays(tmp_path):
    """Codebooks holding strided mx views (transposes) must serialize in logical order."""
    rng = np.random.default_rng(14)
    d, sub, k, st = 8, 4, 4, 2
    base = mx.array(rng.normal(size=(d // sub, st, k, sub)).astype(np.float32))
    m = mx.array(random_orthogonal(d, seed=14).astype(np.float32))
    cb = PQCodebook(
        M=m.T.T, M_inv=m.T, centroids=base.transpose(1, 0, 2, 3), perm=mx.arange(d),
        sub_dim=sub, bits=2, stages=st,
    )  # fmt: skip
    x = rng.normal(size=(50, d)).astype(np.float32)
    save_codebook(tmp_path / "s.safetensors", cb)
    back = load_codebook(tmp_path / "s.safetensors")
    assert np.array_equal(np.array(back.centroids), np.array(cb.centroids.tolist(), np.float32))
    assert np.array_equal(np.array(encode(back, x)), np.array(encode(cb, x)))
    np.testing.assert_array_equal(np.array(decode(back, encode(cb, x))), np.array(decode(cb, encode(cb, x))))


def test_hash_is_deterministic_across_serializations():
    x = np.random.default_rng(13).normal(size=(300, 4)).astype(np.float32)
    info = {f"k{i}": str(i) for i in range(8)}  # many info keys: order must not leak into bytes
    a = train_pq(x, None, sub_dim=2, bits=3, iters=3, seed=1, info=info)
    b = train_pq(x, None, sub_dim=2, bits=3, iters=3, seed=1, info=dict(reversed(info.items())))
    assert len({codebook_hash(a) for _ in range(5)} | {codebook_hash(b)}) == 1


def test_load_rejects_foreign_file(tmp_path):
    from safetensors.numpy import save_file

    p = tmp_path / "other.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(p))
    with pytest.raises(ValueError, match=r"not a coldkv codebook"):
        load_codebook(p)


def test_module_exports():
    for name in cbm.__all__:
        assert hasattr(cbm, name)
