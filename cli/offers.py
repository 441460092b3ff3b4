"""``durastack offers``: the instance offers that fit a requirement, cheapest first.

Either resources from flags (``--gpu A100:80GB:2 --cpu 8..``), or a service file with one table per replica group.
Candidates are the shipped catalog (AWS, GCP) plus this machine (``local``); the output first says which backends
``$DURASTACK_HOME/config.yml`` configures (only those are used by services). Offers shown on a configured cloud
are checked against the account's quotas (backends/quota.py): a QUOTA column says "no quota" for one a launch
would skip, and a note says once when a cloud's quotas could not be read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from backends.catalog import catalog_as_of
from backends.catalog.plan import GroupQuery, candidate_offers, group_queries, look_up_reservations, match_query
from backends.quota import Verdict, mark_offers
from models.backends import BackendsConfig, gpu_image_lines, load_backends_config
from models.offers import InstanceOffer
from models.reservations import ReservationLookup, format_error
from models.resources import ResourcesSpec

BACKENDS = ("aws", "gcp", "local")


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _resources(flags: dict[str, str]) -> ResourcesSpec:
    try:
        return ResourcesSpec.model_validate(flags)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else "?"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"invalid --{field} {flags.get(field)!r}: {msg}")
        _fail("\n".join(lines))


def _queries_from_file(path: Path, spot_policy: Optional[str], max_price: Optional[float],
                       backends: Optional[list[str]], regions: Optional[list[str]],
                       reservation: Optional[str]) -> list[GroupQuery]:
    if not path.is_file():
        _fail(f"{path}: no such file")
    try:
        from models.loader import load_config_file  # written separately; imported only when a file is given
    except ImportError as e:
        _fail(f"cannot read service files yet ({e})")
    result = load_config_file(str(path))
    if result.errors:
        for err in result.errors:
            typer.echo(str(err), err=True)
        raise typer.Exit(1)
    # Command-line filters win over the file's; a group's spot_policy wins over the service's.
    return group_queries(result.config, spot_policy, max_price, backends, regions, reservation)


def _configured() -> tuple[str, BackendsConfig]:
    """(the summary line, the backends config) of config.yml; a broken file is reported, not fatal here."""
    try:
        config = load_backends_config(os.environ)
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"backends: config.yml is invalid ({first}); only local can be used", BackendsConfig()
    return config.summary(), config


def _price(value: float) -> str:
    return "$" + f"{value:.4f}".rstrip("0").rstrip(".")


def _table(title: Optional[str], offers: list[InstanceOffer], total: int, marks: list[Optional[Verdict]]) -> Table:
    table = Table(title=title, title_justify="left", box=None, header_style="bold",
                  caption=f"{len(offers)} of {total} offers; catalog prices as of {catalog_as_of()} (approximate)",
                  caption_justify="left")
    checked = any(marks)  # the QUOTA column only where a configured cloud's offer is shown
    columns = ("#", "BACKEND", "REGION", "INSTANCE", "RESOURCES", "SPOT", "PRICE") + (("QUOTA",) if checked else ())
    for column in columns:
        table.add_column(column, no_wrap=column != "RESOURCES", justify="right" if column == "PRICE" else "left")
    for i, (o, mark) in enumerate(zip(offers, marks), start=1):
        table.add_row(str(i), o.backend, o.region, o.instance_type, o.resources_summary(),
                      "yes" if o.spot else "no", _price(o.price), *([mark.status if mark else ""] if checked else []))
    return table


def cloud_backends(config: BackendsConfig) -> dict:
    """The configured clouds' backends, whose quotas mark the offers shown (no cloud call until then)."""
    if not (config.aws or config.gcp):
        return {}
    from backends.cloud import make_backends
    return make_backends(config)


def offers(
    file: Annotated[Optional[Path], typer.Option("-f", "--file", help="Service file: one table per replica group.",
                                                 show_default=False)] = None,
    gpu: Annotated[Optional[str], typer.Option(help="GPUs, e.g. A100:80GB:2, H100,A100:1..2, 24GB.., 2")] = None,
    cpu: Annotated[Optional[str], typer.Option(help="vCPUs, e.g. 4, 2..8, arm:8")] = None,
    memory: Annotated[Optional[str], typer.Option(help="RAM, e.g. 16GB or 8GB..")] = None,
    disk: Annotated[Optional[str], typer.Option(help="Disk, e.g. 200GB or 100GB..")] = None,
    backend: Annotated[Optional[list[str]], typer.Option(help="aws, gcp or local; repeatable")] = None,
    region: Annotated[Optional[list[str]], typer.Option(help="Region; repeatable")] = None,
    spot: Annotated[bool, typer.Option("--spot", help="Spot offers only.")] = False,
    on_demand: Annotated[bool, typer.Option("--on-demand", help="On-demand offers only (the default).")] = False,
    spot_auto: Annotated[bool, typer.Option("--spot-auto", help="Spot and on-demand offers.")] = False,
    max_price: Annotated[Optional[float], typer.Option(min=0, help="Maximum USD per hour.")] = None,
    reservation: Annotated[Optional[str], typer.Option(
        help="Only what this capacity reservation takes (cr-… on AWS; a GCP reservation name), looked up in the "
             "configured clouds.", show_default=False)] = None,
    limit: Annotated[int, typer.Option(min=0, help="Offers to show per table; 0 shows all.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Show the instance offers that fit the resources, cheapest first."""
    policies = [p for p, on in (("spot", spot), ("on-demand", on_demand), ("auto", spot_auto)) if on]
    if len(policies) > 1:
        _fail("--spot, --on-demand and --spot-auto exclude each other")
    unknown = sorted(set(backend or ()) - set(BACKENDS))
    if unknown:
        _fail(f"invalid --backend {', '.join(unknown)}: choose from {', '.join(BACKENDS)}")
    if reservation is not None and format_error(reservation):
        _fail(f"invalid --reservation: {format_error(reservation)}")
    flags = {k: v for k, v in (("gpu", gpu), ("cpu", cpu), ("memory", memory), ("disk", disk)) if v is not None}
    policy = policies[0] if policies else None
    if file is not None:
        if flags:
            _fail("give either -f FILE or --gpu/--cpu/--memory/--disk, not both")
        queries = _queries_from_file(file, policy, max_price, backend, region, reservation)
    else:
        queries = [GroupQuery("-", _resources(flags), policy or "on-demand", max_price, backend, region,
                              reservation=ReservationLookup(name=reservation) if reservation else None)]

    summary, config = _configured()
    queries = look_up_reservations(queries, config)
    # The same candidates `apply` plans from: a configured cloud only in its configured regions.
    candidates = candidate_offers(config)
    clouds = cloud_backends(config)
    groups, notes = [], []
    for q in queries:
        found, reason = match_query(candidates, q)
        shown = found[:limit] if limit else found
        marks, said = mark_offers(clouds, shown)
        notes += [n for n in said if n not in notes]
        groups.append((q, shown, len(found), reason, marks))

    if as_json:
        typer.echo(json.dumps({"backends": config.configured(), "quota_notes": notes, "groups": [
            {"name": q.name, "offers": [o.model_dump(mode="json") for o in shown], "total": total, "reason": reason,
             "quota": [m._asdict() if m else None for m in marks]}
            | ({"reservation": q.reservation.model_dump(mode="json")} if q.reservation else {})
            for q, shown, total, reason, marks in groups]}, indent=2))
        return
    console = Console()
    console.print(summary, highlight=False, markup=False)
    for line in gpu_image_lines(config):  # which image, and so which NVIDIA driver, a GPU offer boots
        console.print(f"  {line}", highlight=False, markup=False)
    for lookup in {q.reservation.name: q.reservation for q in queries if q.reservation}.values():
        console.print(f"reservation {lookup.name}: {lookup.describe()}", highlight=False, markup=False)
    for q, shown, total, reason, marks in groups:
        title = f"group {q.name}" if file is not None else None
        if not shown:
            console.print(f"{title + ': ' if title else ''}No offers fit ({q.resources.summary()}): {reason}.",
                          highlight=False, markup=False)
        else:
            console.print(_table(title, shown, total, marks))
            lacking = dict.fromkeys(m.reason for m in marks if m and m.status == "no quota")
            for why in lacking:  # a launch skips these offers until the quota is raised
                console.print(f"no quota: {why}", highlight=False, markup=False, soft_wrap=True)
        console.print()
    for note in notes:
        console.print(f"quota: {note}", highlight=False, markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``offers`` to the durastack command."""
    app.command("offers")(offers)


__all__ = ["register", "offers"]
