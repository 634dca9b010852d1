"""Flow: the whole batch job on one config: calibrate -> compress the prompts -> report."""

from __future__ import annotations

import coldkv  # noqa: F401  isort: skip

from prefect import flow

from flows.calibrate import calibrate
from flows.compress import compress_caches
from flows.report import compression_report
from coldkv.tasks import config_for, task_runner


@flow(name="coldkv-pipeline", log_prints=True)
def pipeline(config_path: str = "configs/default.yaml", overrides: dict | None = None, quick_report: bool = True) -> dict:
    """Run the three stages as subflows; returns where everything went."""
    cfg = config_for(config_path, overrides)
    sha = calibrate(config_path, overrides)
    rows = compress_caches.with_options(task_runner=task_runner(cfg))(config_path, overrides)
    folder = compression_report(config_path, None, quick_report, overrides)
    return {"codebooks": sha, "caches": rows, "report": folder, "store": cfg.storage.root}


if __name__ == "__main__":
    import sys

    print(pipeline(*sys.argv[1:2]))
