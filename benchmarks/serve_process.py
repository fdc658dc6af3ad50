"""A `kvcomm serve` process for the serve benchmarks: started here on 127.0.0.1 with the flags
the tests use (embedded SmolLM2, fp32, 32-token blocks, 8 sequences, one OpenMP thread, vLLM's
default process layout), its
log, its worker's RSS, its ``/metrics``, stopped and restarted.

``Server`` keeps every log it wrote (one file per start), so a case can count ``Traceback``
lines over all of them; ``footprint`` is the worker's RSS right after a start, before any
request (vLLM's own footprint: weights, KV cache blocks, Python)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from kvcomm.integrations.serve.replicas import free_port, wait_for_health
from kvcomm.integrations.serve.routes import HEALTH_PROBES  # noqa: F401 (the cases import it from here)

STARTUP_TIMEOUT_S = 600
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""vLLM's default process layout is kept (API server, engine core, worker: each its own
process), as `kvcomm serve` runs unless told otherwise: a request's parameters are pickled on
their way to the worker there (a body nested ~900 deep stopped the engine that way, issue 48)."""


class StartFailed(RuntimeError):
    """`kvcomm serve` exited (or never answered) before serving; ``log_tail`` holds why."""

    def __init__(self, message: str, log_tail: str):
        super().__init__(message)
        self.log_tail = log_tail


class Server:
    """One `kvcomm serve` configuration, started and restarted under ``folder``.

    ``key_argv``: how the API keys reach the command line (``["--api-key", *keys]`` unless
    given: another form of the flags, e.g. ``["--api-key=A", "--api-key=B"]``); ``keys``: the
    keys a client may try (the first is used to read the model's id); ``env``: more environment
    (``VLLM_API_KEY``); ``args``: more `kvcomm serve` flags."""

    def __init__(self, folder: Path, name: str, keys: list[str], *args: str, max_model_len: int = 1024,
                 key_argv: list[str] | None = None, env: dict | None = None):
        self.folder, self.name, self.keys, self.args = Path(folder), name, list(keys), list(args)
        self.max_model_len = max_model_len
        self.key_argv = ["--api-key", *keys] if key_argv is None else key_argv
        self.env = dict(env or {})
        self.logs: list[Path] = []
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.model: str | None = None
        self.footprint = 0
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.logs[-1]

    def start(self) -> Server:
        """Start and wait until ``/health`` answers 200; raises ``StartFailed`` if it exits first."""
        self.starts += 1
        log = self.folder / f"{self.name}-{self.starts}.log"
        self.logs.append(log)
        port = free_port()
        command = [sys.executable, "-m", "kvcomm.cli", "serve", "--gamma", "1", "--port", str(port), "--host",
                   "127.0.0.1", "--max-model-len", str(self.max_model_len), "--block-size", "32", "--max-num-seqs",
                   "8", *self.key_argv, *self.args]
        with log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, **ENV, **self.env})
        self.url = f"http://127.0.0.1:{port}"
        try:
            served = wait_for_health(self.process, self.url, STARTUP_TIMEOUT_S, 2)
        except TimeoutError:
            self.kill()
            raise StartFailed(f"kvcomm serve did not answer within {STARTUP_TIMEOUT_S} s", self.log_tail()) from None
        if served is None:
            raise StartFailed(f"kvcomm serve exited with {self.process.returncode}", self.log_tail())
        self.footprint = worker_rss(self.process.pid)
        self.model = None
        for key in self.keys or [None]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            reply = httpx.get(self.url + "/v1/models", headers=headers, timeout=60)
            if reply.status_code == 200:
                self.model = reply.json()["data"][0]["id"]
                break
        return self

    def alive(self) -> bool:
        """The process runs and ``/health`` answers 200 (vLLM answers 503 once its engine died)."""
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            return httpx.get(self.url + "/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(180)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process = None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            for child in _children(self.process.pid):
                try:
                    child.kill()
                except Exception:  # noqa: BLE001 (gone already)
                    pass
            self.process.kill()
            self.process.wait()

    def restart(self) -> Server:
        if self.process is not None and self.process.poll() is None:
            self.stop()
        self.process = None
        return self.start()

    def log_text(self) -> str:
        """Every log this configuration wrote, in order."""
        return "".join(log.read_text(errors="replace") for log in self.logs if log.exists())

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.logs and self.log.exists() else ""

    def tracebacks(self) -> int:
        return traceback_lines(self.log_text())

    def headers(self, key: str | None) -> dict:
        return {"Authorization": f"Bearer {key}"} if key else {}


SHUTDOWN = re.compile(r"\[shutdown\]|Shutting down")


def traceback_lines(text: str) -> int:
    """``Traceback (most recent call last)`` lines: each is an exception the server did not
    handle. Once the server was told to stop (vLLM's ``[shutdown]`` lines), vLLM's output
    handler sometimes logs the engine core it just stopped as an ``EngineDeadError``: those
    are not counted, every other traceback is."""
    lines = text.splitlines()
    stop = next((n for n, line in enumerate(lines) if SHUTDOWN.search(line)), len(lines))
    count = 0
    for n, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line:
            continue
        block = lines[n + 1: n + 40]
        end = next((i for i, ln in enumerate(block) if re.search(r"\w+(Error|Exception|Exit)\b:", ln)
                    and not ln.split("]", 1)[-1].startswith("   ")), len(block))
        if n > stop and any("EngineDeadError" in ln for ln in block[: end + 1]):
            continue
        count += 1
    return count


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> int:
    """RSS of ``pid`` and all its descendants, bytes."""
    import psutil

    total = 0
    try:
        processes = [psutil.Process(pid), *_children(pid)]
    except psutil.NoSuchProcess:
        return 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def worker_pid(pid: int) -> int | None:
    """The process that holds vLLM's worker under the API server ``pid``: the one vLLM names
    ``VLLM::Worker``, else the engine core (``VLLM::EngineCore``, where the worker runs with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), else the largest child."""
    import psutil

    best, best_rss, found = None, -1, {}
    for child in _children(pid):
        try:
            name = " ".join([child.name(), *child.cmdline()])
            rss = child.memory_info().rss
        except psutil.Error:
            continue
        for role in ("Worker", "EngineCore"):
            if role in name:
                found.setdefault(role, child.pid)
        if rss > best_rss:
            best, best_rss = child.pid, rss
    return found.get("Worker", found.get("EngineCore", best))


def worker_rss(pid: int) -> int:
    """RSS of the worker process under the API server ``pid`` (0 if none found), bytes."""
    import psutil

    found = worker_pid(pid)
    try:
        return psutil.Process(found).memory_info().rss if found else 0
    except psutil.NoSuchProcess:
        return 0


def metric_samples(url: str, key: str, client: httpx.Client | None = None) -> dict[tuple[str, tuple], float]:
    """The server's ``/metrics`` as {(name, sorted label pairs): value}."""
    text = (client or httpx).get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=60).text
    samples = {}
    for line in text.splitlines():
        found = re.match(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if found:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', found.group(2) or "")))
            samples[(found.group(1), labels)] = float(found.group(3))
    return samples
