"""The full-size compression and fidelity report (issue 6) on the default model.

    .venv/bin/python bench/bench_report.py [--out out/bench-report] [--store out/bench-store]

Calibration on ``configs/prompts/calibration`` (8 texts), prompt = the first 2048 tokens of
``bench/data/long_prose.txt``, continuation = the next 256. Presets default / hifi / max (as the
files in ``configs/presets`` are now), a sweep around a fixed anchor setting (codebook bits,
sub-vector width, residual stages, retrieval fraction, window), the ablations (H-weighted vs
plain keys, WRoPE vs post-RoPE keys, with and without a retrieval set, and the assignment rules
incl. the cosine blend) and the needle test. Writes ``report.md``, ``report.json``,
``rate_fidelity.png`` and ``ablations.png`` to ``--out`` and prints the main table. Codebooks are
kept in ``--store``, so a second run skips training (the calibration texts are still captured
for the assignment-rule ablation).
Takes about an hour on 2 CPU cores the first time (codebook training: 2-10 min per setting),
~20 minutes once the codebooks are in the store.
"""

import coldkv  # noqa: F401  isort: skip  (preloads OpenBLAS before mlx)

import argparse
import time
from pathlib import Path

from coldkv.config import CodecSettings, StorageConfig, codec_from_preset, read_prompts, PromptSource
from coldkv.compress import open_store
from coldkv.models import load
from coldkv.report import build_report, main_table

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("default", "hifi", "max")


#: Anchor of the sweep: keys 8 bits / 4 dims (2 bits per element), values 6 bits / 4 dims (1.5),
#: window 4 + 32 int8. Fixed here (not derived from the preset files), so sweep points stay
#: comparable, and their codebooks cached, when the presets change.
ANCHOR = CodecSettings(key_space="wrope", key_metric="h", key_bits=8, key_sub_dim=4, value_bits=6, value_sub_dim=4,
                       sinks=4, recent=32, retrieval_fraction=0.0, retrieval_dtype="int8")  # fmt: skip


def point_name(s: CodecSettings) -> str:
    """k<bits>/<sub_dim>[x<stages>] v<bits>/<sub_dim>[x<stages>] [w<sinks>+<recent>] [ret <fraction>]."""
    def part(tag, bits, sub, stages):
        return f"{tag}{bits}/{sub}" + (f"x{stages}" if stages > 1 else "")

    name = part("k", s.key_bits, s.key_sub_dim, s.key_stages) + " " + part("v", s.value_bits, s.value_sub_dim, s.value_stages)
    if (s.sinks, s.recent) != (ANCHOR.sinks, ANCHOR.recent):
        name += f" w{s.sinks}+{s.recent}"
    return name + (f" ret {s.retrieval_fraction:.0%}" if s.retrieval_fraction else "")


def sweep_settings(presets: dict[str, CodecSettings]) -> dict[str, CodecSettings]:
    """Rate–fidelity points: codebook bits, sub-vector width, residual stages, retrieval fraction
    and window around :data:`ANCHOR`, plus the hifi preset with a larger retrieval set."""
    a = ANCHOR.model_copy(update={"kmeans_iters": presets["default"].kmeans_iters})

    def v(base=a, **kw):
        return base.model_copy(update=kw)

    points = [
        a, v(value_bits=8), v(value_bits=4), v(key_bits=4, key_sub_dim=2), v(key_sub_dim=8),
        v(key_sub_dim=8, value_bits=8), v(key_stages=2), v(value_bits=8, recent=16),
        v(retrieval_fraction=0.02), v(retrieval_fraction=0.05),
    ]  # fmt: skip
    named = {point_name(s): s for s in points}
    named["hifi ret 5%"] = v(presets["hifi"], retrieval_fraction=0.05)
    return named


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "out" / "bench-report"))
    p.add_argument("--store", default=str(ROOT / "out" / "bench-store"))
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--continuation-tokens", type=int, default=256)
    p.add_argument("--calibration-max-tokens", type=int, default=2048)
    p.add_argument("--kmeans-iters", type=int, default=20)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--no-needle", action="store_true")
    args = p.parse_args()

    t0 = time.perf_counter()
    lm = load("default")
    store = open_store(StorageConfig(root=args.store))
    presets = {name: codec_from_preset(name, kmeans_iters=args.kmeans_iters) for name in PRESETS}
    calibration = [t for _, t in read_prompts(PromptSource(path=ROOT / "configs/prompts/calibration"))]
    prose = (ROOT / "bench/data/long_prose.txt").read_text()
    report = build_report(
        lm, store, [("long_prose", prose)], presets, calibration,
        args.prompt_tokens, args.continuation_tokens,
        needle=not args.no_needle, ablations=not args.no_ablations, out=Path(args.out),
        sweep=None if args.no_sweep else sweep_settings(presets),
        calibration_max_tokens=args.calibration_max_tokens, greedy_tokens=32,
    )  # fmt: skip
    print(main_table(report))
    print()
    for t in report["targets"]:
        print(f"- {t['target']}: {t['status']}: {t['text']}")
    print(f"\n{args.out}/report.md written in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
