"""The top-level commands: each group's module is imported only when one of its commands runs (cli/main.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import GROUPS, group_commands

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", sorted(GROUPS))
def test_each_group_registers_the_commands_listed_for_it(module):
    assert sorted(group_commands(module).commands) == sorted(GROUPS[module])


def test_a_command_imports_its_own_group_alone():
    code = ("import json, sys; from cli.main import app, GROUPS; app(['apply', '--help'], standalone_mode=False); "
            "print(json.dumps([m for m in sys.modules if m in GROUPS or m == 'aiohttp']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == ["cli.service"]  # no codec server (aiohttp), no store, …
