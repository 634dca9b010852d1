"""Declare coldkv's Prefect deployments: to a process work pool, or served from this process.

    python flows/deploy.py [--config configs/default.yaml] [--pool coldkv] [--serve]

Three deployments, each run with ``config_path`` as its only parameter:

==================  ======================================  ===========================
name                entrypoint                              schedule
==================  ======================================  ===========================
calibrate           flows/calibrate.py:calibrate            none
compress-nightly    flows/compress.py:compress_caches       ``flow.cron`` of the config
report              flows/report.py:compression_report      none
==================  ======================================  ===========================

Without ``--serve`` the flows are deployed with ``flow.from_source(<repo>, entrypoint).deploy()``
to the process work pool ``--pool`` (created if missing); a worker started with
``prefect worker start --pool coldkv`` runs them in the repo folder. With ``--serve`` the same
deployments are served by this process (``prefect.serve``) until Ctrl+C; no worker needed.

Point it at a server with ``PREFECT_API_URL``; unset, Prefect uses its ephemeral mode and the
deployments land in the database under ``PREFECT_HOME`` (``<repo>/.prefect``).

``prefect.yaml`` at the repo root declares the same deployments for ``prefect deploy --all``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

from coldkv.prefect_env import REPO_ROOT, configure

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

DEFAULT_CONFIG = "configs/default.yaml"
DEFAULT_POOL = "coldkv"


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment: its name, ``file.py:function`` entrypoint (relative to the source folder),
    cron schedule (``None``: run on demand only) and default parameters."""

    name: str
    entrypoint: str
    cron: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    description: str | None = None
    tags: tuple[str, ...] = ("coldkv",)

    @property
    def path(self) -> str:
        """The flow's file, relative to the source folder."""
        return self.entrypoint.rsplit(":", 1)[0]

    @property
    def function(self) -> str:
        return self.entrypoint.rsplit(":", 1)[1]


def _resolve_config(config_path: str | Path) -> tuple[Path, str]:
    """(file to read, value of the ``config_path`` parameter).

    A relative path is taken from the current folder if it exists there, else from the repo
    root. The parameter is repo-relative when the file is inside the repo (the flows run with
    the repo as working folder), else absolute.
    """
    path = Path(config_path).expanduser()
    if not path.is_absolute():
        path = path if path.exists() else REPO_ROOT / path
    path = path.resolve()
    try:
        param = path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        param = str(path)
    return path, param


def deployment_specs(config_path: str | Path = DEFAULT_CONFIG) -> list[DeploymentSpec]:
    """The three coldkv deployments for ``config_path`` (validated; its ``flow.cron`` is the
    nightly schedule). Does not import the flows or Prefect."""
    from coldkv.config import load_config

    path, param = _resolve_config(config_path)
    cfg = load_config(path)
    params = {"config_path": param}
    return [
        DeploymentSpec(
            name="calibrate",
            entrypoint="flows/calibrate.py:calibrate",
            parameters=dict(params),
            description="Capture calibration prompts, fit H and the codebooks.",
        ),
        DeploymentSpec(
            name="compress-nightly",
            entrypoint="flows/compress.py:compress_caches",
            cron=cfg.flow.cron,
            parameters=dict(params),
            description="Capture and compress the configured prompts' KV caches into the store.",
        ),
        DeploymentSpec(
            name="report",
            entrypoint="flows/report.py:compression_report",
            parameters=dict(params),
            description="Fidelity, size and speed report of the compressed caches.",
        ),
    ]


def ensure_work_pool(pool: str = DEFAULT_POOL) -> bool:
    """Create the process work pool ``pool`` on the current API unless it exists; True if
    created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(
                WorkPoolCreate(
                    name=pool,
                    type="process",
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                )
            )
        except ObjectAlreadyExists:
            return False
    return True


def deploy_spec(
    spec: DeploymentSpec,
    *,
    work_pool_name: str = DEFAULT_POOL,
    source: str | Path = REPO_ROOT,
    job_variables: dict[str, Any] | None = None,
) -> UUID:
    """``flow.from_source(source, spec.entrypoint).deploy(...)`` to ``work_pool_name``; the
    deployment id. ``source`` is the folder a worker runs the flow in (the repo by default)."""
    from prefect import Flow

    flow = Flow.from_source(str(Path(source).resolve()), spec.entrypoint)
    return flow.deploy(
        name=spec.name,
        work_pool_name=work_pool_name,
        parameters=spec.parameters,
        cron=spec.cron,
        description=spec.description,
        tags=list(spec.tags),
        job_variables=job_variables,
        print_next_steps=False,
        ignore_warnings=True,  # "process pool: consider .serve()": we offer both on purpose
    )


def deploy_all(
    config_path: str | Path = DEFAULT_CONFIG,
    *,
    work_pool_name: str = DEFAULT_POOL,
    source: str | Path = REPO_ROOT,
    create_pool: bool = True,
) -> dict[str, UUID]:
    """Deploy every spec of ``config_path`` to the work pool; {deployment name: id}."""
    if create_pool:
        ensure_work_pool(work_pool_name)
    return {
        spec.name: deploy_spec(spec, work_pool_name=work_pool_name, source=source)
        for spec in deployment_specs(config_path)
    }


def runner_deployment(spec: DeploymentSpec, *, source: str | Path = REPO_ROOT) -> RunnerDeployment:
    """A deployment for ``prefect.serve`` / ``Runner.add_deployment`` (no work pool)."""
    from prefect import Flow

    flow = Flow.from_source(str(Path(source).resolve()), spec.entrypoint)
    return flow.to_deployment(
        name=spec.name,
        parameters=spec.parameters,
        cron=spec.cron,
        description=spec.description,
        tags=list(spec.tags),
    )


def serve_all(
    config_path: str | Path = DEFAULT_CONFIG,
    *,
    source: str | Path = REPO_ROOT,
    limit: int | None = 1,
) -> None:
    """Serve every spec of ``config_path`` from this process until interrupted."""
    from prefect import serve

    serve(
        *[runner_deployment(spec, source=source) for spec in deployment_specs(config_path)],
        limit=limit,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flows/deploy.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (%(default)s)")
    parser.add_argument("--pool", default=DEFAULT_POOL, help="process work pool (%(default)s)")
    parser.add_argument(
        "--serve", action="store_true", help="serve the deployments from this process instead"
    )
    parser.add_argument(
        "--limit", type=int, default=1, help="with --serve: concurrent runs (%(default)s)"
    )
    args = parser.parse_args(argv)

    configure()  # before prefect is imported: PREFECT_HOME, analytics off (user's values win)
    specs = deployment_specs(args.config)  # fail early on a bad config
    if args.serve:
        serve_all(args.config, limit=args.limit)
        return 0
    ids = deploy_all(args.config, work_pool_name=args.pool)
    for spec in specs:
        when = f"cron {spec.cron!r}" if spec.cron else "on demand"
        print(f"deployed {spec.name:<17} {spec.entrypoint:<40} {when}  id={ids[spec.name]}")
    print(f"\nrun them with a worker:  prefect worker start --pool {args.pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
