"""Connecting to Temporal from the environment: TLS, mTLS and an API key (connect.connection), and the
worker's SDK metrics endpoint.

TLS is real: a CA, server and client certificates made with `cryptography`, and an asyncio relay on
127.0.0.1 that terminates TLS (ALPN h2, optionally requiring a client certificate) in front of a dev
server. The API key travels inside TLS, so a small gRPC server (grpcio, TLS) stands in for the frontend
and shows the metadata it received.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shlex
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Optional

import grpc
import httpx
import pytest
import pytest_asyncio
import typer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from temporalio.api.workflowservice.v1 import (DescribeNamespaceRequest, GetSystemInfoRequest,
                                               GetSystemInfoResponse)
from temporalio.client import Client
from temporalio.service import TLSConfig
from temporalio.testing import WorkflowEnvironment

from cli import client as cli_client
from cli.stack import Stack, StackError
from connect.connection import TemporalConfigError, client_options
from gateway.app import free_port
from models.settings import Settings
from tests.conftest import DATA_CONVERTER, eventually, tool

aio = pytest.mark.asyncio(loop_scope="session")


# ---- certificates ------------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, dns: tuple[str, ...] = (),
          ips: tuple[str, ...] = (), client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                                        critical=True)
    else:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


class Pki:
    """A CA, a server certificate for `temporal.test` (only), a client certificate, and a rogue client's."""

    def __init__(self, root: Path):
        self.root = root
        ca_key, rogue_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        self.ca = self._write("ca", ca_key, _cert("durastack test CA", ca_key, "durastack test CA", ca_key, ca=True))
        server_key = ec.generate_private_key(ec.SECP256R1())
        self.server = self._write("server", server_key, _cert("temporal.test", server_key, "durastack test CA",
                                                              ca_key, dns=("temporal.test",)))
        client_key = ec.generate_private_key(ec.SECP256R1())
        self.client = self._write("client", client_key, _cert("durastack-worker", client_key, "durastack test CA",
                                                              ca_key, client=True))
        rogue_key = ec.generate_private_key(ec.SECP256R1())
        self.rogue = self._write("rogue", rogue_key, _cert("intruder", rogue_key, "rogue CA", rogue_ca_key,
                                                           client=True))

    def _write(self, name: str, key, cert: x509.Certificate) -> tuple[Path, Path]:
        cert_path, key_path = self.root / f"{name}.pem", self.root / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
        return cert_path, key_path


# ---- a TLS-terminating relay -------------------------------------------------------------------

class TlsRelay:
    """127.0.0.1:<port>, TLS (ALPN h2) → plain TCP to ``upstream``; records each accepted handshake."""

    def __init__(self, upstream: str, cert: tuple[Path, Path], client_ca: Optional[Path] = None):
        self.upstream = upstream.rsplit(":", 1)
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(*cert)
        self.ctx.set_alpn_protocols(["h2"])
        if client_ca is not None:
            self.ctx.verify_mode = ssl.CERT_REQUIRED
            self.ctx.load_verify_locations(client_ca)
        self.handshakes: list[dict] = []
        self.server: Optional[asyncio.AbstractServer] = None
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> "TlsRelay":
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0, ssl=self.ctx)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tls = writer.get_extra_info("ssl_object")
        peer = tls.getpeercert() or {}
        self.handshakes.append({"alpn": tls.selected_alpn_protocol(), "version": tls.version(),
                                "client_cn": dict(x[0] for x in peer.get("subject", ())).get("commonName")})
        up_reader, up_writer = await asyncio.open_connection(self.upstream[0], int(self.upstream[1]))
        pipes = [asyncio.create_task(_pipe(reader, up_writer)), asyncio.create_task(_pipe(up_reader, writer))]
        self.tasks.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def dev_server():
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=tool("temporal"), ip="127.0.0.1",
                                                data_converter=DATA_CONVERTER)
    yield env.client.service_client.config.target_host
    await env.shutdown()


def settings(tmp_path: Path, address: str, **tls: object) -> Settings:
    env = {"DURASTACK_HOME": str(tmp_path), "DURASTACK_TEMPORAL_ADDRESS": address}
    env.update({f"DURASTACK_TEMPORAL_{k.upper()}": str(v) for k, v in tls.items()})
    return Settings.from_env(env)


# ---- TLS and mTLS against a real server --------------------------------------------------------

@aio
async def test_tls_to_a_real_server_checks_the_server_name(tmp_path, pki, dev_server):
    async with TlsRelay(dev_server, pki.server) as relay:
        s = settings(tmp_path, relay.address, tls_ca=pki.ca[0], tls_server_name="temporal.test")
        client = await cli_client.connect(s)
        info = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
        assert info.namespace_info.name == "default"
        assert relay.handshakes and relay.handshakes[0]["alpn"] == "h2"
        assert relay.handshakes[0]["version"] in ("TLSv1.2", "TLSv1.3")
        # The certificate names temporal.test only: without the server name, the client refuses it.
        with pytest.raises(cli_client.ControlPlaneDown) as e:
            await cli_client.connect(settings(tmp_path, relay.address, tls_ca=pki.ca[0]))
        assert f"cannot connect to Temporal at {relay.address} over TLS" in str(e.value)
        assert "DURASTACK_TEMPORAL_TLS_CA/_CERT/_KEY/_SERVER_NAME" in str(e.value)


@aio
async def test_mtls_needs_the_client_certificate(tmp_path, pki, dev_server):
    async with TlsRelay(dev_server, pki.server, client_ca=pki.ca[0]) as relay:
        base = dict(tls_ca=pki.ca[0], tls_server_name="temporal.test")
        s = settings(tmp_path, relay.address, tls_cert=pki.client[0], tls_key=pki.client[1], **base)
        client = await cli_client.connect(s)
        info = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
        assert info.namespace_info.name == "default"
        assert [h["client_cn"] for h in relay.handshakes] == ["durastack-worker"]
        with pytest.raises(cli_client.ControlPlaneDown) as e:
            await cli_client.connect(settings(tmp_path, relay.address, **base))
        assert "if it requires a client certificate (mTLS), set DURASTACK_TEMPORAL_TLS_CERT and " \
               "DURASTACK_TEMPORAL_TLS_KEY" in str(e.value)
        with pytest.raises(cli_client.ControlPlaneDown, match="over TLS"):  # another CA's certificate
            await cli_client.connect(settings(tmp_path, relay.address, tls_cert=pki.rogue[0], tls_key=pki.rogue[1],
                                              **base))
        assert [h["client_cn"] for h in relay.handshakes] == ["durastack-worker"]  # nobody else got through


def test_half_configured_tls_names_what_to_fix(tmp_path, pki):
    cases = [
        (dict(tls_cert=pki.client[0]), "DURASTACK_TEMPORAL_TLS_CERT is set, DURASTACK_TEMPORAL_TLS_KEY is not"),
        (dict(tls_key=pki.client[1]), "DURASTACK_TEMPORAL_TLS_KEY is set, DURASTACK_TEMPORAL_TLS_CERT is not"),
        (dict(tls_ca=tmp_path / "nope.pem"), f"DURASTACK_TEMPORAL_TLS_CA: cannot read {tmp_path / 'nope.pem'}: "
                                             "No such file or directory"),
        (dict(tls_ca=pki.root), f"DURASTACK_TEMPORAL_TLS_CA: cannot read {pki.root}: Is a directory"),
        (dict(tls_cert=pki.client[0], tls_key=tmp_path / "x.key"), "DURASTACK_TEMPORAL_TLS_KEY: cannot read"),
        (dict(api_key="k", tls="off"), "DURASTACK_TEMPORAL_TLS=off, but DURASTACK_TEMPORAL_API_KEY is set, "
                                       "which needs TLS"),
    ]
    (tmp_path / "notpem.txt").write_text("hello")
    cases.append((dict(tls_ca=tmp_path / "notpem.txt"), "is not a PEM file"))
    for tls, message in cases:
        with pytest.raises(TemporalConfigError) as e:
            client_options(settings(tmp_path, "127.0.0.1:1", **tls))
        assert message in str(e.value), (tls, str(e.value))
    # The CLI: a user error (exit 1) with that message, before any connection attempt.
    with pytest.raises(typer.Exit) as exit_:
        cli_client.run(cli_client.connect(settings(tmp_path, "127.0.0.1:1", tls_cert=pki.client[0])))
    assert exit_.value.exit_code == 1


def test_no_tls_settings_mean_plain_grpc_and_the_settings_reach_children(tmp_path, pki):
    plain = client_options(settings(tmp_path, "127.0.0.1:7233"))
    assert set(plain) == {"target_host", "namespace", "data_converter"}
    assert plain["data_converter"].payload_codec is not None  # every client gets the secrets codec
    s = settings(tmp_path, "cloud.example:7233", api_key="key-123", tls_cert=pki.client[0],
                 tls_key=pki.client[1], tls_server_name="ns.tmprl.cloud")
    options = client_options(s)
    assert options["api_key"] == "key-123" and isinstance(options["tls"], TLSConfig)
    assert options["tls"].client_cert == pki.client[0].read_bytes() and options["tls"].domain == "ns.tmprl.cloud"
    assert "key-123" not in repr(s)  # the API key is a SecretStr
    again = Settings.from_env(s.to_env())  # what `durastack server` gives the worker
    assert (again.temporal_api_key.get_secret_value(), again.temporal_tls_cert, again.temporal_tls_server_name) == \
        ("key-123", pki.client[0], "ns.tmprl.cloud")


@aio
async def test_embedded_stack_refuses_tls_settings(tmp_path, pki):
    s = Settings.from_env({"DURASTACK_HOME": str(tmp_path / "home"), "DURASTACK_TEMPORAL_TLS_CA": str(pki.ca[0])})
    with pytest.raises(StackError, match="for an external Temporal server"):
        await Stack(s, temporal_cmd=["true"], worker_cmd=["true"], gateway_cmd=["true"]).run()


# ---- the API key -------------------------------------------------------------------------------

@aio
async def test_api_key_is_sent_as_bearer_over_tls(tmp_path, pki):
    seen: list[dict] = []

    async def get_system_info(request, context):
        seen.append(dict(context.invocation_metadata()))
        return GetSystemInfoResponse(server_version="fake-frontend")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "temporal.api.workflowservice.v1.WorkflowService",
        {"GetSystemInfo": grpc.unary_unary_rpc_method_handler(
            get_system_info, request_deserializer=GetSystemInfoRequest.FromString,
            response_serializer=GetSystemInfoResponse.SerializeToString)}),))
    cert, key = pki.server
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
    await server.start()
    try:
        s = settings(tmp_path, f"127.0.0.1:{port}", api_key="tmprl-api-key-42", tls_ca=pki.ca[0],
                     tls_server_name="temporal.test")
        await Client.connect(**client_options(s))
    finally:
        await server.stop(None)
    assert seen and seen[0]["authorization"] == "Bearer tmprl-api-key-42"


# ---- the worker's SDK metrics ------------------------------------------------------------------

@aio
async def test_worker_client_serves_sdk_metrics(tmp_path, dev_server):
    import worker

    assert worker.metrics_runtime(0) is None  # 0: off
    port = free_port()
    s = Settings.from_env({"DURASTACK_HOME": str(tmp_path), "DURASTACK_TEMPORAL_ADDRESS": dev_server,
                           "DURASTACK_WORKER_METRICS_PORT": str(port)})
    client = await worker.connect(s)
    await client.count_workflows()

    async def scraped() -> str:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=2)).text
        return text if "temporal_request" in text else ""
    assert "temporal_request" in await eventually(scraped)


def test_temporal_env_speaks_the_temporal_clis_own_variables(tmp_path, pki, monkeypatch):
    """`durastack temporal-env` for an external Temporal: the same address, TLS and key as the workers, under
    variable names that Temporal's own CLI reads (checked against its `temporal options`)."""
    from typer.testing import CliRunner

    from cli.main import app
    from cli.server import TEMPORAL_CLI_ENV

    env = {"DURASTACK_HOME": str(tmp_path), "DURASTACK_TEMPORAL_ADDRESS": "temporal.test:7233",
           "DURASTACK_TEMPORAL_TLS_CA": str(pki.ca[0]), "DURASTACK_TEMPORAL_TLS_SERVER_NAME": "temporal.test",
           "DURASTACK_TEMPORAL_API_KEY": "tmprl-api-key-42"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    printed = CliRunner().invoke(app, ["temporal-env"])
    assert printed.exit_code == 0, printed.output
    exported = dict(shlex.split(line)[1].split("=", 1) for line in printed.output.splitlines())
    assert exported == {"TEMPORAL_ADDRESS": "temporal.test:7233", "TEMPORAL_NAMESPACE": "default",
                        "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(pki.ca[0]), "TEMPORAL_TLS_SERVER_NAME": "temporal.test",
                        "TEMPORAL_API_KEY": "tmprl-api-key-42"}
    known = subprocess.run([str(Path(sys.executable).with_name("temporal")), "options"], capture_output=True,
                           text=True, timeout=30).stdout
    assert all(f" {name} " in known for name in [*exported, *TEMPORAL_CLI_ENV.values()]), known[:500]
