"""The Web UI's codec endpoint decrypts only for the UI: its Host, its Origin and the installation's credential."""

import base64
import json

import aiohttp
import pytest

from cli.codec_server import codec_credential, codec_endpoint, start_codec_server, ui_origins
from gateway.app import free_port
from connect.codec import SecretCodec, new_key, parse_keys

pytestmark = [pytest.mark.asyncio(loop_scope="session")]


async def test_codec_endpoint_answers_the_ui_only():
    old, new = new_key(), new_key()
    keys = parse_keys(f"{new},{old}", "test")  # rotated: `new` encrypts, both decrypt
    codec = SecretCodec(keys, strict=False)
    secret = (await codec.encode([(await _payload("HF_TOKEN=hf_abc"))]))[0]
    body = {"payloads": [{"metadata": {k: base64.b64encode(v).decode() for k, v in secret.metadata.items()},
                          "data": base64.b64encode(secret.data).decode()}]}
    port, ui = free_port(), ui_origins(8233)[0]
    runner = await start_codec_server(codec, port, [ui])
    base = f"http://127.0.0.1:{port}"
    endpoint = codec_endpoint(base, keys)
    assert endpoint == f"{base}/{codec_credential(keys.keys[0])}" and len(endpoint) == len(base) + 33
    try:
        async with aiohttp.ClientSession() as http:
            async def post(url: str, **headers) -> int:
                async with http.post(url, json=body, headers=headers) as r:
                    return r.status

            ok = {"Origin": ui, "X-Namespace": "default"}
            async with http.post(f"{endpoint}/decode", json=body, headers=ok) as r:
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ui
                assert b"hf_abc" in base64.b64decode((await r.json())["payloads"][0]["data"])
            # A payload the codec compressed (past COMPRESS_ABOVE) reaches the UI as readable JSON.
            big = (await codec.encode([await _payload("X=" + "y" * 100_000)]))[0]
            assert big.metadata["encoding"] == b"binary/zlib"
            wire = {"payloads": [{"metadata": {k: base64.b64encode(v).decode() for k, v in big.metadata.items()},
                                  "data": base64.b64encode(big.data).decode()}]}
            async with http.post(f"{endpoint}/decode", json=wire, headers=ok) as r:
                (shown,) = (await r.json())["payloads"]
                assert base64.b64decode(shown["metadata"]["encoding"]) == b"json/plain"
                assert b"y" * 100_000 in base64.b64decode(shown["data"])
            # The older key's credential still opens it (a UI set up before the rotation).
            assert await post(f"{base}/{codec_credential(keys.keys[1])}/decode", **ok) == 200
            assert await post(f"{endpoint}/encode", **ok) == 200
            # No credential, a wrong one, or one of another installation's key.
            for url in (f"{base}/decode", f"{base}/{'x' * 32}/decode",
                        f"{base}/{codec_credential(parse_keys(new_key(), 'o').keys[0])}/decode"):
                assert await post(url, **ok) == 404, url
            # Another page (CSRF), or no browser at all.
            assert await post(f"{endpoint}/decode", Origin="http://evil.example") == 403
            assert await post(f"{endpoint}/decode", Origin="null") == 403
            assert await post(f"{endpoint}/decode") == 403
            # A rebound name: the right port, the attacker's Host.
            for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}"):
                assert await post(f"{endpoint}/decode", Host=host, **ok) == 403, host
            assert await post(f"{endpoint}/decode".replace("127.0.0.1", "localhost"), **ok) == 200
            # The preflight the UI's browser sends first: CORS for the UI, nothing for another page.
            async with http.options(f"{endpoint}/decode", headers={"Origin": ui,
                                                                   "Access-Control-Request-Method": "POST"}) as pre:
                assert pre.status == 204 and pre.headers["Access-Control-Allow-Origin"] == ui
            async with http.options(f"{endpoint}/decode", headers={"Origin": "http://evil.example"}) as pre:
                assert pre.status == 403 and "Access-Control-Allow-Origin" not in pre.headers
    finally:
        await runner.cleanup()


async def _payload(text: str):
    from temporalio.api.common.v1 import Payload

    from models.secrets import SECRET_MARK

    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(SECRET_MARK + text).encode())
