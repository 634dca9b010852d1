"""Issue 4's three benchmark rows: resume vs recompute, stored bytes, fidelity next to mlx-lm's caches.

    .venv/bin/python bench/bench_resume.py [--store out/bench-store] [--presets default,hifi,max]

On the default model with the first 2048 tokens of ``bench/data/long_prose.txt`` (continuation:
the next 256), in one run:

1. resume time (read + verify + decompress + rebuild the mlx-lm cache + first token) against
   recomputing the prefill, as a ratio (target for the default codec: <= 1/10); mlx-lm's fp16 and
   int8/int4 files loaded the same way for comparison;
2. stored bytes against mlx-lm's ``save_prompt_cache`` fp16 file and that file under zstd alone
   (target: >= 8x smaller than the fp16 file);
3. fidelity over the 256-token teacher-forced continuation (ΔNLL, top-1, KL) next to mlx-lm's int8
   and int4 (group 64) caches stored and restored the same way (target: ΔNLL <= int4's).

Also prints the greedy continuation from the exact and the resumed cache side by side.
Codebooks come from ``--store`` (shared with ``bench_report.py``; trained there if missing).
Timings are medians of ``--reps`` runs.
"""

import coldkv  # noqa: F401  isort: skip  (preloads OpenBLAS before mlx)

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from coldkv import fidelity as fid
from coldkv.compress import open_store
from coldkv.config import PromptSource, StorageConfig, codec_from_preset, read_prompts
from coldkv.models import load
from coldkv.report import (
    Calibration,
    baseline_results,
    baseline_resume_seconds,
    evaluate_codec,
    prepare_case,
    timed_resume,
)

ROOT = Path(__file__).resolve().parents[1]


def median_prefill(lm, case, reps: int) -> float:
    """Median of the case's timed prefill and ``reps - 1`` more."""
    secs = [case.prefill_s]
    for _ in range(reps - 1):
        t0 = time.perf_counter()
        fid.prefill(lm.model, case.prompt)
        secs.append(time.perf_counter() - t0)
    return statistics.median(secs)


def coldkv_rows(lm, store, calib, case, presets, reps: int) -> list[dict]:
    rows = []
    for name in presets:
        s = codec_from_preset(name)
        row = evaluate_codec(lm, store, calib.codebooks(s), case, s, name)
        extra = [timed_resume(lm, store, row["cache_id"], case.continuation[0], len(case.prompt))[1] for _ in range(reps - 1)]
        row["resume_s"] = statistics.median([row["resume_s"]] + [t["resume_s"] for t in extra])
        row["codebook_load_s"] = statistics.median([row["codebook_load_s"]] + [t["codebook_load_s"] for t in extra])
        rows.append(row)
    return rows


def baseline_timing(lm, case, reps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        return {m: statistics.median(baseline_resume_seconds(lm, case, m, Path(tmp)) for _ in range(reps))
                for m in ("fp16", "int8", "int4")}  # fmt: skip


def print_tables(rows, base, btime, prefill_s, case, lm, greedy_default) -> None:
    fp16, zst, int4 = (base[m] for m in ("fp16", "fp16+zstd", "int4"))
    print(f"\nprompt {len(case.prompt)} tokens, continuation {len(case.continuation)}; "
          f"prefill (recompute) {prefill_s:.2f} s (median)\n")  # fmt: skip
    print("Row 1: resume (read + verify + decompress + rebuild + first token) vs recomputing the prefill")
    print("| cache | resume s | resume / prefill | cold (+ codebook load) / prefill |\n|---|---|---|---|")
    for r in rows:
        print(f"| coldkv {r['method']} | {r['resume_s']:.3f} | {r['resume_s'] / prefill_s:.4f} "
              f"(1/{prefill_s / r['resume_s']:.0f}) | {(r['resume_s'] + r['codebook_load_s']) / prefill_s:.4f} |")  # fmt: skip
    for m, s in btime.items():
        print(f"| mlx-lm {m} file | {s:.3f} | {s / prefill_s:.4f} (1/{prefill_s / s:.0f}) | - |")
    print("\nRow 2: stored bytes vs the mlx-lm fp16 prompt-cache file and that file under zstd alone")
    print("| cache | bytes | x vs fp16 file | x vs fp16 file + zstd |\n|---|---|---|---|")
    for r in [fp16, zst, base["int8"], int4] + rows:
        name = r["method"] if r.get("kind") == "baseline" else f"coldkv {r['method']}"
        print(f"| {name} | {r['bytes']:,} | {fp16['bytes'] / r['bytes']:.2f} | {zst['bytes'] / r['bytes']:.2f} |")
    print("\nRow 3: fidelity over the teacher-forced continuation, restored vs exact cache")
    print("| cache | ΔNLL | top-1 | KL | greedy agreement |\n|---|---|---|---|---|")
    for r in [base["int8"], int4] + rows:
        name = f"mlx-lm {r['method']}" if r.get("kind") == "baseline" else f"coldkv {r['method']}"
        print(f"| {name} | {r['delta_nll']:+.4f} | {r['top1_agreement']:.4f} | {r['kl_mean']:.4f} | "
              f"{r['greedy_agreement']:.2f} |")  # fmt: skip
    print("\ngreedy continuation, exact cache:   ", repr(lm.tokenizer.decode(case.greedy_exact)))
    print("greedy continuation, coldkv default:", repr(lm.tokenizer.decode(greedy_default)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default=str(ROOT / "out" / "bench-store"))
    p.add_argument("--out", default=str(ROOT / "out" / "bench-resume"))
    p.add_argument("--presets", default="default,hifi,max")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--continuation-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    lm = load("default")
    store = open_store(StorageConfig(root=args.store))
    texts = [t for _, t in read_prompts(PromptSource(path=ROOT / "configs/prompts/calibration"))]
    calib = Calibration(lm, store, texts, 2048)
    tokens = lm.tokenizer.encode((ROOT / "bench/data/long_prose.txt").read_text())
    case = prepare_case(lm, "long_prose", tokens, args.prompt_tokens, args.continuation_tokens, greedy_tokens=32)
    base = {r["method"]: r for r in baseline_results(lm, case, store.zstd_level)}
    prefill_s = median_prefill(lm, case, args.reps)
    rows = coldkv_rows(lm, store, calib, case, args.presets.split(","), args.reps)
    btime = baseline_timing(lm, case, args.reps)
    restored, _ = timed_resume(lm, store, rows[0]["cache_id"], case.continuation[0], len(case.prompt))
    greedy_default = fid.greedy_decode(lm.model, restored, case.continuation[:1], len(case.greedy_exact))
    print_tables(rows, base, btime, prefill_s, case, lm, greedy_default)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"prefill_s": prefill_s, "coldkv": rows, "baselines": list(base.values()), "baseline_resume_s": btime},
        indent=2, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
