"""``durastack codec-server``: the Temporal Web UI's remote codec, so that the UI can show secret env values.

The UI posts ``{"payloads": [...]}`` (protobuf JSON: base64 metadata and data) to ``<endpoint>/decode``
and ``<endpoint>/encode`` and shows what comes back. This server answers with ``models.codec`` and the
key of whoever runs it (``DURASTACK_CODEC_KEY`` or ``$DURASTACK_HOME/codec.key``); a ciphertext of another
key is left as it is. It listens on 127.0.0.1 only and answers the browser only for the UI origins it
is given (CORS). ``durastack server`` runs it in-process for the embedded UI (``--ui-codec-endpoint``):
there, whoever can reach it can also reach the unauthenticated dev server, which runs commands as
this user, so it exposes nothing new.
"""

from __future__ import annotations

import asyncio
from typing import Iterable, Optional

import typer
from aiohttp import web
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from models.codec import SecretCodec

ALLOWED_HEADERS = "Content-Type, X-Namespace, Authorization"


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

    async def preflight(request: web.Request) -> web.StreamResponse:
        return cors(request, web.Response(status=204 if request.headers.get("Origin") in allowed else 403))

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

    app = web.Application(client_max_size=8 * 1024 * 1024)
    for name in ("encode", "decode"):
        app.router.add_post(f"/{name}", handler(name))
        app.router.add_route("OPTIONS", f"/{name}", preflight)
    return app


async def start_codec_server(codec: SecretCodec, port: int, origins: Iterable[str]) -> web.AppRunner:
    """Serve ``codec_app`` on 127.0.0.1:<port> until ``runner.cleanup()``."""
    runner = web.AppRunner(codec_app(codec, origins), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
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

        from models.codec import CodecKeyError, load_keys
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
                  "Ctrl-C to stop", flush=True)
            try:
                await asyncio.Event().wait()
            finally:
                await runner.cleanup()

        try:
            asyncio.run(serve())
        except KeyboardInterrupt:
            pass
