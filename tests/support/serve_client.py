"""Start a `kvcomm serve` subprocess for tests and talk to it over HTTP (standard library only)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    keys: tuple[str, ...]
    log: Path
    model: str = ""

    def request(self, method: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict | str]:
        """(HTTP status, parsed JSON or text) of one request; ``key``: bearer API key."""
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        text = raw.decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def complete(self, token_ids: list[int], key: str, max_tokens: int = 8, kvcomm: dict | None = None, **extra) -> dict:
        """POST /v1/completions for a token-id prompt, greedy; returns the JSON response (raises on non-200)."""
        body = {"model": self.model, "prompt": list(token_ids), "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, **extra}
        if kvcomm is not None:
            body["kv_transfer_params"] = {"kvcomm": kvcomm}
        status, reply = self.request("POST", "/v1/completions", body, key)
        if status != 200:
            raise AssertionError(f"HTTP {status}: {reply}")
        return reply

    def stop(self, timeout_s: float = 150) -> int:
        """SIGTERM (vLLM shuts down gracefully), SIGKILL after ``timeout_s`` (longer than `kvcomm serve`'s
        own shutdown budget with --state-dir, so a save at exit is never cut short here); returns the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(log: Path, keys: tuple[str, ...], *args: str, multiprocess: bool = False) -> Server:
    """`python -m kvcomm.cli serve` with test settings; waits for /health and /v1/models.
    ``keys``: vLLM's ``--api-key`` values; empty: no key at all (keyless mode, no authentication).
    ``multiprocess``: vLLM's default engine (its worker in a process of its own, the
    environment variable unset); False: the worker in the engine-core process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    port = free_port()
    command = [sys.executable, "-m", "kvcomm.cli", "serve", "--gamma", "1", "--port", str(port),
               "--host", "127.0.0.1", "--max-model-len", "1024", "--block-size", "32", "--max-num-seqs", "8",
               *(("--api-key", *keys) if keys else ()), *args]
    # One OpenMP thread: on a small shared CPU, threads waiting at barriers for a descheduled
    # sibling make each forward many times slower.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if not multiprocess:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    handle = open(log, "w")
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", keys, log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvcomm serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            status, _ = server.request("GET", "/health")
        except OSError:
            status = 0
        if status == 200:
            status, models = server.request("GET", "/v1/models", key=keys[0] if keys else None)
            server.model = models["data"][0]["id"]
            return server
        time.sleep(2)
    server.stop()
    raise RuntimeError(f"kvcomm serve did not answer /health within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
