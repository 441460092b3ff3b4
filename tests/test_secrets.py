"""Secret env values: which are secret, the payload codec, its key, and a real service run whose history
(every run across continue-as-new, every replica) never holds a secret in cleartext or base64."""

from __future__ import annotations

import base64
import json
import stat
import uuid
import zlib
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
import typer
from temporalio.api.common.v1 import Payload

from activities import interface
from activities.interface import implements
from cli.codec_server import codec_endpoint, start_codec_server, ui_origins
from cli.service import _resolve
from connect.codec import (COMPRESS_ABOVE, KEY_ENV, KEY_FILE, CodecKeyError, SecretCodec, ensure_key_file, load_keys,
                           new_key, parse_keys)
from gateway.app import free_port
from cli.control import deliver
from models.loader import load_config_text
from models.replica import JobSpec
from models.messages import ApplyRequest, Launched, LaunchInput, ScaleRequest
from models.state import ServiceState
from models.secrets import ENCRYPTED_MARK, REDACT, SECRET_MARK
from models.service import ServiceConfiguration
from tests.conftest import eventually, last_run_result, run_histories
from tests.fakes.cloud import FakeCloud, fake_cloud_worker
from rules.changes import classify, spec_hash
from rules.jobs import job_spec
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

HF = "hf_" + "Q7rT9xLp2VwK4mZs8NbYc3Hd6Jf1GaUe"  # from the caller's environment
DB = "postgres://app:Sup3r-S3cret-Passw0rd@db.internal/app"  # inline, listed in `secrets`
API = "sk-inline-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2"  # inline, secret by its name
SECRETS = (HF, DB, API)
aio = pytest.mark.asyncio(loop_scope="session")

CONFIG = """
type: service
name: {name}
port: 8000
env:
  - HF_TOKEN
  - MODEL_ID=llama-3-8b-instruct
  - DATABASE=postgres://app:Sup3r-S3cret-Passw0rd@db.internal/app
  - OPENAI_API_KEY=sk-inline-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2
secrets: [DATABASE]
groups:
  - name: web
    count: 1
    commands: [serve v1]
  - name: burst
    count: 0..3
    scaling: {{metric: rps, target: 2}}
    commands: [serve v1]
"""


def resolved(name: str, environ: dict) -> ServiceConfiguration:
    config = load_config_text(CONFIG.format(name=name)).config
    assert config is not None
    return _resolve(config, Path(f"{name}.yml"), environ)


def encoded_forms(secret: str) -> list[bytes]:
    """The secret as raw bytes and as every base64 rendering it can take inside a longer base64 text."""
    forms = [secret.encode()]
    for shift in range(3):  # the secret's offset modulo 3 in the encoded bytes
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = encode(b"\0" * shift + secret.encode())
            forms.append(text[4:-4])  # the part that depends on the secret alone
    return forms


def assert_nowhere(blob: bytes, where: str) -> None:
    for secret in SECRETS:
        for form in encoded_forms(secret):
            assert form not in blob, f"{where} holds {secret[:6]}… as {form[:12]!r}…"


# ---- which values are secret -------------------------------------------------------------------

def test_one_rule_marks_environment_listed_and_secret_looking_names():
    config = resolved("svc", {"HF_TOKEN": HF})
    assert config.secrets == ["DATABASE", "HF_TOKEN"]  # listed, then taken from the environment
    assert config.secret_env == ["HF_TOKEN", "DATABASE", "OPENAI_API_KEY"]
    env = config.model_dump(mode="json")["env"]
    assert env["MODEL_ID"] == "llama-3-8b-instruct"  # history keeps ordinary values readable
    assert {k: v for k, v in env.items() if k != "MODEL_ID"} == {
        "HF_TOKEN": SECRET_MARK + HF, "DATABASE": SECRET_MARK + DB, "OPENAI_API_KEY": SECRET_MARK + API}
    shown = config.model_dump(mode="json", context=REDACT)["env"]
    assert shown == {"HF_TOKEN": "***", "MODEL_ID": "llama-3-8b-instruct", "DATABASE": "***",
                     "OPENAI_API_KEY": "***"}
    # What the workflow reads back is the real value, and the same configuration.
    again = ServiceConfiguration.model_validate_json(config.model_dump_json())
    assert again == config and again.env["HF_TOKEN"] == HF
    job = job_spec(config, "svc", "web", 0, 0)
    assert job.env["HF_TOKEN"] == HF and JobSpec.model_validate_json(job.model_dump_json()) == job
    assert json.loads(job.model_dump_json())["env"]["DATABASE"] == SECRET_MARK + DB


def test_secrets_name_env_entries_and_values_hold_no_nul():
    bad = load_config_text("type: service\nport: 8000\ncommands: [x]\nenv: [A=1]\nsecrets: [A, B]\n")
    assert [(e.path, e.message) for e in bad.errors] == [
        ("secrets[1]", "B is not in `env`; list the names of `env` entries that are secret")]
    nul = load_config_text('type: service\nport: 8000\ncommands: [x]\nenv: {A: "x\\0y"}\n')
    assert nul.errors and "NUL" in nul.errors[0].message


def test_ciphertext_reaching_a_model_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="durastack's data converter"):
        JobSpec.model_validate({"service": "s", "group": "g", "replica_num": 0, "submission_num": 0, "port": 1,
                                "env": {"HF_TOKEN": ENCRYPTED_MARK + "v1:00000000:AAAA"}})


def test_marking_a_value_secret_restarts_nothing():
    plain = load_config_text(CONFIG.format(name="svc").replace("secrets: [DATABASE]", "")).config
    listed = resolved("svc", {"HF_TOKEN": HF})
    plain = plain.model_copy(update={"env": listed.env})
    changes = classify(plain, listed)
    assert (changes.in_place, changes.rolling, changes.not_updatable) == (["secrets"], [], [])
    assert spec_hash(plain, "web") == spec_hash(listed, "web")
    changed = listed.model_copy(update={"env": {**listed.env, "HF_TOKEN": HF + "x"}})
    assert spec_hash(changed, "web") != spec_hash(listed, "web")  # a new secret value still rolls


@aio
async def test_spec_hashes_are_keyed_and_their_key_is_encrypted():
    """A replica's spec hash sits in history in clear and hashes its secret values: keyed with the service's
    `hash_key`, which is itself encrypted, nobody who reads history can test guesses of a secret against it."""
    config = resolved("svc", {"HF_TOKEN": HF})
    key = "k" * 64
    assert spec_hash(config, "web", key) != spec_hash(config, "web")  # the unkeyed one could be recomputed
    assert spec_hash(config, "web", key) != spec_hash(config, "web", "o" * 64)
    assert spec_hash(config, "web", key) == spec_hash(resolved("svc", {"HF_TOKEN": HF}), "web", key)
    changed = config.model_copy(update={"env": {**config.env, "HF_TOKEN": HF + "x"}})
    assert spec_hash(changed, "web", key) != spec_hash(config, "web", key)  # a new secret value still rolls
    codec = SecretCodec(parse_keys(new_key(), "test"))
    state = ServiceState(name="svc", config=config, hash_key=key)
    sealed = await codec.encode([Payload(metadata={"encoding": b"json/plain"}, data=state.model_dump_json().encode())])
    assert key.encode() not in sealed[0].data
    back = ServiceState.model_validate_json((await codec.decode(sealed))[0].data)
    assert back.hash_key == key and back == state
    assert key not in state.model_dump_json(context=REDACT)


def test_missing_environment_value_is_a_user_error():
    config = load_config_text(CONFIG.format(name="svc")).config
    with pytest.raises(typer.Exit):
        _resolve(config, Path("svc.yml"), {})


# ---- the codec and its key ---------------------------------------------------------------------

def payload(value) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(value).encode())


@aio
async def test_codec_encrypts_marked_strings_only_and_restores_them():
    codec = SecretCodec(parse_keys(new_key(), "test"))
    config = resolved("svc", {"HF_TOKEN": HF})
    plain, marked = payload({"n": 1, "s": "readable"}), Payload(
        metadata={"encoding": b"json/plain"}, data=config.model_dump_json().encode())
    out = await codec.encode([plain, marked])
    assert out[0] is plain  # no mark: the payload passes untouched
    assert_nowhere(out[1].data, "the encoded payload")
    assert b"llama-3-8b-instruct" in out[1].data and b"durastack-encrypted:v1:" in out[1].data
    assert out[1].data.count(b"durastack-encrypted") == 3
    back = await codec.decode(out)
    assert ServiceConfiguration.model_validate_json(back[1].data) == config
    # A fresh nonce each time: equal secrets do not give equal ciphertexts.
    assert (await codec.encode([marked]))[0].data != out[1].data


@aio
async def test_a_large_payload_travels_compressed_with_its_secrets_sealed_first():
    codec = SecretCodec(parse_keys(new_key(), "test"))
    big = payload({"token": SECRET_MARK + HF, "rows": [f"replica {i} of a large state" for i in range(20_000)]})
    assert len(big.data) > 4 * COMPRESS_ABOVE
    (out,) = await codec.encode([big])
    assert out.metadata["encoding"] == b"binary/zlib" and len(out.data) < len(big.data) / 10
    inner = Payload.FromString(zlib.decompress(out.data))
    assert_nowhere(inner.data, "the compressed payload")  # sealed before it was compressed
    assert inner.data.count(b"durastack-encrypted") == 1
    (back,) = await codec.decode([out])
    assert json.loads(back.data) == json.loads(big.data) and back.metadata == big.metadata
    small = payload({"rows": ["short"]})
    assert (await codec.encode([small]))[0] is small  # small payloads stay readable JSON in history


@aio
async def test_wrong_key_is_named_or_left_encrypted():
    mine, theirs = parse_keys(new_key(), "mine"), parse_keys(new_key(), KEY_ENV)
    sealed = await SecretCodec(mine).encode([payload({"k": SECRET_MARK + HF})])
    with pytest.raises(CodecKeyError) as e:
        await SecretCodec(theirs).decode(sealed)
    assert mine.ids[0] in str(e.value) and theirs.ids[0] in str(e.value) and KEY_ENV in str(e.value)
    kept = await SecretCodec(theirs, strict=False).decode(sealed)
    assert kept[0].data == sealed[0].data
    # Rotation: a new first key encrypts, the old one still decrypts.
    both = parse_keys(f"{new_key()},{base64.b64encode(mine.keys[0]).decode()}", KEY_ENV)
    assert json.loads((await SecretCodec(both).decode(sealed))[0].data) == {"k": SECRET_MARK + HF}


def test_key_from_environment_or_home_file(tmp_path: Path):
    with pytest.raises(CodecKeyError, match=f"no codec key: set {KEY_ENV}.*durastack server"):
        load_keys(tmp_path, {})
    with pytest.raises(CodecKeyError, match=f"{KEY_ENV} is not a valid codec key: expected base64 of 32"):
        load_keys(tmp_path, {KEY_ENV: "too-short"})
    path = ensure_key_file(tmp_path, {})
    assert path == tmp_path / KEY_FILE and stat.S_IMODE(path.stat().st_mode) == 0o600
    first = load_keys(tmp_path, {})
    assert ensure_key_file(tmp_path, {}) == path and load_keys(tmp_path, {}) == first  # never replaced
    key = new_key()
    assert load_keys(tmp_path, {KEY_ENV: key}).keys == (base64.b64decode(key),)  # the environment wins
    assert load_keys(tmp_path, {KEY_ENV: base64.urlsafe_b64encode(base64.b64decode(key)).decode().rstrip("=")}
                     ).keys == (base64.b64decode(key),)
    assert ensure_key_file(tmp_path / "other", {KEY_ENV: key}) is None


@aio
async def test_worker_without_a_key_stops_with_the_fix(tmp_path: Path, monkeypatch):
    import worker
    from models.settings import Settings

    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(CodecKeyError, match=KEY_ENV):
        await worker.connect(Settings.from_env({}, home=tmp_path, temporal_port=free_port()))


# ---- a real service run ------------------------------------------------------------------------

class RecordingCloud(FakeCloud):
    """FakeCloud whose launch also records the env each replica was given."""

    def __init__(self) -> None:
        super().__init__()
        self.envs: dict[str, dict[str, str]] = {}

    def replica_activities(self):
        acts = super().replica_activities()
        place = next(a for a in acts if a.__name__ == "place")

        @implements(interface.place_replica)
        async def recording_place(inp: LaunchInput) -> Launched:
            self.envs[inp.replica.job.replica_id] = dict(inp.replica.job.env)
            return await place(inp)

        return [recording_place, *(a for a in acts if a is not place)]


@aio
async def test_service_run_history_holds_no_secret(dev_env, capsys):
    """On the dev server, across continue-as-new hops (the time-skipping server can lose a hop's events)."""
    ts_env = dev_env
    name = f"sec-{uuid.uuid4().hex[:6]}"
    config = resolved(name, {"HF_TOKEN": HF})
    async for cloud in fake_cloud_worker(dev_env, RecordingCloud()):
        handle = await ts_env.client.start_workflow(
            ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config), history_limit=60),
            id=service_workflow_id(name), task_queue=cloud.queue)
        first_run = handle.first_execution_run_id or handle.result_run_id
        web0 = f"{name}/web/r0-s0"
        await eventually(lambda: _async(web0 in cloud.envs))
        assert cloud.envs[web0] == {"HF_TOKEN": HF, "MODEL_ID": "llama-3-8b-instruct", "DATABASE": DB,
                                    "OPENAI_API_KEY": API, "DURASTACK_SERVICE": name, "DURASTACK_GROUP": "web",
                                    "DURASTACK_REPLICA": "0"}
        runs = {first_run}
        for count in (2, 1, 3, 1):  # enough history for continue-as-new hops
            # An update meeting a hop is answered WorkflowNotReady: asked again, as the CLI does.
            await deliver(lambda: handle.execute_update(ServiceRunWorkflow.scale,
                                                        ScaleRequest(group="burst", count=count)))
            await eventually(lambda: _ready(handle, "burst", count))
            runs.add((await handle.describe()).run_id)
        assert len(runs) >= 2, "expected a continue-as-new hop"
        # After the hops: the state still holds the real values, and a new secret value rolls out.
        assert (await handle.query(ServiceRunWorkflow.config)).env["HF_TOKEN"] == HF
        new = config.model_copy(update={"env": {**config.env, "HF_TOKEN": HF[::-1]}})
        result = await deliver(lambda: handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=new)))
        assert result.rolling == ["env"]
        # A rollout on the dev server, with the suite's other tests beside it: CI once needed more than 30 s.
        await eventually(lambda: _rolled_out(handle, result.deployment), 90)
        rolled = [e for r, e in cloud.envs.items() if r.startswith(f"{name}/web/") and e["HF_TOKEN"] == HF[::-1]]
        assert len(rolled) == 1 and rolled[0]["DATABASE"] == DB
        await _cli_shows_no_secret(ts_env, name, capsys)
        await handle.signal(ServiceRunWorkflow.stop)
        assert await last_run_result(ts_env.client, handle.id) == "stopped"
    service_runs = await run_histories(ts_env.client, handle.id)
    assert len(service_runs) >= len(runs) >= 2
    replicas = [await ts_env.client.get_workflow_handle(f"service/{rid}").fetch_history() for rid in cloud.envs]
    for history in service_runs + replicas:
        raw = b"".join(e.SerializeToString() for e in history.events)
        assert_nowhere(raw, f"history of {history.workflow_id}")
        assert_nowhere(history.to_json().encode(), f"JSON history of {history.workflow_id}")
        assert b"llama-3-8b-instruct" in raw  # the rest stays readable
    # Every service input and each replica's job carry the three secrets, encrypted.
    assert all(b"".join(e.SerializeToString() for e in h.events).count(b"durastack-encrypted") >= 3
               for h in service_runs + replicas)
    await _codec_server_decodes_with_the_right_key_only(service_runs[-1])


async def _cli_shows_no_secret(env, name: str, capsys) -> None:
    from cli.inspect import _ps
    from cli.service import _config
    from models.settings import Settings

    settings = Settings.from_env({}, temporal_address=env.client.service_client.config.target_host)
    capsys.readouterr()
    await _config(settings, name, as_json=True)
    await _config(settings, name, as_json=False)
    await _ps(settings, name, False, True, False)
    printed = capsys.readouterr().out
    assert_nowhere(printed.encode(), "`durastack config` / `ps --json`")
    assert '"HF_TOKEN": "***"' in printed and "HF_TOKEN: '***'" in printed
    assert "llama-3-8b-instruct" in printed


async def _codec_server_decodes_with_the_right_key_only(history) -> None:
    started = history.events[0].workflow_execution_started_event_attributes.input
    body = {"payloads": [{"metadata": {k: base64.b64encode(v).decode() for k, v in p.metadata.items()},
                          "data": base64.b64encode(p.data).decode()} for p in started.payloads]}
    origin = ui_origins(8233)[0]
    right = load_keys(Path("/nonexistent"))  # the session's DURASTACK_CODEC_KEY
    for keys, expect_secret in ((right, True), (parse_keys(new_key(), "other"), False)):
        port = free_port()
        runner = await start_codec_server(SecretCodec(keys, strict=False), port, [origin])
        try:
            async with aiohttp.ClientSession() as http:
                url = f"{codec_endpoint(f'http://127.0.0.1:{port}', keys)}/decode"
                async with http.options(url, headers={"Origin": origin,
                                                      "Access-Control-Request-Method": "POST"}) as pre:
                    assert pre.status == 204 and pre.headers["Access-Control-Allow-Origin"] == origin
                    assert "X-Namespace" in pre.headers["Access-Control-Allow-Headers"]
                async with http.post(url, json=body, headers={"Origin": origin, "X-Namespace": "default"}) as r:
                    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == origin
                    decoded = b"".join(base64.b64decode(p["data"]) for p in (await r.json())["payloads"])
                async with http.post(url, json=body, headers={"Origin": "http://evil.example"}) as r:
                    assert "Access-Control-Allow-Origin" not in r.headers  # the browser withholds the answer
        finally:
            await runner.cleanup()
        assert (HF.encode() in decoded and DB.encode() in decoded) is expect_secret
        if not expect_secret:
            assert_nowhere(decoded, "a decode with another key")
            assert decoded.count(b"durastack-encrypted") >= 3


async def _ready(handle, group: str, count: int) -> bool:
    status = await handle.query(ServiceRunWorkflow.status, rpc_timeout=timedelta(seconds=3))
    g = next(g for g in status.groups if g.name == group)
    return sum(1 for r in g.replicas if r.ready and r.status == "running") == count


async def _rolled_out(handle, deployment: int) -> bool:
    status = await handle.query(ServiceRunWorkflow.status, rpc_timeout=timedelta(seconds=3))
    web = next(g for g in status.groups if g.name == "web")
    live = [r for r in web.replicas if r.status not in ("terminated", "failed")]
    return not web.rollout and [(r.deployment, r.ready) for r in live] == [(deployment, True)]


async def _async(value):
    return value

