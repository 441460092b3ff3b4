"""The embedded Temporal's door: only whoever holds the home's codec key gets in.

The dev server runs in a network namespace of the home (``ds-<home tag>-tp``, loopback only): its gRPC port, Web
UI, HTTP API and metrics exist only there, so no local user can connect to them. The door is an nginx started
in that namespace on listening sockets the stack binds on the host's 127.0.0.1 (the same port numbers), and it
is the only way in:

* gRPC (the Temporal port): each call must carry ``authorization: Bearer <key>``, which the SDK and the
  ``temporal`` CLI send as their API key; anything else gets gRPC UNAUTHENTICATED. ``connect.connection`` sends
  it for every durastack process; ``durastack temporal-env`` prints it for the ``temporal`` CLI.
* The Web UI (the UI port): the Host must be this port on 127.0.0.1 or localhost (a page whose name was rebound
  to 127.0.0.1 fails), a request that changes anything must come from the UI's own Origin, and every request
  needs HTTP Basic credentials (user ``durastack``; ``durastack ui`` prints the password). Browsers keep those
  per origin, where a cookie on 127.0.0.1 would also go to every other local user's port.
* The codec endpoint the UI decrypts secrets with is served at ``/_durastack/codec`` behind the same login, so
  neither a process's arguments nor the page's settings hold a credential.

The keys are derived from the codec key (``connect.codec.derived_secret``): every holder computes them, none
reveals it. The configuration that holds them is mode 600 under the home; nginx's workers, which parse every
request, run as ``nobody`` when the stack runs as root (a process whose uid changed cannot be traced by that user).
"""

from __future__ import annotations

import base64
import os
import socket
from pathlib import Path

from connect.codec import CodecKeys, derived_secret
from connect.connection import API_KEY_PURPOSE
from models.settings import Settings

UI_USER = "durastack"
CODEC_PATH = "/_durastack/codec"
RUN_DIR = "door"  # under the home: the configuration, pid file and error log
WORKERS = "user nobody nogroup;\n"
# What a gRPC call may take: the worker's long polls last up to a minute, a query or an update up to the caller.
CALL_TIMEOUT = "1h"
UI_PURPOSE = "web ui password"
REFUSED = ("this Temporal takes the API key of its durastack home: run durastack as the home's owner, or see "
           "durastack temporal-env")
REALM = 'Basic realm="durastack Web UI (user durastack; durastack ui prints the password)", charset="UTF-8"'


def ui_password(keys: CodecKeys) -> str:
    return derived_secret(keys.keys[0], UI_PURPOSE)


def ui_endpoint(settings: Settings) -> str:
    """The codec endpoint the embedded UI is given: through the door, with no credential in it."""
    return f"{settings.ui_url}{CODEC_PATH}"


def _basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"{UI_USER}:{password}".encode()).decode()


def render(settings: Settings, keys: CodecKeys, run_dir: Path, codec_credential: str | None) -> str:
    """The door's nginx.conf. Every key of the rotation opens it: a client set up before the newest key was added
    keeps working. ``codec_credential``: the path segment the codec server wants (cli/codec_server.py); None
    when the stack runs none."""
    s = settings
    bearer = "".join(f'    "Bearer {derived_secret(k, API_KEY_PURPOSE)}" 1;\n' for k in keys.keys)
    basic = "".join(f'    "{_basic(derived_secret(k, UI_PURPOSE))}" 1;\n' for k in keys.keys)
    hosts = rf"(127\.0\.0\.1|localhost):{s.ui_port}"
    foreign = f"the Web UI answers only at {s.ui_url} (or localhost), to its own pages\\n"
    codec = "" if codec_credential is None else f"""
    location {CODEC_PATH}/ {{
      proxy_pass http://127.0.0.1:{s.codec_port}/{codec_credential}/;
      proxy_set_header Host 127.0.0.1:{s.codec_port};
    }}"""
    return f"""daemon off;
worker_processes 1;
pid {run_dir}/nginx.pid;
error_log {run_dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  server_tokens off;
  map_hash_bucket_size 256;  # the keys are long
  map $http_authorization $grpc_allowed {{
    default 0;
{bearer}  }}
  map $http_authorization $ui_login {{
    default 0;
{basic}  }}
  # Host, method and Origin: reads from any page of the UI's origin, changes only with its Origin.
  map "$http_host|$request_method|$http_origin" $ui_origin {{
    default 0;
    "~^{hosts}\\|(GET|HEAD)\\|$" 1;
    "~^{hosts}\\|[A-Z]+\\|http://{hosts}$" 1;
  }}
  upstream temporal {{ server 127.0.0.1:{s.temporal_port}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{s.temporal_port};
    http2 on;
    http2_max_concurrent_streams 1024;
    keepalive_requests 4294967295;
    keepalive_timeout {CALL_TIMEOUT};
    client_max_body_size 0;
    location / {{
      if ($grpc_allowed = 0) {{ return 418; }}
      error_page 418 = @refused;
      grpc_pass grpc://temporal;
      grpc_read_timeout {CALL_TIMEOUT};
      grpc_send_timeout {CALL_TIMEOUT};
      grpc_set_header Authorization "";
    }}
    location @refused {{
      default_type application/grpc;
      add_header grpc-status 16 always;
      add_header grpc-message "{REFUSED}" always;
      return 200 "";
    }}
  }}
  server {{
    listen 127.0.0.1:{s.ui_port};
    client_max_body_size 8m;
    proxy_http_version 1.1;
    proxy_buffering off;
    proxy_request_buffering off;
    proxy_max_temp_file_size 0;
    proxy_read_timeout 5m;
    proxy_set_header Authorization "";
    if ($ui_origin = 0) {{ return 403 "{foreign}"; }}
    if ($ui_login = 0) {{ return 401; }}
    error_page 401 @login;
    location @login {{
      add_header WWW-Authenticate '{REALM}' always;
      default_type text/plain;
      return 401 "log in as durastack, with the password durastack ui prints\\n";
    }}
    location / {{
      proxy_pass http://127.0.0.1:{s.ui_port};
    }}{codec}
  }}
}}
"""


def listeners(settings: Settings) -> list[socket.socket]:
    """The door's listening sockets, bound here on the host, in the order of their ``listen`` lines. The stack holds
    them for its whole life, so a restarted door (or a slow one) loses no connection: they wait in the backlog."""
    made = []
    try:
        for port in (settings.temporal_port, settings.ui_port):
            sock = socket.create_server(("127.0.0.1", port), backlog=511)
            # nginx does not make an inherited socket non-blocking; a blocking one can stall a worker in accept(2).
            sock.setblocking(False)
            made.append(sock)
    except OSError:
        for sock in made:
            sock.close()
        raise
    return made


def write_config(run_dir: Path, text: str) -> Path:
    """``nginx.conf`` in ``run_dir`` (mode 600: it holds the keys). Nothing is buffered to disk (gRPC streams, the UI's
    proxy buffers nothing), so the workers need no directory of the home."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True, mode=0o700)  # nginx opens logs/error.log before its config
    path = run_dir / "nginx.conf"
    tmp = path.with_name("nginx.conf.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((WORKERS if os.geteuid() == 0 else "") + text)
    os.replace(tmp, path)
    return path


def argv(netns: Path, run_dir: Path) -> list[str]:
    from gateway.nginx import nginx_binary

    return ["nsenter", f"--net={netns}", "--", nginx_binary(), "-p", str(run_dir), "-c", str(run_dir / "nginx.conf")]


def inherited(socks: list[socket.socket]) -> dict[str, str]:
    """nginx's environment variable for the listening sockets it inherits."""
    return {"NGINX": "".join(f"{s.fileno()};" for s in socks)}


def possible() -> tuple[bool, str]:
    """Whether the door can be set up here (root, iproute2, nginx), and a line saying what that means."""
    from backends import local_net

    ok, why = local_net.probe()
    if ok:
        return True, "only this home's owner gets in (API key; the Web UI asks for a login: durastack ui)"
    return False, f"open to every local user of this machine ({why.partition(': ')[2]})"
