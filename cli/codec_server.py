"""``durastack codec-server``: the Temporal Web UI's remote codec, so that the UI can show secret env values.

The UI posts ``{"payloads": [...]}`` (protobuf JSON: base64 metadata and data) to ``<endpoint>/decode``
and ``<endpoint>/encode`` and shows what comes back. This server answers with ``connect.codec`` and the
key of whoever runs it (``DURASTACK_CODEC_KEY`` or ``$DURASTACK_HOME/codec.key``); a ciphertext of another
key is left as it is. It listens on 127.0.0.1 only, and decrypts only for the Web UI:

* Host must be this listener's loopback address and port (a page whose name was rebound to 127.0.0.1 fails);
* Origin must be one of the UI origins it is given (another page's request, or one without Origin, gets 403);
* the path must carry the installation's codec credential: ``/<credential>/decode``. The Temporal UI posts to
  ``<codec endpoint>/decode`` and can send no header or cookie of ours (an Authorization header only when the
  UI has its own login), so the credential is part of the endpoint URL it is configured with. It is derived
  from the codec key (:func:`codec_credential`): every holder of the key computes the same one, and it
  reveals nothing of the key. ``durastack server`` passes ``<codec url>/<credential>`` to the embedded UI
  (``--ui-codec-endpoint``); ``durastack codec-server`` prints the URL to set in another UI.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import socket
from typing import Iterable, Optional

import typer
from aiohttp import web
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from gateway.localhttp import check_host, check_origin
from connect.codec import CodecKeys, SecretCodec

ALLOWED_HEADERS = "Content-Type, X-Namespace, Authorization"


def codec_credential(key: bytes) -> str:
    """The URL path segment that opens the codec endpoint for holders of ``key`` (32 url-safe characters)."""
    digest = hmac.new(key, b"durastack codec endpoint credential", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode()[:32]


def codec_endpoint(url: str, keys: CodecKeys) -> str:
    """The endpoint to give a Web UI: ``url`` plus the credential of the key that encrypts."""
    return f"{url.rstrip('/')}/{codec_credential(keys.keys[0])}"


def ui_origins(ui_port: int) -> list[str]:
    return [f"http://127.0.0.1:{ui_port}", f"http://localhost:{ui_port}"]


def codec_app(codec: SecretCodec, origins: Iterable[str]) -> web.Application:
    allowed = set(origins)

    def cors(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin in allowed:
            response.headers.update({
                "Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Allow-Methods": "POST, OPTIONS", "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                "Access-Control-Allow-Credentials": "true",
                # Chrome's Private Network Access: a public UI (Temporal Cloud) calling 127.0.0.1.
                "Access-Control-Allow-Private-Network": "true"})
        return response

    @web.middleware
    async def guard(request: web.Request, handler):
        try:
            check_host(request)
            # A preflight carries the UI's Origin too; it needs no credential (the browser sends none) and
            # answers nothing but CORS headers.
            check_origin(request, allowed, required=True)
            if request.method != "OPTIONS":
                # Any key of the rotation: a UI set up before the newest key was added keeps working.
                given = request.match_info.get("credential", "").encode()
                if not any(hmac.compare_digest(given, codec_credential(k).encode()) for k in codec.keys().keys):
                    raise web.HTTPNotFound(text="no codec endpoint here: the URL needs this installation's "
                                                "credential (`durastack codec-server` prints it)")
        except web.HTTPException as e:
            return cors(request, web.Response(status=e.status, text=e.text))
        return await handler(request)

    async def preflight(request: web.Request) -> web.StreamResponse:
        return cors(request, web.Response(status=204))

    def handler(name: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                payloads = json_format.Parse(await request.text(), Payloads(), ignore_unknown_fields=True).payloads
            except json_format.ParseError as e:
                return cors(request, web.json_response({"message": f"bad payloads: {e}"}, status=400))
            done = await getattr(codec, name)(payloads)
            body = json_format.MessageToJson(Payloads(payloads=done))
            return cors(request, web.Response(text=body, content_type="application/json"))
        return handle

    app = web.Application(client_max_size=8 * 1024 * 1024, middlewares=[guard])
    for name in ("encode", "decode"):
        app.router.add_post(f"/{{credential}}/{name}", handler(name))
        app.router.add_route("OPTIONS", f"/{{credential}}/{name}", preflight)
    return app


async def start_codec_server(codec: SecretCodec, port: int, origins: Iterable[str],
                             sock: Optional[socket.socket] = None) -> web.AppRunner:
    """Serve ``codec_app`` on 127.0.0.1:<port> (or on ``sock``, bound there in another namespace) until
    ``runner.cleanup()``."""
    runner = web.AppRunner(codec_app(codec, origins), access_log=None)
    await runner.setup()
    try:
        await (web.TCPSite(runner, "127.0.0.1", port) if sock is None else web.SockSite(runner, sock)).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


def register(app: typer.Typer) -> None:
    @app.command(name="codec-server")
    def codec_server(
        port: Optional[int] = typer.Option(None, "--port", help="Port on 127.0.0.1 (env DURASTACK_CODEC_PORT, "
                                                                "default 8234)."),
        origin: list[str] = typer.Option([], "--origin", help="A Web UI origin allowed to call it (repeatable); "
                                                              "default the embedded UI's."),
    ) -> None:
        """Serve the Web UI's codec endpoint (POST /decode, /encode) with your codec key, on 127.0.0.1."""
        from rich.console import Console

        from connect.codec import CodecKeyError, load_keys
        from models.settings import Settings

        settings = Settings.from_env(codec_port=port)
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        try:
            keys = load_keys(settings.home)
        except CodecKeyError as e:
            err.print(str(e), style="red", markup=False)
            raise typer.Exit(1)

        async def serve() -> None:
            try:
                runner = await start_codec_server(SecretCodec(keys, strict=False), settings.codec_port,
                                                  origin or ui_origins(settings.ui_port))
            except OSError as e:
                err.print(f"cannot listen on 127.0.0.1:{settings.codec_port} ({e.strerror}); choose another with "
                          "--port or DURASTACK_CODEC_PORT", style="red", markup=False)
                raise typer.Exit(1)
            print(f"codec server on {settings.codec_url} (key {', '.join(keys.ids)} from {keys.source}); "
                  f"set the Web UI's codec endpoint to {codec_endpoint(settings.codec_url, keys)} "
                  "(it holds this installation's credential); Ctrl-C to stop", flush=True)
            try:
                await asyncio.Event().wait()
            finally:
                await runner.cleanup()

        try:
            asyncio.run(serve())
        except KeyboardInterrupt:
            pass
