"""Pulling a private image: ``registry_auth`` and the registry an image reference names (pure).

dstack's form, which files bring unchanged::

    image: nvcr.io/nim/meta/llama-3.1-8b-instruct:latest
    env: [NGC_API_KEY]
    registry_auth:
      username: $oauthtoken
      password: ${{ env.NGC_API_KEY }}

``${{ env.NAME }}`` takes the value of the service's ``env`` entry NAME when the replica's job is built (the entry
may itself come from the caller's environment: a bare ``NAME``). The password is secret wherever it is written:
encrypted in Temporal history, ``***`` for people, sent to the instance over SSH for the pull only, never in user
data, metadata or logs.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Annotated, Mapping

from pydantic import AfterValidator, Field

from models.common import Model
from models.secrets import SecretText

ENV_REF = re.compile(r"\$\{\{\s*env\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
DOCKER_HUB = "https://index.docker.io/v1/"  # the key Docker's own config uses for Docker Hub


def _credential(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    if len(value) > 16384:
        raise ValueError("is longer than 16384 characters")
    return value


Credential = Annotated[SecretText, AfterValidator(_credential)]


class RegistryAuth(Model):
    username: Credential = Field(description=(
        "User name at the image's registry (e.g. `$oauthtoken` for NGC, `AWS` for ECR); `${{ env.NAME }}` takes "
        "an `env` entry's value. Kept secret as the password is (it may come from a secret entry)."))
    password: Credential = Field(description=(
        "Password or token; `${{ env.NAME }}` takes an `env` entry's value. Secret: encrypted in history, sent to "
        "the instance over SSH for the pull only."))

    def env_names(self) -> list[str]:
        """The ``env`` entries it names."""
        return [m[1] for text in (self.username, self.password) for m in ENV_REF.finditer(text)]

    def resolved(self, env: Mapping[str, str]) -> "RegistryAuth":
        """With each ``${{ env.NAME }}`` replaced by the entry's value (empty when the job has none)."""
        sub = lambda text: ENV_REF.sub(lambda m: env.get(m[1], ""), text)  # noqa: E731
        return RegistryAuth.model_construct(username=sub(self.username), password=sub(self.password))


def registry_of(image: str) -> str:
    """The registry an image reference pulls from, as Docker reads it: the first path component when it has a
    ``.`` or a ``:`` or is ``localhost``, else Docker Hub."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return DOCKER_HUB


def docker_config(image: str, auth: RegistryAuth) -> str:
    """A Docker client ``config.json`` holding the credentials for ``image``'s registry (what ``docker login``
    writes without a credential store)."""
    token = base64.b64encode(f"{auth.username}:{auth.password}".encode()).decode()
    return json.dumps({"auths": {registry_of(image): {"auth": token}}})


__all__ = ["DOCKER_HUB", "ENV_REF", "RegistryAuth", "docker_config", "registry_of"]
