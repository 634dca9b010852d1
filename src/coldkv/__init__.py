"""coldkv: cold storage for LLM KV caches (A2ATS query-aware VQ, zstd safetensors)."""

# Must run before anything imports mlx.core: see coldkv/_blas.py.
from coldkv import _blas

_blas.preload()

__version__ = "0.1.0"
