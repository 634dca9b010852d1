"""Shared fixtures. The real default model is loaded once per test session."""

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import pytest

PROSE = (
    "The lighthouse stood at the end of a long spit of sand, and for most of the year the "
    "keeper saw nobody but the men who brought oil and letters from the mainland. He kept a "
    "careful log of the weather, the ships that passed, and the birds that rested on the gallery "
    "rail during the autumn storms. In the spring the sand shifted and the path to the village "
    "disappeared under the dunes, so he walked along the waterline instead, counting the wrecks "
    "that the winter had uncovered. His daughter, who lived in the city, wrote to him every "
    "month and asked when he would finally retire; he always answered that the light would not "
    "keep itself, and that the sea was better company than most people he had met."
)


@pytest.fixture(scope="session")
def lm():
    from coldkv.models import load

    return load("default")


@pytest.fixture(scope="session")
def prose_tokens(lm):
    return lm.tokenizer.encode(PROSE)


TINY_CODEC = {"key_bits": 4, "value_bits": 4, "kmeans_iters": 3, "recent": 8}
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def write_config(folder, prompts, store="store", codec=None, **sections):
    """A small YAML config in ``folder``: tiny codec, calibration on the shipped prompts (160 tokens each)."""
    import yaml

    data = {
        "model": "default",
        "prompts": {"path": str(prompts)},
        "calibration": {"prompts": {"path": str(REPO / "configs/prompts/default")}, "max_tokens_per_prompt": 160},
        "codec": {"preset": "default", **TINY_CODEC, **(codec or {})},
        "storage": {"root": str(store)},
        **sections,
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def tiny_book(lm):
    """A small codebook set (4-bit PQ, 3 k-means iterations) trained on the shipped prompts."""
    from pathlib import Path

    from coldkv import calibrate
    from coldkv.config import codec_from_preset

    settings = codec_from_preset("default", **TINY_CODEC)
    root = Path(__file__).resolve().parents[1] / "configs" / "prompts" / "default"
    texts = [p.read_text() for p in sorted(root.glob("*.txt"))]
    data = calibrate.collect(lm, texts, max_tokens=160)
    return settings, calibrate.train_codebooks(lm, data, settings)
