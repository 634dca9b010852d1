"""Shared helpers for the A2ATS / kernel / codebook tests."""

from __future__ import annotations

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import numpy as np


def random_spd(d: int, cond: float = 100.0, seed: int = 0) -> np.ndarray:
    """Random symmetric positive-definite ``[d, d]`` float64 matrix with condition number ``cond``.

    Random orthonormal eigenbasis, eigenvalues log-spaced from 1 to ``cond``.
    """
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    lam = np.logspace(0.0, np.log10(cond), d)
    h = (q * lam) @ q.T
    return 0.5 * (h + h.T)


def random_orthogonal(d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.normal(size=(d, d)))
    return q * np.sign(np.diag(r))


def h_dist(x: np.ndarray, c: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Brute-force ``(x_n - c_j) H (x_n - c_j)ᵀ`` in float64: ``[N, d], [K, d] -> [N, K]``."""
    x = np.asarray(x, np.float64)
    c = np.asarray(c, np.float64)
    diff = x[:, None, :] - c[None, :, :]
    return np.einsum("nkd,de,nke->nk", diff, np.asarray(h, np.float64), diff)


def assert_argmin_matches(idx, dist: np.ndarray, rtol: float = 1e-5) -> None:
    """``idx`` is the argmin of each row of ``dist`` up to float32 near-ties.

    Every pick must be within ``rtol`` (relative to the row's scale) of the row minimum, and at
    least 99% of the picks must be exactly the float64 argmin.
    """
    idx = np.asarray(idx).astype(np.int64)
    ref = dist.argmin(axis=1)
    rows = np.arange(dist.shape[0])
    gap = dist[rows, idx] - dist[rows, ref]
    scale = np.abs(dist).max(axis=1) + 1e-12
    assert np.all(gap <= rtol * scale), f"worst gap {np.max(gap / scale):.3g}"
    assert np.mean(idx == ref) >= 0.99, f"only {np.mean(idx == ref):.3f} exact"


def blobs(n_per: int, centers: np.ndarray, spread: float, seed: int = 0):
    """Gaussian blobs around ``centers`` ``[B, d]``: returns points ``[B·n_per, d]`` and labels."""
    rng = np.random.default_rng(seed)
    b, d = centers.shape
    labels = np.repeat(np.arange(b), n_per)
    pts = centers[labels] + spread * rng.normal(size=(b * n_per, d))
    perm = rng.permutation(b * n_per)
    return pts[perm].astype(np.float32), labels[perm]
