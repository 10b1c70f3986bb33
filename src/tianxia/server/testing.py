"""Start a real ``tianxia serve`` process on a free local port (tests, benchmarks, examples)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(["smollm2-135m", "--api-key", "k"]) as srv: srv.url ...``"""

    def __init__(
        self, args: list[str], *, startup_timeout: float = 300.0, env: dict | None = None
    ) -> None:
        self.port = free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.args = args
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix="tianxia-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        import httpx

        cmd = [
            sys.executable,
            "-m",
            "tianxia.cli",
            "serve",
            *self.args,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format to ``[(name, labels, value)]``."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first series ``name`` whose labels include ``labels`` (None if absent)."""
    for n, lab, value in parse_metrics(text):
        if n == name and all(lab.get(k) == v for k, v in labels.items()):
            return value
    return None
