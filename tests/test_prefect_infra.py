"""Prefect infrastructure: deployment specs, prefect.yaml, a local server, a process worker, serve.

The integration tests (marked ``integration``) start a real ``prefect server`` on a free loopback
port and run a tiny stand-in flow written to ``tmp_path``, not coldkv's flows. They check that
every server, worker and flow-run process is gone afterwards, also when the test body raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import yaml

from coldkv import prefect_env
from coldkv.prefect_env import (
    REPO_ROOT,
    LocalPrefectServer,
    PrefectInfraError,
    ProcessWorker,
    process_tree,
    run_worker_once,
)


def _load_deploy_module():
    """flows/deploy.py as a module (flows/ is a script folder, not on sys.path)."""
    name = "coldkv_flows_deploy"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "flows" / "deploy.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while being created
        spec.loader.exec_module(module)
    return sys.modules[name]


deploy = _load_deploy_module()

POOL = "coldkv-test"
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"

TINY_FLOW = '''
import os
import time
from pathlib import Path

from prefect import flow


@flow(name="tiny")
def tiny(out: str, text: str = "hello", sleep: float = 0.0) -> str:
    Path(out).write_text(f"{text}|{os.getpid()}|{os.getcwd()}")
    time.sleep(sleep)
    return out
'''


def _write_tiny(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.py").write_text(TINY_FLOW)
    return folder


@contextlib.contextmanager
def _client(api_url: str, home: Path):
    """This process's Prefect client settings pointed at ``api_url`` (and a tmp PREFECT_HOME)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    home.mkdir(parents=True, exist_ok=True)
    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_HOME: str(home)}):
        yield


def _flow_run_state(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def _assert_gone(pids: set[int], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        alive = {pid for pid in pids if process_tree(pid)}
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not alive, f"{what} still running: {sorted(alive)}"


def _wait_for(predicate, timeout: float, what) -> None:
    """Poll ``predicate``; ``what`` (a string or a callable giving one) names it on timeout."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            what = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


# --------------------------------------------------------------------------- specs, no server


def test_deployment_specs_default_config():
    cron = yaml.safe_load(DEFAULT_CONFIG.read_text())["flow"]["cron"]
    assert cron == "0 2 * * *"
    specs = {s.name: s for s in deploy.deployment_specs("configs/default.yaml")}
    assert list(specs) == ["calibrate", "compress-nightly", "report"]
    assert specs["calibrate"].entrypoint == "flows/calibrate.py:calibrate"
    assert specs["compress-nightly"].entrypoint == "flows/compress.py:compress_caches"
    assert specs["report"].entrypoint == "flows/report.py:compression_report"
    assert specs["compress-nightly"].cron == cron
    assert specs["calibrate"].cron is None and specs["report"].cron is None
    for spec in specs.values():
        assert spec.parameters == {"config_path": "configs/default.yaml"}
        assert spec.path.startswith("flows/") and spec.path.endswith(".py")
    # the absolute path of a config in the repo gives the same repo-relative parameter
    assert deploy.deployment_specs(DEFAULT_CONFIG) == list(specs.values())


@pytest.mark.parametrize("cron", ["30 3 * * 1", None])
def test_deployment_specs_cron_and_path_from_config(tmp_path, cron):
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    prompts = str(REPO_ROOT / "configs" / "prompts" / "default")
    data["prompts"]["path"] = prompts
    data["calibration"]["prompts"]["path"] = prompts
    data["flow"]["cron"] = cron
    config = tmp_path / "nightly.yaml"
    config.write_text(yaml.safe_dump(data))
    specs = {s.name: s for s in deploy.deployment_specs(config)}
    assert specs["compress-nightly"].cron == cron
    assert specs["report"].parameters == {"config_path": str(config.resolve())}


def test_prefect_yaml_declares_the_same_deployments():
    doc = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    declared = {d["name"]: d for d in doc["deployments"]}
    specs = deploy.deployment_specs("configs/default.yaml")
    assert list(declared) == [s.name for s in specs]
    for spec in specs:
        d = declared[spec.name]
        assert d["entrypoint"] == spec.entrypoint
        assert d["parameters"] == spec.parameters
        assert d["work_pool"]["name"] == deploy.DEFAULT_POOL == "coldkv"
        assert [s["cron"] for s in d.get("schedules") or []] == ([spec.cron] if spec.cron else [])
    # the pull step changes into the folder recorded by the build step at deploy time
    (build,) = doc["build"]
    step_id = build["prefect.deployments.steps.run_shell_script"]["id"]
    (pull,) = doc["pull"]
    directory = pull["prefect.deployments.steps.set_working_directory"]["directory"]
    assert directory == "{{ %s.stdout }}" % step_id


def test_deploy_script_runs_as_a_script():
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "flows" / "deploy.py"), "--help"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    assert "--serve" in proc.stdout and "--pool" in proc.stdout


def test_configure_fills_in_only_what_is_unset(monkeypatch, tmp_path):
    keys = ["PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK",
            "PREFECT_LOGGING_LEVEL", "PREFECT_API_URL"]
    for key in keys:
        monkeypatch.delenv(key, raising=False)  # restored after the test
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setattr(prefect_env, "DEFAULT_HOME", tmp_path / "default-home")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # prefect may be imported already
        changed = prefect_env.configure()
    assert changed == {
        "PREFECT_HOME": str(tmp_path / "default-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:9/api"
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "DEBUG"
    assert (tmp_path / "default-home").is_dir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert prefect_env.configure() == {}  # idempotent
        monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "user-home"))
        assert prefect_env.configure() == {}  # the user's PREFECT_HOME wins over the default
        assert prefect_env.configure(tmp_path / "explicit") == {
            "PREFECT_HOME": str((tmp_path / "explicit").resolve())
        }


# --------------------------------------------------------------------------- real server

_module_server_running = False


@pytest.fixture(scope="session")
def server_home(tmp_path_factory):
    """One PREFECT_HOME for the servers of this module, so the database is migrated once."""
    return tmp_path_factory.mktemp("prefect-server")


@pytest.fixture(scope="module")
def prefect_server(server_home):
    global _module_server_running
    server = LocalPrefectServer(home=server_home)
    with server:
        _module_server_running = True
        try:
            yield server
        finally:
            _module_server_running = False
    _assert_gone({server.pid}, "prefect server")


@pytest.mark.integration
def test_processes_are_killed_when_the_body_raises(tmp_path, server_home):
    """Server, long-lived worker and the flow-run process it started all die on an exception."""
    from prefect.deployments import run_deployment

    # runs first in this module: reuse the shared home unless the module's server is using it
    home = tmp_path / "server" if _module_server_running else server_home
    src = _write_tiny(tmp_path / "src")
    out = tmp_path / "started.txt"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    server = LocalPrefectServer(home=home)
    worker = None

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with server as api_url:
            with _client(api_url, tmp_path / "client"):
                deploy.ensure_work_pool("coldkv-kill")
                spec = deploy.DeploymentSpec(
                    name="tiny-sleeps", entrypoint="tiny.py:tiny",
                    parameters={"out": str(out), "sleep": 300},
                )
                dep_id = deploy.deploy_spec(spec, work_pool_name="coldkv-kill", source=src)
                run_deployment(dep_id, timeout=0)
            worker = ProcessWorker(
                api_url, "coldkv-kill", run_once=False, create_pool=False,
                home=tmp_path / "worker", grace_period=5,
                env={"TMPDIR": str(tmpdir)},  # a killed flow run leaves its temp folders
            )
            with worker:
                _wait_for(
                    out.exists, 90, lambda: f"the flow run; worker log:\n{worker.log_tail()}"
                )
                _wait_for(lambda: out.read_text().count("|") == 2, 5, "the flow's pid")
                flow_pid = int(out.read_text().split("|")[1])
                assert process_tree(flow_pid), "the flow run should be running now"
                assert worker.proc.poll() is None
                raise Boom
    _assert_gone({server.pid}, "prefect server")
    _assert_gone({worker.pid}, "prefect worker")
    _assert_gone({flow_pid}, "flow-run process")


@pytest.mark.integration
def test_server_startup_failure_reports_log_and_cleans_up(tmp_path):
    server = LocalPrefectServer(home=tmp_path / "slow", startup_timeout=0.5)
    with pytest.raises(PrefectInfraError, match="was not healthy after") as info:
        with server:
            pytest.fail("the body must not run")
    assert "server.log" in str(info.value)
    assert server.api_url is None
    _assert_gone({server.pid}, "prefect server")


@pytest.mark.integration
def test_deploy_to_process_pool_and_run_with_worker(prefect_server, tmp_path):
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment

    api_url = prefect_server.api_url
    src = _write_tiny(tmp_path / "src")
    out = tmp_path / "out.txt"
    spec = deploy.DeploymentSpec(
        name="tiny-pool", entrypoint="tiny.py:tiny",
        parameters={"out": str(out), "text": "from-worker"},
    )
    with _client(api_url, tmp_path / "client"):
        deploy.ensure_work_pool(POOL)
        assert deploy.ensure_work_pool(POOL) is False  # idempotent
        dep_id = deploy.deploy_spec(spec, work_pool_name=POOL, source=src)
        flow_run = run_deployment(dep_id, timeout=0)
        assert flow_run.state.type == StateType.SCHEDULED

        # creates the pool with the CLI first (already there: fine), then runs what is due
        worker = run_worker_once(api_url, POOL, home=tmp_path / "worker", timeout=120)
        state = _flow_run_state(flow_run.id)
    assert state.type == StateType.COMPLETED, worker.log_tail()
    text, pid, cwd = out.read_text().split("|")
    assert text == "from-worker"
    assert Path(cwd).resolve() == src.resolve()  # the pull step changed into the source folder
    assert worker.returncode == 0
    _assert_gone({worker.pid, int(pid)}, "worker or flow-run process")


@pytest.mark.integration
def test_served_deployment_runs_once(prefect_server, tmp_path, monkeypatch):
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.runner import Runner

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # Runner's runner_storage/

    src = _write_tiny(tmp_path / "src")
    out = tmp_path / "served.txt"
    spec = deploy.DeploymentSpec(
        name="tiny-served", entrypoint="tiny.py:tiny",
        parameters={"out": str(out), "text": "served"},
    )

    async def serve_once(deployment):
        runner = Runner(name="coldkv-test-runner", query_seconds=1)
        dep_id = await runner.aadd_deployment(deployment)
        flow_run = await run_deployment(dep_id, timeout=0)
        await runner.start(run_once=True)
        return flow_run.id

    result = {}

    def in_thread():  # off the main thread, so the Runner installs no SIGTERM handler in pytest
        try:
            # the code path of `flows/deploy.py --serve` (sync: outside the event loop)
            deployment = deploy.runner_deployment(spec, source=src)
            result["id"] = asyncio.run(serve_once(deployment))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            result["error"] = exc

    with _client(prefect_server.api_url, tmp_path / "client"):
        thread = threading.Thread(target=contextvars.copy_context().run, args=(in_thread,))
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "Runner.start(run_once=True) did not return"
        if "error" in result:
            raise result["error"]
        state = _flow_run_state(result["id"])
    assert state.type == StateType.COMPLETED
    assert out.read_text().split("|")[0] == "served"


@pytest.mark.integration
def test_prefect_yaml_deploys_with_the_cli(prefect_server, tmp_path):
    """`prefect --no-prompt deploy --all` with the repo's prefect.yaml, on stand-in flows."""
    from prefect.client.orchestration import get_client

    project = tmp_path / "project"
    (project / "flows").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "prefect.yaml", project / "prefect.yaml")
    specs = deploy.deployment_specs("configs/default.yaml")
    for spec in specs:
        (project / spec.path).write_text(textwrap.dedent(f"""
            from prefect import flow

            @flow(name="standin-{spec.name}")
            def {spec.function}(config_path: str = "configs/default.yaml"):
                return config_path
        """))
    env = prefect_server.env(home=tmp_path / "cli")
    declared = {}
    with _client(prefect_server.api_url, tmp_path / "client"):
        deploy.ensure_work_pool("coldkv")
        proc = subprocess.run(
            prefect_env.prefect_command("--no-prompt", "deploy", "--all"),
            cwd=project, env=env, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Warning" not in proc.stderr, proc.stderr
        with get_client(sync_client=True) as client:
            for spec in specs:
                d = client.read_deployment_by_name(f"standin-{spec.name}/{spec.name}")
                assert d.entrypoint == spec.entrypoint
                assert d.parameters == spec.parameters
                assert d.work_pool_name == "coldkv"
                assert d.pull_steps == [{
                    "prefect.deployments.steps.set_working_directory": {
                        "directory": str(project.resolve())
                    }
                }]
                crons = [s.schedule.cron for s in d.schedules]
                assert crons == ([spec.cron] if spec.cron else [])
                declared[spec.name] = d

        # flows/deploy.py's path (flow.from_source(...).deploy) makes the same deployments
        ids = deploy.deploy_all("configs/default.yaml", work_pool_name="coldkv", source=project)
        with get_client(sync_client=True) as client:
            for spec in specs:
                assert ids[spec.name] == declared[spec.name].id
                d = client.read_deployment(ids[spec.name])
                for attr in ("entrypoint", "parameters", "work_pool_name", "pull_steps"):
                    assert getattr(d, attr) == getattr(declared[spec.name], attr), attr
                assert [s.schedule.cron for s in d.schedules] == (
                    [spec.cron] if spec.cron else []
                )


@pytest.mark.integration
@pytest.mark.model
def test_compress_deployment_runs_on_a_process_worker_and_fills_the_store(prefect_server, tmp_path):
    """coldkv's real compress deployment, from the repo, run by a process worker on a tiny config."""
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment

    from coldkv.store import Store

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "one.txt").write_text("The orchard keeper pruned the apple trees before the first frost.")
    (prompts / "two.txt").write_text("Every evening the ferry crossed the bay with two cars and a dog.")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "model": "default",
        "prompts": {"path": "prompts"},
        "calibration": {"prompts": {"path": str(REPO_ROOT / "configs/prompts/default")}, "max_tokens_per_prompt": 128},
        "codec": {"preset": "default", "key_bits": 4, "value_bits": 4, "kmeans_iters": 2, "recent": 8},
        "storage": {"root": "store"},
    }))  # fmt: skip
    spec = next(s for s in deploy.deployment_specs(config) if s.name == "compress-nightly")
    assert spec.entrypoint == "flows/compress.py:compress_caches" and spec.cron
    with _client(prefect_server.api_url, tmp_path / "client"):
        deploy.ensure_work_pool(POOL)
        dep_id = deploy.deploy_spec(spec, work_pool_name=POOL, source=REPO_ROOT)
        flow_run = run_deployment(dep_id, timeout=0)
        worker = run_worker_once(prefect_server.api_url, POOL, home=tmp_path / "worker", timeout=300)
        state = _flow_run_state(flow_run.id)
    assert state.type == StateType.COMPLETED, worker.log_tail()
    store = Store(tmp_path / "store")
    assert sorted(m.meta["name"] for m in store.list_caches()) == ["one", "two"]
    assert not store.verify()
    _assert_gone({worker.pid}, "prefect worker")
