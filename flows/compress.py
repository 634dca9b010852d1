"""Flow: for each prompt of a dataset, capture -> H-weighted codes -> zstd shards in the store.

Re-running on unchanged input does no work (task cache keyed by model identity + prompt hash +
codec settings + codebook hash); a changed prompt is recompressed; a failing prompt is retried
(``flow.retries``) and reported while the others still finish.
"""

from __future__ import annotations

import coldkv  # noqa: F401  isort: skip

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from coldkv.config import read_prompts
from coldkv.tasks import (
    cache_stored,
    calibrate_codebooks,
    codebooks_stored,
    compress_prompt,
    config_for,
    model_identity,
)


class CompressFailed(RuntimeError):
    """Some prompts could not be compressed (the others were stored)."""


@flow(name="compress-caches", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def compress_caches(config_path: str = "configs/default.yaml", overrides: dict | None = None) -> list[dict]:
    """Compress every prompt of the config's dataset into the store; returns one row per prompt."""
    cfg = config_for(config_path, overrides)
    prompts = read_prompts(cfg.prompts)
    model_id = model_identity(cfg.model)
    calibrate = calibrate_codebooks.with_options(refresh_cache=not codebooks_stored(config_path, model_id, overrides))
    book_sha = calibrate(config_path, model_id, overrides)
    task = compress_prompt.with_options(retries=cfg.flow.retries, retry_delay_seconds=cfg.flow.retry_delay_seconds)
    futures = [
        task.with_options(refresh_cache=not cache_stored(text, config_path, book_sha, overrides)).submit(
            pid, text, config_path, model_id, book_sha, overrides
        )
        for pid, text in prompts
    ]
    rows, failures = [], []
    for (pid, _), fut in zip(prompts, futures):
        fut.wait()
        state = fut.state
        if state.is_completed():
            rows.append({**fut.result(), "state": state.name})
        else:
            msg = str(fut.result(raise_on_failure=False))
            failures.append(f"{pid}: {msg}")
            rows.append({"prompt": pid, "state": state.name, "error": msg})
    create_table_artifact(key="coldkv-compress", table=rows, description="coldkv compress-caches")
    for row in rows:
        print(row)
    if failures:
        raise CompressFailed(f"{len(failures)} of {len(prompts)} prompts failed: " + "; ".join(failures))
    return rows


if __name__ == "__main__":
    import sys

    compress_caches(*sys.argv[1:2])
