"""bench/scale_out.py runs against today's workflows: its worker registers every activity they call, and its
services reach serving, are watched, and are watched again after the worker is killed.

The bench is not run by CI otherwise, and once stopped working unnoticed when the service started calling a
new local activity (every service's first workflow task failed, so no replica ever started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_scale_out_runs_two_services_to_the_end():
    done = subprocess.run([sys.executable, "-m", "bench.scale_out", "--services", "2", "--settle", "1", "--idle", "2",
                           "--timeout", "120"], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "scale out: 2 services × 3 groups × 2 replicas = 12 replica workflows" in done.stdout
    assert "all watches running again" in done.stdout and "Temporal dev server" in done.stdout
