"""``durastack ssh-keys``: the installation's SSH key pair and host-key seed (backends/ssh_keys.py), made ahead of
the workers, for a directory they only read (a Kubernetes Secret)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.console import out, user_error


def register(app: typer.Typer) -> None:
    @app.command(name="ssh-keys")
    def ssh_keys(
        directory: Optional[Path] = typer.Argument(
            None, help="Where the two files go (default: DURASTACK_SSH_DIR, else $DURASTACK_HOME/ssh).",
            metavar="DIRECTORY", show_default=False),
    ) -> None:
        """Make the SSH key pair (id_ed25519) and host-key seed (host_seed) in DIRECTORY unless they are there,
        and print the public key instances authorize. Every worker and CLI user of one deployment needs these
        same files in DURASTACK_SSH_DIR; instances launched with them accept no other key, so back them up.
        Kubernetes: kubectl -n durastack create secret generic durastack-ssh --from-file=DIRECTORY
        """
        from backends.ssh_keys import CLIENT_KEY, HOST_SEED, SSHKeys, SSHKeysError, ssh_dir
        from models.settings import Settings

        try:
            keys = SSHKeys.at(directory or ssh_dir(Settings.from_env().home))
        except SSHKeysError as e:
            raise user_error(str(e))
        out.print(f"{keys.directory}: {CLIENT_KEY}, {HOST_SEED}", markup=False)
        out.print(keys.client_public(), markup=False)
