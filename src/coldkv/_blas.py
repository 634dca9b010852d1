"""Load the system OpenBLAS before MLX so MLX's CPU matmul uses it.

The ``mlx[cpu]`` wheel for Linux links a reference BLAS (~6 GFLOP/s on our 2-core
machines). Its BLAS symbols are resolved dynamically, so a fast BLAS loaded into the
global symbol namespace *before the first* ``import mlx.core`` wins (~33x faster
matmul, see ``bench/bench_blas.py``). Importing mlx first silently loses this.

Switch off with ``COLDKV_NO_OPENBLAS=1``; point at another library with
``COLDKV_OPENBLAS=/path/to/libopenblas.so``.
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

#: Path of the BLAS that was preloaded, or None.
LOADED: str | None = None
#: Why nothing was preloaded (None when something was).
REASON: str | None = None


def preload(quiet: bool = False) -> str | None:
    """Preload the system OpenBLAS (Linux only). Returns its path, or None.

    Idempotent. Prints a one-line hint on stderr when the library is missing,
    unless ``quiet``.
    """
    global LOADED, REASON
    if LOADED is not None:
        return LOADED
    if not sys.platform.startswith("linux"):
        REASON = "not Linux (MLX uses Accelerate/Metal there)"
        return None
    if os.environ.get("COLDKV_NO_OPENBLAS", "").strip() not in ("", "0"):
        REASON = "disabled by COLDKV_NO_OPENBLAS"
        return None
    if "mlx.core" in sys.modules:
        REASON = "mlx.core was imported before coldkv; import coldkv first"
        if not quiet:
            print(f"coldkv: OpenBLAS not preloaded: {REASON}", file=sys.stderr)
        return None
    override = os.environ.get("COLDKV_OPENBLAS")
    for path in ((override,) if override else CANDIDATES):
        if path and os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:  # pragma: no cover - broken install
                REASON = f"could not load {path}: {exc}"
                continue
            LOADED, REASON = path, None
            return path
    REASON = REASON or "system OpenBLAS not found"
    if not quiet:
        print(
            "coldkv: system OpenBLAS not found; MLX matmul will be ~30x slower on CPU. "
            "Install it with: sudo apt-get install libopenblas0-pthread",
            file=sys.stderr,
        )
    return None
