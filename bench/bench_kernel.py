"""Benchmark the H-weighted assignment kernel and z-space codebook training.

Prints, from ONE run on this machine:

* for N=65536, d=64 and K in (256, 4096): assignments/s and effective GFLOP/s
  (2·N·K·d flops, the distance GEMM) of ``coldkv.kernels.h_weighted_assign`` and of the seed
  API ``a2ats_h_weighted_assignment``, next to a plain ``mx.matmul`` of the same shapes
  (``[N, d] @ [d, K]``), and the ratio kernel/matmul (target >= 0.5);
* the same for the published port ``veloxquant_mlx.quantizers.a2ats`` if it can be imported
  (on a smaller N: it materialises an ``[N, K, d]`` difference tensor), with our speed-up;
* the PQ-shaped workload (d/4 batched sub-vector problems, K=256) against a batched matmul;
* the time to train one (layer, KV head) codebook on 64K calibration vectors
  (d=64, PQ sub_dim 4, 8 bits, H-weighted, rotated).

Run: ``.venv/bin/python bench/bench_kernel.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import time

import mlx.core as mx
import numpy as np

from coldkv import _blas, codebooks, kernels
from coldkv.quantizers import a2ats


def best_time(fn, reps: int) -> float:
    """Best wall time of ``reps`` runs (after one warm-up), evaluating the result."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def random_spd(d: int, cond: float, rng: np.random.Generator) -> np.ndarray:
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (q * np.logspace(0, np.log10(cond), d)) @ q.T


def row(name: str, n: int, k: int, d: int, t: float, ref: float | None = None) -> str:
    rate = n / t
    gflops = 2.0 * n * k * d / t / 1e9
    ratio = f"  {ref / t:6.2f}x matmul" if ref else ""
    return f"  {name:<34s} {t * 1e3:9.1f} ms  {rate / 1e6:8.3f} M assign/s  {gflops:7.1f} GFLOP/s{ratio}"


def bench_kernel(n: int, d: int, k: int, reps: int, rng: np.random.Generator) -> dict:
    h = random_spd(d, 1e3, rng)
    ell = mx.array(np.linalg.cholesky(h).astype(np.float32))
    x = mx.array(rng.normal(size=(n, d)).astype(np.float32))
    c = mx.array(rng.normal(size=(k, d)).astype(np.float32))
    cz = kernels.transform_centroids(c, ell)
    cz_t = mx.contiguous(cz.T)
    mx.eval(ell, x, c, cz, cz_t)

    t_mm = best_time(lambda: x @ cz_t, reps)
    t_kernel = best_time(lambda: kernels.h_weighted_assign(x, cz, ell), reps)
    t_dist = best_time(lambda: kernels.h_weighted_assign(x, cz, ell, return_distance=True), reps)
    t_seed = best_time(lambda: a2ats.a2ats_h_weighted_assignment(x, c, ell), reps)
    print(f"N={n} d={d} K={k}  (chunk {kernels.auto_chunk(n, k)} rows)")
    print(row("mx.matmul [N,d]@[d,K]", n, k, d, t_mm))
    print(row("kernels.h_weighted_assign", n, k, d, t_kernel, t_mm))
    print(row("  ... with min distance", n, k, d, t_dist, t_mm))
    print(row("a2ats_h_weighted_assignment (seed)", n, k, d, t_seed, t_mm))
    return {"x": x, "c": c, "ell": ell, "h": h, "rate": n / t_kernel, "ratio": t_mm / t_kernel}


def bench_pq_shape(n: int, sub_dim: int, d: int, k: int, reps: int, rng: np.random.Generator) -> None:
    """The PQ workload: d/sub_dim independent sub-vector problems, batched as groups."""
    g = d // sub_dim
    x = mx.array(rng.normal(size=(g, n, sub_dim)).astype(np.float32))
    c = mx.array(rng.normal(size=(g, k, sub_dim)).astype(np.float32))
    c_t = mx.contiguous(c.swapaxes(1, 2))
    mx.eval(x, c, c_t)
    t_mm = best_time(lambda: x @ c_t, reps)
    t_k = best_time(lambda: kernels.nearest_centroid(x, c), reps)
    rows, gb = kernels.chunk_plan(n, k, g)
    print(f"PQ-shaped: {g} sub-vectors x N={n} x K={k}, sub_dim={sub_dim}  (chunk {gb}x{rows})")
    print(row("batched mx.matmul [G,N,s]@[G,s,K]", g * n, k, sub_dim, t_mm))
    print(row("kernels.nearest_centroid (batched)", g * n, k, sub_dim, t_k, t_mm))


def bench_velox(res: dict, n_small: int, reps: int) -> None:
    try:
        from veloxquant_mlx.quantizers import a2ats as vq
    except Exception as exc:  # noqa: BLE001 - report any import failure
        print(f"  veloxquant-mlx: cannot import ({type(exc).__name__}: {exc}); not compared")
        return
    x, c, ell = res["x"][:n_small], res["c"], res["ell"]
    k, d = c.shape
    t_v = best_time(lambda: vq.a2ats_h_weighted_assignment(x, c, ell), reps)
    t_o = best_time(lambda: a2ats.a2ats_h_weighted_assignment(x, c, ell), reps)
    same = np.mean(
        np.array(vq.a2ats_h_weighted_assignment(x, c, ell))
        == np.array(a2ats.a2ats_h_weighted_assignment(x, c, ell))
    )
    print(row(f"veloxquant-mlx (N={n_small})", n_small, k, d, t_v))
    print(row(f"ours, seed API (N={n_small})", n_small, k, d, t_o))
    print(
        f"  speed-up vs veloxquant-mlx: {t_v / t_o:.1f}x at N={n_small}, "
        f"{res['rate'] / (n_small / t_v):.1f}x (our kernel at full N vs theirs at N={n_small}); "
        f"same assignment on {same:.2%} of rows"
    )


def bench_cholesky(d: int, rng: np.random.Generator) -> None:
    h = mx.array(random_spd(d, 1e3, rng).astype(np.float32))
    t_o = best_time(lambda: a2ats.a2ats_cholesky_factor(h), 5)
    line = f"  a2ats_cholesky_factor d={d}: ours {t_o * 1e3:.2f} ms"
    try:
        from veloxquant_mlx.quantizers import a2ats as vq

        t_v = best_time(lambda: vq.a2ats_cholesky_factor(h), 3)
        line += f", veloxquant-mlx {t_v * 1e3:.2f} ms ({t_v / t_o:.0f}x)"
    except Exception:  # noqa: BLE001
        pass
    print(line)


def bench_training(n: int, d: int, sub_dim: int, bits: int, iters: int, rng: np.random.Generator) -> None:
    # Keys with a decaying spectrum, H with condition number 1e3 (both synthetic).
    a = rng.normal(size=(d, d)) * np.logspace(0, -1.5, d)
    x = mx.array((rng.normal(size=(n, d)) @ a).astype(np.float32))
    h = mx.array(random_spd(d, 1e3, rng).astype(np.float32))
    mx.eval(x, h)
    t0 = time.perf_counter()
    cb = codebooks.train_pq(x, h, sub_dim=sub_dim, bits=bits, iters=iters, seed=0)
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    codes = codebooks.encode(cb, x)
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    x_hat = codebooks.decode(cb, codes)
    t_dec = time.perf_counter() - t0
    err = codebooks.h_weighted_error(x, x_hat, h)
    ref = codebooks.h_weighted_error(x, mx.zeros_like(x), h)
    rel = float(mx.sum(err).item() / mx.sum(ref).item())
    print(
        f"codebook training, one (layer, head): N={n} d={d} sub_dim={sub_dim} bits={bits} "
        f"({codebooks.bits_per_element(cb):.1f} bits/elem), H-weighted + rotated, iters<={iters}"
    )
    print(f"  train {t_train:.2f} s   encode {t_enc * 1e3:.0f} ms   decode {t_dec * 1e3:.0f} ms"
          f"   relative H-error {rel:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--ks", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--iters", type=int, default=25, help="k-means iterations for training")
    p.add_argument("--quick", action="store_true", help="small shapes, smoke run")
    args = p.parse_args()
    if args.quick:
        args.n, args.ks, args.reps, args.iters = 8192, [256], 1, 3
    rng = np.random.default_rng(0)
    print(f"OpenBLAS preloaded: {_blas.LOADED or 'no (' + str(_blas.REASON) + ')'}; mlx {mx.__version__}")
    ratios = {}
    for k in args.ks:
        res = bench_kernel(args.n, args.d, k, args.reps, rng)
        ratios[k] = res["ratio"]
        n_small = max(64, min(args.n, (512 * 2**20) // (4 * k * args.d)))  # their [N, K, d] <= 512 MiB
        bench_velox(res, n_small, max(1, args.reps - 1))
    bench_pq_shape(args.n, 4, args.d, 256, args.reps, rng)
    bench_cholesky(args.d, rng)
    bench_training(args.n, args.d, 4, 8, args.iters, rng)
    print("kernel / matmul rate: " + ", ".join(f"K={k}: {r:.2f}" for k, r in ratios.items())
          + "  (target >= 0.5)")


if __name__ == "__main__":
    main()
