"""Processes a test starts on 127.0.0.1 (the stand-in SGLang engine among them) and ends, by their PID, itself."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "examples" / "pd-disaggregation" / "engine.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    def __init__(self):
        self.started: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], capture: bool = False) -> subprocess.Popen:
        """``argv`` started; with ``capture``, its stdout readable as text."""
        p = subprocess.Popen(argv, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, text=capture)
        self.started.append(p)
        return p

    def start_engine(self, mode: str, *flags: str, latency: float = 0.02, bootstrap: int = 0,
                     capture: bool = False) -> tuple[int, subprocess.Popen]:
        """The stand-in engine in ``mode`` on a free port (its KV bootstrap port ``bootstrap``, or another free one)."""
        port = free_port()
        argv = [sys.executable, str(ENGINE), "--disaggregation-mode", mode, "--host", "127.0.0.1", "--port",
                str(port), "--disaggregation-bootstrap-port", str(bootstrap or free_port()), "--latency",
                str(latency), *flags]
        return port, self.spawn(argv, capture)

    def stop_all(self) -> None:
        for proc in self.started:  # only what this test started, by its PID
            proc.kill()
            proc.wait()
            if proc.stdout:
                proc.stdout.close()
