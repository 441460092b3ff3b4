"""`durastack apply` against a real `durastack server`: one update-with-start per apply, so re-applying is a
no-op that says so, and applies racing for one service each get a deployment of their own and say which."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e import BIN, Stack, running_stack

pytestmark = pytest.mark.e2e

SERVICE = """
type: service
name: {name}
port: 8000
auth: false
env:
  VERSION: "{version}"
replicas:
  - name: web
    count: 1
    commands: [python3 -m http.server 8000]
    resources: {{cpu: 1, memory: 1GB..}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)


def write(tmp_path: Path, name: str, version: str) -> Path:
    path = tmp_path / f"{name}-{version}.yml"
    path.write_text(SERVICE.format(name=name, version=version))
    return path


def deployment(output: str) -> int:
    """The deployment an apply reports: 0 when it submitted the service."""
    if "Submitted" in output:
        return 0
    found = re.search(r"deployment (\d+)", output)
    assert found, output
    return int(found.group(1))


def running_version(stack: Stack, name: str) -> str:
    result = stack.cli("config", name, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["env"]["VERSION"]


def apply_together(stack: Stack, files: list[Path]) -> list[subprocess.CompletedProcess]:
    """Start one `durastack apply -y -d` per file at once, then wait for all of them."""
    procs = [subprocess.Popen([str(BIN / "durastack"), "apply", "-f", str(f), "-y", "--detach"], env=stack.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for f in files]
    results = []
    for p, f in zip(procs, files):
        out, err = p.communicate(timeout=180)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def check_truthful(results: list[subprocess.CompletedProcess]) -> list[int]:
    """Each apply exited 0 with a deployment of its own; only one that was not the next says it came after
    another apply, and then names the one before it."""
    for r in results:
        assert r.returncode == 0, r.stdout + r.stderr
    numbers = [deployment(r.stdout) for r in results]
    assert len(set(numbers)) == len(numbers), [r.stdout for r in results]
    for r, n in zip(results, numbers):
        after = re.search(r"applied after deployment (\d+) from another apply", r.stdout)
        assert after is None or int(after.group(1)) == n - 1, r.stdout
        if n == min(numbers):
            assert after is None, r.stdout  # the first one applied came after no other
    return numbers


def test_reapplying_the_running_file_changes_nothing(stack: Stack, tmp_path: Path):
    file = write(tmp_path, "again", "1")
    first = stack.cli("apply", "-f", str(file), "-y", "--detach")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Submitted" in first.stdout
    second = stack.cli("apply", "-f", str(file), "-y", "--detach")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "no changes" in second.stdout and "Submitted" not in second.stdout
    changed = stack.cli("apply", "-f", str(write(tmp_path, "again", "2")), "-y", "--detach")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert deployment(changed.stdout) == 1 and "another apply" not in changed.stdout
    # Back to the first file: a change again (the same file over another deployment is another update).
    back = stack.cli("apply", "-f", str(file), "-y", "--detach")
    assert back.returncode == 0, back.stdout + back.stderr
    assert deployment(back.stdout) == 2 and running_version(stack, "again") == "1"
    assert stack.cli("stop", "again", "-y").returncode == 0


def test_the_same_file_applied_after_a_stop_starts_the_service_again(stack: Stack, tmp_path: Path):
    """Temporal keeps a closed run's update answers: the second apply must not get the first one's back."""
    file = write(tmp_path, "revived", "1")
    for _ in range(2):
        result = stack.cli("apply", "-f", str(file), "-y")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Submitted" in result.stdout
        assert stack.ps("revived")["groups"][0]["replicas"][-1]["status"] == "running"
        assert stack.cli("stop", "revived", "-y").returncode == 0


def test_concurrent_applies_of_a_new_service_make_one_run(stack: Stack, tmp_path: Path):
    files = [write(tmp_path, "fresh", "a"), write(tmp_path, "fresh", "b")]
    results = apply_together(stack, files)
    numbers = check_truthful(results)
    assert sorted(numbers) in ([0, 1], [1, 2])  # [1, 2]: the other update reached the new run first
    last = files[numbers.index(max(numbers))]
    assert running_version(stack, "fresh") == last.stem.split("-")[-1]
    assert stack.cli("stop", "fresh", "-y").returncode == 0


def test_concurrent_applies_to_a_running_service_are_serialized(stack: Stack, tmp_path: Path):
    base = stack.cli("apply", "-f", str(write(tmp_path, "race", "0")), "-y", "--detach")
    assert base.returncode == 0, base.stdout + base.stderr
    files = [write(tmp_path, "race", "b"), write(tmp_path, "race", "c")]
    results = apply_together(stack, files)
    numbers = check_truthful(results)
    assert sorted(numbers) == [1, 2]
    last = files[numbers.index(max(numbers))]
    assert running_version(stack, "race") == last.stem.split("-")[-1]
    assert stack.cli("stop", "race", "-y").returncode == 0
