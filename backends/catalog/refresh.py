"""Regenerate the offers catalog from the providers' own data. Needs network and credentials; never run in CI.

    python -m backends.catalog.refresh --out backends/catalog/offers.csv --gcp-project P --gcp-api-key K

AWS: specs and zones from EC2 DescribeInstanceTypes / DescribeInstanceTypeOfferings (boto3 credentials), on-demand
prices from the public Price List bulk CSV of each region, spot prices from DescribeSpotPriceHistory (cheapest zone
right now). GCP: machine shapes are fixed by Google and listed below; zones come from the Compute API; prices from the
Cloud Billing Catalog API. GCE bills machine and GPUs as separate SKUs, so a price is
vCPUs × core SKU + GB × RAM SKU + GPUs × GPU SKU.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import re
import sys
from collections import defaultdict
from typing import Iterable, Optional

from backends.catalog import COLUMNS, marketed_gpu_memory_gb

SIZES = ("xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge", "48xlarge")
AWS_TYPES = (
    [f"g4dn.{s}" for s in SIZES[:6]] + [f"g5.{s}" for s in SIZES] + [f"g6.{s}" for s in SIZES]
    + [f"g6e.{s}" for s in SIZES] + ["p4d.24xlarge", "p4de.24xlarge", "p5.4xlarge", "p5.48xlarge"]
    + [f"m5.{s}" for s in ("large", "xlarge", "2xlarge", "4xlarge")]
    + [f"{f}.{s}" for f in ("m7i", "c7i") for s in ("large", "xlarge", "2xlarge", "4xlarge", "8xlarge")]
    + [f"t3.{s}" for s in ("medium", "large", "xlarge", "2xlarge")]
)
AWS_REGIONS = ("us-east-1", "us-east-2", "us-west-2", "eu-west-1", "eu-central-1", "ap-northeast-1")
PRICE_LIST_URL = "https://pricing.us-east-1.amazonaws.com/offers/v1.0/aws/AmazonEC2/current/{region}/index.csv"
PRICE_LIST_FILTERS = {"TermType": {"OnDemand"}, "Tenancy": {"Shared"}, "Operating System": {"Linux"},
                      "CapacityStatus": {"Used"}, "Unit": {"Hrs"}, "Pre Installed S/W": {"", "NA"},
                      "MarketOption": {"OnDemand", ""}}

GCP_REGIONS = ("us-central1", "us-east1", "us-east4", "europe-west4", "asia-east1", "asia-southeast1")
# GCP GPUs: (catalog name, memory GB, accelerator type, billing SKU name).
GCP_GPUS = {
    "T4": ("T4", 16.0, "nvidia-tesla-t4", "nvidia tesla t4"),
    "V100": ("V100", 16.0, "nvidia-tesla-v100", "nvidia tesla v100"),
    "L4": ("L4", 24.0, "nvidia-l4", "nvidia l4"),
    "A100-40": ("A100", 40.0, "nvidia-tesla-a100", "nvidia tesla a100"),
    "A100-80": ("A100", 80.0, "nvidia-a100-80gb", "nvidia tesla a100 80gb"),
    "H100": ("H100", 80.0, "nvidia-h100-80gb", "nvidia h100 80gb"),
}
# machine type → (vCPUs, RAM GB, GPU key or None, GPU count). N1 takes attachable GPUs: one row per pairing.
GCP_SHAPES: list[tuple[str, int, float, Optional[str], int]] = (
    [(f"n1-standard-{n}", n, n * 3.75, gpu, count) for gpu in ("T4", "V100")
     for n, count in ((4, 1), (8, 1), (16, 2), (32, 4))]
    + [(f"g2-standard-{n}", n, n * 4.0, "L4", c) for n, c in ((4, 1), (8, 1), (12, 1), (16, 1), (24, 2), (32, 1),
                                                              (48, 4), (96, 8))]
    + [(f"a2-highgpu-{g}g", 12 * g, 85.0 * g, "A100-40", g) for g in (1, 2, 4, 8)]
    + [(f"a2-ultragpu-{g}g", 12 * g, 170.0 * g, "A100-80", g) for g in (1, 2, 4, 8)]
    + [("a3-highgpu-8g", 208, 1872.0, "H100", 8)]
    + [(f"{f}-standard-{n}", n, n * 4.0, None, 0) for f in ("e2", "n2") for n in (2, 4, 8, 16)]
)
GCP_COMPUTE_SERVICE = "https://cloudbilling.googleapis.com/v1/services/6F81-5844-456A/skus"


def write_csv(rows: Iterable[dict], out, as_of: str, source: str) -> None:
    out.write(f"# as_of={as_of} source={source}\n")
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)


def aws_on_demand_prices(region: str, types: set[str]) -> dict[str, float]:
    import httpx

    prices = {}
    with httpx.stream("GET", PRICE_LIST_URL.format(region=region), timeout=120, follow_redirects=True) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for _ in range(5):  # disclaimer lines before the header
            next(lines)
        for row in csv.DictReader(lines):
            if row["Instance Type"] in types and all(row.get(k, "") in v for k, v in PRICE_LIST_FILTERS.items()):
                prices[row["Instance Type"]] = float(row["PricePerUnit"])
    return prices


def aws_rows(region: str) -> list[dict]:
    import boto3

    ec2 = boto3.client("ec2", region_name=region)
    zones: dict[str, list[str]] = defaultdict(list)
    pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": AWS_TYPES}])
    for page in pages:
        for o in page["InstanceTypeOfferings"]:
            zones[o["InstanceType"]].append(o["Location"])
    if not zones:
        return []
    specs = {t["InstanceType"]: t for page in ec2.get_paginator("describe_instance_types").paginate(
        InstanceTypes=sorted(zones)) for t in page["InstanceTypes"]}
    spot: dict[str, float] = {}
    for page in ec2.get_paginator("describe_spot_price_history").paginate(
            InstanceTypes=sorted(zones), ProductDescriptions=["Linux/UNIX"],
            StartTime=datetime.datetime.now(datetime.timezone.utc)):
        for item in page["SpotPriceHistory"]:
            t, price = item["InstanceType"], float(item["SpotPrice"])
            spot[t] = min(price, spot.get(t, price))
    on_demand = aws_on_demand_prices(region, set(zones))
    rows = []
    for name in sorted(t for t in zones if t in on_demand):
        spec = specs[name]
        gpu = (spec.get("GpuInfo") or {}).get("Gpus", [{}])[0]
        rows.append(dict(
            provider="aws", instance_type=name, region=region, zones=" ".join(sorted(zones[name])),
            cpu_arch="arm" if "arm64" in spec["ProcessorInfo"]["SupportedArchitectures"] else "x86",
            vcpus=spec["VCpuInfo"]["DefaultVCpus"], memory_gib=spec["MemoryInfo"]["SizeInMiB"] / 1024,
            gpu_vendor=gpu.get("Manufacturer", "").lower(), gpu_name=gpu.get("Name", ""),
            gpu_memory_gib=marketed_gpu_memory_gb(gpu["MemoryInfo"]["SizeInMiB"]) if gpu else "",
            gpu_count=gpu.get("Count", 0),
            on_demand_usd_hr=on_demand[name], spot_usd_hr=spot.get(name, "")))
    return rows


def gcp_sku_prices(api_key: str) -> dict[tuple[str, str, bool], dict[str, float]]:
    """(kind, name, spot) → {region: USD/h}; kind is core, ram or gpu, name a family (n1) or a GPU SKU name."""
    import httpx

    prices: dict = defaultdict(dict)
    params = {"key": api_key, "pageSize": 5000}
    while True:
        page = httpx.get(GCP_COMPUTE_SERVICE, params=params, timeout=60).raise_for_status().json()
        for sku in page.get("skus", []):
            usage, desc = sku["category"]["usageType"], sku["description"]
            if usage not in ("OnDemand", "Preemptible") or re.search(r"Sole Tenancy|Custom|Reserved", desc):
                continue
            m = re.match(r"^(?:spot preemptible )?(.+?) (gpu|ram|core) running in", desc, flags=re.IGNORECASE)
            if not m:
                continue
            what, kind = m.group(1).lower(), m.group(2).lower()
            name = what if kind == "gpu" else what.split()[0]  # "n1 predefined instance" → "n1"
            rate = sku["pricingInfo"][0]["pricingExpression"]["tieredRates"][-1]["unitPrice"]
            usd = int(rate.get("units", 0)) + rate.get("nanos", 0) / 1e9
            for region in sku.get("serviceRegions", []):
                prices[(kind, name, usage == "Preemptible")][region] = usd
        if not page.get("nextPageToken"):
            return prices
        params["pageToken"] = page["nextPageToken"]


def gcp_zones(project: str) -> dict[str, set[str]]:
    """Machine type or accelerator type → zones that offer it."""
    from google.cloud import compute_v1

    zones: dict[str, set[str]] = defaultdict(set)
    for client in (compute_v1.MachineTypesClient(), compute_v1.AcceleratorTypesClient()):
        for scope, listing in client.aggregated_list(project=project):
            for item in getattr(listing, "machine_types", None) or getattr(listing, "accelerator_types", []):
                zones[item.name].add(scope.removeprefix("zones/"))
    return zones


def gcp_rows(project: str, api_key: str) -> list[dict]:
    prices, zones = gcp_sku_prices(api_key), gcp_zones(project)
    rows = []
    for machine, vcpus, mem, gpu_key, count in GCP_SHAPES:
        family = machine.split("-")[0]
        gpu_name, gpu_mem, accelerator, sku = GCP_GPUS[gpu_key] if gpu_key else ("", 0.0, None, None)
        for region in GCP_REGIONS:
            where = {z for z in zones.get(machine, ()) if z.startswith(region + "-")}
            if family == "n1":
                where &= zones.get(accelerator, set())
            price = {}
            for spot in (False, True):
                parts = [(vcpus, ("core", family, spot)), (mem, ("ram", family, spot))]
                parts += [(count, ("gpu", sku, spot))] if sku else []
                if all(region in prices.get(key, {}) for _, key in parts):
                    price[spot] = round(sum(n * prices[key][region] for n, key in parts), 6)
            if where and False in price:
                rows.append(dict(
                    provider="gcp", instance_type=machine, region=region, zones=" ".join(sorted(where)),
                    cpu_arch="x86", vcpus=vcpus, memory_gib=mem, gpu_vendor="nvidia" if gpu_key else "",
                    gpu_name=gpu_name, gpu_memory_gib=gpu_mem or "", gpu_count=count,
                    on_demand_usd_hr=price[False], spot_usd_hr=price.get(True, "")))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="CSV file to write ('-' for stdout)")
    p.add_argument("--providers", nargs="+", choices=("aws", "gcp"), default=["aws", "gcp"])
    p.add_argument("--gcp-project", default=os.environ.get("GOOGLE_CLOUD_PROJECT"), help="for zones")
    p.add_argument("--gcp-api-key", default=os.environ.get("GCP_API_KEY"), help="for the Cloud Billing Catalog API")
    args = p.parse_args(argv)
    if "gcp" in args.providers and not (args.gcp_project and args.gcp_api_key):
        p.error("GCP needs --gcp-project and --gcp-api-key (or GOOGLE_CLOUD_PROJECT and GCP_API_KEY)")
    rows = []
    if "aws" in args.providers:
        for region in AWS_REGIONS:
            print(f"aws {region}", file=sys.stderr)
            rows += aws_rows(region)
    if "gcp" in args.providers:
        print("gcp", file=sys.stderr)
        rows += gcp_rows(args.gcp_project, args.gcp_api_key)
    source = ("AWS EC2 API and Price List bulk CSV, spot from DescribeSpotPriceHistory; "
              "GCP Compute API and Cloud Billing Catalog")
    as_of = datetime.date.today().isoformat()
    if args.out == "-":
        write_csv(rows, sys.stdout, as_of, source)
    else:
        with open(args.out, "w", encoding="utf-8", newline="") as f:
            write_csv(rows, f, as_of, source)
    print(f"{len(rows)} rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
