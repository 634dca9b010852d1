"""OpenBLAS preload: MLX matmul rate and default-model prefill speed, with and without it.

Both variants run in this one invocation (each in a fresh subprocess, since the BLAS must be
chosen before mlx is imported), on the same shapes and the same prompt, and the ratio is
printed. Absolute numbers on shared machines are noise; the ratio is the result.

    .venv/bin/python bench/bench_blas.py [--n 1024] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import coldkv
from coldkv import _blas
import mlx.core as mx
n, tokens = int(sys.argv[1]), int(sys.argv[2])
a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b)
mx.eval(a @ b)
reps, t = 0, time.perf_counter()
while time.perf_counter() - t < 2.0:
    mx.eval(a @ b); reps += 1
gflops = 2 * n**3 * reps / (time.perf_counter() - t) / 1e9
from coldkv.models import load
from mlx_lm.models.cache import make_prompt_cache
lm = load("default")
text = "The history of the lighthouse is a history of ships, storms and the people who kept the light. " * 40
ids = mx.array(lm.tokenizer.encode(text)[:tokens])[None]
cache = make_prompt_cache(lm.model)
t = time.perf_counter()
for s in range(0, ids.shape[1], 256):
    lm.model(ids[:, s:s+256], cache=cache); mx.eval([c.keys for c in cache])
tps = ids.shape[1] / (time.perf_counter() - t)
print(json.dumps({"blas": _blas.LOADED or "bundled reference BLAS", "gflops": gflops, "prefill_tps": tps}))
"""


def run(env_extra: dict, n: int, tokens: int) -> dict:
    env = {**os.environ, **env_extra}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(n), str(tokens)], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024, help="square matmul size")
    ap.add_argument("--tokens", type=int, default=256, help="prefill length")
    args = ap.parse_args()
    fast = run({}, args.n, args.tokens)
    slow = run({"COLDKV_NO_OPENBLAS": "1"}, args.n, args.tokens)
    print(f"matmul {args.n}x{args.n} float32, prefill {args.tokens} tokens of SmolLM2-135M (2 threads max)")
    print(f"{'variant':<34}{'GFLOP/s':>10}{'prefill tok/s':>16}")
    for name, r in (("system OpenBLAS (coldkv default)", fast), ("mlx[cpu] bundled BLAS", slow)):
        print(f"{name:<34}{r['gflops']:>10.1f}{r['prefill_tps']:>16.1f}")
    print(f"speed-up: matmul {fast['gflops'] / slow['gflops']:.1f}x, prefill {fast['prefill_tps'] / slow['prefill_tps']:.1f}x")
    print(f"(preloaded: {fast['blas']})")


if __name__ == "__main__":
    main()
