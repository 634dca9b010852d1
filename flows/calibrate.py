"""Flow: calibration prompts -> post-RoPE queries -> H per (layer, KV head) -> codebooks in the store."""

from __future__ import annotations

import coldkv  # noqa: F401  isort: skip

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.artifacts import create_markdown_artifact

from coldkv.tasks import calibrate_codebooks, codebooks_stored, config_for, model_identity


@flow(name="calibrate", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def calibrate(config_path: str = "configs/default.yaml", overrides: dict | None = None) -> str:
    """Train (or find) the codebook set the config asks for; returns its sha256 in the store."""
    cfg = config_for(config_path, overrides)
    model_id = model_identity(cfg.model)
    stored = codebooks_stored(config_path, model_id, overrides)
    sha = calibrate_codebooks.with_options(refresh_cache=not stored)(config_path, model_id, overrides)
    create_markdown_artifact(
        key="coldkv-codebooks",
        markdown=f"codebooks `{sha}` for model `{model_id[:12]}` in `{cfg.storage.root}`",
        description="coldkv calibration",
    )
    return sha


if __name__ == "__main__":
    import sys

    print(calibrate(*sys.argv[1:2]))
