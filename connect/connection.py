"""How every durastack process connects to Temporal: address, namespace, TLS / mTLS / API key, data converter.

``Client.connect(**client_options(settings))`` is the one way in, for the CLI, the worker, the server
supervisor, tests and benchmarks, so that all of them share the codec that encrypts secrets
(connect.codec) and the TLS settings (models.settings, ``DURASTACK_TEMPORAL_TLS*``, ``…_API_KEY``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from temporalio.service import TLSConfig

from connect.codec import CodecKeyError, derived_secret, home_data_converter, load_keys
from models.settings import TEMPORAL_TLS_ENV, Settings


API_KEY_PURPOSE = "temporal api key"  # the embedded Temporal's key, derived from the codec key


class TemporalConfigError(ValueError):
    """The connection settings are incomplete or unreadable; the message names the variable to fix."""


def client_options(settings: Settings, environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """Keyword arguments of ``Client.connect`` from ``settings`` (the codec key: connect.codec.load_keys, on need)."""
    options: dict[str, Any] = {"target_host": settings.address, "namespace": settings.namespace,
                               "data_converter": home_data_converter(settings.home, environ)}
    tls = tls_config(settings)
    if tls is not None:
        options["tls"] = tls
    if settings.temporal_api_key is not None:
        options["api_key"] = settings.temporal_api_key.get_secret_value()
    elif settings.temporal_address is None:
        key = embedded_api_key(settings, environ)
        if key is not None:  # plain gRPC all the same: the door is on this machine's loopback
            options.update(api_key=key, tls=False)
    return options


def embedded_api_key(settings: Settings, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The key the embedded Temporal's door takes (cli/door.py), derived from the home's codec key; None when this
    process cannot read that key (it is then refused, and told why)."""
    try:
        return derived_secret(load_keys(settings.home, environ).keys[0], API_KEY_PURPOSE)
    except CodecKeyError:
        return None


def tls_config(settings: Settings) -> Optional[TLSConfig]:
    """The TLS of the connection, or None for plain gRPC (the embedded dev server)."""
    s = settings
    var = TEMPORAL_TLS_ENV
    if (s.temporal_tls_cert is None) != (s.temporal_tls_key is None):
        have, need = ("temporal_tls_cert", "temporal_tls_key") if s.temporal_tls_key is None else \
            ("temporal_tls_key", "temporal_tls_cert")
        raise TemporalConfigError(f"mTLS needs both a client certificate and its key: {var[have]} is set, "
                                  f"{var[need]} is not")
    given = [v for f, v in var.items() if f != "temporal_tls" and getattr(s, f) is not None]
    if s.temporal_tls is False and given:
        raise TemporalConfigError(f"{var['temporal_tls']}=off, but {', '.join(given)} "
                                  f"{'is' if len(given) == 1 else 'are'} set, which needs TLS: unset one or the other")
    if not (s.temporal_tls or given):
        return None
    return TLSConfig(server_root_ca_cert=_read(s.temporal_tls_ca, var["temporal_tls_ca"]),
                     client_cert=_read(s.temporal_tls_cert, var["temporal_tls_cert"]),
                     client_private_key=_read(s.temporal_tls_key, var["temporal_tls_key"]),
                     domain=s.temporal_tls_server_name)


def uses_tls(settings: Settings) -> bool:
    return tls_config(settings) is not None


def _read(path: Optional[Path], var: str) -> Optional[bytes]:
    if path is None:
        return None
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TemporalConfigError(f"{var}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise TemporalConfigError(f"{var}: {path} is not a PEM file (no -----BEGIN line)")
    return data


def connect_failure(settings: Settings, error: BaseException) -> str:
    """Why ``Client.connect`` failed, with the settings that may fix it (the SDK's text is in Rust terms)."""
    text = str(error) or type(error).__name__
    if not uses_tls(settings):
        return f"cannot connect to Temporal at {settings.address} ({text})"
    message = f"cannot connect to Temporal at {settings.address} over TLS ({text}); "
    check = "check DURASTACK_TEMPORAL_TLS_CA/_CERT/_KEY/_SERVER_NAME and DURASTACK_TEMPORAL_API_KEY"
    if settings.temporal_tls_cert is not None:
        return message + check
    # A server that wants a client certificate hangs up during the handshake; rustls and hyper report that
    # as an alert, an EOF, a closed connection or a broken pipe depending on timing, so say it either way.
    closed = any(s in text for s in ("close_notify", "UnexpectedEof", "CertificateRequired", "certificate required",
                                     "connection closed", "broken pipe", "reset by peer", "ConnectionReset"))
    return message + ("the server ended the connection during TLS setup: " if closed else "") + (
        "if it requires a client certificate (mTLS), set DURASTACK_TEMPORAL_TLS_CERT and DURASTACK_TEMPORAL_TLS_KEY; "
        f"else {check}")
