"""`app.py` started on a free loopback port, for the browser tests and the load test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # (the repository: tests/support/ is two below)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(log: Path, env: dict[str, str] | None = None, startup_s: float = 240) -> Iterator[str]:
    """Start `app.py` (its output in `log`, `env` on top of this process's), wait until it answers, yield its
    URL; stop it on exit. The first start converts the GGUF (~25 s on a quiet machine)."""
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + startup_s
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"app.py exited with {proc.returncode}; see {log}")
                try:
                    urllib.request.urlopen(f"{url}/gradio_api/info", timeout=5).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"app.py did not start in {startup_s} s; see {log}")
                    time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
