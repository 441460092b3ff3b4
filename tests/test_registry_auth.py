"""`registry_auth`: the file's rules, the job's credentials, their secrecy in history, and the pull's Docker config.
(The pull itself, refused and accepted by a registry: tests/test_e2e_registry_auth.py.)"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from backends.runtime import group_runtime_fields, local_limits
from cli.service import _resolve
from connect.codec import SecretCodec, parse_keys, new_key
from models.loader import load_config_text
from models.registry import DOCKER_HUB, docker_config, registry_of
from models.replica import JobSpec
from temporalio.api.common.v1 import Payload
from rules.changes import classify, spec_hash
from rules.jobs import job_spec

TOKEN = "nvapi-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Jh1"
NGC = """\
type: service
name: nim
port: 8000
image: nvcr.io/nim/meta/llama-3.1-8b-instruct:latest
env:
  - NGC_API_KEY
  - MODEL=llama
registry_auth:
  username: $oauthtoken
  password: {password}
"""


def load(password: str = "${{ env.NGC_API_KEY }}", text: str = NGC):
    return load_config_text(text.format(password=password))


def resolved(password: str = "${{ env.NGC_API_KEY }}"):
    result = load(password)
    assert result.valid, result.errors
    return _resolve(result.config, Path("nim.yml"), {"NGC_API_KEY": TOKEN})


def test_dstacks_ngc_file_loads_and_the_job_gets_the_entrys_value():
    job = job_spec(resolved(), "nim", "0", 0, 0)
    assert (job.registry_auth.username, job.registry_auth.password) == ("$oauthtoken", TOKEN)


@pytest.mark.parametrize("password, said", [
    ("${{ env.NGC_KEY }}", "registry_auth.password: `${{ env.NGC_KEY }}`: NGC_KEY is not in `env`"),
    ("${{ secrets.NGC_API_KEY }}", "registry_auth.password: the only expression `registry_auth` takes is"),
    ("pre-${{ env.NGC_API_KEY }}-${{ groups[0].replicas[0].IP_ADDRESS }}", "the only expression"),
    ("''", "registry_auth.password: must not be empty"),
])
def test_bad_credentials_are_refused_naming_the_field_and_line(password, said):
    result = load(password)
    assert not result.valid
    errors = [str(e) for e in result.errors]
    assert any(said in e and "(line 10)" in e for e in errors), errors


def test_credentials_without_an_image_are_refused():
    result = load("secret", NGC.replace("image: nvcr.io/nim/meta/llama-3.1-8b-instruct:latest\n",
                                        "commands: [serve]\n"))
    assert any("no group sets `image`" in str(e) for e in result.errors), result.errors


def test_the_local_backend_says_it_pulls_nothing():
    config = load("secret", NGC + "commands: [serve]\n").config
    errors, warnings = local_limits(group_runtime_fields(config, 0))
    assert not errors and warnings == ["image: ignored by the local backend, which runs the commands on this "
                                       "machine (and so is `registry_auth`)"]


def test_rotating_the_token_restarts_no_replica():
    before, after = resolved(), _resolve(load().config, Path("nim.yml"), {"NGC_API_KEY": "nvapi-rotated"})
    changes = classify(before.model_copy(update={"env": {**before.env, "NGC_API_KEY": TOKEN}}),
                       before.model_copy(update={"registry_auth": after.registry_auth.model_copy(
                           update={"password": "nvapi-rotated"}), "env": {**before.env, "NGC_API_KEY": TOKEN}}))
    assert changes.in_place == ["registry_auth"] and not changes.rolling
    # The job's resolved credentials are not part of what it runs either.
    assert spec_hash(before, "0") == spec_hash(before.model_copy(update={"registry_auth": None}), "0")


@pytest.mark.asyncio
async def test_the_token_is_sealed_in_history_and_hidden_from_people():
    job = job_spec(resolved("literal-" + TOKEN), "nim", "0", 0, 0)
    codec = SecretCodec(parse_keys(new_key(), "test"))
    (sealed,) = await codec.encode([Payload(metadata={"encoding": b"json/plain"},
                                            data=job.model_dump_json().encode())])
    assert TOKEN.encode() not in sealed.data and b"$oauthtoken" not in sealed.data
    (back,) = await codec.decode([sealed])
    assert JobSpec.model_validate_json(back.data).registry_auth.password == "literal-" + TOKEN
    shown = job.model_dump(mode="json", context={"secrets": "redact"})["registry_auth"]
    assert shown == {"username": "***", "password": "***"}


@pytest.mark.parametrize("image, registry", [
    ("nvcr.io/nim/meta/llama:1", "nvcr.io"), ("localhost:5000/app", "localhost:5000"),
    ("localhost/app", "localhost"), ("123.dkr.ecr.us-east-1.amazonaws.com/app:2", "123.dkr.ecr.us-east-1.amazonaws.com"),
    ("vllm/vllm-openai:v0.11.0", DOCKER_HUB), ("ubuntu", DOCKER_HUB), ("team:8/app", "team:8"),
])
def test_the_registry_is_read_from_the_image_as_docker_reads_it(image, registry):
    assert registry_of(image) == registry


def test_the_pulls_docker_config_holds_the_credentials_for_that_registry_only():
    auth = job_spec(resolved(), "nim", "0", 0, 0).registry_auth
    config = json.loads(docker_config("nvcr.io/nim/x:1", auth))
    assert config == {"auths": {"nvcr.io": {"auth": base64.b64encode(f"$oauthtoken:{TOKEN}".encode()).decode()}}}
