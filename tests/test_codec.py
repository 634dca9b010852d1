import coldkv  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from coldkv import codec
from coldkv.capture import capture
from coldkv.codec import CodecError, Layout, pack_bits, unpack_bits

pytestmark = pytest.mark.model


@pytest.mark.parametrize("bits", [1, 3, 4, 5, 7, 8, 10, 12])
def test_bit_packing_round_trips_at_real_width(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(3, 17, 2, 16)).astype(np.uint16)
    packed = pack_bits(codes, bits)
    assert packed.dtype == np.uint8 and packed.size == -(-codes.size * bits // 8)
    assert np.array_equal(unpack_bits(packed, bits, codes.shape), codes)
    with pytest.raises(CodecError, match=f"does not fit in {bits} bits"):
        pack_bits(np.array([2**bits]), bits)


def test_layout_clips_window_to_short_prompts(tiny_book):
    s = tiny_book[0].model_copy(update={"retrieval_fraction": 0.0})
    assert Layout.plan(100, s) == Layout(100, 4, 8, 0)
    assert Layout.plan(10, s).n_bulk == 0 and Layout.plan(3, s) == Layout(3, 3, 0, 0)
    assert Layout.plan(100, s.model_copy(update={"retrieval_fraction": 0.1})).n_retrieval == 9


def _capture(lm, tokens, queries=False):
    return capture(lm.model, tokens, queries=queries)


def test_window_is_exact_and_bulk_is_close(lm, prose_tokens, tiny_book):
    s, book = tiny_book
    s16 = s.model_copy(update={"retrieval_dtype": "float16"})
    cap = _capture(lm, prose_tokens)
    tensors, meta = codec.encode(cap, book, s16)
    layers = codec.decode(tensors, meta, book, s16)
    T = len(prose_tokens)
    for (k, v), layer in zip(layers, cap.layers):
        assert k.shape == layer.keys.shape == (3, T, 64)
        for lo, hi in ((0, s.sinks), (T - s.recent, T)):  # window: float16 copy
            assert mx.allclose(k[:, lo:hi], layer.keys[:, lo:hi], atol=2e-2, rtol=1e-3).item()
            assert mx.allclose(v[:, lo:hi], layer.values[:, lo:hi], atol=2e-3, rtol=1e-3).item()
    # bulk: coded, lossy but far better than nothing (relative error well below 1)
    k, _ = layers[10]
    b = slice(s.sinks, T - s.recent)
    err = mx.linalg.norm(k[:, b] - cap.layers[10].keys[:, b]) / mx.linalg.norm(cap.layers[10].keys[:, b])
    assert 0.01 < err.item() < 0.6


def test_retrieval_set_tokens_decode_to_their_high_fidelity_copy(lm, prose_tokens, tiny_book):
    s, book = tiny_book
    s = s.model_copy(update={"retrieval_fraction": 0.1, "retrieval_dtype": "float16"})
    cap = capture(lm.model, prose_tokens, queries="last:16")
    tensors, meta = codec.encode(cap, book, s)
    idx = tensors["retrieval_idx"]
    assert idx.shape == (90, meta["n_retrieval"]) and meta["n_retrieval"] > 0
    assert (np.diff(idx, axis=1) > 0).all()  # sorted, distinct per group
    layers = codec.decode(tensors, meta, book, s)
    g = 37  # layer 12, kv head 1
    pos = idx[g] + s.sinks
    got = np.array(layers[12][0][1])[pos]
    want = np.array(cap.layers[12].keys[1])[pos]
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-3)


def test_int8_hifi_round_trip_error_is_small():
    x = mx.random.normal((6, 10, 64), key=mx.random.key(0)) * 3
    t = codec.store_hifi(x, "int8", "w")
    assert t["w.q"].dtype == np.uint8 and t["w.q"].shape == (6, 10, 64)
    y = codec.load_hifi(t, "int8", "w")
    step = (x.max(axis=-1) - x.min(axis=-1)) / 255  # one 8-bit step per head vector
    assert (mx.abs(y - x).max(axis=-1) <= step).all().item()


def test_geometry_and_settings_mismatch_are_refused(lm, tiny_book):
    s, book = tiny_book
    cap = _capture(lm, [1, 2, 3, 4])
    with pytest.raises(CodecError, match="settings differ"):
        codec.encode(cap, book, s.model_copy(update={"key_bits": 5}))
    cap.layers = cap.layers[:10]
    with pytest.raises(CodecError, match="10 layers x 3 KV heads x 64 does not match"):
        codec.encode(cap, book, s)
