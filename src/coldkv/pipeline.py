"""``coldkv run``: the whole pipeline through Prefect's flows, with its embedded server.

No server needs starting by hand: with ``PREFECT_API_URL`` unset, Prefect runs the flows
against a temporary local server (ephemeral mode). Set ``PREFECT_API_URL`` to use a real one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import coldkv  # noqa: F401

from coldkv.prefect_env import REPO_ROOT, configure


def run_pipeline(config_path: str, store: str | None = None, model: str | None = None, quick_report: bool = True) -> int:
    """Run calibrate -> compress -> report on ``config_path``; prints where the report is."""
    configure()
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from flows.pipeline import pipeline

    overrides = {}
    if store:
        overrides["storage.root"] = store if "://" in store else str(Path(store).resolve())
    if model:
        overrides["model"] = model
    t0 = time.perf_counter()
    result = pipeline(str(Path(config_path).resolve()), overrides or None, quick_report)
    seconds = time.perf_counter() - t0
    print()
    print(f"coldkv pipeline finished in {seconds:.0f} s")
    for row in result["caches"]:
        print(f"  {row['prompt']:<16} {row['cache_id']}  {row['tokens']:>5} tokens  "
              f"{row['bytes'] / 1e3:8.1f} KB  {row['ratio']:.1f}x vs fp16  [{row['state']}]")  # fmt: skip
    print(f"store:  {result['store']}")
    print(f"report: {Path(result['report']) / 'report.md'}")
    return 0
