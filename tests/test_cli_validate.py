"""`durastack validate` and `--version` through the real typer app."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
runner = CliRunner()


def test_valid_file_prints_one_line_per_group():
    result = runner.invoke(app, ["validate", "-f", str(EXAMPLES / "replica-groups-service.yml")])
    assert result.exit_code == 0, result.output
    assert "group=replica-1 replicas=0..2 (rps target 2, window 60s)" in result.output
    assert "group=replica-2 replicas=0..3" in result.output


def test_invalid_file_exits_1_with_every_error(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("type: service\nport: 8000\nimage: a\npython: 3.12\nreplicas:\n  - count: 0..2\n    nvcc: true\n")
    result = runner.invoke(app, ["validate", "-f", str(bad)])
    assert result.exit_code == 1
    assert "3 errors" in result.output
    assert "replicas[0].count: a range of replicas (0..2) needs `scaling`" in result.output
    assert "(line 7)" in result.output and "Traceback" not in result.output


def test_json_output_shape(tmp_path):
    result = runner.invoke(app, ["validate", "-f", str(EXAMPLES / "replica-groups-service.yml"), "--json"])
    payload = json.loads(result.output)
    assert payload["valid"] is True and payload["errors"] == []
    assert payload["groups"][1]["name"] == "replica-2"
    assert payload["groups"][1]["replicas"] == {"min": 0, "max": 3}
    assert payload["groups"][1]["scaling"]["target"] == 2
    bad = tmp_path / "bad.yml"
    bad.write_text("type: service\nport: 8000\ncomands: [x]\n")
    result = runner.invoke(app, ["validate", "-f", str(bad), "--json"])
    payload = json.loads(result.output)
    assert result.exit_code == 1 and payload["valid"] is False and payload["groups"] == []
    assert {"path": "comands", "line": 3, "message": "unknown field; did you mean `commands`?"} in payload["errors"]


def test_missing_file_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["validate", "-f", str(tmp_path / "nope.yml")])
    assert result.exit_code == 1 and "no such file" in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("durastack ")
