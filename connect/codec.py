"""The payload codec that keeps secret env values out of Temporal history and the Web UI.

``models.secrets`` marks secret values when a model is serialized; ``SecretCodec.encode`` replaces
each marked string of a JSON payload with AES-GCM ciphertext and leaves the rest of the payload
as it was, so history stays readable (counts, commands, events) while secrets are not. ``decode``
restores the marked strings; validation then strips the mark. The codec runs in the client and the
worker outside the workflow sandbox, so workflow code never sees ciphertext.

A payload past ``COMPRESS_ABOVE`` bytes (after that) is sent zlib-compressed, whole, as ``binary/zlib``: what
continues as new carries a whole state (a backend's fleet monitor carries every replica it watches: 6,000 made
2.3 MB of JSON, past Temporal's 2 MB limit on a payload, and 0.1 MB compressed). The Web UI's codec server
decodes it like any other, so history stays readable there.

Why field-level rather than whole-payload encryption: the service workflow's input carries the whole
state (configuration, replicas, events) across every continue-as-new; encrypting it whole would hide
every decision from the Web UI for the sake of one token.

The key: ``DURASTACK_CODEC_KEY`` — standard or URL-safe base64 of 32 random bytes
(``python -c "import os,base64; print(base64.b64encode(os.urandom(32)).decode())"``); a comma list
rotates keys: the first encrypts, every one decrypts. Without it, ``$DURASTACK_HOME/codec.key`` (same
format, mode 600), which ``durastack server`` creates. Every process of one deployment — CLI, workers,
codec server — needs the same key. A ciphertext names its key by id (8 hex digits of the key's
SHA-256), so a process holding another key says so instead of failing obscurely.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter, pydantic_data_converter
from temporalio.converter import (CompositePayloadConverter, DataConverter, DefaultPayloadConverter,
                                  JSONPlainPayloadConverter, PayloadCodec)

from connect.files import write_once
from models.history import lenient
from models.secrets import ENCRYPTED_MARK, SECRET_MARK
from models.validation import broken_rules

log = logging.getLogger("durastack.codec")
KEY_ENV = "DURASTACK_CODEC_KEY"
KEY_FILE = "codec.key"
KEY_FORMAT = "base64 of 32 random bytes, e.g. from `head -c32 /dev/urandom | base64`"
VERSION = "v1"
_AAD = b"durastack-secret-" + VERSION.encode()
# The marks as they appear in JSON bytes: the byte test that lets payloads without secrets through untouched.
_SECRET_JSON = json.dumps(SECRET_MARK)[1:-1].encode()
_ENCRYPTED_JSON = json.dumps(ENCRYPTED_MARK)[1:-1].encode()
_JSON = b"json/plain"
_ZLIB = b"binary/zlib"
COMPRESS_ABOVE = 64 * 1024  # bytes; smaller payloads stay plain JSON, readable in history without the codec


class CodecKeyError(ValueError):
    """No usable key, or a ciphertext this process cannot decrypt; the message says what to set."""


@dataclass(frozen=True)
class CodecKeys:
    """The keys of this process: ``keys[0]`` encrypts; any decrypts the ciphertexts naming its id."""

    keys: tuple[bytes, ...]
    source: str  # where they came from, for messages

    @property
    def ids(self) -> list[str]:
        return [key_id(k) for k in self.keys]

    def digest(self, purpose: str, data: bytes) -> str:
        """A keyed hash of ``data`` (HMAC-SHA256 with the key that encrypts, 16 hex digits), for identifiers that
        go into history in clear but hash secret values: without the key, nobody can test guesses against it."""
        return hmac.new(self.keys[0], purpose.encode() + b"\0" + data, hashlib.sha256).hexdigest()[:16]


def derived_secret(key: bytes, purpose: str) -> str:
    """A secret for ``purpose`` derived from a codec key, 43 url-safe characters: every holder of the key computes
    the same one, and it reveals nothing of the key."""
    digest = hmac.new(key, b"durastack secret for: " + purpose.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:8]


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def parse_keys(text: str, source: str) -> CodecKeys:
    keys = []
    for i, item in enumerate(p.strip() for p in text.split(",")):
        try:
            raw = base64.b64decode(item + "=" * (-len(item) % 4), altchars=b"-_" if "-" in item or "_" in item
                                   else None, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != 32:
            which = f"key {i + 1} of {source}" if "," in text else source
            raise CodecKeyError(f"{which} is not a valid codec key: expected {KEY_FORMAT}; set {KEY_ENV} "
                                "to the key the other durastack processes use")
        keys.append(raw)
    return CodecKeys(tuple(keys), source)


def load_keys(home: Path, environ: Optional[Mapping[str, str]] = None) -> CodecKeys:
    """``DURASTACK_CODEC_KEY``, else ``<home>/codec.key``; neither → CodecKeyError naming both."""
    env = os.environ if environ is None else environ
    if env.get(KEY_ENV, "").strip():
        return parse_keys(env[KEY_ENV], KEY_ENV)
    path = Path(home) / KEY_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise CodecKeyError(f"no codec key: set {KEY_ENV} ({KEY_FORMAT}) to the key your durastack workers use, "
                            f"or run `durastack server` once with this home to create {path}") from None
    except OSError as e:
        raise CodecKeyError(f"cannot read the codec key {path}: {e.strerror}; or set {KEY_ENV}") from None
    return parse_keys(text, str(path))


def ensure_key_file(home: Path, environ: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """Create ``<home>/codec.key`` (mode 600) unless ``DURASTACK_CODEC_KEY`` is set or the file exists."""
    env = os.environ if environ is None else environ
    if env.get(KEY_ENV, "").strip():
        return None
    path = Path(home) / KEY_FILE
    write_once(path, new_key() + "\n", 0o600)  # two starters, one key
    return path


class SecretCodec(PayloadCodec):
    """Encrypts the marked strings of JSON payloads (see the module doc).

    ``keys`` may be a loader, called on first need: a command that moves no secret needs no key.
    ``strict=False`` (the Web UI's codec server) leaves a ciphertext it cannot decrypt as it is.
    """

    def __init__(self, keys: CodecKeys | Callable[[], CodecKeys], strict: bool = True) -> None:
        self._keys = keys if isinstance(keys, CodecKeys) else None
        self._load = keys if callable(keys) else None
        self.strict = strict

    def keys(self) -> CodecKeys:
        if self._keys is None:
            assert self._load is not None
            self._keys = self._load()
        return self._keys

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [_compress(self._rewrite(p, _SECRET_JSON, self._encrypt)) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self._rewrite(_decompress(p), _ENCRYPTED_JSON, self._decrypt) for p in payloads]

    def _rewrite(self, payload: Payload, mark: bytes, change: Callable[[str], str]) -> Payload:
        if mark not in payload.data or payload.metadata.get("encoding") != _JSON:
            return payload
        value = _walk(json.loads(payload.data), change)
        out = Payload()
        out.CopyFrom(payload)
        out.data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        return out

    def _encrypt(self, text: str) -> str:
        if not text.startswith(SECRET_MARK):
            return text
        key = self.keys().keys[0]
        nonce = os.urandom(12)
        sealed = AESGCM(key).encrypt(nonce, text[len(SECRET_MARK):].encode(), _AAD)
        return f"{ENCRYPTED_MARK}{VERSION}:{key_id(key)}:{base64.urlsafe_b64encode(nonce + sealed).decode()}"

    def _decrypt(self, text: str) -> str:
        if not text.startswith(ENCRYPTED_MARK):
            return text
        version, kid, blob = (text[len(ENCRYPTED_MARK):].split(":", 2) + ["", ""])[:3]
        keys = self.keys()
        key = dict(zip(keys.ids, keys.keys)).get(kid)
        try:
            if version != VERSION or key is None:
                raise InvalidTag()
            raw = base64.urlsafe_b64decode(blob)
            return SECRET_MARK + AESGCM(key).decrypt(raw[:12], raw[12:], _AAD).decode()
        except (InvalidTag, ValueError, binascii.Error):
            if not self.strict:
                return text
            raise CodecKeyError(f"a secret in this payload was encrypted with codec key {kid or '?'} ({version}); "
                                f"this process has key {', '.join(keys.ids)} from {keys.source}. Set {KEY_ENV} "
                                "to the key the other durastack processes use") from None


def _compress(payload: Payload) -> Payload:
    """The payload itself, compressed whole, when it is past ``COMPRESS_ABOVE`` (its secrets already sealed)."""
    if len(payload.data) <= COMPRESS_ABOVE:
        return payload
    return Payload(metadata={"encoding": _ZLIB}, data=zlib.compress(payload.SerializeToString()))


def _decompress(payload: Payload) -> Payload:
    if payload.metadata.get("encoding") != _ZLIB:
        return payload
    return Payload.FromString(zlib.decompress(payload.data))


def _walk(value: Any, change: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, list):
        return [_walk(v, change) for v in value]
    if isinstance(value, dict):
        return {k: _walk(v, change) for k, v in value.items()}
    return value


class HistoryJSONConverter(PydanticJSONPlainPayloadConverter):
    """The pydantic JSON converter, except that a payload today's model rules refuse is read leniently
    (``models.history``): what history holds was admitted under the rules of its day."""

    def from_payload(self, payload: Payload, type_hint: Optional[type] = None) -> Any:
        try:
            return super().from_payload(payload, type_hint)
        except ValidationError as e:
            if type_hint is None:
                raise
            log.warning("%s read back without today's rules, which it does not meet: %s",
                        getattr(type_hint, "__name__", type_hint), broken_rules(e))
            return lenient(type_hint, json.loads(payload.data))


class PayloadConverter(CompositePayloadConverter):
    """Temporal's default converters, with ``HistoryJSONConverter`` for JSON."""

    def __init__(self) -> None:
        history = HistoryJSONConverter()
        super().__init__(*(history if isinstance(c, JSONPlainPayloadConverter) else c
                           for c in DefaultPayloadConverter.default_encoding_payload_converters))


def data_converter(codec: PayloadCodec) -> DataConverter:
    """The pydantic data converter with ``codec``: what every durastack client and worker uses."""
    return dataclasses.replace(pydantic_data_converter, payload_converter_class=PayloadConverter,
                               payload_codec=codec)


def home_data_converter(home: Path, environ: Optional[Mapping[str, str]] = None) -> DataConverter:
    """The data converter of a process whose key comes from the environment or ``home`` (loaded on need)."""
    return data_converter(SecretCodec(lambda: load_keys(home, environ)))
