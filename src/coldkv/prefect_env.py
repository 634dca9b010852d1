"""Prefect environment and local infrastructure: settings, a local server, a process worker.

Nothing here imports :mod:`prefect`; the server and the worker run as subprocesses.

``configure()`` must run **before** ``import prefect``: Prefect 3 reads its settings from the
environment once, when it is imported. It fills in only what the user has not set, so a real
``PREFECT_API_URL`` (or ``PREFECT_HOME``, ...) in the environment is respected::

    from coldkv.prefect_env import configure
    configure()                      # PREFECT_HOME=<repo>/.prefect, analytics off, ...
    import prefect

A throw-away server and a worker that runs what is pending once, for tests and scripts::

    with LocalPrefectServer() as api_url:          # http://127.0.0.1:<free port>/api
        ensure_process_pool(api_url, "coldkv")
        ...                                        # deploy, trigger runs
        with ProcessWorker(api_url, "coldkv") as worker:   # prefect worker start --run-once
            worker.wait(timeout=120)

Both context managers start their subprocess in a new session (its own process group) and, on
exit, also when the body raised or start-up failed, send SIGTERM to the group and to every
descendant they saw, then SIGKILL whatever is left after a grace period.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "REPO_ROOT",
    "DEFAULT_HOME",
    "PrefectInfraError",
    "configure",
    "prefect_command",
    "subprocess_env",
    "free_port",
    "ensure_process_pool",
    "LocalPrefectServer",
    "ProcessWorker",
    "run_worker_once",
    "process_tree",
    "terminate_tree",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_HOME = REPO_ROOT / ".prefect"

# Filled in by configure() / subprocess_env() only where the user has not set them.
_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # else the server tries the internet, logs ERROR
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "INFO",
}


class PrefectInfraError(RuntimeError):
    """A Prefect server or worker subprocess that did not start or finish as expected."""


# --------------------------------------------------------------------------- settings


def configure(home: str | Path | None = None) -> dict[str, str]:
    """Set Prefect's environment variables for coldkv; call it before ``import prefect``.

    ``PREFECT_HOME`` becomes ``home`` when given (an explicit argument wins), otherwise
    ``<repo>/.prefect`` unless the user already set it. ``PREFECT_SERVER_ANALYTICS_ENABLED=false``,
    ``DO_NOT_TRACK=1`` and ``PREFECT_LOGGING_LEVEL=INFO`` are set only when unset. Nothing
    else (notably ``PREFECT_API_URL``) is touched: unset means Prefect's ephemeral mode.

    Returns the variables this call changed. Warns when :mod:`prefect` was already imported and
    something changed, since the running process will not see it (subprocesses will).
    """
    changed: dict[str, str] = {}
    if home is not None:
        path = str(Path(home).expanduser().resolve())
        if os.environ.get("PREFECT_HOME") != path:
            changed["PREFECT_HOME"] = path
    elif not os.environ.get("PREFECT_HOME"):
        changed["PREFECT_HOME"] = str(DEFAULT_HOME)
    for key, value in _DEFAULTS.items():
        if not os.environ.get(key):
            changed[key] = value
    os.environ.update(changed)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    if changed and "prefect" in sys.modules:
        warnings.warn(
            "coldkv.prefect_env.configure() ran after `import prefect`; this process keeps the "
            f"settings it imported with (changed now: {sorted(changed)}). Call it first.",
            RuntimeWarning,
            stacklevel=2,
        )
    return changed


def subprocess_env(
    api_url: str | None = None,
    home: str | Path | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment for a Prefect subprocess: ``os.environ`` plus coldkv's defaults.

    ``api_url`` sets ``PREFECT_API_URL`` (``None`` keeps the caller's), ``home`` sets
    ``PREFECT_HOME``; ``extra`` is applied last.
    """
    env = dict(os.environ)
    for key, value in _DEFAULTS.items():
        if not env.get(key):
            env[key] = value
    if not env.get("PREFECT_HOME"):
        env["PREFECT_HOME"] = str(DEFAULT_HOME)
    if home is not None:
        env["PREFECT_HOME"] = str(Path(home).expanduser().resolve())
    if api_url is not None:
        env["PREFECT_API_URL"] = api_url
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def prefect_command(*args: str) -> list[str]:
    """``prefect ARGS...`` run with this interpreter (``python -m prefect``), so the venv's."""
    return [sys.executable, "-m", "prefect", *args]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- processes


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) of every live (non-zombie) process; {} where it can't be read."""
    table: dict[int, tuple[int, int]] = {}
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) >= 3 and fields[0] != "Z":
                table[int(entry.name)] = (int(fields[1]), int(fields[2]))
        return table
    try:  # macOS and other systems without /proc
        out = subprocess.run(
            ["ps", "-A", "-o", "pid=,ppid=,pgid=,stat="],
            capture_output=True, text=True, timeout=10, check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return table
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and not parts[3].startswith("Z"):
            table[int(parts[0])] = (int(parts[1]), int(parts[2]))
    return table


def process_tree(root: int, pgid: int | None = None) -> set[int]:
    """Live (non-zombie) processes in group ``pgid`` (default: ``root``) or descended from
    ``root`` or from a member of that group."""
    if pgid is None:
        pgid = root
    table = _process_table()
    found = {pid for pid, (_, group) in table.items() if group == pgid}
    if root in table:
        found.add(root)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():  # a zombie is as good as gone: it runs nothing and holds no port
        try:
            text = stat.read_text()
            return text[text.rfind(")") + 2 :].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    return True


def _signal(pids: set[int], pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate_tree(proc: subprocess.Popen, grace_period: float = 10.0) -> None:
    """Stop ``proc`` (a session leader), its process group and all its descendants.

    SIGTERM first; whatever is still alive after ``grace_period`` seconds gets SIGKILL. Child
    processes that moved to a session of their own (Prefect runs flows that way) are found by
    parentage and signalled too.
    """
    pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
    seen = process_tree(proc.pid, pgid)
    if proc.poll() is None:
        seen.add(proc.pid)
    if not seen:
        proc.wait()
        return
    _signal(seen, pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader so it does not linger as a zombie
        seen |= process_tree(proc.pid, pgid)
        seen = {pid for pid in seen if _alive(pid)}
        if not seen:
            break
        time.sleep(0.1)
    else:
        _signal(seen, pgid, signal.SIGKILL)
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            proc.poll()
            seen = {pid for pid in seen | process_tree(proc.pid, pgid) if _alive(pid)}
            if not seen:
                break
            _signal(seen, pgid, signal.SIGKILL)
            time.sleep(0.1)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd above
        pass


_LIVE: set[subprocess.Popen] = set()


@atexit.register
def _kill_leftovers() -> None:  # last resort if an interpreter exits inside a `with`
    for proc in list(_LIVE):
        terminate_tree(proc, grace_period=3.0)
        _LIVE.discard(proc)


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(empty log)"


class _Managed:
    """A subprocess in its own session whose output goes to ``log_path``."""

    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    grace_period: float = 10.0

    def _spawn(self, cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        _LIVE.add(proc)
        self.proc = proc
        return proc

    def stop(self) -> None:
        """Terminate the subprocess tree (idempotent)."""
        proc = self.proc
        if proc is None:
            return
        try:
            terminate_tree(proc, self.grace_period)
        finally:
            _LIVE.discard(proc)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)


# --------------------------------------------------------------------------- server


class LocalPrefectServer(_Managed):
    """``prefect server start`` on a free loopback port, for the duration of a ``with`` block.

    ``with LocalPrefectServer() as api_url:`` yields ``http://127.0.0.1:<port>/api`` once
    ``/api/health`` answers. ``home`` is the server's ``PREFECT_HOME`` (its SQLite database and
    ``server.log`` live there); by default a temporary folder, deleted on exit. Start-up that
    takes longer than ``startup_timeout`` s raises :class:`PrefectInfraError` with the last lines
    of the server log. The process group is terminated on exit, whatever happened.

    Attributes once entered: ``api_url``, ``port``, ``home``, ``log_path``, ``pid``, and
    ``env()`` for clients (``PREFECT_API_URL`` set).
    """

    def __init__(
        self,
        home: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 60.0,
        grace_period: float = 10.0,
        ui: bool = False,
        extra_env: Mapping[str, str] | None = None,
        keep_home: bool = False,
    ):
        self._home_arg = home
        self.host = host
        self._port_arg = port
        self.startup_timeout = startup_timeout
        self.grace_period = grace_period
        self.ui = ui
        self.extra_env = dict(extra_env or {})
        self.keep_home = keep_home
        self.home: Path | None = None
        self.port: int | None = None
        self.api_url: str | None = None
        self._tmp_home = False

    def env(self, home: str | Path | None = None, **extra: str) -> dict[str, str]:
        """Environment for a client subprocess of this server (CLI, worker, deploy script)."""
        if self.api_url is None:
            raise PrefectInfraError("the server is not running")
        return subprocess_env(self.api_url, home=home, extra=extra)

    def __enter__(self) -> str:
        if self._home_arg is None:
            self.home = Path(tempfile.mkdtemp(prefix="coldkv-prefect-server-"))
            self._tmp_home = True
        else:
            self.home = Path(self._home_arg).expanduser().resolve()
            self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = self.home / "server.log"
        try:
            self._start()
        except BaseException:
            self._cleanup()
            raise
        return self.api_url  # type: ignore[return-value]

    def _start(self) -> None:
        attempts = 1 if self._port_arg else 3
        for attempt in range(attempts):
            self.port = self._port_arg or free_port(self.host)
            url = f"http://{self.host}:{self.port}"
            env = subprocess_env(
                f"{url}/api",
                home=self.home,
                extra={
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_SERVER_UI_ENABLED": "true" if self.ui else "false",
                    **self.extra_env,
                },
            )
            cmd = prefect_command(
                "server", "start", "--host", self.host, "--port", str(self.port),
                "--ui" if self.ui else "--no-ui", "--analytics-off",
            )
            proc = self._spawn(cmd, env, cwd=self.home)
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if _healthy(f"{url}/api/health"):
                    self.api_url = f"{url}/api"
                    return
                time.sleep(0.2)
            exited = proc.poll()
            log = self.log_tail()
            self.stop()
            if exited is not None and "address already in use" in log.lower() and (
                attempt + 1 < attempts
            ):
                continue  # lost the race for the port: try another one
            what = (
                f"exited with code {exited}"
                if exited is not None
                else f"was not healthy after {self.startup_timeout:.0f} s"
            )
            raise PrefectInfraError(
                f"prefect server on {url} {what}. Last lines of {self.log_path}:\n{log}"
            )

    def _cleanup(self) -> None:
        try:
            self.stop()
        finally:
            self.api_url = None
            if self._tmp_home and not self.keep_home and self.home is not None:
                shutil.rmtree(self.home, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self._cleanup()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# --------------------------------------------------------------------------- worker


def ensure_process_pool(
    api_url: str | None,
    pool: str,
    *,
    home: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> bool:
    """Create work pool ``pool`` of type ``process`` unless it exists. True if created.

    Runs ``prefect work-pool create --type process POOL`` against ``api_url`` (``None``: the
    caller's ``PREFECT_API_URL``).
    """
    proc = subprocess.run(
        prefect_command("--no-prompt", "work-pool", "create", "--type", "process", pool),
        env=subprocess_env(api_url, home=home, extra=env), capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=timeout, check=False,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return True
    if "already exists" in out:
        return False
    raise PrefectInfraError(f"could not create work pool {pool!r} (rc={proc.returncode}):\n{out}")


class ProcessWorker(_Managed):
    """``prefect worker start --pool POOL`` (``--run-once`` by default) in a ``with`` block.

    On entry it makes sure the process pool exists (``create_pool=True``) and starts the worker;
    ``wait(timeout)`` waits for a run-once worker to finish (it runs every flow run that is due
    and exits). On exit the worker's process tree, flow-run subprocesses included, is stopped.
    A long-lived worker (``run_once=False``) polls every ``query_seconds`` until the block ends.
    ``home`` is the worker's ``PREFECT_HOME`` (default: inherited / ``<repo>/.prefect``); its
    output is appended to ``log_path`` (default: ``<PREFECT_HOME>/worker-<pool>.log``). The
    worker runs in ``cwd`` (default: the repo); flow runs change into their deployment's folder.
    """

    def __init__(
        self,
        api_url: str | None,
        pool: str,
        *,
        run_once: bool = True,
        home: str | Path | None = None,
        name: str | None = None,
        query_seconds: float | None = 1.0,
        create_pool: bool = True,
        grace_period: float = 10.0,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        cwd: str | Path | None = None,
    ):
        self.api_url = api_url
        self.pool = pool
        self.run_once = run_once
        self.home = home
        self.name = name
        self.query_seconds = query_seconds
        self.create_pool = create_pool
        self.grace_period = grace_period
        self.extra_env = dict(env or {})
        self.cwd = Path(cwd) if cwd is not None else REPO_ROOT
        self.log_path = Path(log_path) if log_path is not None else None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def __enter__(self) -> ProcessWorker:
        try:
            if self.create_pool:
                ensure_process_pool(self.api_url, self.pool, home=self.home, env=self.extra_env)
            extra = dict(self.extra_env)
            if self.query_seconds is not None:
                extra.setdefault("PREFECT_WORKER_QUERY_SECONDS", str(self.query_seconds))
            env = subprocess_env(self.api_url, home=self.home, extra=extra)
            if self.log_path is None:
                self.log_path = Path(env["PREFECT_HOME"]) / f"worker-{self.pool}.log"
            cmd = ["worker", "start", "--pool", self.pool, "--type", "process"]
            if self.name:
                cmd += ["--name", self.name]
            if self.run_once:
                cmd.append("--run-once")
            self._spawn(prefect_command(*cmd), env, cwd=self.cwd)
        except BaseException:
            self.stop()
            raise
        return self

    def wait(self, timeout: float = 300.0) -> int:
        """Wait for the worker to exit (``run_once=True``); its exit code. Raises on timeout."""
        if self.proc is None:
            raise PrefectInfraError("the worker was not started")
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PrefectInfraError(
                f"worker for pool {self.pool!r} still running after {timeout:.0f} s. "
                f"Last lines of {self.log_path}:\n{self.log_tail()}"
            ) from None

    def __exit__(self, *exc) -> None:
        self.stop()


def run_worker_once(
    api_url: str | None, pool: str, *, timeout: float = 300.0, **kwargs
) -> ProcessWorker:
    """Run ``prefect worker start --pool POOL --run-once`` to completion; the finished worker.

    Raises :class:`PrefectInfraError` (with the worker log) if it fails or times out.
    """
    with ProcessWorker(api_url, pool, run_once=True, **kwargs) as worker:
        code = worker.wait(timeout)
        if code != 0:
            raise PrefectInfraError(
                f"worker for pool {pool!r} exited with code {code}. "
                f"Last lines of {worker.log_path}:\n{worker.log_tail()}"
            )
    return worker
