"""Which `env` values are secret, and how they are marked when serialized (pure; no crypto here).

The rule, in one place (``is_secret``): an `env` entry is secret when

* its value was taken from the caller's environment (a bare ``K`` in the file; ``durastack apply``
  records the name in ``secrets``), or
* its name is listed in the configuration's ``secrets``, or
* its name looks secret: it contains TOKEN, SECRET, KEY, PASSWORD, PASSWD, PASS, PWD, CREDENTIAL,
  AUTH, PRIVATE, CERT, DSN, COOKIE, SESSION or DATABASE_URL (any case; HF_TOKEN, AWS_SECRET_ACCESS_KEY…).

Everything else (``MODEL_ID=llama``) stays readable in history and in the Web UI. Erring on the
secret side only costs readability, so the name test matches substrings.

Marking: in JSON mode a secret value serializes as ``SECRET_MARK + value``; ``connect.codec`` (the
Temporal payload codec) replaces each marked string with AES-GCM ciphertext (``ENCRYPTED_MARK…``)
before a payload leaves the process, and restores the marked string on the way in. Validation strips
the mark again, so models always hold the real value. The mark starts with NUL, which no environment
value can contain (execve cannot pass it), so it never collides with a user's value. Dumping with
``context=REDACT`` shows ``***`` instead (for people), with ``context=REVEAL`` the bare value (for
hashing what a replica runs).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Iterable, Mapping, Optional

from pydantic import BeforeValidator, FieldSerializationInfo, PlainSerializer

SECRET_MARK = "\x00durastack-secret:"
ENCRYPTED_MARK = "\x00durastack-encrypted:"
REDACTED = "***"
REDACT = {"secrets": "redact"}
REVEAL = {"secrets": "reveal"}
SECRET_NAME_RE = re.compile(
    r"TOKEN|SECRET|KEY|PASSWORD|PASSWD|PASS|PWD|CREDENTIAL|AUTH|PRIVATE|CERT|DSN|COOKIE|SESSION|DATABASE_URL",
    re.IGNORECASE)
SECRETS_DESCRIPTION = (
    "Names of `env` entries whose values are secret: encrypted in Temporal history and shown as *** by the CLI. "
    "Entries taken from your environment (a bare K) and names containing TOKEN, SECRET, KEY, PASSWORD, PASS, "
    "PWD, CREDENTIAL, AUTH, PRIVATE, CERT, DSN, COOKIE, SESSION or DATABASE_URL are secret without being listed.")


def is_secret(name: str, listed: Iterable[str] = ()) -> bool:
    return name in listed or bool(SECRET_NAME_RE.search(name))


def unmark(value: Any) -> Any:
    """The real value of a string read back from a payload; other values pass through."""
    if not isinstance(value, str):
        return value
    if value.startswith(ENCRYPTED_MARK):
        # Only a client without durastack's data converter (connect.codec) can get here.
        raise ValueError("an encrypted secret reached this process undecrypted: connect with durastack's data "
                         "converter (connect.connection.client_options) and the DURASTACK_CODEC_KEY in use")
    if value.startswith(SECRET_MARK):
        return value[len(SECRET_MARK):]
    if "\x00" in value:
        raise ValueError("an environment value cannot contain a NUL character")
    return value


def unmark_env(value: Any) -> Any:
    """BeforeValidator of an env mapping: strip the marks of the values serialized by ``dump_env``."""
    if isinstance(value, Mapping):
        return {k: unmark(v) for k, v in value.items()}
    return value


def _secret_form(value: str, context: Any) -> str:
    """A secret value as JSON: marked (default), redacted or revealed per ``context``."""
    mode = context.get("secrets") if isinstance(context, Mapping) else None
    return value if mode == "reveal" else REDACTED if mode == "redact" else SECRET_MARK + value


def dump_secret(value: str, context: Any) -> str:
    """JSON form of a value that is secret whatever its name (a key); an empty one stays empty."""
    return _secret_form(value, context) if value else value


def dump_env(env: Mapping[str, Optional[str]], listed: Iterable[str], context: Any) -> dict[str, Optional[str]]:
    """JSON form of an env mapping: its secret values in their secret form (``_secret_form``)."""
    listed = set(listed)
    return {name: value if value is None or not is_secret(name, listed) else _secret_form(value, context)
            for name, value in env.items()}


def _dump_secret_json(value: str, info: FieldSerializationInfo) -> str:
    return dump_secret(value, info.context)


# A string that is secret whatever its field's name (a key): marked in JSON, so the codec encrypts it.
SecretText = Annotated[str, BeforeValidator(unmark), PlainSerializer(_dump_secret_json, when_used="json")]
