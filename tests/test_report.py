"""`coldkv report --quick` end to end on the real default model (a small case, CI-sized)."""

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import json
from pathlib import Path

import pytest
import yaml

from coldkv.cli import main as cli_main

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]
BASELINES = ("fp16", "fp16+zstd", "int8", "int4", "int3", "int2")

TEXTS = {
    "harbor": (
        "The harbor master kept a ledger of every ship that entered the bay. Each morning he walked "
        "along the quay, noting the names painted on the hulls, the flags they flew and the cargo "
        "that the dockers carried ashore: barrels of salted fish, bolts of wool, crates of oranges "
        "from the south. In winter the traffic slowed, and he spent the long evenings copying the "
        "ledger into a fair hand, adding small drawings of the ships he liked best. When he retired, "
        "the town council asked to keep the books, and they still sit in a glass case in the old "
        "customs house, open at a page from the year of the great storm, when forty ships sheltered "
        "in the bay for a week and the quay was so crowded that sailors crossed from deck to deck."
    ),
    "garden": (
        "A kitchen garden rewards patience more than skill. The soil needs a season of compost and "
        "mulch before it grows anything worth eating, and the first year's crops are often thin. "
        "Beans and peas are forgiving, climbing any support they are given and fixing nitrogen in "
        "the ground for whatever follows them. Tomatoes ask for more: a warm wall, steady watering "
        "and a gardener willing to pinch out the side shoots every few days. Root vegetables prefer "
        "loose, stone-free beds, or the carrots fork and twist into strange shapes. By the third "
        "summer the garden begins to feed its keeper, and the evenings spent weeding between rows "
        "feel less like work than like a conversation with the weather and the changing light."
    ),
}


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    prompts = tmp / "prompts"
    prompts.mkdir()
    for name, text in TEXTS.items():
        (prompts / f"{name}.txt").write_text(text)
    cfg = {
        "model": "default",
        "prompts": {"path": str(prompts)},
        "calibration": {"prompts": {"path": str(REPO / "configs/prompts/default")}, "max_tokens_per_prompt": 256},
        "codec": {"preset": "default", "key_bits": 4, "value_bits": 4, "kmeans_iters": 3},
        "storage": {"root": str(tmp / "store")},
        "report": {"out": str(tmp / "unused"), "prompt_tokens": 96, "continuation_tokens": 32, "needle": False},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp / "out"
    rc = cli_main(["report", "--config", str(path), "--out", str(out), "--quick"])
    return rc, out


def test_report_runs(quick_report):
    rc, out = quick_report
    assert rc == 0
    for name in ("report.json", "report.md", "rate_fidelity.png"):
        assert (out / name).is_file(), name


def test_report_json_structure(quick_report):
    _, out = quick_report
    rep = json.loads((out / "report.json").read_text())
    for key in ("meta", "baselines", "coldkv", "sizes", "fidelity", "timing", "targets"):
        assert key in rep, key
    assert rep["meta"]["n_prompts"] == 2 and rep["meta"]["quick"] is True
    assert [p["prompt_tokens"] for p in rep["meta"]["prompts"]] == [96, 96]
    methods = [r["method"] for r in rep["baselines"]]
    assert methods == list(BASELINES)
    for r in rep["baselines"] + rep["coldkv"]:
        for k in ("bytes", "bits_per_element", "ratio_vs_fp16", "delta_nll", "top1_agreement", "kl_mean",
                  "attn_rel_mse", "attn_topk_recall", "greedy_agreement"):
            assert isinstance(r[k], (int, float)), (r["method"], k)
    fp16 = rep["baselines"][0]
    assert fp16["ratio_vs_fp16"] == pytest.approx(1.0) and fp16["top1_agreement"] == pytest.approx(1.0)

    (name,) = [r["method"] for r in rep["coldkv"]]
    size = rep["sizes"][name]
    assert size["bytes"] == size["shard_bytes"] + size["manifest_bytes"]
    assert size["raw_bulk_codes"] > 0 and size["raw_window"] > 0 and size["codebook_bytes"] > 0
    assert size["ratio_codebooks_not_amortised"] < size["ratio_codebooks_amortised"] <= size["ratio_vs_fp16"]
    assert 1 < size["ratio_vs_fp16"] < 32  # a real compressed cache, not an accounting formula
    assert set(rep["fidelity"]) == set(BASELINES) | {name}
    (timing,) = rep["timing"]
    assert timing["prefill_s"] > 0 and timing["resume_over_prefill"] > 0 and timing["compress_over_prefill"] > 0

    targets = {t["target"]: t for t in rep["targets"]}
    assert set(targets) == {"default", "hifi", "max"}
    assert targets["default"]["status"] in ("MET", "NOT MET")
    assert targets["hifi"]["status"] == targets["max"]["status"] == "NOT RUN"


def test_report_markdown(quick_report):
    _, out = quick_report
    md = (out / "report.md").read_text()
    for heading in ("## Targets", "## Main table", "## Sizes", "## Timing"):
        assert heading in md
    assert "| method | bytes/cache | bits/elem | x vs fp16 | ΔNLL |" in md
    for method in BASELINES:
        assert f"\n| {method} |" in md, method
    assert "\n| config |" in md
    assert "MET" in md


def test_report_png(quick_report):
    _, out = quick_report
    data = (out / "rate_fidelity.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
