"""What a user would use instead of coldkv, stored, restored and scored the same way.

Rows (DESIGN §2, §5):

* ``fp16``      mlx-lm ``save_prompt_cache`` file with keys/values cast to float16: the
                reference file every ratio is measured against;
* ``fp16+zstd`` that same file compressed with zstandard alone (lossless);
* ``int8/4/3/2`` mlx-lm's own KV quantization (``QuantizedKVCache``: ``mx.quantize`` with
                ``group_size`` 64, affine, fp16 scale and bias per group), saved with
                ``save_prompt_cache``, loaded back and dequantized into a float ``KVCache``.

Sizes are bytes on disk (safetensors header included). ``bits_nominal`` is the accounting
formula (16, or ``bits + 32 / group_size``); ``bits_measured`` is ``8 * bytes / elements``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import zstandard
from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache, save_prompt_cache

from coldkv.fidelity import (
    Tokens,
    cache_arrays,
    cache_dtype,
    cache_from_arrays,
    compare_logprobs,
    teacher_forced_logprobs,
)

QUANT_BITS = (8, 4, 3, 2)


def cache_elements(cache: list) -> int:
    """Number of stored key + value elements (offset positions only)."""
    return sum(k.size + v.size for k, v in cache_arrays(cache))


def fp16_cache(cache: list) -> list:
    """The cache as mlx-lm ``KVCache``s with float16 keys/values, trimmed to the offset."""
    return cache_from_arrays(cache_arrays(cache), dtype=mx.float16)


def fp16_prompt_cache_bytes(cache: list, path: str | os.PathLike) -> int:
    """Write the reference "fp16 file" (``save_prompt_cache``, float16) to ``path``; its size.

    The buffers are trimmed to the offset first (a live ``KVCache`` over-allocates in steps
    of 256 positions, which ``save_prompt_cache`` would otherwise write out).
    """
    save_prompt_cache(str(path), fp16_cache(cache))
    return os.path.getsize(path)


def zstd_bytes(path: str | os.PathLike, level: int = 3) -> int:
    """Size of the file at ``path`` compressed with zstandard alone at ``level``."""
    data = Path(path).read_bytes()
    return len(zstandard.ZstdCompressor(level=level).compress(data))


def quantized_cache(cache: list, bits: int, group_size: int = 64) -> list[QuantizedKVCache]:
    """mlx-lm ``QuantizedKVCache`` per layer, quantized from the float16 cache.

    As ``KVCache.to_quantized`` does, but from float16 keys/values (so scale and bias are
    float16, as on a user's fp16 model) and trimmed to the offset. Each layer's state is
    ``((wq, scales, biases), (wq, scales, biases), offset, group_size, bits)`` with
    ``wq: [1, n_kv, T, d * bits / 32] uint32`` and scales, biases ``[1, n_kv, T, d / group_size]``.
    """
    out = []
    for k, v in cache_arrays(cache):
        q = QuantizedKVCache(group_size=group_size, bits=bits)
        q.keys = mx.quantize(k.astype(mx.float16), group_size=group_size, bits=bits)
        q.values = mx.quantize(v.astype(mx.float16), group_size=group_size, bits=bits)
        q.offset = k.shape[-2]
        out.append(q)
    mx.eval([(q.keys, q.values) for q in out])
    return out


def dequantize_cache(qcache: list, dtype: mx.Dtype = mx.float32) -> list:
    """Plain float ``KVCache`` list (``dtype``) from a ``QuantizedKVCache`` list."""
    arrays = []
    for q in qcache:
        n = q.offset
        k, v = (
            mx.dequantize(*[a[..., :n, :] for a in x], group_size=q.group_size, bits=q.bits)
            for x in (q.keys, q.values)
        )
        arrays.append((k, v))
    return cache_from_arrays(arrays, dtype=dtype)


def quantized_roundtrip(
    cache: list, bits: int, group_size: int = 64, path: str | os.PathLike | None = None
) -> tuple[list, int]:
    """Quantize like mlx-lm ``kv_bits``, save, load back, dequantize.

    Returns ``(restored_cache, bytes_on_disk)``: ``restored_cache`` is a ``KVCache`` list in
    the dtype of ``cache``; the file is written to ``path`` (a temporary file if ``None``).
    """
    dtype = cache_dtype(cache)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(path) if path is not None else Path(tmp) / f"int{bits}.safetensors"
        save_prompt_cache(str(file), quantized_cache(cache, bits, group_size))
        nbytes = os.path.getsize(file)
        loaded = load_prompt_cache(str(file))
        if not all(isinstance(c, QuantizedKVCache) and c.bits == bits for c in loaded):
            raise RuntimeError("save_prompt_cache did not round-trip QuantizedKVCache")
        restored = dequantize_cache(loaded, dtype)
    return restored, nbytes


def _row(name, nbytes, fp16_bytes, n_elem, bits_nominal, fid) -> dict:
    return {
        "method": name,
        "bytes": nbytes,
        "bits_nominal": bits_nominal,
        "bits_measured": 8 * nbytes / n_elem,
        "ratio_vs_fp16": fp16_bytes / nbytes,
        **fid.as_dict(),
    }


def baseline_rows(
    model: nn.Module,
    exact_cache: list,
    continuation: Tokens,
    prompt_tokens: Sequence[int] | None = None,
    *,
    bits: Sequence[int] = QUANT_BITS,
    group_size: int = 64,
    zstd_level: int = 3,
    workdir: str | os.PathLike | None = None,
) -> list[dict]:
    """Size and fidelity of every baseline, scored with :func:`coldkv.fidelity.compare`.

    Args:
        exact_cache: the exact prompt cache (the model's own dtype, e.g. float32).
        continuation: tokens scored on top of each restored cache (see ``coldkv.fidelity``).
        prompt_tokens: if given, checked against the cache length and reported.
        workdir: where the files are written (kept); a temporary folder if ``None``.

    Returns one dict per row (``fp16``, ``fp16+zstd``, ``int8`` ...) with ``method``,
    ``bytes``, ``bits_nominal``, ``bits_measured``, ``ratio_vs_fp16``, the
    :class:`~coldkv.fidelity.FidelityResult` fields, ``n_prompt_tokens`` and ``n_elements``.
    """
    n_prompt = exact_cache[0].offset
    if prompt_tokens is not None and len(prompt_tokens) != n_prompt:
        raise ValueError(f"cache holds {n_prompt} positions but prompt has {len(prompt_tokens)} tokens")
    n_elem = cache_elements(exact_cache)
    dtype = cache_dtype(exact_cache)
    lp_exact = teacher_forced_logprobs(model, exact_cache, continuation)

    def fidelity(restored):
        return compare_logprobs(lp_exact, teacher_forced_logprobs(model, restored, continuation), continuation)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(workdir) if workdir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        fp16_file = folder / "fp16.safetensors"
        fp16_bytes = fp16_prompt_cache_bytes(exact_cache, fp16_file)
        restored = cache_from_arrays(
            [(k, v) for k, v in cache_arrays(load_prompt_cache(str(fp16_file)))], dtype=dtype
        )
        fid16 = fidelity(restored)
        zbytes = zstd_bytes(fp16_file, zstd_level)
        rows = [
            _row("fp16", fp16_bytes, fp16_bytes, n_elem, 16.0, fid16),
            _row("fp16+zstd", zbytes, fp16_bytes, n_elem, 8 * zbytes / n_elem, fid16),
        ]
        for b in bits:
            restored, nbytes = quantized_roundtrip(
                exact_cache, b, group_size, path=folder / f"int{b}.safetensors"
            )
            rows.append(_row(f"int{b}", nbytes, fp16_bytes, n_elem, b + 32 / group_size, fidelity(restored)))
    for r in rows:
        r["n_prompt_tokens"] = n_prompt
        r["n_elements"] = n_elem
    return rows


def format_rows(rows: list[dict]) -> str:
    """Plain-text table of :func:`baseline_rows` output."""
    head = f"{'method':<10} {'bytes':>10} {'bits':>6} {'ratio':>6} {'dNLL':>8} {'KL':>8} {'top1':>6}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['method']:<10} {r['bytes']:>10,d} {r['bits_measured']:>6.2f} {r['ratio_vs_fp16']:>6.2f} "
            f"{r['delta_nll']:>+8.4f} {r['kl_mean']:>8.5f} {r['top1_agreement']:>6.3f}"
        )
    return "\n".join(lines)
