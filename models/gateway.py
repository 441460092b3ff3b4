"""Gateway state and statistics: what the gateway routes, the tokens it accepts, and what it reports.

Pure data plus pure state transitions; the gateway app persists :class:`GatewayState` as JSON and
renders nginx configuration from it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from datetime import datetime
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from models.common import Model

SERVICE_NAME_PATTERN = r"^[a-z][a-z0-9-]{0,62}$"  # a DNS label: the service is also <name>.localhost
GROUP_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
REPLICA_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$"  # e.g. "svc/0/r3-s0"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
TOKEN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
TOKEN_PREFIX_CHARS = 6  # shown to tell tokens apart: 36 of a token's 256 random bits, nothing to guess from
WINDOWS = (30, 60, 300)  # stats windows in seconds
DEFAULT_COLD_START_TIMEOUT = 300  # seconds a request may wait in the activator for a first replica
MAX_COLD_START_TIMEOUT = 86400
MAX_UNAVAILABLE = 1024  # characters of a route's `unavailable` reason

# The control API's bearer token, made on the gateway's first start in its runtime dir (mode 600) unless
# DURASTACK_GATEWAY_CONTROL_TOKEN gives one; the CLI and the worker of the same home read it from there.
CONTROL_TOKEN_FILE = "control.token"

# A rate limit's path prefix becomes part of an nginx `location` line: characters that cannot break it only.
RATE_LIMIT_PREFIX_PATTERN = r"^/[A-Za-z0-9._~%!&()*+,=:@/-]*$"
RATE_LIMIT_HEADER_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_RATE_LIMIT_RPS = 1_000_000  # what nginx's `rate=` and `burst=` take comfortably
MAX_RATE_LIMIT_BURST = 1_000_000

_UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the NUL; nginx -t refuses longer paths
_UNSAFE = re.compile(r"[\s;{}'\"\\#$]")  # would break out of an nginx `server` line


def hash_token(token: str) -> str:
    """The form in which a gateway token is stored: lowercase hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(token.encode()).hexdigest()


def read_control_token(runtime_dir) -> Optional[str]:
    """The control token the gateway of ``runtime_dir`` made, or None when there is none (yet) or it is unreadable."""
    from pathlib import Path

    try:
        return (Path(runtime_dir) / CONTROL_TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


class DuplicateToken(ValueError):
    """A token of that name exists already."""


class UnknownToken(LookupError):
    """No token of that name."""


class TokenInfo(Model):
    """What may be shown of a gateway token: never the token, nor its hash."""

    name: str = Field(pattern=TOKEN_NAME_PATTERN, description="Name given at creation, unique, e.g. 'default' or 'ci'.")
    prefix: str = Field(max_length=TOKEN_PREFIX_CHARS, description="The token's first characters, to recognise it.")
    created_at: datetime = Field(description="When the token was created (UTC).")
    services: Optional[tuple[Annotated[str, Field(pattern=SERVICE_NAME_PATTERN)], ...]] = Field(
        None, description="The services it opens, fixed at creation; None: every service with auth.")


class GatewayToken(TokenInfo):
    """A token as the gateway keeps it: hashed. Every route with ``auth`` of its ``services`` (all, if None) accepts
    it."""

    token_sha256: str = Field(pattern=SHA256_PATTERN,
                              description="hash_token() of the token; the token itself is never stored.")

    def info(self) -> TokenInfo:
        return TokenInfo(name=self.name, prefix=self.prefix, created_at=self.created_at, services=self.services)


class NewToken(TokenInfo):
    """Answer of POST /api/tokens: the only time the token is ever shown."""

    token: str = Field(description="The bearer token, in plain text; the gateway keeps only its hash.")


class TokenList(Model):
    """Answer of GET /api/tokens."""

    tokens: tuple[TokenInfo, ...] = Field((), description="Every token the gateway accepts, by name.")


class Upstream(Model):
    """One ready replica that the gateway may send a service's traffic to."""

    replica_id: str = Field(pattern=REPLICA_ID_PATTERN, description="Replica identity, e.g. 'svc/0/r3-s0'.")
    group: str = Field(pattern=GROUP_NAME_PATTERN, description="Replica group the replica belongs to.")
    address: str = Field(description="Where nginx connects: 'unix:/abs/path.sock' or '127.0.0.1:PORT'.")

    @field_validator("address")
    @classmethod
    def _check_address(cls, v: str) -> str:
        if _UNSAFE.search(v):
            raise ValueError(f"address contains a character nginx cannot take: {v!r}")
        if v.startswith("unix:"):
            path = v[len("unix:"):]
            if not path.startswith("/"):
                raise ValueError(f"a unix address needs an absolute path, got {v!r}")
            if len(path.encode()) > _UNIX_PATH_MAX:
                raise ValueError(f"unix socket path longer than {_UNIX_PATH_MAX} bytes: {path!r}")
            return v
        host, sep, port = v.rpartition(":")
        try:
            ipaddress.IPv4Address(host)
            ok = bool(sep) and port.isdigit() and 0 < int(port) < 65536
        except ValueError:
            ok = False
        if not ok:
            # IPv4 literals only: a host name would be resolved once, at nginx config load.
            raise ValueError(f"expected 'unix:/abs/path.sock' or 'IPV4:PORT', got {v!r}")
        return v


class RouteRateLimit(Model):
    """A request-rate limit of a route (nginx ``limit_req``): per client address or per header value; past
    the burst nginx answers 429. A request matches the limit with the longest prefix, as nginx locations do."""

    prefix: str = Field("/", max_length=1024, pattern=RATE_LIMIT_PREFIX_PATTERN,
                        description="Path prefix, relative to the service (\"/\": every path).")
    key: Literal["ip_address", "header"] = Field("ip_address", description="Count per client address or per header value.")
    header: Optional[str] = Field(None, pattern=RATE_LIMIT_HEADER_PATTERN,
                                  description="With key `header`: the header whose value is counted per. Requests "
                                              "without it are not limited.")
    rps: float = Field(ge=1 / 60, le=MAX_RATE_LIMIT_RPS, description="Allowed requests per second per key.")
    burst: int = Field(0, ge=0, le=MAX_RATE_LIMIT_BURST,
                       description="Requests allowed at once above the rate before 429.")

    @model_validator(mode="after")
    def _header_with_key(self) -> "RouteRateLimit":
        if (self.key == "header") != (self.header is not None):
            raise ValueError("`header` is required with key `header`, and only then")
        return self


class ServiceRoute(Model):
    """A service the gateway routes: auth settings and its ready replicas."""

    name: str = Field(pattern=SERVICE_NAME_PATTERN, description="Service name, routed as /services/<name>/ and <name>.localhost.")
    auth: bool = Field(True, description="Require 'Authorization: Bearer <token>' with one of the gateway's tokens "
                                         "(401 without, 403 with another).")
    upstreams: tuple[Upstream, ...] = Field((), description="Ready replicas, sorted by replica_id; empty means the activator holds requests.")
    cold_start_timeout: int = Field(
        DEFAULT_COLD_START_TIMEOUT, ge=0, le=MAX_COLD_START_TIMEOUT,
        description="Seconds the activator holds a request while the service has no ready replica, then 503 "
                    "with Retry-After; 0 answers 503 at once.")
    pass_authorization: bool = Field(
        False, description="With auth, hand the client's Authorization header (a gateway token, which opens every "
                           "service) on to the replica; off: nginx drops it. Without auth it always passes.")
    strip_prefix: bool = Field(True, description="Drop /services/<name> from the path before proxying to a replica; "
                                                 "false: the replica gets the path as the client sent it.")
    rate_limits: tuple[RouteRateLimit, ...] = Field((), max_length=64, description="Request-rate limits, unique by prefix.")
    unavailable: str = Field("", max_length=MAX_UNAVAILABLE, description=(
        "Why the service cannot serve now (its replicas crash-loop): with no upstream, the activator answers 503 "
        "with it at once instead of holding the request; '' holds."))

    @field_validator("rate_limits")
    @classmethod
    def _unique_prefixes(cls, v: tuple[RouteRateLimit, ...]) -> tuple[RouteRateLimit, ...]:
        if len({limit.prefix for limit in v}) != len(v):
            raise ValueError("each rate limit prefix may appear once")
        return v

    @model_validator(mode="before")
    @classmethod
    def _drop_route_tokens(cls, data: Any) -> Any:
        # A state.json of before the global tokens had per-route hashes: those are no longer accepted.
        if isinstance(data, dict) and "token_sha256" in data:
            data = {k: v for k, v in data.items() if k != "token_sha256"}
        return data

    @field_validator("upstreams")
    @classmethod
    def _sort_upstreams(cls, v: tuple[Upstream, ...]) -> tuple[Upstream, ...]:
        return _by_replica_id(v)


def _by_replica_id(upstreams) -> tuple[Upstream, ...]:
    """Unique by replica_id (the last one wins), sorted: a stable config for the same set."""
    by_id = {u.replica_id: u for u in upstreams}
    return tuple(by_id[k] for k in sorted(by_id))


class GatewayState(Model):
    """Everything the gateway routes. ``generation`` grows with every change that was applied."""

    services: dict[str, ServiceRoute] = Field(default_factory=dict, description="Routes by service name.")
    tokens: dict[str, GatewayToken] = Field(
        default_factory=dict, description="The tokens every route with auth accepts, by name; hashed only.")
    generation: int = Field(0, ge=0, description="Bumped on every applied change; served at /__generation.")

    def _with(self, services: dict[str, ServiceRoute], tokens: dict[str, GatewayToken] | None = None) -> "GatewayState":
        tokens = self.tokens if tokens is None else tokens
        if services == self.services and tokens == self.tokens:
            return self  # idempotent: no change, no new generation, no reload
        return GatewayState(services=services, tokens=tokens, generation=self.generation + 1)

    def put_service(self, name: str, auth: bool, cold_start_timeout: int | None = None,
                    pass_authorization: bool = False, strip_prefix: bool = True,
                    rate_limits: tuple[RouteRateLimit, ...] = (), unavailable: str = "") -> "GatewayState":
        """Create or update a route; its replicas stay. ``cold_start_timeout=None`` keeps the current one."""
        old = self.services.get(name)
        if cold_start_timeout is None:
            cold_start_timeout = old.cold_start_timeout if old else DEFAULT_COLD_START_TIMEOUT
        route = ServiceRoute(name=name, auth=auth, upstreams=old.upstreams if old else (),
                             cold_start_timeout=cold_start_timeout, pass_authorization=pass_authorization,
                             strip_prefix=strip_prefix, rate_limits=rate_limits, unavailable=unavailable)
        return self._with({**self.services, name: route})

    def add_token(self, token: GatewayToken) -> "GatewayState":
        """Raises DuplicateToken for a name in use: a token is never replaced silently."""
        if token.name in self.tokens:
            raise DuplicateToken(f"a token named {token.name!r} exists already")
        return self._with(self.services, {**self.tokens, token.name: token})

    def revoke_token(self, name: str) -> "GatewayState":
        """Raises UnknownToken: a typo must not look like a revocation."""
        if name not in self.tokens:
            raise UnknownToken(f"no token named {name!r}")
        return self._with(self.services, {k: v for k, v in self.tokens.items() if k != name})

    def delete_service(self, name: str) -> "GatewayState":
        return self._with({k: v for k, v in self.services.items() if k != name})

    def register(self, service: str, upstream: Upstream) -> "GatewayState":
        """Add or replace a replica; raises KeyError for an unknown service."""
        route = self.services[service]
        ups = [u for u in route.upstreams if u.replica_id != upstream.replica_id] + [upstream]
        return self._with({**self.services, service: route.model_copy(update={"upstreams": _by_replica_id(ups)})})

    def unregister(self, service: str, replica_id: str) -> "GatewayState":
        """Remove a replica; an unknown service or replica is not an error (cleanup may repeat)."""
        route = self.services.get(service)
        if route is None:
            return self
        ups = tuple(u for u in route.upstreams if u.replica_id != replica_id)
        return self._with({**self.services, service: route.model_copy(update={"upstreams": ups})})


class StatsWindow(Model):
    """Totals of one window."""

    requests: int = Field(0, ge=0, description="Replica hits in the window.")
    request_time: float = Field(0.0, ge=0, description="Average request time in seconds, 3 decimals; 0.0 without requests.")


class ServiceStats(Model):
    """A service's request totals per window, as the autoscaler reads them."""

    service: str = Field(description="Service name.")
    windows: dict[int, StatsWindow] = Field(description="Keyed by window seconds: 30, 60, 300.")
    per_group: Optional[dict[str, dict[int, StatsWindow]]] = Field(
        None, description="Same windows per replica group, for hits whose replica is known (not activator hits).")
    held: int = Field(0, ge=0, description="Requests the activator is holding right now, waiting for a first ready replica.")
    held_total: int = Field(0, ge=0, description="Requests the activator has held since the gateway started.")


class StatsReport(Model):
    """Answer of GET /api/stats: one entry per registered service, all-zero without traffic."""

    collected_at: float = Field(description="Unix time the windows were computed at.")
    services: dict[str, ServiceStats] = Field(default_factory=dict, description="Stats by service name.")


class PutServiceRequest(Model):
    """Body of PUT /api/services/{name}."""

    auth: bool = Field(True, description="Require a bearer token: one of the gateway's tokens (POST /api/tokens).")
    cold_start_timeout: Optional[int] = Field(
        None, ge=0, le=MAX_COLD_START_TIMEOUT,
        description=f"Seconds a request may be held for a first replica (0: 503 at once); "
                    f"omitted: keep the route's current value, {DEFAULT_COLD_START_TIMEOUT} for a new route.")
    pass_authorization: bool = Field(
        False, description="With auth, pass the client's Authorization header (a gateway token) on to the replica; "
                           "by default nginx drops it, since that token opens every service.")
    strip_prefix: bool = Field(True, description="Drop /services/<name> before proxying; false: pass the path unchanged.")
    rate_limits: tuple[RouteRateLimit, ...] = Field((), max_length=64, description="Request-rate limits, unique by prefix.")
    unavailable: str = Field("", max_length=MAX_UNAVAILABLE, description=(
        "Why the service cannot serve now: with no upstream, 503 with it at once instead of holding; '' holds."))



class CreateTokenRequest(Model):
    """Body of POST /api/tokens."""

    name: str = Field(pattern=TOKEN_NAME_PATTERN, description="A unique name: letters, digits, '_', '.', '-'.")
    services: Optional[tuple[Annotated[str, Field(pattern=SERVICE_NAME_PATTERN)], ...]] = Field(
        None, min_length=1, description="Only these services accept it; None: every service with auth.")


class RegisterReplicaRequest(Model):
    """Body of PUT /api/services/{name}/replicas/{replica_id}."""

    group: str = Field(pattern=GROUP_NAME_PATTERN, description="Replica group of the replica.")
    address: str = Field(description="'unix:/abs/path.sock' or '127.0.0.1:PORT'.")
