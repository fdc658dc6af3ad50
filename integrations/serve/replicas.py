"""A local deployment: N `kvcomm serve` replicas and `vllm-router` in front, started, checked and stopped together.

    python -m kvcomm.integrations.serve.replicas --replicas 2 --port 8000 --logs ./replicas-logs \\
        [--policy consistent_hash] [--state-dir ./replicas-state] [-- any `kvcomm serve` flags]

Each replica is ``kvcomm serve`` on 127.0.0.1 and a free port of its own (its log
``LOGS/replica-<i>.log``; with ``--state-dir``, its state in ``STATE/replica-<i>/``); the router
(``vllm-router``, the ``replicas`` extra: ``pip install 'kvcomm[replicas]'``) listens on
``--port`` with ``--policy`` (default ``consistent_hash``: a team's calls, keyed by their
``X-Session-ID``, on one replica) and health-checks every replica each
``--health-interval`` seconds (``LOGS/router.log``). The command returns when every replica
answers ``/health`` and the router answers too, prints the router's URL, and serves until
SIGINT or SIGTERM; then it stops the router and every replica (SIGTERM: each saves its state;
SIGKILL after ``STOP_TIMEOUT_S``). A replica that fails to start stops everything, and its log's
tail is printed. ``Replicas`` is the same deployment in Python (the replica benchmark and the
tests use it), with ``kill(i)`` (SIGKILL of replica ``i``'s process tree) and ``restart(i)``.

The same layout on a cluster: each replica a pod (a Deployment or StatefulSet of `kvcomm serve`
with a persistent volume for ``--state-dir``), the router a Deployment of its own with
``--service-discovery --selector app=kvcomm`` instead of ``--worker-urls``; docs/serving.md says how
this maps to the production-stack Helm chart.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

POLICIES = ("consistent_hash", "cache_aware", "round_robin", "power_of_two", "random")
STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 150
"""Longer than `kvcomm serve`'s own shutdown budget with ``--state-dir`` (90 s), so a save at exit is never cut short."""


class DeploymentError(RuntimeError):
    """A replica or the router did not start; the message names which and ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_binary() -> str:
    """The ``vllm-router`` executable: next to this Python's, else on ``PATH``."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if not found:
        raise DeploymentError("vllm-router is not installed: pip install 'kvcomm[replicas]' (vllm-router==0.1.17 from PyPI)")
    return found


def _tree(pid: int) -> list:
    import psutil

    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class Replica:
    """One `kvcomm serve` process of the deployment. ``url``: ``http://host:port`` (the port is
    kept across restarts, so the router's worker list stays valid); ``starts``: how often started."""

    def __init__(self, index: int, folder: Path, serve_args: list[str], host: str, state_dir: Path | None, env: dict[str, str]):
        self.index, self.folder, self.serve_args, self.host = index, folder, list(serve_args), host
        self.state_dir, self.env = state_dir, dict(env)
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log = folder / f"replica-{index}.log"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def launch(self) -> None:
        """Start the process (not waiting for it to serve); the log is appended to across restarts."""
        self.starts += 1
        command = [sys.executable, "-m", "kvcomm.cli", "serve", "--host", self.host, "--port", str(self.port), *self.serve_args]
        if self.state_dir is not None:
            command += ["--state-dir", str(self.state_dir)]
        with self.log.open("a") as out:
            out.write(f"\n=== replica {self.index}, start {self.starts}: {' '.join(command)}\n")
            out.flush()
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                            start_new_session=True)

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Seconds until ``/health`` answered 200; ``DeploymentError`` if the process exits first or the time runs out."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise DeploymentError(f"replica {self.index} exited with {code} before serving:\n{_tail(self.log)}")
            if self.healthy():
                return time.monotonic() - began
            time.sleep(1)
        raise DeploymentError(f"replica {self.index} did not answer /health within {timeout_s:.0f} s:\n{_tail(self.log)}")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the replica's whole process tree (API server, engine core, worker), as a crash would."""
        if self.process is None:
            return
        for process in reversed(_tree(self.process.pid)):
            try:
                process.kill()
            except Exception:  # noqa: BLE001 (gone already)
                pass
        self.process.wait()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (vLLM shuts down; `kvcomm serve` saves its state), SIGKILL of the tree after ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            self.kill()  # reaps what a dead API server left
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


class Replicas:
    """``count`` `kvcomm serve` replicas behind ``vllm-router --policy policy``, logs in ``folder``.

    Use as a context manager (``with Replicas(...) as deployment:``): ``start`` on entry, ``stop``
    on exit, whatever happened. ``url``: the router's. ``serve_args``: more `kvcomm serve` flags for
    every replica; ``state_dir``: a folder holding ``replica-<i>/`` per replica; ``env``: more
    environment for the replicas. ``health_interval_s``: the router's health-check period; one
    failed check takes a replica out, one passed check brings it back."""

    def __init__(self, folder: str | Path, count: int = 2, *, policy: str = "consistent_hash", serve_args: list[str] = (),
                 port: int | None = None, host: str = "127.0.0.1", state_dir: str | Path | None = None,
                 env: dict[str, str] | None = None, health_interval_s: int = 1, router_args: list[str] = ()):
        if count < 1:
            raise ValueError(f"count must be >= 1 replica (got {count})")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {policy!r})")
        if health_interval_s < 1:
            raise ValueError(f"health_interval_s must be >= 1 (got {health_interval_s})")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.policy, self.host, self.health_interval_s = policy, host, int(health_interval_s)
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.router_log = self.folder / "router.log"
        self.router_args = list(router_args)
        self.router: subprocess.Popen | None = None
        states = Path(state_dir) if state_dir is not None else None
        self.replicas = [Replica(i, self.folder, list(serve_args), host, states / f"replica-{i}" if states else None, env or {})
                         for i in range(count)]

    def __enter__(self) -> Replicas:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *_) -> None:
        self.stop()

    def start(self) -> Replicas:
        """Start every replica (at once), wait until each answers ``/health``, then start the router and wait for it."""
        for replica in self.replicas:
            replica.launch()
        for replica in self.replicas:
            replica.wait_healthy()
        self.start_router()
        return self

    def start_router(self, policy: str | None = None, replicas: list[int] | None = None) -> None:
        """Start the router (``policy``: another than the deployment's; ``replicas``: in front of
        these replicas only) and wait until it answers ``/health``; ``stop_router`` first if one runs."""
        if policy is not None:
            if policy not in POLICIES:
                raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {policy!r})")
            self.policy = policy
        workers = [self.replicas[i].url for i in (range(len(self.replicas)) if replicas is None else replicas)]
        command = [router_binary(), "--host", self.host, "--port", str(self.port), "--policy", self.policy,
                   "--worker-urls", *workers,
                   "--health-check-interval-secs", str(self.health_interval_s), "--health-failure-threshold", "1",
                   "--health-success-threshold", "1", "--health-check-timeout-secs", "5",
                   "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port(self.host)),
                   "--prometheus-host", self.host, *self.router_args]
        with self.router_log.open("a") as out:
            out.write(f"\n=== router: {' '.join(command)}\n")
            out.flush()
            self.router = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        began = time.monotonic()
        while time.monotonic() - began < 120:
            if self.router.poll() is not None:
                raise DeploymentError(f"vllm-router exited with {self.router.returncode}:\n{_tail(self.router_log)}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise DeploymentError(f"vllm-router did not answer /health within 120 s:\n{_tail(self.router_log)}")

    def kill(self, index: int) -> None:
        """SIGKILL replica ``index`` (its whole process tree); the router's next health check takes it out."""
        self.replicas[index].kill()

    def restart(self, index: int) -> float:
        """Start replica ``index`` again (same port, same ``--state-dir``); seconds until it answers
        ``/health`` (it restores its saved state before that), plus the router's next check."""
        replica = self.replicas[index]
        replica.kill()
        began = time.monotonic()
        replica.launch()
        replica.wait_healthy()
        time.sleep(self.health_interval_s + 1)  # the router's next check brings it back
        return time.monotonic() - began

    def stop_router(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        self.router = None

    def stop(self) -> None:
        """Stop the router, then every replica (each in a thread of its own: they save at once)."""
        self.stop_router()
        threads = [threading.Thread(target=replica.stop) for replica in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m kvcomm.integrations.serve.replicas", description=__doc__.split("\n")[0],
                                     epilog="Flags after -- go to every `kvcomm serve` replica.")
    parser.add_argument("--replicas", type=int, default=2, help="how many `kvcomm serve` replicas (default 2)")
    parser.add_argument("--policy", choices=POLICIES, default="consistent_hash", help="vllm-router's policy (default consistent_hash)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="where the router and the replicas listen (default 127.0.0.1)")
    parser.add_argument("--logs", default="replicas-logs", help="the folder for every log (default ./replicas-logs)")
    parser.add_argument("--state-dir", default=None, help="each replica keeps its state in STATE_DIR/replica-<i>/")
    parser.add_argument("--health-interval", type=int, default=1, help="seconds between the router's health checks (default 1)")
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1 (got {args.replicas})")
    deployment = Replicas(args.logs, args.replicas, policy=args.policy, serve_args=serve_args, port=args.port, host=args.host,
                          state_dir=args.state_dir, health_interval_s=args.health_interval)
    stopping, failed = threading.Event(), []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        deployment.start()
        print(f"vllm-router ({args.policy}) at {deployment.url} in front of "
              f"{', '.join(r.url for r in deployment.replicas)}; logs in {deployment.folder}/. Ctrl-C stops them all.", flush=True)
        while not stopping.wait(5):
            for replica in deployment.replicas:
                if not replica.alive():
                    print(f"replica {replica.index} exited ({replica.process.returncode}); see {replica.log}", flush=True)
                    failed.append(replica.index)
                    stopping.set()
    except DeploymentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        deployment.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
