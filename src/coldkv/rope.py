"""RoPE settings of a model, and rotation at explicit positions (to undo / redo RoPE on keys).

mlx-lm stores keys **post-RoPE**. To code keys pre-RoPE (WRoPE, DESIGN §1) we must undo the
rotation of each key at its own position and redo it after decoding. ``mx.fast.rope`` only
rotates by increasing positions ``offset + t``; :func:`rotate` takes any position vector
(including negative ones, which is the inverse rotation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import coldkv  # noqa: F401
import mlx.core as mx


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates queries and keys: angle[t, i] = position[t] * scale / wavelengths[i].

    ``kind`` is the mlx-lm class name (``RoPE``, ``Llama3RoPE``, ...). ``wavelengths`` has
    ``dims // 2`` entries. ``traditional`` pairs consecutive features (2i, 2i+1); otherwise
    features (i, i + dims/2) are paired. Features past ``dims`` are not rotated.
    """

    kind: str
    dims: int
    traditional: bool
    scale: float
    base: float | None
    wavelengths: tuple[float, ...]
    supported: bool = True  # False: rotation depends on the sequence (e.g. dynamic NTK)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RopeSpec":
        d = dict(d)
        d["wavelengths"] = tuple(d["wavelengths"])
        return cls(**d)


def rope_spec(rope_module) -> RopeSpec:
    """Read the RoPE settings from an mlx-lm attention module's ``rope`` attribute."""
    kind = type(rope_module).__name__
    dims = int(getattr(rope_module, "dims", getattr(rope_module, "dim", 0)))
    traditional = bool(getattr(rope_module, "traditional", False))
    scale = float(getattr(rope_module, "scale", 1.0))
    freqs = getattr(rope_module, "_freqs", None)
    base = getattr(rope_module, "base", None)
    supported = kind in ("RoPE", "Llama3RoPE", "ProportionalRoPE")
    if freqs is not None:
        wavelengths = tuple(float(f) for f in freqs.tolist())
        base = None
    elif base is not None:
        base = float(base)
        exps = mx.arange(0, dims, 2, dtype=mx.float32) / dims
        wavelengths = tuple(float(f) for f in (base**exps).tolist())
    else:
        wavelengths, supported = (), False
    if kind == "YarnRoPE":  # also scales the input by mscale; rotation itself is standard
        supported = False
    return RopeSpec(kind, dims, traditional, scale, base, wavelengths, supported)


def rotate(x: mx.array, positions: mx.array, spec: RopeSpec) -> mx.array:
    """Rotate ``x`` as RoPE does at the given positions.

    Args:
        x: [..., T, D] vectors (queries or keys), D >= spec.dims.
        positions: [T] positions (float or int; negative positions rotate backwards, so
            ``rotate(rotate(x, p), -p) == x``).
        spec: the model's :class:`RopeSpec`.

    Returns:
        [..., T, D] rotated vectors, same dtype as ``x``.
    """
    if not spec.supported:
        raise NotImplementedError(f"RoPE kind {spec.kind!r} cannot be undone position-wise")
    half = spec.dims // 2
    inv_wl = 1.0 / mx.array(spec.wavelengths, dtype=mx.float32)  # [half]
    theta = positions.astype(mx.float32)[:, None] * (spec.scale * inv_wl)[None, :]  # [T, half]
    cos, sin = mx.cos(theta), mx.sin(theta)
    xf = x.astype(mx.float32)
    rot, rest = xf[..., : spec.dims], xf[..., spec.dims :]
    if spec.traditional:
        pairs = rot.reshape(*rot.shape[:-1], half, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    else:
        a, b = rot[..., :half], rot[..., half:]
        out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    if rest.shape[-1]:
        out = mx.concatenate([out, rest], axis=-1)
    return out.astype(x.dtype)


def unrotate(x: mx.array, positions: mx.array, spec: RopeSpec) -> mx.array:
    """Undo RoPE: pre-RoPE vectors from post-RoPE ones at ``positions`` ([..., T, D] -> same)."""
    return rotate(x, -positions.astype(mx.float32), spec)
