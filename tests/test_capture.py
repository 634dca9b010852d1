import coldkv  # noqa: F401
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base as mlx_base
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from coldkv.capture import CaptureError, capture, query_positions
from coldkv.rope import rotate, unrotate

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def cap(lm, prose_tokens):
    return capture(lm.model, prose_tokens, chunk=64)


def test_captured_kv_equals_mlx_lm_prompt_cache_bit_for_bit(lm, prose_tokens, cap):
    cache = make_prompt_cache(lm.model)
    x = mx.array(prose_tokens)[None]
    for s in range(0, len(prose_tokens), 64):
        lm.model(x[:, s : s + 64], cache=cache)
    assert len(cap.layers) == len(cache) == 30
    for layer, c in zip(cap.layers, cache):
        k, v = c.keys_and_values()
        assert mx.array_equal(layer.keys, k[0])
        assert mx.array_equal(layer.values, v[0])


def test_shapes_gqa_and_rope_settings(cap, prose_tokens):
    T = len(prose_tokens)
    assert cap.layers[0].keys.shape == (3, T, 64)
    assert cap.layers[0].queries.shape == (9, T, 64)
    assert cap.kv_head_of == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert cap.query_heads_of[1] == [3, 4, 5]
    assert cap.rope.kind == "RoPE" and cap.rope.traditional and cap.rope.base == 100000.0


def test_captured_query_reproduces_the_models_attention_output(lm, prose_tokens, cap):
    """Layer 0's own attention output at position t == softmax(q_t K^T) V through o_proj."""
    layer = lm.model.model.layers[0]
    h = layer.input_layernorm(lm.model.model.embed_tokens(mx.array(prose_tokens)[None]))
    ref = layer.self_attn(h, mask="causal", cache=None)[0]  # [T, hidden]
    t = len(prose_tokens) - 5
    q = cap.layers[0].queries[:, t]  # [9, 64]
    k = cap.layers[0].keys[mx.array(cap.kv_head_of), : t + 1]  # [9, t+1, 64]
    v = cap.layers[0].values[mx.array(cap.kv_head_of), : t + 1]
    scores = (q[:, None, :] @ k.transpose(0, 2, 1))[:, 0] * (64**-0.5)
    out = (mx.softmax(scores, axis=-1)[:, None, :] @ v)[:, 0]  # [9, 64]
    mine = layer.self_attn.o_proj(out.reshape(1, -1))[0]
    assert mx.allclose(mine, ref[t], atol=1e-4, rtol=1e-4).item()


def test_keys_undo_rope_to_the_raw_projection(lm, prose_tokens, cap):
    layer = lm.model.model.layers[0]
    h = layer.input_layernorm(lm.model.model.embed_tokens(mx.array(prose_tokens)[None]))
    raw = layer.self_attn.k_proj(h)[0].reshape(len(prose_tokens), 3, 64).transpose(1, 0, 2)
    pos = mx.arange(len(prose_tokens))
    pre = unrotate(cap.layers[0].keys, pos, cap.rope)
    assert mx.allclose(pre, raw, atol=2e-4).item()
    assert mx.allclose(rotate(pre, pos, cap.rope), cap.layers[0].keys, atol=2e-4).item()


def test_query_sampling_and_wrapper_is_restored(lm, prose_tokens):
    before = mlx_base.scaled_dot_product_attention, llama.scaled_dot_product_attention
    cap = capture(lm.model, prose_tokens[:40], chunk=16, queries=8)
    assert cap.query_positions.tolist() == [0, 8, 16, 24, 32]
    assert cap.layers[5].queries.shape == (9, 5, 64)
    assert (mlx_base.scaled_dot_product_attention, llama.scaled_dot_product_attention) == before
    rnd = query_positions(100, "random:10", seed=3)
    assert rnd.shape == (10,) and len(set(rnd.tolist())) == 10


def test_wrapper_is_restored_even_on_error(lm):
    before = llama.scaled_dot_product_attention
    def boom(done, total):
        raise KeyboardInterrupt  # e.g. the user presses Ctrl-C between chunks

    with pytest.raises(KeyboardInterrupt):
        capture(lm.model, [1, 2, 3, 4, 5, 6], chunk=2, progress=boom)
    assert llama.scaled_dot_product_attention is before


def test_bad_prompts_give_clear_errors(lm):
    with pytest.raises(CaptureError, match="prompt is empty"):
        capture(lm.model, [])
    with pytest.raises(CaptureError, match="longer than the model's context of 8"):
        capture(lm.model, list(range(20)), context_length=8)
    with pytest.raises(CaptureError, match="token id 1000000000 is outside the model's vocabulary"):
        capture(lm.model, [5, 10**9])
    with pytest.raises(CaptureError, match="stride must be positive"):
        capture(lm.model, [1, 2, 3], queries=-2)


def test_state_space_model_is_refused():
    class Mamba(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(2, 2)]

    with pytest.raises(CaptureError, match="not an attention model"):
        capture(Mamba(), [1, 2, 3])
