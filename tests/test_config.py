"""Service configuration: shapes, value syntax, every validation rule, errors with paths and lines."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from models.loader import MAX_FILE_BYTES, load_config_file, load_config_text
from models.service import ServiceConfiguration
from rules.addresses import late

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(text: str):
    return load_config_text(textwrap.dedent(text))


def ok(text: str) -> ServiceConfiguration:
    result = load(text)
    assert result.errors == [], [str(e) for e in result.errors]
    assert result.config is not None
    return result.config


def errors(text: str) -> list[str]:
    result = load(text)
    assert result.config is None
    return [str(e) for e in result.errors]


def one_error(text: str) -> str:
    errs = errors(text)
    assert len(errs) == 1, errs
    return errs[0]


BASE = "type: service\nport: 8000\n"


# --- shapes -----------------------------------------------------------------------------------

def test_seed_example_has_two_named_autoscaled_groups():
    result = load_config_file(EXAMPLES / "replica-groups-service.yml")
    assert result.valid
    cfg = result.config
    assert cfg.name == "replica-groups-test" and cfg.python == "3.12"
    groups = cfg.replica_groups
    assert [g.name for g in groups] == ["replica-1", "replica-2"]
    assert [(g.count.min, g.count.max) for g in groups] == [(0, 2), (0, 3)]
    assert all(g.scaling.target == 2 and g.scaling.window == 60 for g in groups)
    assert groups[0].commands[0] == 'echo "Group 1 - Version 0" > /tmp/version.txt'
    assert groups[1].resources.cpu.count.min == 2


def test_pd_example_is_valid_with_router_and_gpu_groups():
    cfg = load_config_file(EXAMPLES / "pd-disaggregation-service.yml").config
    assert [g.name for g in cfg.replica_groups] == ["0", "1", "2"]
    assert cfg.replica_groups[0].router.type == "dynamo"
    assert cfg.replica_groups[2].resources.gpu.count.min == 1
    assert cfg.env["HF_TOKEN"] is None and cfg.env["MODEL_ID"] == "meta-llama/Llama-3.2-3B-Instruct"
    assert cfg.effective_probes()[0].url == "/v1/chat/completions"


def test_head_shape_groups_with_replicas_key():
    cfg = ok(BASE + """
        groups:
          - name: prefill
            replicas: 1
            commands: [a]
          - replicas: 0..4
            count: 9
            scaling: {metric: rps, target: 1.5}
            commands: [b]
        """.replace("\n        ", "\n"))
    assert [g.name for g in cfg.replica_groups] == ["prefill", "1"]
    assert cfg.replica_groups[1].count.max == 4  # `replicas` wins over `count`


def test_homogeneous_service_gets_implicit_group_zero():
    cfg = ok(BASE + "replicas: 0..2\nscaling: {metric: rps, target: 3}\ncommands: [serve]\n")
    (group,) = cfg.replica_groups
    assert group.name == "0" and (group.count.min, group.count.max) == (0, 2)
    assert group.commands == ["serve"] and group.scaling.target == 3


def test_default_count_is_one():
    (group,) = ok(BASE + "commands: [serve]\n").replica_groups
    assert (group.count.min, group.count.max) == (1, 1)


def test_dump_and_revalidate_is_a_fixed_point():
    cfg = load_config_file(EXAMPLES / "pd-disaggregation-service.yml").config
    dumped = cfg.model_dump(mode="json")
    again = ServiceConfiguration.model_validate(dumped)
    assert again == cfg
    assert again.model_dump(mode="json") == dumped


def test_input_dict_is_not_modified():
    from models.loader import load_config_data
    data = {"type": "service", "port": 80, "replicas": [{"count": 1, "commands": ["a"]}]}
    load_config_data(data)
    assert data == {"type": "service", "port": 80, "replicas": [{"count": 1, "commands": ["a"]}]}


# --- value syntax -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, lo, hi", [("2", 2, 2), ("'0..2'", 0, 2), ("..3", 0, 3), ("'1..4'", 1, 4)])
def test_replica_ranges(text, lo, hi):
    scaling = "" if lo == hi else "scaling: {metric: rps, target: 1}\n"
    (g,) = ok(BASE + f"replicas: {text}\n{scaling}commands: [x]\n").replica_groups
    assert (g.count.min, g.count.max) == (lo, hi)


@pytest.mark.parametrize("text, seconds", [("30s", 30), ("1m", 60), ("5m", 300), (300, 300)])
def test_scaling_window_durations(text, seconds):
    cfg = ok(BASE + f"replicas: 0..2\nscaling: {{metric: rps, target: 1, window: {text}, "
                    f"scale_up_delay: 1h, scale_down_delay: 90}}\ncommands: [x]\n")
    assert cfg.scaling.window == seconds
    assert cfg.scaling.scale_up_delay == 3600 and cfg.scaling.scale_down_delay == 90


def test_scaling_defaults():
    cfg = ok(BASE + "replicas: 0..2\nscaling: {metric: rps, target: 1}\ncommands: [x]\n")
    assert (cfg.scaling.window, cfg.scaling.scale_up_delay, cfg.scaling.scale_down_delay) == (60, 300, 600)


def test_resources_forms():
    cfg = ok(BASE + """commands: [x]
resources:
  cpu: arm:8
  memory: 16GB..
  disk: 200GB
  gpu: H100,A100:80GB:1..2
""")
    r = cfg.resources
    assert r.cpu.arch == "arm" and r.cpu.count.min == 8
    assert r.memory.min == 16 and r.memory.max is None
    assert r.disk.min == r.disk.max == 200
    assert r.gpu.name == ["H100", "A100"] and r.gpu.memory.min == 80 and (r.gpu.count.min, r.gpu.count.max) == (1, 2)
    assert r.gpu.effective_vendor() == "nvidia"


def test_gpu_mapping_form_and_plain_count():
    r = ok(BASE + "commands: [x]\nresources: {gpu: {name: [L4], count: 2, memory: 24GB}}\n").resources
    assert r.gpu.name == ["L4"] and r.gpu.count.min == 2
    r = ok(BASE + "commands: [x]\nresources: {gpu: 2}\n").resources
    assert r.gpu.name is None and r.gpu.count.min == r.gpu.count.max == 2
    r = ok(BASE + "commands: [x]\nresources: {gpu: '24GB..'}\n").resources
    assert r.gpu.memory.min == 24 and r.gpu.count.min == 1 and r.gpu.count.max is None


def test_env_forms(monkeypatch):
    cfg = ok(BASE + "commands: [x]\nenv: [A=1, B, C=x=y]\n")
    assert cfg.env == {"A": "1", "B": None, "C": "x=y"}
    cfg = ok(BASE + "commands: [x]\nenv: {A: 1, B: null, C: text}\n")
    assert cfg.env == {"A": "1", "B": None, "C": "text"}


def test_python_float_310_reads_as_310():
    assert ok(BASE + "commands: [x]\npython: 3.10\n").python == "3.10"
    assert ok(BASE + "commands: [x]\npython: '3.11'\n").python == "3.11"
    assert "python" in one_error(BASE + "commands: [x]\npython: 2.7\n")


@pytest.mark.parametrize("port, container", [("8000", 8000), ("'80:8000'", 8000), ("{container_port: 9000}", 9000)])
def test_port_forms(port, container):
    cfg = ok(f"type: service\nport: {port}\ncommands: [x]\n")
    assert cfg.port.container_port == container


def test_model_string_gives_default_probe_and_empty_list_disables_it():
    cfg = ok(BASE + "commands: [x]\nmodel: llama\n")
    (probe,) = cfg.effective_probes()
    assert probe.method == "post" and probe.timeout == 30 and '"llama"' in probe.body
    assert ok(BASE + "commands: [x]\nmodel: llama\nprobes: []\n").effective_probes() == []


# --- validation rules ----------------------------------------------------------------

def test_v1_max_required_min_defaults_to_zero_and_order():
    assert "maximum number of replicas is required" in one_error(
        BASE + "replicas: '1..'\nscaling: {metric: rps, target: 1}\ncommands: [x]\n")
    assert "invalid range order" in one_error(BASE + "replicas: 3..1\ncommands: [x]\n")
    assert "greater than or equal to 0" in one_error(BASE + "replicas: -1\ncommands: [x]\n")


def test_v2_range_needs_scaling_in_group():
    msg = one_error(BASE + "replicas:\n  - count: 0..2\n    commands: [x]\n")
    assert msg.startswith("replicas[0].count:") and "needs `scaling`" in msg and msg.endswith("(line 4)")


def test_v3_scaling_needs_range():
    msg = one_error(BASE + "replicas: 2\nscaling: {metric: rps, target: 1}\ncommands: [x]\n")
    assert msg.startswith("scaling:") and "needs a range" in msg


def test_v4_fixed_zero_is_accepted_with_a_warning():
    result = load(BASE + "replicas: 0\ncommands: [x]\n")
    assert result.valid and "never starts" in str(result.warnings[0])


def test_v5_empty_group_list():
    assert one_error(BASE + "replicas: []\n").startswith("replicas: `groups` cannot be an empty list")
    assert one_error(BASE + "groups: []\n").startswith("groups: `groups` cannot be an empty list")


def test_v6_names_regex_and_uniqueness():
    msg = one_error(BASE + "replicas:\n  - name: Bad_Name\n    count: 1\n    commands: [x]\n")
    assert msg.startswith("replicas[0].name:") and "line 4" in msg
    msg = one_error(BASE + "replicas:\n  - count: 1\n    commands: [x]\n  - name: '0'\n    count: 1\n    commands: [y]\n")
    assert "duplicate replica group names found: ['0']" in msg


def test_v7_v8_top_level_scaling_and_commands_with_groups():
    errs = errors(BASE + "commands: [x]\nscaling: {metric: rps, target: 1}\n"
                         "replicas:\n  - count: 1\n    commands: [y]\n")
    assert any(e.startswith("scaling: top-level `scaling` is not allowed") for e in errs)
    assert any(e.startswith("commands: top-level `commands` is not allowed") for e in errs)


def test_v9_top_level_resources_allowed_with_groups_but_warned():
    result = load(BASE + "resources: {gpu: 1}\nreplicas:\n  - count: 1\n    commands: [y]\n")
    assert result.valid and str(result.warnings[0]).startswith("resources: ignored")


def test_v10_homogeneous_needs_commands_or_image():
    assert "either `commands` or `image`" in one_error(BASE)
    ok(BASE + "image: vllm/vllm-openai\n")


def test_v11_group_needs_commands_or_image():
    msg = one_error(BASE + "python: 3.12\nreplicas:\n  - count: 1\n    nvcc: true\n")
    assert msg.startswith("replicas[0]: replica group '0': either `commands` or `image`")
    ok(BASE + "image: alpine\nreplicas:\n  - count: 1\n")


@pytest.mark.parametrize("a, b", [("image: x", "python: '3.11'"), ("image: x", "docker: true"),
                                  ("python: '3.11'", "docker: true"), ("nvcc: true", "docker: true"),
                                  ("image: x", "nvcc: true")])
def test_v12_mutually_exclusive_within_group(a, b):
    msg = one_error(BASE + f"replicas:\n  - count: 1\n    commands: [c]\n    {a}\n    {b}\n")
    assert "mutually exclusive within a replica group" in msg and msg.startswith("replicas[0].")


def test_v12_python_and_nvcc_allowed_in_group():
    ok(BASE + "replicas:\n  - count: 1\n    commands: [c]\n    python: '3.11'\n    nvcc: true\n")


def test_v13_docker_with_privileged_false():
    msg = one_error(BASE + "replicas:\n  - count: 1\n    commands: [c]\n    docker: true\n    privileged: false\n")
    assert msg.startswith("replicas[0].privileged:") and "(line 7)" in msg
    ok(BASE + "replicas:\n  - count: 1\n    commands: [c]\n    docker: true\n")


@pytest.mark.parametrize("service, group", [("image: a", "image: a"), ("docker: true", "docker: false"),
                                            ("privileged: true", "privileged: true"),
                                            ("python: '3.11'", "python: '3.11'"), ("nvcc: true", "nvcc: false"),
                                            ("spot_policy: spot", "spot_policy: auto"),
                                            ("reservation: r1", "reservation: r1")])
def test_v14_set_in_one_place_only(service, group):
    errs = errors(BASE + f"{service}\nreplicas:\n  - count: 1\n    commands: [c]\n  - count: 1\n"
                         f"    commands: [d]\n    {group}\n")
    field = group.split(":")[0]
    assert any(e.startswith(f"replicas[1].{field}: `{field}` is set at both the service level") for e in errs), errs


def test_v14_false_booleans_at_service_level_do_not_count():
    ok(BASE + "nvcc: false\nreplicas:\n  - count: 1\n    commands: [c]\n    nvcc: true\n")
    ok(BASE + "docker: false\nreplicas:\n  - count: 1\n    commands: [c]\n    docker: true\n")


@pytest.mark.parametrize("service, group", [("image: a", "docker: true"), ("image: a", "python: '3.12'"),
                                            ("image: a", "nvcc: false"), ("docker: true", "image: b"),
                                            ("docker: true", "nvcc: true"), ("python: '3.11'", "image: b"),
                                            ("python: '3.11'", "docker: true"), ("nvcc: true", "image: b")])
def test_v15_cross_level_conflicts(service, group):
    errs = errors(BASE + f"{service}\nreplicas:\n  - count: 1\n    commands: [c]\n    {group}\n")
    field = group.split(":")[0]
    assert any(e.startswith(f"replicas[0].{field}: service-level") for e in errs), errs


def test_v15_allowed_cross_level_pairs():
    ok(BASE + "python: '3.11'\nreplicas:\n  - count: 1\n    commands: [c]\n    nvcc: true\n")
    ok(BASE + "nvcc: true\nreplicas:\n  - count: 1\n    commands: [c]\n    python: '3.12'\n")


def test_v16_service_level_exclusions_and_image_with_nvcc():
    assert one_error(BASE + "image: a\npython: '3.11'\n").startswith("python: `image` and `python`")
    assert one_error(BASE + "image: a\nnvcc: true\n").startswith("nvcc: `image` and `nvcc: true`")
    assert "docker: true" in one_error(BASE + "commands: [x]\npython: '3.11'\ndocker: true\n")


def test_group_privileged_false_under_service_docker():
    msg = one_error(BASE + "docker: true\nreplicas:\n  - count: 1\n    commands: [c]\n    privileged: false\n")
    assert msg.startswith("replicas[0].privileged:") and "service-level `docker: true`" in msg


def test_v17_router_rules():
    errs = errors(BASE + "replicas:\n  - count: 2\n    commands: [c]\n    router: {type: sglang}\n"
                         "  - count: 1\n    commands: [d]\n    router: {type: dynamo}\n")
    assert any(e.startswith("replicas[0].count: the replica group with `router` must have exactly 1") for e in errs)
    assert any(e.startswith("replicas[1].router: at most one replica group") for e in errs)


def test_v18_scaling_fields():
    assert "window must be one of" in one_error(BASE + "replicas: 0..2\nscaling: {metric: rps, target: 1, window: 45s}\ncommands: [x]\n")
    engine = BASE + "replicas: 0..2\nscaling: {{metric: queue, target: 1, window: {}}}\ncommands: [x]\n"
    # an engine is read every second: a window shorter than the gateway's is its own
    assert load(engine.format("10s")).config.replica_groups[0].scaling.window == 10
    assert one_error(engine.format("4s")).startswith("scaling.window: window of an engine metric must be "
                                                     "from `5s` to `300s`")
    assert "window of an engine metric" in one_error(engine.format("10m"))
    assert one_error(BASE + "replicas: 0..2\nscaling: {metric: rps, target: 0}\ncommands: [x]\n").startswith("scaling.target:")
    assert one_error(BASE + "replicas: 0..2\nscaling: {metric: cpu, target: 1}\ncommands: [x]\n").startswith("scaling.metric:")


def test_v19_probes_and_rate_limit_prefixes_unique():
    errs = errors(BASE + "commands: [x]\nprobes: [{type: http, url: /h}, {type: http, url: /h}]\n"
                         "rate_limits: [{prefix: /a, rps: 1}, {prefix: /a, rps: 2}]\n")
    assert any(e.startswith("probes[1]: probes must be unique") for e in errs)
    assert any(e.startswith("rate_limits: prefixes ['/a']") for e in errs)


def test_probe_limits():
    assert "timeout" in one_error(BASE + "commands: [x]\nprobes: [{type: http, timeout: 10m}]\n")
    probes = ", ".join(f"{{type: http, url: /p{i}}}" for i in range(11))
    assert "at most 10 probes" in one_error(BASE + f"commands: [x]\nprobes: [{probes}]\n")
    assert "body" in one_error(BASE + "commands: [x]\nprobes: [{type: http, body: x}]\n")


def test_service_name_regex():
    assert one_error(BASE + "name: Bad\ncommands: [x]\n").startswith("name: must match")


# --- error reporting ------------------------------------------------------------------------------

def test_several_mistakes_are_all_reported_with_lines():
    errs = errors("""type: service
port: 8000
image: alpine
python: 3.12
replicas:
  - count: 1
    commands: [x]
    nvcc: true
  - count: 0..3
    comands: [y]
  - count: 1
    resources:
      gpu: A100:2:3
""")
    assert "replicas[1].comands: unknown field; did you mean `commands`? (line 10)" in errs
    assert any(e.startswith("replicas[2].resources.gpu:") and e.endswith("(line 13)") for e in errs)
    assert "python: `image` and `python` are mutually exclusive fields (line 4)" in errs
    assert any(e.startswith("replicas[0].nvcc: service-level `image` conflicts") for e in errs)
    assert any(e.startswith("replicas[1].count:") and "(line 9)" in e for e in errs)


def test_wrong_type_names_field_and_line():
    msg = one_error(BASE + "commands: [x]\nauth: maybe\n")
    assert msg.startswith("auth:") and msg.endswith("(line 4)")
    msg = one_error(BASE + "commands: x\n")
    assert msg.startswith("commands:") and "list" in msg


def test_missing_required_field():
    assert one_error("type: service\ncommands: [x]\n").startswith("port: required field is missing")


def test_unknown_top_level_field():
    assert one_error(BASE + "commands: [x]\nreplica: 2\n").startswith("replica: unknown field; did you mean `replicas`?")


def test_bad_yaml_reports_line():
    msg = one_error("type: service\nport: [8000\ncommands: x\n")
    assert msg.startswith("invalid YAML") and "(line" in msg


def test_duplicate_key_is_an_error():
    assert "invalid YAML" in one_error(BASE + "port: 9000\ncommands: [x]\n")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_document(text):
    assert "must be a mapping" in one_error(text)


def test_empty_file():
    assert "empty" in one_error("")


def test_other_run_type_is_refused():
    assert one_error("type: task\ncommands: [x]\n").startswith("type: durastack runs services")


def test_ten_megabyte_file_is_refused(tmp_path):
    path = tmp_path / "big.yml"
    path.write_text(BASE + "commands:\n" + "  - echo hi\n" * (10 * 1024 * 1024 // 12))
    result = load_config_file(path)
    assert result.config is None and "at most 1024 KiB" in str(result.errors[0])
    assert path.stat().st_size > MAX_FILE_BYTES


def test_alias_bomb_is_refused_quickly():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 12):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        bomb += f"{cur}: &{cur} [{', '.join(['*' + prev] * 10)}]\n"
    assert "aliases" in one_error(bomb)


def test_missing_file(tmp_path):
    result = load_config_file(tmp_path / "nope.yml")
    assert "no such file" in str(result.errors[0])


# --- bounded input, control characters, fields nothing honours ---------------------------------------

def test_replica_counts_are_bounded_per_group_and_per_service():
    assert one_error(BASE + "commands: [x]\n\nreplicas: 10000\n") == \
        "replicas: at most 64 replicas per group are allowed, got 10000 (line 5)"
    assert "at most 64 replicas per group" in one_error(BASE + "commands: [x]\nreplicas: 0..65\n"
                                                        "scaling: {metric: rps, target: 1}\n")
    ok(BASE + "commands: [x]\nreplicas: 64\n")
    groups = "".join(f"  - {{name: g{i}, replicas: 64, commands: [x]}}\n" for i in range(5))
    assert one_error(BASE + "groups:\n" + groups) == ("groups: the groups' maximum replica counts add up to 320; "
                                                      "at most 256 replicas per service are allowed (line 3)")
    groups = "".join(f"  - {{name: g{i}, replicas: 1, commands: [x]}}\n" for i in range(33))
    assert one_error(BASE + "groups:\n" + groups).startswith("groups: at most 32 replica groups are allowed, got 33")


def test_command_and_env_sizes_are_bounded():
    assert one_error(BASE + "commands: [x]\n" + "env:\n" + "".join(f"  V{i}: x\n" for i in range(129))) \
        .startswith("env: at most 128 variables are allowed, got 129")
    assert one_error(BASE + f"commands: ['{'x' * 16385}']\n").startswith(
        "commands[0]: is 16385 bytes long; at most 16384 bytes are allowed")
    assert one_error(BASE + "commands: [" + ", ".join(["x"] * 65) + "]\n").startswith(
        "commands: at most 64 commands are allowed, got 65")
    five = ", ".join([f"'{'x' * 16000}'"] * 5)
    assert one_error(BASE + f"groups:\n  - {{name: a, replicas: 1, commands: [{five}]}}\n").startswith(
        "groups[0].commands: the commands add up to 80000 bytes; at most 65536 bytes per group")
    env = "".join(f"  V{i}: '{'x' * 16000}'\n" for i in range(5))
    assert one_error(BASE + "commands: [x]\nenv:\n" + env).startswith(
        "env: names and values add up to")
    three = ", ".join([f"'{'x' * 16000}'"] * 3)
    groups = "".join(f"  - {{name: g{i}, replicas: 1, commands: [{three}]}}\n" for i in range(6))
    assert "at most 262144 bytes per service" in one_error(BASE + "groups:\n" + groups)


def test_validate_command_refuses_ten_thousand_replicas(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app
    bad = tmp_path / "big.yml"
    bad.write_text(BASE + "commands: [x]\nreplicas: 10000\n")
    result = CliRunner().invoke(app, ["validate", "-f", str(bad)])
    assert result.exit_code == 1
    assert "replicas: at most 64 replicas per group are allowed, got 10000 (line 4)" in result.output


def test_control_characters_are_refused_with_the_field_path():
    errs = errors(BASE + 'commands: ["echo a\\0b", "echo \\e[2J"]\nenv:\n  A: "x\\x01"\n  B: "a\\rb"\n'
                         'image: "img\\nx"\nname: "ab\\n"\n')
    assert "commands[0]: contains the control character U+0000 at character 7; only tab and newline may appear " \
           "here (line 3)" in errs
    assert any(e.startswith("commands[1]: contains the control character U+001B") for e in errs)
    assert any(e.startswith("env.A: contains the control character U+0001") and e.endswith("(line 5)") for e in errs)
    assert any(e.startswith("env.B: contains the control character U+000D") for e in errs)
    assert any(e.startswith("image: contains the control character U+000A") for e in errs)
    assert any(e.startswith("name: must match") for e in errs)  # `$` no longer lets a final newline through
    assert "groups[0].name: must match" in one_error(BASE + 'groups:\n  - {name: "a\\n", replicas: 1, commands: [x]}\n')
    assert one_error(BASE + 'commands: [x]\nprobes: [{type: http, headers: [{name: X, value: "a\\r\\nB: c"}]}]\n') \
        .startswith("probes[0].headers[0].value: contains the control character U+000D")


def test_multi_line_commands_tabs_and_multi_line_env_values_are_fine():
    cfg = ok(BASE + "commands:\n  - |\n    echo a\n    echo\tb\nenv:\n  CERT: \"-----BEGIN-----\\nabc\\n\"\n")
    assert cfg.commands == ["echo a\necho\tb\n"] and cfg.env["CERT"].count("\n") == 2


def test_every_invalid_env_name_is_reported_at_its_line():
    errs = errors(BASE + "commands: [x]\nenv:\n  A-B: 1\n  OK: 2\n  9X: 3\n  C D: 4\n")
    assert [e.split(":")[0] for e in errs] == ["env.A-B", "env.9X", "env.C D"]
    assert errs[0].endswith("(line 5)") and errs[1].endswith("(line 7)") and errs[2].endswith("(line 8)")
    assert len(errors(BASE + "commands: [x]\nenv: [A-B=1, OK=2, 9X=3]\n")) == 2


def test_env_names_that_steer_the_dynamic_loader_or_libc_are_refused_at_their_line():
    errs = errors(BASE + "commands: [x]\nenv:\n  LD_PRELOAD: /tmp/x.so\n  OK: 2\n  GCONV_PATH: /tmp\n"
                         "  LD_LIBRARY_PATH: /opt/lib\n  GLIBC_TUNABLES: x\n")
    assert [e.split(":")[0] for e in errs] == ["env.LD_PRELOAD", "env.GCONV_PATH", "env.LD_LIBRARY_PATH",
                                               "env.GLIBC_TUNABLES"]
    assert errs[0].startswith("env.LD_PRELOAD: LD_PRELOAD changes what the dynamic loader or libc loads")
    assert errs[0].endswith("(line 5)") and errs[1].endswith("(line 7)")
    assert "export LD_PRELOAD=" in errs[0]
    assert [e.split(":")[0] for e in errors(BASE + "commands: [x]\nenv: [A=1, LD_AUDIT=/a.so, LOCPATH=/l]\n")] == \
        ["env.LD_AUDIT", "env.LOCPATH"]
    # names that merely look alike, and the app's own settings glibc also drops for setuid programs, are fine
    assert ok(BASE + "commands: [x]\nenv: [OLD_PATH=1, MALLOC_ARENA_MAX=2, TMPDIR=/t, TZDIR=/z]\n").env["TMPDIR"]


def test_https_without_a_certificate_is_refused():
    assert one_error(BASE + "commands: [x]\nhttps: true\n").startswith("https: `https: true` needs a TLS certificate")


def test_gateway_settings_it_does_honour_are_accepted():
    ok(BASE + "commands: [x]\nstrip_prefix: true\nhttps: false\n")
    ok(BASE + "commands: [x]\nhttps: auto\n")  # no domain: plain HTTP, which is what auto means then
    cfg = ok(BASE + "commands: [x]\nstrip_prefix: false\npass_authorization: true\nrate_limits:\n"
                    "  - {prefix: /, rps: 0.5, burst: 3}\n  - {prefix: /v1/chat, key: {type: header, header: X-Key}, rps: 10}\n")
    assert not cfg.strip_prefix and cfg.pass_authorization
    assert [(r.prefix, r.key.type, r.burst) for r in cfg.rate_limits] == [("/", "ip_address", 3), ("/v1/chat", "header", 0)]


@pytest.mark.parametrize("limit, message, line", [
    ("{prefix: '/a;b', rps: 1}", "rate_limits[0].prefix: a prefix may hold", 5),
    ("{prefix: v1, rps: 1}", "rate_limits[0].prefix:", 5),
    ("{rps: 0}", "rate_limits[0].rps:", 5),
    ("{rps: 2000000}", "rate_limits[0].rps: at most 1000000", 5),
    ("{rps: 1, burst: -1}", "rate_limits[0].burst:", 5),
    ("{rps: 1, key: {type: header}}", "rate_limits[0].key.header: key type `header` needs", 5),
    ("{rps: 1, key: {header: X-Key}}", "rate_limits[0].key.header: `header` is only for", 5),
    ("{rps: 1, key: {type: cookie}}", "rate_limits[0].key.type:", 5),
])
def test_bad_rate_limits_name_the_field_and_line(limit, message, line):
    error = one_error(BASE + f"commands: [x]\nrate_limits:\n  - {limit}\n")
    assert error.startswith(message) and error.endswith(f"(line {line})"), error


def test_pass_authorization_without_auth_is_a_warning():
    result = load(BASE + "commands: [x]\nauth: false\npass_authorization: true\n")
    assert result.errors == [] and [str(w).split(":")[0] for w in result.warnings] == ["pass_authorization"]


def test_strip_prefix_and_pass_authorization_are_booleans():
    assert one_error(BASE + "commands: [x]\nstrip_prefix: maybe\n").startswith("strip_prefix:")
    assert one_error(BASE + "commands: [x]\npass_authorization: 3\n").startswith("pass_authorization:")


def test_user_and_working_dir_syntax():
    cfg = ok(BASE + "commands: [x]\nuser: app\nworking_dir: src/app\n")
    assert (cfg.user, cfg.working_dir) == ("app", "src/app")
    assert ok(BASE + "commands: [x]\nuser: '1000'\n").user == "1000"
    assert one_error(BASE + "commands: [x]\nuser: 'a b'\n").startswith("user:")
    assert one_error(BASE + 'commands: [x]\nworking_dir: "a\\0b"\n').startswith("working_dir: contains the control")


def test_working_dir_and_user_reach_the_job():
    from rules.jobs import job_spec
    cfg = ok(BASE + "commands: [x]\nuser: app\nworking_dir: src\n")
    job = job_spec(cfg, "svc", "0", 0, 0)
    assert (job.working_dir, job.user) == ("src", "app")


# --- replica addresses in commands (${{ groups[i].replicas[j].IP_ADDRESS }}) ---------------------

PD = BASE + """groups:
  - name: router
    replicas: 1
    router: {type: sglang}
    commands: [route]
  - name: prefill
    replicas: 2
    commands: [%s]
  - name: decode
    replicas: 0..2
    scaling: {metric: rps, target: 1}
    commands: [%s]
"""


@pytest.mark.parametrize("expr", ["groups[0].replicas[0].IP_ADDRESS", "groups[router].replicas[0].IP_ADDRESS",
                                  "groups['router'].replicas[0].PORT", ' groups [ "router" ] . replicas[0].IP_ADDRESS '])
def test_reference_by_index_or_name_is_valid(expr):
    import json
    cfg = ok(PD % (json.dumps(f"serve --router ${{{{{expr}}}}}"), "serve"))
    assert "${{" in cfg.replica_groups[1].commands[0]


def test_dollar_dollar_is_a_literal_left_as_the_expression_in_the_command_run():
    from rules.jobs import job_spec
    # Even a malformed or unknown expression is no reference once escaped: it passes validation as text.
    cfg = ok(PD % ("'echo $${{ groups[9].replicas[0].NOPE }} ${{ groups[router].replicas[0].IP_ADDRESS }}'",
                   "'echo $${{ x }}'"))
    spec = job_spec(cfg, "svc", "prefill", 1, 0, {"groups[router].replicas[0].IP_ADDRESS": "10.0.0.7"})
    assert spec.commands == ["echo ${{ groups[9].replicas[0].NOPE }} 10.0.0.7"]
    assert job_spec(cfg, "svc", "decode", 2, 0, {}).commands == ["echo ${{ x }}"]


def test_reference_to_a_replica_below_the_minimum_is_valid():
    ok(PD % ("serve", "'serve --prefill ${{ groups[prefill].replicas[1].IP_ADDRESS }}'"))


def test_reference_out_of_range_names_the_minimum_with_path_and_line():
    err = one_error(PD % ("serve", "'serve --prefill ${{ groups[1].replicas[2].IP_ADDRESS }}'"))
    assert err.startswith("groups[2].commands[0]: ${{ groups[1].replicas[2].IP_ADDRESS }}: replica index 2 is out "
                          "of range: group 'prefill' always has 2 replica(s)")
    assert err.endswith("(line 14)")


def test_reference_to_a_group_that_scales_to_zero_is_refused():
    err = one_error(PD % ("'serve ${{ groups[decode].replicas[0].IP_ADDRESS }}'", "serve"))
    assert err.startswith("groups[1].commands[0]: ") and "group 'decode' scales to zero" in err


@pytest.mark.parametrize("expr, text", [
    ("groups[3].replicas[0].IP_ADDRESS", "no replica group with index 3 (groups: router, prefill, decode)"),
    ("groups[nope].replicas[0].IP_ADDRESS", "no replica group with name 'nope'"),
    ("groups[0].replicas[0].HOSTNAME", "unknown attribute HOSTNAME"),
    ("groups[0].replica[0].IP_ADDRESS", "malformed expression"),
    ("groups[0].replicas[-1].IP_ADDRESS", "malformed expression"),
    ("env.X", "malformed expression"),
])
def test_bad_references_are_refused(expr, text):
    err = one_error(PD % (f"'serve ${{{{ {expr} }}}}'", "serve"))
    assert err.startswith("groups[1].commands[0]: ") and text in err, err


def test_unclosed_expression_is_refused():
    err = one_error(PD % ("'serve ${{ groups[0].replicas[0].IP_ADDRESS'", "serve"))
    assert "malformed expression" in err


def test_reference_in_env_is_refused_with_its_line():
    text = PD % ("serve", "serve") + "env:\n  - A=1\n  - ROUTER=${{ groups[0].replicas[0].IP_ADDRESS }}\n"
    err = one_error(text)
    assert err.startswith("env.ROUTER: `${{ … }}` expressions may appear only in `commands`")
    assert err.endswith("(line 17)")


def test_references_in_a_cycle_are_accepted_and_resolved_at_placement():
    # dstack's shapes: a router and its workers naming each other; a group naming its own replicas[0] (every node
    # joins node 0). Every replica has its address once placed, so these resolve when each is launched.
    mutual = ok(PD.replace("commands: [route]", "commands: ['route ${{ groups[1].replicas[0].IP_ADDRESS }}']")
                % ("'serve ${{ groups[router].replicas[0].IP_ADDRESS }}'", "'serve ${{ groups[router].replicas[0].IP_ADDRESS }}'"))
    assert late(mutual, "router") == ["groups[prefill].replicas[0].IP_ADDRESS"]
    assert late(mutual, "prefill") == ["groups[router].replicas[0].IP_ADDRESS"]
    assert late(mutual, "decode") == []  # names the router, which does not name decode back: resolved before launch
    own = ok(PD % ("'serve ${{ groups[prefill].replicas[0].IP_ADDRESS }}'", "serve"))
    assert late(own, "prefill") == ["groups[prefill].replicas[0].IP_ADDRESS"]


def test_a_homogeneous_service_may_name_its_own_replicas():
    config = ok(BASE + "replicas: 2\ncommands: ['serve ${{ groups[0].replicas[1].IP_ADDRESS }}']\n")
    group = config.replica_groups[0].name or ""
    assert late(config, group) == [f"groups[{group}].replicas[1].IP_ADDRESS"]


@pytest.mark.parametrize("text, events, duration", [
    ("retry: true", ["no-capacity", "interruption", "error"], None),
    ("retry: false", [], None),  # no retry at all: the first failure fails the service
    ("retry: {}", ["no-capacity", "interruption", "error"], None),
    ("retry: {on_events: []}", [], None),
    ("retry: {on_events: [no-capacity, interruption], duration: 2h}", ["no-capacity", "interruption"], 7200),
])
def test_retry_shapes(text, events, duration):
    config = ok(BASE + "commands: [x]\n" + text + "\n")
    assert config.retry is not None and (list(config.retry.on_events), config.retry.duration) == (events, duration)
    # It survives the trip through the workflow's state unchanged (`false` does not become "unset").
    assert ServiceConfiguration.model_validate(config.model_dump(mode="json")) == config


def test_without_retry_the_policy_is_unset():
    assert ok(BASE + "commands: [x]\n").retry is None


@pytest.mark.parametrize("text, seconds", [("max_duration: 2h", 7200), ("max_duration: 90", 90),
                                           ("max_duration: off", None), ("max_duration: false", None), ("", None)])
def test_max_duration_is_a_duration_or_off(text, seconds):
    config = ok(BASE + "commands: [x]\n" + text + "\n")
    assert config.max_duration == seconds
    assert ServiceConfiguration.model_validate(config.model_dump(mode="json")) == config


@pytest.mark.parametrize("text, message", [
    ("max_duration: 0", "max_duration: input should be greater than 0 (line 4)"),
    ("max_duration: soon", "max_duration: expected a duration like 30s, 5m, 1h or a number of seconds, got 'soon' "
                           "(or off) (line 4)"),
    ("retry: {on_events: [crash]}", "retry.on_events[0]: input should be 'no-capacity', 'interruption' or 'error' "
                                    "(line 4)"),
])
def test_bad_retry_and_max_duration_name_the_field_and_line(text, message):
    assert one_error(BASE + "commands: [x]\n" + text + "\n") == message


@pytest.mark.parametrize("field, value, path, line", [
    ("image", "repo/app:${{ groups[0].replicas[0].IP_ADDRESS }}", "image", 3),
    ("working_dir", "/w/${{ env.X }}", "working_dir", 3),
    ("entrypoint", "${{ secrets.TOKEN }}", "entrypoint", 3),
])
def test_expressions_outside_commands_are_refused_with_their_line(field, value, path, line):
    err = one_error(BASE + f"{field}: '{value}'\ncommands: [serve]\n")
    assert err.startswith(f"{path}: `${{{{ … }}}}` expressions may appear only in `commands`: `{field}` would get "
                          "it as literal text"), err
    assert err.endswith(f"(line {line})")


def test_expressions_in_group_fields_are_refused_with_their_line():
    text = PD.replace("    router: {type: sglang}\n",
                      "    router: {type: sglang}\n    reservation: 'cr-${{ groups[1].replicas[0].PORT }}'\n")
    text = text.replace("  - name: prefill\n", "  - name: prefill\n    image: 'img:${{ env.TAG }}'\n")
    errs = errors(text % ("serve", "serve"))
    expressions = [e for e in errs if "expressions may appear only" in e]
    assert [e.split(":")[0] for e in expressions] == ["groups[0].reservation", "groups[1].image"], errs
    assert expressions[0].endswith("(line 7)") and expressions[1].endswith("(line 10)"), errs


def test_expressions_in_commands_still_pass():
    ok(PD % ("'serve --router ${{ groups[router].replicas[0].IP_ADDRESS }}'", "serve"))


@pytest.mark.parametrize("value", ["cr-0123456789abcdef0", "a100-pool", "projects/other-proj/reservations/pool"])
def test_a_reservation_names_an_ec2_one_or_a_gcp_one(value):
    assert ok(BASE + f"reservation: {value}\ncommands: [x]\n").reservation == value
    group = ok(BASE + f"groups:\n  - name: a\n    replicas: 1\n    reservation: {value}\n    commands: [x]\n")
    assert group.replica_groups[0].reservation == value


@pytest.mark.parametrize("text, path, says", [
    ("reservation: My_Pool\ncommands: [x]\n", "reservation", "`reservation` takes an EC2 Capacity Reservation"),
    ("reservation: projects/p/zones/z/reservations/r\ncommands: [x]\n", "reservation", "got 'projects/p/zones/"),
    ("reservation: cr-0123456789abcdef0\nspot_policy: spot\ncommands: [x]\n", "reservation",
     "a reservation takes on-demand instances only"),
    ("reservation: cr-0123456789abcdef0\nbackends: [local]\ncommands: [x]\n", "reservation",
     "reservations are on AWS or GCP, and `backends` names local only"),
    ("groups:\n  - name: a\n    replicas: 1\n    reservation: pool\n    spot_policy: spot\n    commands: [x]\n",
     "groups[0].reservation", "a reservation takes on-demand instances only"),
    ("reservation: pool\ngroups:\n  - name: a\n    replicas: 1\n    spot_policy: spot\n    commands: [x]\n",
     "groups[0].spot_policy", "`spot_policy: spot` in replica group 'a': the service's `reservation` takes")])
def test_a_reservation_no_cloud_could_have_or_no_offer_could_use_is_refused(text, path, says):
    err = one_error(BASE + text)
    assert err.startswith(f"{path}: ") and says in err, err
