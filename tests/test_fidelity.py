"""Fidelity metrics and baselines on the real default model (SmolLM2-135M)."""

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from coldkv import baselines as B
from coldkv import fidelity as F

PROSE = (
    "The history of the lighthouse is a story of stone, fire and patience. Long before electric "
    "lamps, keepers climbed narrow stairs each evening to trim the wicks of oil lamps and polish "
    "the great lenses, so that ships far out at sea could find their way past rocks and shoals. "
    "The work was lonely and often dangerous: storms could cut a station off from the mainland "
    "for weeks, and supplies of food and fuel had to be rationed with care. Many keepers kept "
    "detailed logs of the weather, the passing vessels and the small events of daily life, and "
    "these records are now treasured by historians. In the twentieth century automation slowly "
    "replaced the keepers, and one by one the towers fell silent except for the steady turning "
    "of their lights. Today many lighthouses are museums, where visitors can climb the same "
    "stairs and look out over the water that the keepers once watched every night of the year. "
    "Some of them still guide ships, although most sailors now trust satellites and radar, and "
    "the old lamps shine mostly for the people who come to remember how hard the work once was."
)
N_PROMPT, N_CONT = 150, 32


@pytest.fixture(scope="module")
def lm():
    from coldkv.models import load

    return load("default")


@pytest.fixture(scope="module")
def text(lm):
    toks = lm.tokenizer.encode(PROSE)
    assert len(toks) >= N_PROMPT + N_CONT
    return toks[:N_PROMPT], toks[N_PROMPT : N_PROMPT + N_CONT]


@pytest.fixture(scope="module")
def exact(lm, text):
    return F.prefill(lm.model, text[0])


@pytest.fixture(scope="module")
def rows(lm, exact, text, tmp_path_factory):
    rows = B.baseline_rows(lm.model, exact, text[1], text[0], workdir=tmp_path_factory.mktemp("bl"))
    print("\n" + B.format_rows(rows))
    return {r["method"]: r for r in rows}


# --------------------------------------------------------------------------------------
# Caches and teacher forcing
# --------------------------------------------------------------------------------------


@pytest.mark.model
def test_prefill_shapes(lm, exact):
    cfg = lm.config
    assert len(exact) == cfg["num_hidden_layers"]
    for k, v in F.cache_arrays(exact):
        assert k.shape == (1, cfg["num_key_value_heads"], N_PROMPT, cfg["head_dim"])
        assert v.shape == k.shape
    assert all(c.offset == N_PROMPT for c in exact)


@pytest.mark.model
def test_chunked_prefill_matches(lm, exact, text):
    chunked = F.prefill(lm.model, text[0], chunk=64)
    for (k1, v1), (k2, v2) in zip(F.cache_arrays(exact), F.cache_arrays(chunked)):
        assert mx.allclose(k1, k2, atol=1e-3, rtol=1e-3).item()
        assert mx.allclose(v1, v2, atol=1e-3, rtol=1e-3).item()


@pytest.mark.model
def test_exact_vs_itself(lm, exact, text):
    r = F.compare(lm.model, exact, exact, text[1])
    assert r.delta_nll == 0.0
    assert r.ppl_ratio == 1.0
    assert r.kl_mean < 1e-6
    assert r.top1_agreement == 1.0
    assert r.n_tokens == N_CONT - 1 and r.n_positions == N_CONT
    assert 0.5 < r.nll_exact < 6.0  # real prose, real model


@pytest.mark.model
def test_cache_from_arrays_identical_logits(lm, exact, text):
    rebuilt = F.cache_from_arrays(F.cache_arrays(exact))
    assert all(isinstance(c, KVCache) and c.offset == N_PROMPT for c in rebuilt)
    a = F.teacher_forced_logprobs(lm.model, exact, text[1])
    b = F.teacher_forced_logprobs(lm.model, rebuilt, text[1])
    assert a.shape == (N_CONT, lm.config["vocab_size"])
    assert mx.array_equal(a, b).item()


@pytest.mark.model
def test_teacher_forcing_does_not_mutate(lm, text):
    cache = F.prefill(lm.model, text[0])
    before = [(mx.array(k), mx.array(v)) for k, v in F.cache_arrays(cache)]
    buffers = [(c.keys.shape, c.values.shape) for c in cache]
    F.teacher_forced_logprobs(lm.model, cache, text[1])
    F.greedy_decode(lm.model, cache, text[1][:1], 2)
    assert all(c.offset == N_PROMPT for c in cache)
    assert [(c.keys.shape, c.values.shape) for c in cache] == buffers
    for (k0, v0), (k1, v1) in zip(before, F.cache_arrays(cache)):
        assert mx.array_equal(k0, k1).item() and mx.array_equal(v0, v1).item()
    # the next-token distributions really come from the cache: compare with a full forward pass
    full = lm.model(mx.array(text[0] + text[1])[None])[0, N_PROMPT:]
    full = full - mx.logsumexp(full, axis=-1, keepdims=True)
    lp = F.teacher_forced_logprobs(lm.model, cache, text[1])
    assert mx.allclose(full, lp, atol=1e-3).item()


@pytest.mark.model
def test_greedy_agreement_self(lm, exact, text):
    g = F.greedy_agreement(lm.model, lm.tokenizer, exact, exact, n=8, start_tokens=text[1][:1])
    assert g.agreement == 1.0 and g.prefix_agreement == 1.0 and g.first_divergence is None
    assert g.tokens_exact == g.tokens_restored and len(g.tokens_exact) == 8
    assert g.text_exact == g.text_restored and g.text_exact


@pytest.mark.model
def test_noise_cache_is_much_worse(lm, exact, text):
    mx.random.seed(0)
    noisy = [
        (mx.random.normal(k.shape) * mx.std(k), mx.random.normal(v.shape) * mx.std(v))
        for k, v in F.cache_arrays(exact)
    ]
    r = F.compare(lm.model, exact, F.cache_from_arrays(noisy), text[1])
    assert r.delta_nll > 1.0
    assert r.kl_mean > 0.5
    assert r.top1_agreement < 0.8


# --------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------


@pytest.mark.model
def test_quantized_roundtrip(exact):
    restored, nbytes = B.quantized_roundtrip(exact, 4)
    assert all(isinstance(c, KVCache) and c.offset == N_PROMPT for c in restored)
    assert restored[0].keys.dtype == exact[0].keys.dtype
    k, k_hat = F.cache_arrays(exact)[0][0], F.cache_arrays(restored)[0][0]
    assert 0 < mx.abs(k - k_hat).max().item() < 0.2 * mx.abs(k).max().item()
    n_elem = B.cache_elements(exact)
    assert n_elem * 4.5 / 8 < nbytes < n_elem * 4.5 / 8 + 64 * 1024


@pytest.mark.model
def test_baseline_sizes(lm, rows):
    cfg = lm.config
    payload = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * N_PROMPT * cfg["head_dim"] * 2
    fp16 = rows["fp16"]["bytes"]
    assert payload < fp16 < payload + 32 * 1024  # safetensors header + metadata only
    assert rows["fp16"]["ratio_vs_fp16"] == 1.0
    assert fp16 > rows["int8"]["bytes"] > rows["int4"]["bytes"] > rows["int3"]["bytes"] > rows["int2"]["bytes"]
    assert rows["fp16+zstd"]["bytes"] < fp16
    for b in (8, 4, 3, 2):
        assert rows[f"int{b}"]["bits_nominal"] == b + 0.5
        assert b + 0.5 < rows[f"int{b}"]["bits_measured"] < b + 0.5 + 0.2


@pytest.mark.model
def test_baseline_fidelity_order(rows):
    assert rows["fp16"]["kl_mean"] < 1e-3 and rows["fp16"]["top1_agreement"] == 1.0
    assert rows["fp16+zstd"]["kl_mean"] == rows["fp16"]["kl_mean"]  # zstd is lossless
    assert rows["int8"]["kl_mean"] < rows["int4"]["kl_mean"] < rows["int2"]["kl_mean"]
    assert rows["int4"]["kl_mean"] < rows["int3"]["kl_mean"] < rows["int2"]["kl_mean"]
    assert rows["int8"]["top1_agreement"] >= 0.95
    assert rows["int2"]["top1_agreement"] < rows["int8"]["top1_agreement"]
    for r in rows.values():
        assert r["n_tokens"] == N_CONT - 1 and r["n_prompt_tokens"] == N_PROMPT


# --------------------------------------------------------------------------------------
# Attention-score error (synthetic, no model)
# --------------------------------------------------------------------------------------


def _qk(n_heads=6, n_kv=2, Q=16, T=100, d=32):
    mx.random.seed(1)
    return mx.random.normal((n_heads, Q, d)), mx.random.normal((n_kv, T, d))


def test_attention_score_error_identical():
    q, k = _qk()
    e = F.attention_score_error(q, k, k, top_k=10)
    assert e.rel_mse == 0.0 and e.topk_recall == 1.0 and e.top_k == 10
    assert e.rel_mse_per_head == [0.0] * 6


def test_attention_score_error_perturbed_and_gqa():
    q, k = _qk()
    noise = 0.3 * mx.random.normal(k.shape)
    k_hat = k + noise * mx.array([0.0, 1.0])[:, None, None]  # only KV head 1 perturbed
    e = F.attention_score_error(q, k, k_hat, top_k=10)
    assert e.rel_mse > 0 and e.topk_recall < 1.0
    # heads 0-2 share KV head 0 (exact), heads 3-5 share KV head 1 (perturbed)
    assert e.rel_mse_per_head[:3] == [0.0] * 3
    assert all(x > 0.01 for x in e.rel_mse_per_head[3:])
    # rel_mse ≈ noise² / signal² per element for isotropic data
    assert 0.03 < e.rel_mse_per_head[4] < 0.2
    worse = F.attention_score_error(q, k, k + 3 * noise, top_k=10)
    assert worse.rel_mse > e.rel_mse and worse.topk_recall < e.topk_recall
    # top_k larger than T is clipped; a batch dimension is accepted
    e_all = F.attention_score_error(q[None], k[None], k_hat[None], top_k=1000)
    assert e_all.top_k == 100 and e_all.topk_recall == 1.0
