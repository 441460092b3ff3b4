"""Files in the durastack home that are made once and then only read: the codec key, the installation id."""

from __future__ import annotations

import os
from pathlib import Path


def write_once(path: Path, text: str, mode: int = 0o644) -> str:
    """The content of ``path``, after writing ``text`` there if the file did not exist.

    The text goes whole into a draft that is then hard-linked into place: processes starting together agree on
    the first one written, and none ever reads a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        draft = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
        with os.fdopen(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
            f.write(text)
        try:
            os.link(draft, path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_text()
