"""Local servers for the tests and the acceptance tooling: a free port on 127.0.0.1, waiting
for a server to answer, an `mlflow server` over a sqlite store. Light on purpose (no
Prefect import, which reconfigures logging): tests that read log records use it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, process: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    """Wait until `url` answers 200; fail naming the server's log when it dies or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited ({process.returncode}) before {url} answered: see {log}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s: see {log}")


def mlflow_server(store: Path, cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`mlflow server` on 127.0.0.1 over the sqlite store `store`, once it answers: the
    process and its tracking URI (the caller stops it)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{store}", "--workers", "1"],
        cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        # MLflow's job runner (GenAI jobs, a consumer process per job type) runs nothing here.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", server, Path(f"mlflow server on {store} (output discarded)"))
    return server, url
