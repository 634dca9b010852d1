"""H-weighted (A2ATS) vs plain PQ: attention-score error on held-out queries, per bit rate.

Calibrates on configs/prompts/calibration (post-RoPE queries and keys), then codes the keys of
a different text (bench/data/long_prose.txt) and scores them with that text's own queries, which
neither codebook saw. Also prints the condition number of H per layer (isotropic H = 1).

    .venv/bin/python bench/bench_attention.py [--tokens 512] [--layers 0,5,10,15,20,25,29]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import coldkv  # noqa: F401  isort: skip
import mlx.core as mx
import numpy as np

from coldkv import calibrate
from coldkv import codebooks as cbk
from coldkv.capture import capture
from coldkv.fidelity import attention_score_error
from coldkv.models import load

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="calibration tokens per text")
    ap.add_argument("--layers", default="0,5,10,15,20,25,29")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    lm = load("default")
    texts = [p.read_text() for p in sorted((REPO / "configs/prompts/calibration").glob("*.txt"))]
    calib = calibrate.collect(lm, texts, max_tokens=args.tokens)
    held = capture(lm.model, lm.tokenizer.encode((REPO / "bench/data/long_prose.txt").read_text())[:1024], queries=4)

    h_all = calibrate.second_moment(calib.queries)
    cond = cbk.condition_number(h_all).reshape(calib.n_layers, calib.n_kv_heads)
    print(f"condition number of H = E[qᵀq] per layer (median over its {calib.n_kv_heads} KV heads):")
    print("  " + "  ".join(f"L{i}:{np.median(c):.0f}" for i, c in enumerate(cond)))

    groups = mx.array([layer * calib.n_kv_heads + h for layer in layers for h in range(calib.n_kv_heads)])
    keys, H = calib.keys[groups], h_all[groups]
    print(f"\nheld-out attention-score error (relative MSE of q·k, and top-32 recall), layers {layers}")
    print(f"{'bits/elem':>9}  {'plain PQ':>10}  {'H-weighted':>10}  {'ratio':>6}  {'recall plain':>12}  {'recall H':>8}")
    for sub_dim, bits, label in ((4, 4, "1.0"), (4, 6, "1.5"), (4, 8, "2.0"), (2, 6, "3.0")):
        res = {}
        for name, metric in (("plain", None), ("h", H)):
            t0 = time.perf_counter()
            cb = cbk.train_pq(keys, metric, sub_dim=sub_dim, bits=bits, iters=args.iters, seed=0)
            errs, recalls = [], []
            for i, layer in enumerate(layers):
                sub = cb.subset(slice(i * calib.n_kv_heads, (i + 1) * calib.n_kv_heads))
                k = held.layers[layer].keys
                e = attention_score_error(held.layers[layer].queries, k, sub.decode(sub.encode(k)))
                errs.append(e.rel_mse)
                recalls.append(e.topk_recall)
            res[name] = (float(np.mean(errs)), float(np.mean(recalls)), time.perf_counter() - t0)
        (pe, pr, _), (he, hr, _) = res["plain"], res["h"]
        print(f"{label:>9}  {pe:>10.4f}  {he:>10.4f}  {he / pe:>6.2f}  {pr:>12.3f}  {hr:>8.3f}")


if __name__ == "__main__":
    main()
