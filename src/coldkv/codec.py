"""Codec: one captured cache <-> a high-fidelity retrieval set plus a coded bulk set.

Per (layer, KV head) group, the T tokens of a cache are split into

* the **window**: ``sinks`` first tokens and ``recent`` last tokens (same for every group),
* the **bulk**: everything between, coded with the group's PQ codebooks (keys by the A2ATS
  H-weighted kernel, values plain or output-aware; see :mod:`coldkv.calibrate`),
* the **retrieval set**: inside the bulk, the ``retrieval_fraction`` of tokens most relevant to
  the query proxy (the mean of the last captured queries of the group's query heads), chosen by
  :func:`coldkv.quantizers.a2ats_select_retrieval_set`. These tokens are also coded in the
  bulk (so code arrays stay rectangular) but decode to their high-fidelity copy.

Window and retrieval tokens are stored as float16 or int8 (affine, one group per head vector,
float16 scale and bias, as ``mx.quantize``). Codes are bit-packed to their real width.
Decoding rebuilds dense post-RoPE keys and values (re-applying RoPE where keys were coded
pre-RoPE) ready to become an mlx-lm ``KVCache``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import coldkv  # noqa: F401
import mlx.core as mx
import numpy as np

from coldkv.calibrate import CodebookSet, grouped, key_vectors
from coldkv.capture import Capture
from coldkv.config import CodecSettings
from coldkv.quantizers import a2ats_select_retrieval_set
from coldkv.rope import RopeSpec, rotate

CODEC_VERSION = 1


class CodecError(ValueError):
    """A cache and codebook set (or stored tensors) that do not fit together."""


# ----------------------------------------------------------------------------- bit packing


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned integer codes (< 2**bits) into a flat uint8 array, ``bits`` bits each."""
    flat = np.ascontiguousarray(codes).reshape(-1).astype(np.uint32)
    if flat.size and int(flat.max()) >= (1 << bits):
        raise CodecError(f"code {int(flat.max())} does not fit in {bits} bits")
    if bits == 8:
        return flat.astype(np.uint8)
    planes = ((flat[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`pack_bits`: codes of ``shape`` (uint16) from packed uint8."""
    n = int(np.prod(shape))
    if bits == 8:
        return packed[:n].reshape(shape).astype(np.uint16)
    planes = np.unpackbits(packed, count=n * bits, bitorder="little").reshape(n, bits)
    weights = (1 << np.arange(bits, dtype=np.uint32)).astype(np.uint32)
    return (planes.astype(np.uint32) @ weights).astype(np.uint16).reshape(shape)


# ----------------------------------------------------------------------------- hi-fi tensors


def store_hifi(x: mx.array, dtype: str, prefix: str) -> dict[str, np.ndarray]:
    """Window / retrieval vectors [G, n, d] as float16, or int8 affine (one group per vector)."""
    if dtype == "float16":
        return {prefix: np.array(x.astype(mx.float16))}
    d = x.shape[-1]
    if x.shape[1] == 0:
        return {f"{prefix}.q": np.zeros(x.shape, np.uint8), f"{prefix}.scales": np.zeros(x.shape[:-1] + (1,), np.float16),
                f"{prefix}.biases": np.zeros(x.shape[:-1] + (1,), np.float16)}  # fmt: skip
    # float16 scale/bias (as a user's fp16 cache would have), quantized from the fp16 values
    wq, scales, biases = mx.quantize(x.astype(mx.float16), group_size=d, bits=8)
    return {
        f"{prefix}.q": np.array(wq).view(np.uint8).reshape(x.shape),
        f"{prefix}.scales": np.array(scales),
        f"{prefix}.biases": np.array(biases),
    }


def load_hifi(t: dict[str, np.ndarray], dtype: str, prefix: str) -> mx.array:
    """Inverse of :func:`store_hifi` -> float32 [G, n, d]."""
    if dtype == "float16":
        return mx.array(t[prefix]).astype(mx.float32)
    q = t[f"{prefix}.q"]
    G, n, d = q.shape
    if n == 0:
        return mx.zeros((G, 0, d), mx.float32)
    wq = mx.array(np.ascontiguousarray(q).view(np.uint32).reshape(G, n, d // 4))
    out = mx.dequantize(wq, mx.array(t[f"{prefix}.scales"]), mx.array(t[f"{prefix}.biases"]), group_size=d, bits=8)
    return out.astype(mx.float32)


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Token split of a cache of T tokens: window [0, sinks) + [T - recent, T), bulk between."""

    T: int
    sinks: int
    recent: int
    n_retrieval: int

    @classmethod
    def plan(cls, T: int, s: CodecSettings) -> "Layout":
        sinks = min(s.sinks, T)
        recent = min(s.recent, T - sinks)
        bulk = T - sinks - recent
        n_ret = math.ceil(s.retrieval_fraction * bulk) if bulk else 0
        return cls(T, sinks, recent, n_ret)

    @property
    def bulk(self) -> tuple[int, int]:
        return self.sinks, self.T - self.recent

    @property
    def n_bulk(self) -> int:
        return self.T - self.sinks - self.recent


def query_proxy(cap: Capture, last: int = 16) -> mx.array | None:
    """[G, d] query proxy per group: mean of the last ``last`` captured queries of its heads."""
    if cap.layers[0].queries is None or cap.layers[0].queries.shape[1] == 0:
        return None
    q = mx.stack([layer.queries[:, -last:] for layer in cap.layers])  # [L, H, t, d]
    L, H, t, d = q.shape
    grp = H // cap.n_kv_heads
    return q.reshape(L * cap.n_kv_heads, grp * t, d).mean(axis=1)


def select_retrieval(keys_bulk: mx.array, proxy: mx.array, fraction: float) -> mx.array:
    """Per group, bulk positions of the retrieval set: [G, n_ret] int32 (sorted), via the seed API."""
    idx = [a2ats_select_retrieval_set(keys_bulk[g], proxy[g], fraction)[0] for g in range(keys_bulk.shape[0])]
    return mx.stack(idx).astype(mx.int32)


# ----------------------------------------------------------------------------- encode / decode


def check_compatible(cap_shape: tuple[int, int, int], book: CodebookSet) -> None:
    L, n_kv, d = cap_shape
    if (L, n_kv, d) != (book.n_layers, book.n_kv_heads, book.head_dim):
        raise CodecError(
            f"cache geometry {L} layers x {n_kv} KV heads x {d} does not match the codebooks' "
            f"{book.n_layers} x {book.n_kv_heads} x {book.head_dim}"
        )


def encode(cap: Capture, book: CodebookSet, s: CodecSettings) -> tuple[dict[str, np.ndarray], dict]:
    """Encode a captured cache. Returns (tensors for the store, codec metadata).

    Tensors (G = layers * KV heads, W = sinks + recent, Tb = bulk tokens, R = retrieval tokens):
      key_codes / value_codes: packed uint8 of [G, Tb, stages, n_sub] codes;
      window_keys / window_values: [G, W, d] (post-RoPE keys), float16 or int8 (+ scales, biases);
      retrieval_idx: [G, R] int32 bulk-relative positions; retrieval_keys / _values: [G, R, d].
    """
    check_compatible((len(cap.layers), cap.n_kv_heads, cap.head_dim), book)
    if book.settings != s.codebook_fields():
        raise CodecError("codec settings differ from the settings the codebooks were trained with")
    lay = Layout.plan(cap.num_tokens, s)
    K, V = grouped(cap)  # [G, T, d] post-RoPE
    b0, b1 = lay.bulk
    rope = RopeSpec.from_dict(book.rope) if book.rope else None
    pos = mx.arange(b0, b1)
    tensors: dict[str, np.ndarray] = {}
    meta = {"codec_version": CODEC_VERSION, "T": lay.T, "sinks": lay.sinks, "recent": lay.recent}
    if lay.n_bulk:
        kx = key_vectors(K[:, b0:b1], pos, s.key_space, rope)
        kc = np.array(book.keys.encode(kx))
        vc = np.array(book.values.encode(V[:, b0:b1]))
        tensors["key_codes"] = pack_bits(kc, book.keys.bits)
        tensors["value_codes"] = pack_bits(vc, book.values.bits)
        meta["key_codes_shape"], meta["value_codes_shape"] = list(kc.shape), list(vc.shape)
    win = mx.concatenate([mx.arange(0, b0), mx.arange(b1, lay.T)]).astype(mx.int32)
    tensors.update(store_hifi(K[:, win], s.retrieval_dtype, "window_keys"))
    tensors.update(store_hifi(V[:, win], s.retrieval_dtype, "window_values"))
    proxy = query_proxy(cap)
    n_ret = lay.n_retrieval if proxy is not None else 0
    if n_ret:
        idx = select_retrieval(K[:, b0:b1], proxy, s.retrieval_fraction)  # [G, R] bulk-relative
        rk = mx.take_along_axis(K[:, b0:b1], idx[..., None], axis=1)
        rv = mx.take_along_axis(V[:, b0:b1], idx[..., None], axis=1)
        tensors["retrieval_idx"] = np.array(idx).astype(np.int32)
        tensors.update(store_hifi(rk, s.retrieval_dtype, "retrieval_keys"))
        tensors.update(store_hifi(rv, s.retrieval_dtype, "retrieval_values"))
    meta["n_retrieval"] = n_ret
    return tensors, meta


def decode(tensors: dict[str, np.ndarray], meta: dict, book: CodebookSet, s: CodecSettings) -> list[tuple[mx.array, mx.array]]:
    """Rebuild per-layer (keys, values), each [n_kv, T, d] float32 post-RoPE, from stored tensors."""
    T, sinks, recent = meta["T"], meta["sinks"], meta["recent"]
    b0, b1 = sinks, T - recent
    G, d = book.n_layers * book.n_kv_heads, book.head_dim
    wk = load_hifi(tensors, s.retrieval_dtype, "window_keys")
    wv = load_hifi(tensors, s.retrieval_dtype, "window_values")
    parts_k, parts_v = [wk[:, :sinks]], [wv[:, :sinks]]
    if b1 > b0:
        kc = unpack_bits(tensors["key_codes"], book.keys.bits, tuple(meta["key_codes_shape"]))
        vc = unpack_bits(tensors["value_codes"], book.values.bits, tuple(meta["value_codes_shape"]))
        kb = book.keys.decode(mx.array(kc))  # [G, Tb, d]
        vb = book.values.decode(mx.array(vc))
        if s.key_space == "wrope":
            kb = rotate(kb, mx.arange(b0, b1), RopeSpec.from_dict(book.rope))
        if meta.get("n_retrieval"):
            idx = mx.array(tensors["retrieval_idx"]).astype(mx.int32)
            rk = load_hifi(tensors, s.retrieval_dtype, "retrieval_keys")
            rv = load_hifi(tensors, s.retrieval_dtype, "retrieval_values")
            rows = mx.broadcast_to(mx.arange(G)[:, None], idx.shape)
            kb[rows, idx] = rk
            vb[rows, idx] = rv
        parts_k.append(kb)
        parts_v.append(vb)
    parts_k.append(wk[:, sinks:])
    parts_v.append(wv[:, sinks:])
    K = mx.concatenate(parts_k, axis=1).reshape(book.n_layers, book.n_kv_heads, T, d)
    V = mx.concatenate(parts_v, axis=1).reshape(book.n_layers, book.n_kv_heads, T, d)
    mx.eval(K, V)
    return [(K[i], V[i]) for i in range(book.n_layers)]


def stored_bits(tensors: dict[str, np.ndarray], meta: dict, n_layers: int, n_kv: int, d: int) -> dict[str, float]:
    """Raw (pre-zstd) bytes by part, and bits per cache element (keys+values) overall."""
    parts = {"bulk_codes": 0, "window": 0, "retrieval": 0}
    for name, a in tensors.items():
        part = "bulk_codes" if name.endswith("_codes") else name.split("_", 1)[0]
        parts[part if part in parts else "retrieval"] += a.nbytes
    elements = 2 * n_layers * n_kv * meta["T"] * d
    parts["bits_per_element"] = 8 * sum(parts.values()) / elements
    return parts
