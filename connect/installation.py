"""The control plane's id, tagged on every cloud instance it makes (``BackendsConfig.installation``).

It belongs with the connection: every worker of one deployment must derive the same id, and what they share
is the Temporal server they connect to (its address and namespace) or, for the embedded one, the home.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional

from connect.files import write_once
from models.backends import INSTALLATION_PATTERN


def installation_id(temporal_address: Optional[str], namespace: str, home: Path) -> str:
    """The control plane's id when DURASTACK_INSTALLATION is not set.

    With an external Temporal, from its address and namespace: every worker of one deployment derives the same
    id (a provisioning retry on another worker must find the same key). With the embedded one of `durastack
    server`, a random id kept in the home, which its workers share: two laptops never look alike."""
    if temporal_address:
        return "t-" + hashlib.sha256(f"{temporal_address}/{namespace}".encode()).hexdigest()[:12]
    path = Path(home) / "installation"
    value = write_once(path, "h-" + os.urandom(6).hex() + "\n").strip()  # workers starting together agree
    if not re.match(INSTALLATION_PATTERN, value):
        raise ValueError(f"{path}: not an installation id ({value!r}); remove it to make a new one")
    return value
