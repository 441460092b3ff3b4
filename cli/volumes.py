"""Network volumes from the command line, as dstack users know them: ``durastack apply -f vol.yml`` of a ``type:
volume`` file makes one (``size``) or registers an existing one (``volume_id``), ``durastack volume list`` shows
them and ``durastack volume delete NAME`` deletes one (a registered one is only forgotten). And, for a service's
``apply``, where its network volumes put its replicas (``plan``).

The clouds are called from here, with config.yml's credentials, as ``durastack offers`` and the plan call them; the
store (``DURASTACK_DATABASE_URL``, else the home's SQLite) keeps each volume, where the workers read it when they
place and start a replica that mounts it. The CLI never migrates the store: ``durastack db upgrade`` (or the worker,
when it starts) does.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import typer

from cli.client import EXIT_CONTROL_PLANE_DOWN
from cli.console import err, out, print_errors, user_error
from cli.render import age
from models.settings import Settings
from models.volumes import VOLUME_NAME_RE, VolumeConfiguration, VolumeRecord, Where, network_names, placement

volume_app = typer.Typer(no_args_is_help=True, help="Network volumes (`type: volume` files, applied with `durastack "
                         "apply -f`): list them, delete one.")


def _volumes(write: bool = False):
    """The store's volumes. Writing needs the store at the latest revision (it has the table); reading one that is
    not there yet, or older, reads as no volume (None)."""
    from sqlalchemy.exc import SQLAlchemyError

    from store import Store, database_url, head_revision
    from store.volumes import VolumeStore

    store = Store(database_url(Settings.from_env().home), upgrade=False)
    try:
        ready = (store.sqlite_path is None or store.sqlite_path.exists()) and store.current() == head_revision()
    except SQLAlchemyError as e:
        err.print(f"store {store.where()}: {e}", style="red", markup=False)
        raise typer.Exit(EXIT_CONTROL_PLANE_DOWN)
    if not ready:
        if write:
            raise user_error(f"the store ({store.where()}) is not at the latest revision: start `durastack server` "
                             "(its worker migrates it) or run `durastack db upgrade`")
        return None
    return VolumeStore(store)


def _disks(backend: str):
    from backends.cloud import make_backends
    from backends.volumes import disks_of
    from models.backends import load_backends_config

    try:
        clouds = make_backends(load_backends_config(os.environ))
    except (OSError, ValueError) as e:
        raise user_error(f"config.yml: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    if backend not in clouds:
        raise user_error(f"backend: {backend} is not configured in config.yml (backends.{backend})")
    return clouds[backend], disks_of(clouds[backend])


def apply_volume(file: Path, yes: bool) -> None:
    """Make or register the volume a ``type: volume`` file describes; one of that name already there must match it."""
    from backends.cloud_errors import CloudError
    from backends.volumes import VolumeError
    from cli.service import _confirm
    from models.loader import load_volume_file

    result = load_volume_file(file)
    if not result.valid:
        print_errors(result, file)
        raise typer.Exit(1)
    cfg = result.config
    name = cfg.name or file.stem
    if not VOLUME_NAME_RE.fullmatch(name):
        raise user_error(f"{file}: set `name:` (the file name {file.stem!r} is not a valid volume name)")
    volumes = _volumes(write=True)
    existing = volumes.get(name)
    if existing is not None:
        differs = _differences(cfg, existing)
        if differs:
            raise user_error(f"volume {name} exists ({existing.summary()}) with another {', '.join(differs)}; a "
                             f"volume is not changed in place: `durastack volume delete {name}` first")
        out.print(f"Volume {name} exists already ({existing.summary()}): nothing to do.", markup=False)
        return
    cloud, disks = _disks(cfg.backend)
    if cfg.region not in cloud.regions:
        raise user_error(f"region: {cfg.region} is not one of backends.{cfg.backend}.regions in config.yml "
                         f"({', '.join(cloud.regions)}): no replica could be placed beside it")
    verb = "Register" if cfg.volume_id else "Create"
    _confirm(f"Volume {name} does not exist yet. {verb} the volume?", yes)
    try:
        record = disks.register(name, cfg) if cfg.volume_id else disks.create(name, cfg)
    except (CloudError, VolumeError) as e:
        raise user_error(f"volume {name}: {getattr(e, 'message', None) or e}")
    kept = volumes.add(record)
    _print_table([kept])


def _differences(cfg: VolumeConfiguration, record: VolumeRecord) -> list[str]:
    """The fields of ``cfg`` the kept volume has otherwise (one the file leaves unset differs only for `volume_id`:
    made or registered)."""
    kept = {"backend": record.backend, "region": record.region, "availability_zone": record.zone,
            "size": None if record.registered else record.size_gb,
            "volume_id": record.cloud_id if record.registered else None}
    given = cfg.model_dump(include=set(kept))
    return [k for k in kept if given[k] != kept[k] and (given[k] is not None or k == "volume_id")]


def _print_table(records: list[VolumeRecord]) -> None:
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "BACKEND", "REGION", "ZONE", "VOLUME", "SIZE", "CREATED"):
        table.add_column(column)
    for r in records:
        table.add_row(r.name, r.backend, r.region, r.zone, r.cloud_id + (" (registered)" if r.registered else ""),
                      f"{r.size_gb}GB", age(r.created_at))
    out.print(table)


@volume_app.command("list")
def list_volumes(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The network volumes made or registered with `durastack apply -f`."""
    volumes = _volumes()
    records = volumes.all() if volumes is not None else []
    if as_json:
        out.print_json(json.dumps([r.model_dump(mode="json") for r in records]))
    elif records:
        _print_table(records)
    else:
        out.print("No volumes. Make one with `durastack apply -f` of a `type: volume` file.", markup=False)


@volume_app.command("delete")
def delete_volume(name: str = typer.Argument(..., help="Volume name."),
                  yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask for confirmation.")) -> None:
    """Delete a volume and its data (one registered with `volume_id` is only forgotten; its disk stays). A volume
    attached to an instance is refused: stop the service that mounts it first."""
    from backends.cloud_errors import CloudError
    from backends.volumes import VolumeBusy, VolumeError
    from cli.service import _confirm

    volumes = _volumes(write=True)
    record = volumes.get(name)
    if record is None:
        raise user_error(f"no volume {name} (`durastack volume list`)")
    what = "forget it (the disk stays)" if record.registered else "delete it with its data"
    _confirm(f"Volume {name} ({record.summary()}): {what}?", yes)
    if not record.registered:
        _, disks = _disks(record.backend)
        try:
            disks.delete(record)
        except VolumeBusy as e:
            raise user_error(f"{e}: stop the service that mounts it first")
        except (CloudError, VolumeError) as e:
            raise user_error(f"volume {name}: {getattr(e, 'message', None) or e}")
    volumes.remove(name)
    out.print(f"Volume {name} {'forgotten' if record.registered else 'deleted'}.", markup=False)


def plan(config, queries: list) -> tuple[list, list[str]]:
    """A service's plan: each group's query narrowed to where its network volumes are (``models.volumes.placement``,
    as the launch narrows it), a line per volume printed; and the problems (a volume that does not exist, volumes
    and the service's own narrowing that leave no place)."""
    names = network_names(config.volumes)
    if not names:
        return queries, []
    volumes = _volumes()
    if volumes is None:
        return queries, [f"volumes: the store knows no volume yet, {', '.join(names)} included (start `durastack "
                         "server`, whose worker brings the store up to date, or run `durastack db upgrade`)"]
    found = {n: volumes.get(n) for n in names}
    missing = [n for n, r in found.items() if r is None]
    if missing:
        return queries, [f"volumes: no volume {', '.join(missing)} (make it with `durastack apply -f` of a `type: "
                         "volume` file; `durastack volume list`)"]
    records = [found[n] for n in names]
    for mount in config.volumes:
        if mount.network:
            out.print(f"  volume {mount.name} at {mount.path}: {found[mount.name].summary()}", markup=False)
    narrowed, problems = [], []
    for q in queries:
        where, why = placement(Where(backends=q.backends, regions=q.regions, zones=q.zones), records)
        if why:
            problems.append(f"group {q.name}: {why}")
        narrowed.append(dataclasses.replace(q, backends=where.backends, regions=where.regions, zones=where.zones))
    return narrowed, problems


def register(app: typer.Typer) -> None:
    app.add_typer(volume_app, name="volume")


__all__ = ["apply_volume", "plan", "register"]
