"""Block devices for the simulated hosts (tests/fakes/vpc.py), which have none.

A cloud disk is a directory the simulated VPC keeps for it (``disks/<cloud id>``): its files in ``fs/`` and, once
formatted, its filesystem's type in ``fstype``; a new disk has neither, as a new disk has no filesystem. While the
cloud says the disk is attached to an instance, that instance's host shows it at the device path a real one would
(``$DURASTACK_DEV/disk/by-id/…``: an EBS volume on a Nitro instance, a GCE disk by its device name), as a link to
that directory; detached, the link goes: no device. These stand-ins read that layout as the real tools read a disk:

* ``blkid -p -o value -s TYPE …``: prints the type of a formatted disk (exit 0); exit 2 when it finds nothing;
* ``mkfs.ext4 DEV``: formats a blank disk (refuses, as mke2fs would ask to, one that has a filesystem);
* ``mount DEV DIR``: bind-mounts the disk's files at DIR (in the host's own mount namespace, which ``ip netns exec``
  made); a disk without a filesystem fails as mount fails ("wrong fs type"). Any other mount is the real one.

``umount`` and ``mountpoint`` are the real ones.
"""

from __future__ import annotations

from pathlib import Path

BLKID = """#!/bin/sh
for dev; do :; done
if [ ! -e "$dev" ]; then echo "blkid: error: $dev: No such file or directory" >&2; exit 2; fi
if [ -f "$dev/fstype" ]; then cat "$dev/fstype"; exit 0; fi
exit 2
"""
MKFS = """#!/bin/sh
for dev; do :; done
if [ ! -e "$dev" ]; then echo "mke2fs: No such file or directory while trying to determine filesystem size" >&2; exit 1; fi
if [ -f "$dev/fstype" ]; then echo "$dev contains a $(cat "$dev/fstype") file system; Proceed anyway? (y,N)" >&2; exit 1; fi
mkdir -p "$dev/fs" && echo ext4 > "$dev/fstype"
"""
MOUNT = """#!/bin/sh
if [ $# -eq 2 ] && [ -d "$1" ] && case "$1" in "${DURASTACK_DEV:-/nonexistent}"/*) true;; *) false;; esac; then
  if [ ! -f "$1/fstype" ]; then
    echo "mount: $2: wrong fs type, bad option, bad superblock on $1, missing codepage or helper program, or other error." >&2
    exit 32
  fi
  exec /usr/bin/mount --bind "$1/fs" "$2"
fi
exec /usr/bin/mount "$@"
"""


def install(bin_dir: Path) -> None:
    """Put the stand-ins in a host's ``bin`` (first on its PATH)."""
    for name, text in (("blkid", BLKID), ("mkfs.ext4", MKFS), ("mount", MOUNT)):
        tool = bin_dir / name
        tool.write_text(text)
        tool.chmod(0o755)


def show(dev_dir: Path, disks_dir: Path, attached: dict[str, str]) -> None:
    """Make ``dev_dir`` show exactly the disks ``attached`` (device path under it → the disk's cloud id): a link for
    each, to its directory under ``disks_dir`` (made blank the first time a disk is seen); no link for any other."""
    by_id = dev_dir / "disk" / "by-id"
    by_id.mkdir(parents=True, exist_ok=True)
    for link in list(by_id.iterdir()):
        if str(link.relative_to(dev_dir)) not in attached:
            link.unlink()
    for device, disk in attached.items():
        target = disks_dir / disk
        target.mkdir(parents=True, exist_ok=True)
        link = dev_dir / device
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)


__all__ = ["install", "show"]
