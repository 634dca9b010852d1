"""Flow: the compression-ratio and fidelity report, as files and a Prefect markdown artifact."""

from __future__ import annotations

import coldkv  # noqa: F401  isort: skip

from pathlib import Path

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.artifacts import create_markdown_artifact

from coldkv.tasks import build_report_task


@flow(name="compression-report", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def compression_report(
    config_path: str = "configs/default.yaml", out: str | None = None, quick: bool = True,
    overrides: dict | None = None,
) -> str:  # fmt: skip
    """Write report.md / report.json / plots; publish report.md as an artifact. Returns the folder."""
    folder = build_report_task(config_path, out, quick, overrides)
    md = Path(folder) / "report.md"
    create_markdown_artifact(key="coldkv-report", markdown=md.read_text(), description=f"coldkv report ({md})")
    print(f"report written to {md}")
    return folder


if __name__ == "__main__":
    import sys

    compression_report(*sys.argv[1:2])
