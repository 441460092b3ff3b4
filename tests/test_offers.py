"""Offers: matching a resources requirement, the shipped catalog, the local offer, the CLI."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
from collections import defaultdict

import pytest
import typer
from typer.testing import CliRunner

from backends.catalog import (catalog_as_of, catalog_metadata, gpu_short_name, load_catalog, local_offer,
                                marketed_gpu_memory_gb)
from cli.offers import register
from models.offers import InstanceOffer, describe_mismatch, match_offers
from models.reservations import Reservation, ReservationLookup
from models.resources import ResourcesSpec


def res(**fields) -> ResourcesSpec:
    return ResourcesSpec.model_validate(fields)


def offer(instance_type: str, cpus: int, memory_gb: float, price: float, *, backend="aws", region="us-east-1",
          gpu: tuple[str, float, int] | None = None, vendor="nvidia", spot=False, arch="x86",
          disk_gb=100.0) -> InstanceOffer:
    name, mem, count = gpu or (None, 0.0, 0)
    return InstanceOffer(backend=backend, instance_type=instance_type, region=region, zones=[f"{region}a"],
                         cpu_arch=arch, cpus=cpus, memory_gb=memory_gb, disk_gb=disk_gb,
                         gpu_vendor=vendor if gpu else None, gpu_name=name, gpu_memory_gb=mem, gpu_count=count,
                         spot=spot, price=price)


# A small synthetic catalog, so that these tests do not depend on real prices.
CATALOG = [
    offer("t3.large", 2, 8, 0.0832),
    offer("t3.large", 2, 8, 0.03, spot=True),
    offer("m5.xlarge", 4, 16, 0.192),
    offer("m7g.xlarge", 4, 16, 0.1632, arch="arm"),
    offer("g4dn.xlarge", 4, 16, 0.526, gpu=("T4", 16, 1)),
    offer("g5.xlarge", 4, 16, 1.006, gpu=("A10G", 24, 1)),
    offer("g5.xlarge", 4, 16, 0.41, gpu=("A10G", 24, 1), spot=True),
    offer("g5.xlarge", 4, 16, 1.1227, gpu=("A10G", 24, 1), region="eu-west-1"),
    offer("p4d.24xlarge", 96, 1152, 21.9576, gpu=("A100", 40, 8)),
    offer("p4de.24xlarge", 96, 1152, 27.4471, gpu=("A100", 80, 8)),
    offer("p5.4xlarge", 16, 256, 6.88, gpu=("H100", 80, 1), region="us-east-2"),
    offer("a2-highgpu-1g", 12, 85, 3.673385, backend="gcp", region="us-central1", gpu=("A100", 40, 1)),
    offer("a2-ultragpu-2g", 24, 340, 10.13758, backend="gcp", region="us-central1", gpu=("A100", 80, 2)),
    offer("a3-highgpu-8g", 208, 1872, 88.25, backend="gcp", region="europe-west4", gpu=("H100", 80, 8)),
    offer("g2-standard-8", 8, 32, 0.8538, backend="gcp", region="us-central1", gpu=("L4", 24, 1)),
    offer("n1-standard-16", 16, 60, 5.465, backend="gcp", region="us-central1", gpu=("V100", 16, 2)),
    offer("mi300x.8x", 96, 1024, 30.0, backend="aws", region="us-west-2", gpu=("MI300X", 192, 8), vendor="amd"),
    offer("local", 8, 32, 0.0, backend="local", region="local", disk_gb=50.0),
]


def types(offers) -> set[str]:
    return {o.instance_type for o in offers}


# ---- matching: resources ------------------------------------------------------------------------------------------

def test_default_resources_allow_gpu_and_cpu_offers_cheapest_first():
    found = match_offers(CATALOG, res(), backends=["aws", "gcp"])
    assert found[0].instance_type == "t3.large" and not found[0].spot
    assert any(o.gpu_count for o in found) and any(not o.gpu_count for o in found)
    assert [o.price for o in found] == sorted(o.price for o in found)


def test_default_disk_is_not_enforced_on_the_local_machine():
    assert "local" in types(match_offers(CATALOG, res()))  # 50 GB free, default 100GB.. not enforced
    assert "local" not in types(match_offers(CATALOG, res(disk="100GB..")))  # asked for explicitly


def test_cpu_count_exact_and_range():
    assert {o.cpus for o in match_offers(CATALOG, res(cpu=4), backends=["aws", "gcp"])} == {4}
    assert types(match_offers(CATALOG, res(cpu="12..16"))) == {"p5.4xlarge", "a2-highgpu-1g", "n1-standard-16"}
    assert all(o.cpus >= 96 for o in match_offers(CATALOG, res(cpu="96..")))


def test_cpu_arch():
    assert types(match_offers(CATALOG, res(cpu="arm:4"))) == {"m7g.xlarge"}
    x86 = match_offers(CATALOG, res(cpu="x86:4"))
    assert "m7g.xlarge" not in types(x86) and "m5.xlarge" in types(x86)


def test_local_machine_needs_only_the_minimum():
    local = next(o for o in CATALOG if o.backend == "local")
    assert match_offers(CATALOG, res(cpu=1, memory="1GB"), backends=["local"]) == [local]
    assert match_offers(CATALOG, res(cpu=local.cpus + 1), backends=["local"]) == []


def test_memory_range():
    assert {o.memory_gb for o in match_offers(CATALOG, res(memory="16GB"), backends=["aws", "gcp"])} == {16}
    assert types(match_offers(CATALOG, res(memory="..8GB"), backends=["aws", "gcp"])) == {"t3.large"}
    assert all(o.memory_gb >= 1000 for o in match_offers(CATALOG, res(memory="1TB..")))


def test_cloud_disk_is_sized_from_the_requirement():
    assert {o.disk_gb for o in match_offers(CATALOG, res(), backends=["aws", "gcp"])} == {100.0}
    assert {o.disk_gb for o in match_offers(CATALOG, res(disk="250GB.."))} == {250.0}
    assert {o.disk_gb for o in match_offers(CATALOG, res(disk="..50GB"), backends=["aws"])} == {50.0}


def test_local_disk_must_fit_the_free_space():
    fits = match_offers(CATALOG, res(disk="40GB.."), backends=["local"])
    assert len(fits) == 1 and fits[0].disk_gb == 50.0  # the machine's free disk, not resized
    assert match_offers(CATALOG, res(disk="60GB"), backends=["local"]) == []


def test_gpu_name_memory_and_count_shorthand():
    assert types(match_offers(CATALOG, res(gpu="A100:80GB:2"))) == {"a2-ultragpu-2g"}


def test_gpu_name_matches_every_memory_size_case_insensitively():
    want = {"p4d.24xlarge", "p4de.24xlarge", "a2-highgpu-1g", "a2-ultragpu-2g"}
    assert types(match_offers(CATALOG, res(gpu="A100"))) == want
    assert types(match_offers(CATALOG, res(gpu="a100"))) == want


def test_gpu_name_list_and_count_range():
    found = match_offers(CATALOG, res(gpu="H100,A100:1..2"))
    assert types(found) == {"a2-highgpu-1g", "a2-ultragpu-2g", "p5.4xlarge"}


def test_gpu_memory_range_alone_needs_a_gpu():
    found = match_offers(CATALOG, res(gpu="24GB.."))
    assert found and all(o.gpu_count >= 1 and o.gpu_memory_gb >= 24 for o in found)
    assert not {"g4dn.xlarge", "n1-standard-16", "m5.xlarge"} & types(found)


def test_gpu_count_only():
    found = match_offers(CATALOG, res(gpu=2))
    assert types(found) == {"a2-ultragpu-2g", "n1-standard-16"}


def test_gpu_count_range_from_zero_keeps_cpu_offers_but_not_other_gpus():
    found = types(match_offers(CATALOG, res(gpu="A10G:0..1")))
    assert {"m5.xlarge", "g5.xlarge"} <= found and "g4dn.xlarge" not in found


def test_gpu_total_memory():
    found = match_offers(CATALOG, res(gpu={"total_memory": "160GB..640GB"}))
    assert types(found) == {"a2-ultragpu-2g", "p4d.24xlarge", "p4de.24xlarge", "a3-highgpu-8g"}


def test_gpu_vendor_explicit_and_from_name():
    assert types(match_offers(CATALOG, res(gpu="amd"))) == {"mi300x.8x"}
    assert types(match_offers(CATALOG, res(gpu="MI300X"))) == {"mi300x.8x"}
    assert "mi300x.8x" not in types(match_offers(CATALOG, res(gpu="nvidia")))


def test_gpu_compute_capability():
    found = types(match_offers(CATALOG, res(gpu={"compute_capability": "8.0"})))
    assert {"g5.xlarge", "g2-standard-8", "p4d.24xlarge", "p5.4xlarge"} <= found
    assert not {"g4dn.xlarge", "n1-standard-16", "mi300x.8x"} & found  # 7.5, 7.0, unknown


# ---- matching: filters and order ----------------------------------------------------------------------------------

def test_spot_policies():
    assert all(o.spot for o in match_offers(CATALOG, res(), spot_policy="spot"))
    assert types(match_offers(CATALOG, res(), spot_policy="spot")) == {"t3.large", "g5.xlarge"}
    assert not any(o.spot for o in match_offers(CATALOG, res()))
    auto = match_offers(CATALOG, res(gpu="A10G"), spot_policy="auto")
    assert [o.spot for o in auto] == [True, False, False]  # the spot price is the cheapest


def test_unknown_spot_policy_is_an_error():
    with pytest.raises(ValueError, match="spot_policy"):
        match_offers(CATALOG, res(), spot_policy="cheap")


def test_max_price_is_inclusive():
    found = match_offers(CATALOG, res(), max_price=0.526)
    assert found and max(o.price for o in found) == 0.526
    assert match_offers(CATALOG, res(gpu="H100"), max_price=5) == []


def test_backends_and_regions():
    assert {o.backend for o in match_offers(CATALOG, res(), backends=["gcp"])} == {"gcp"}
    assert types(match_offers(CATALOG, res(), regions=["us-east-2"])) == {"p5.4xlarge"}
    both = match_offers(CATALOG, res(gpu="A10G"), regions=["us-east-1", "eu-west-1"])
    assert [o.region for o in both] == ["us-east-1", "eu-west-1"]
    assert match_offers(CATALOG, res(), backends=["aws"], regions=["us-central1"]) == []


def test_sort_ties_are_broken_by_backend_type_region_whatever_the_input_order():
    same = [offer("b", 4, 16, 1.0, backend="gcp", region="r1"), offer("b", 4, 16, 1.0, region="r2"),
            offer("a", 4, 16, 1.0, region="r3"), offer("b", 4, 16, 1.0, region="r1"), offer("z", 4, 16, 0.5)]
    expected = [("aws", "z", "us-east-1"), ("aws", "a", "r3"), ("aws", "b", "r1"), ("aws", "b", "r2"),
                ("gcp", "b", "r1")]
    for seed in range(5):
        random.Random(seed).shuffle(same)
        assert [(o.backend, o.instance_type, o.region) for o in match_offers(same, res())] == expected


# ---- why nothing matched ------------------------------------------------------------------------------------------

def test_describe_mismatch_names_the_missing_gpu():
    assert match_offers(CATALOG, res(gpu="X100")) == []
    assert describe_mismatch(CATALOG, res(gpu="X100")) == "no offer has a GPU named X100"
    assert describe_mismatch(CATALOG, res(gpu="A10G")) is None


def test_describe_mismatch_names_the_narrowing_requirements():
    why = describe_mismatch(CATALOG, res(gpu="A10G"), backends=["gcp"])
    assert why is not None and why.startswith("no offer has a GPU named A10G together with") and "gcp" in why


def test_describe_mismatch_for_max_price_names_the_cheapest_fit():
    why = describe_mismatch(CATALOG, res(gpu="H100"), max_price=5)
    assert why is not None and "p5.4xlarge" in why and "$6.88/h" in why


def test_resources_summary():
    g5 = match_offers(CATALOG, res(gpu="A10G"))[1]
    assert g5.resources_summary() == "4xCPU, 16GB, 1xA10G (24GB), 100GB (disk)"
    assert CATALOG[3].resources_summary() == "4xCPU (arm), 16GB, 100GB (disk)"


# ---- the shipped catalog ------------------------------------------------------------------------------------------

AWS_FAMILIES = ("g4dn", "g5", "g6", "g6e", "p4d", "p4de", "p5", "m5", "m7i", "c7i", "t3")
GCP_FAMILIES = {"n1-standard/T4": "T4", "n1-standard/V100": "V100", "g2-standard": "L4", "a2-highgpu": "A100",
                "a2-ultragpu": "A100", "a3-highgpu": "H100", "e2-standard": None, "n2-standard": None}


def family(o: InstanceOffer) -> str:
    if o.backend == "aws":
        return o.instance_type.split(".")[0]
    base = o.instance_type.rsplit("-", 1)[0]
    return f"{base}/{o.gpu_name}" if base == "n1-standard" else base


@pytest.fixture(scope="module")
def shipped() -> list[InstanceOffer]:
    return load_catalog()


def test_shipped_catalog_header():
    assert catalog_as_of() == "2026-11-01"
    assert "approximate" in catalog_metadata()["source"]


def test_shipped_catalog_has_every_family_in_several_regions(shipped):
    regions = defaultdict(set)
    for o in shipped:
        regions[(o.backend, family(o))].add(o.region)
    for fam in AWS_FAMILIES:
        assert len(regions[("aws", fam)]) >= 2, fam
    for fam in GCP_FAMILIES:
        assert len(regions[("gcp", fam)]) >= 2, fam
    assert {"us-east-1", "us-east-2", "us-west-2", "eu-west-1"} <= {o.region for o in shipped if o.backend == "aws"}
    assert {"us-central1", "us-east1", "europe-west4", "asia-east1"} <= {
        o.region for o in shipped if o.backend == "gcp"}


def test_shipped_catalog_has_the_required_sizes(shipped):
    names = types(shipped)
    assert {f"g4dn.{s}" for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge")} <= names
    assert {f"g5.{s}" for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge",
                                "48xlarge")} <= names
    assert {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "a3-highgpu-8g"} <= names
    for gpu in ("T4", "V100"):
        assert {o.gpu_count for o in shipped if o.instance_type.startswith("n1-") and o.gpu_name == gpu} == {1, 2, 4}


def test_shipped_catalog_numbers_are_sane(shipped):
    on_demand = {}
    for o in shipped:
        assert o.price > 0 and o.cpus > 0 and o.memory_gb > 0, o
        assert o.zones and all(z.startswith(o.region) for z in o.zones), o
        assert (o.gpu_count > 0) == (o.gpu_name is not None) == (o.gpu_memory_gb > 0), o
        assert o.gpu_vendor in (None, "nvidia"), o
        key = (o.backend, o.instance_type, o.region, o.gpu_name, o.gpu_count)
        if not o.spot:
            assert key not in on_demand, f"duplicate row {key}"
            on_demand[key] = o.price
    spots = [o for o in shipped if o.spot]
    assert len(spots) > len(on_demand) / 2
    for o in spots:
        assert o.price < on_demand[(o.backend, o.instance_type, o.region, o.gpu_name, o.gpu_count)], o


def test_shipped_catalog_gpu_specs(shipped):
    def one(instance_type, region):
        return next(o for o in shipped if (o.instance_type, o.region) == (instance_type, region) and not o.spot)

    p5 = one("p5.48xlarge", "us-east-1")
    assert (p5.gpu_name, p5.gpu_count, p5.gpu_memory_gb, p5.cpus) == ("H100", 8, 80, 192)
    g5 = one("g5.xlarge", "us-east-1")
    assert (g5.gpu_name, g5.gpu_memory_gb, g5.cpus, g5.memory_gb) == ("A10G", 24, 4, 16)  # 22888 MiB → 24
    assert one("g6.xlarge", "us-east-1").gpu_memory_gb == 24 and one("g6e.xlarge", "us-east-1").gpu_memory_gb == 48
    assert one("a2-highgpu-1g", "us-central1").gpu_memory_gb == 40
    assert one("a2-ultragpu-1g", "us-central1").gpu_memory_gb == 80


def test_shipped_catalog_matches_realistic_requests(shipped):
    cheapest_a10g = match_offers(shipped, res(gpu="A10G"))[0]
    assert cheapest_a10g.instance_type == "g5.xlarge"
    assert {o.instance_type for o in match_offers(shipped, res(gpu="A100:80GB:2"))} == {"a2-ultragpu-2g"}
    l4 = match_offers(shipped, res(gpu="L4"), backends=["gcp"])
    assert l4[0].instance_type == "g2-standard-4"


def test_load_catalog_from_a_file(tmp_path):
    path = tmp_path / "offers.csv"
    path.write_text(
        "# as_of=2030-01-02 source=test data\n"
        "provider,instance_type,region,zones,cpu_arch,vcpus,memory_gib,gpu_vendor,gpu_name,gpu_memory_gib,"
        "gpu_count,on_demand_usd_hr,spot_usd_hr\n"
        "aws,g5.xlarge,us-east-1,us-east-1a us-east-1b,x86,4,16,nvidia,A10G,24,1,1.006,0.4\n"
        "gcp,e2-standard-2,us-central1,us-central1-a,x86,2,8,,,,0,0.067,\n")
    offers = load_catalog(path)
    assert [(o.instance_type, o.spot, o.price) for o in offers] == [
        ("g5.xlarge", False, 1.006), ("g5.xlarge", True, 0.4), ("e2-standard-2", False, 0.067)]
    assert offers[0].zones == ["us-east-1a", "us-east-1b"] and offers[2].gpu_name is None
    assert catalog_as_of(path) == "2030-01-02" and catalog_metadata(path)["source"] == "test data"
    offers.clear()  # callers get a copy; the cache is untouched
    assert len(load_catalog(path)) == 3


def test_load_catalog_rejects_a_bad_file(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("provider,instance_type,region\naws,g5.xlarge,us-east-1\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_catalog(path)


# ---- this machine -------------------------------------------------------------------------------------------------

def test_local_offer_describes_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("DURASTACK_HOME", str(tmp_path / "not-yet" / "home"))  # falls back to an existing parent
    local = local_offer()
    assert local.cpus == os.cpu_count()
    assert (local.backend, local.region, local.price, local.spot) == ("local", "local", 0.0, False)
    assert local.memory_gb > 0
    assert abs(local.disk_gb - shutil.disk_usage(tmp_path).free / 1024**3) < 1


def _fake_nvidia_smi(directory, script: str) -> None:
    path = directory / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_local_offer_reads_gpus_from_nvidia_smi(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, 'printf "NVIDIA A10G, 23028\\nNVIDIA A10G, 23028\\n"\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    local = local_offer()
    assert (local.gpu_vendor, local.gpu_name, local.gpu_count, local.gpu_memory_gb) == ("nvidia", "A10G", 2, 24)


@pytest.mark.parametrize("script", [None, "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"])
def test_local_offer_without_working_nvidia_smi_has_no_gpu(tmp_path, monkeypatch, script):
    if script:
        _fake_nvidia_smi(tmp_path, script)
    monkeypatch.setenv("PATH", str(tmp_path))
    local = local_offer()
    assert (local.gpu_count, local.gpu_name, local.gpu_memory_gb) == (0, None, 0.0)


@pytest.mark.parametrize("name,short", [("NVIDIA A100-SXM4-80GB", "A100"), ("Tesla T4", "T4"),
                                        ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA GeForce RTX 4090", "RTX4090"),
                                        ("NVIDIA RTX A6000", "A6000"), ("NVIDIA L4", "L4")])
def test_gpu_short_name(name, short):
    assert gpu_short_name(name) == short


@pytest.mark.parametrize("mib,gb", [(22888, 24), (23028, 24), (45776, 48), (15360, 16), (81559, 80), (40960, 40),
                                    (4096, 4)])
def test_marketed_gpu_memory(mib, gb):
    assert marketed_gpu_memory_gb(mib) == gb


# ---- CLI ----------------------------------------------------------------------------------------------------------

def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # a callback keeps `offers` a subcommand in a one-command app
        pass

    register(app)
    return app


def run(*args: str):
    return CliRunner().invoke(_app(), ["offers", *args], env={"COLUMNS": "200"})


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_table_cheapest_first():
    result = run("--gpu", "A10G", "--backend", "aws", "--limit", "3")
    assert result.exit_code == 0, result.output
    first, *rest = result.stdout.splitlines()
    assert first.startswith("backends: ")  # which backends config.yml configures
    lines = [line.split() for line in rest if " aws " in line]
    assert [line[0] for line in lines] == ["1", "2", "3"]
    assert "3 of " in result.stdout  # the caption says how many fit in all
    assert all(line[3] == "g5.xlarge" for line in lines)
    assert "1xA10G (24GB), 100GB (disk)" in result.stdout and "$1.006" in result.stdout
    for column in ("BACKEND", "REGION", "INSTANCE", "RESOURCES", "SPOT", "PRICE"):
        assert column in result.stdout


def test_cli_json_shape_limit_and_order():
    data = run_json("--cpu", "8", "--memory", "32GB", "--backend", "aws", "--limit", "4")
    [group] = data["groups"]
    assert group["name"] == "-" and len(group["offers"]) == 4 and group["total"] > 4
    assert all(o["cpus"] == 8 and o["memory_gb"] == 32 for o in group["offers"])
    prices = [o["price"] for o in group["offers"]]
    assert prices == sorted(prices)
    assert InstanceOffer.model_validate(group["offers"][0]).backend == "aws"


def test_cli_spot_flags():
    spot = run_json("--gpu", "A10G", "--spot", "--limit", "0")["groups"][0]["offers"]
    assert spot and all(o["spot"] for o in spot)
    auto = run_json("--gpu", "A10G", "--spot-auto", "--limit", "0")["groups"][0]["offers"]
    assert {o["spot"] for o in auto} == {True, False}
    on_demand = run_json("--gpu", "A10G", "--on-demand", "--limit", "0")["groups"][0]["offers"]
    assert on_demand and not any(o["spot"] for o in on_demand)
    assert run("--spot", "--on-demand").exit_code == 1


def test_cli_regions_and_max_price():
    offers = run_json("--region", "us-east-1", "--region", "europe-west4", "--max-price", "0.5",
                      "--limit", "0")["groups"][0]["offers"]
    assert {o["region"] for o in offers} == {"us-east-1", "europe-west4"}
    assert all(o["price"] <= 0.5 for o in offers)


def test_cli_local_backend_is_this_machine():
    offers = run_json("--backend", "local", "--disk", "0.001GB")["groups"][0]["offers"]
    assert len(offers) == 1 and offers[0]["backend"] == "local" and offers[0]["cpus"] == os.cpu_count()


def test_cli_says_why_nothing_fits():
    result = run("--gpu", "X100")
    assert result.exit_code == 0
    assert "No offers fit" in result.stdout and "no offer has a GPU named X100" in result.stdout
    assert run_json("--gpu", "X100")["groups"][0] == {
        "name": "-", "offers": [], "total": 0, "reason": "no offer has a GPU named X100", "quota": []}


@pytest.mark.parametrize("option,value", [("--gpu", "A100:foo:bar"), ("--cpu", "arm:4:8"), ("--memory", "lots"),
                                          ("--disk", "10..5"), ("--backend", "azure")])
def test_cli_bad_option_value_exits_1_naming_the_option(option, value):
    result = run(option, value)
    assert result.exit_code == 1
    assert option in result.stderr and value in result.stderr


def test_cli_file_and_resource_flags_exclude_each_other(tmp_path):
    service = tmp_path / "service.yml"
    service.write_text("type: service\n")
    result = run("-f", str(service), "--gpu", "A10G")
    assert result.exit_code == 1 and "either -f FILE" in result.stderr


SERVICE = """\
type: service
name: offers-test
port: 8000
backends: [aws]
max_price: 2
groups:
  - name: llm
    replicas: 1
    commands: ["python3 -m http.server 8000"]
    resources:
      gpu: A10G
    spot_policy: spot
  - name: router
    replicas: 1
    commands: ["python3 -m http.server 8000"]
    resources:
      cpu: 4
      memory: 16GB
"""


def test_cli_file_gives_one_group_each_with_its_own_policy(tmp_path):
    service = tmp_path / "service.yml"
    service.write_text(SERVICE)
    groups = {g["name"]: g for g in run_json("-f", str(service), "--limit", "0")["groups"]}
    assert list(groups) == ["llm", "router"]
    llm, router = groups["llm"]["offers"], groups["router"]["offers"]
    assert llm and all(o["spot"] and o["gpu_name"] == "A10G" for o in llm)  # the group's spot_policy
    assert router and not any(o["spot"] for o in router)  # the default: on-demand
    assert all(o["backend"] == "aws" and o["price"] <= 2 for o in llm + router)  # the service's filters
    assert all(o["cpus"] == 4 and o["memory_gb"] == 16 for o in router)
    result = run("-f", str(service))
    assert result.exit_code == 0 and "group llm" in result.stdout and "group router" in result.stdout


def test_cli_file_flags_override_the_service(tmp_path):
    service = tmp_path / "service.yml"
    service.write_text(SERVICE)
    groups = run_json("-f", str(service), "--backend", "gcp", "--on-demand", "--limit", "0")["groups"]
    offers = [o for g in groups for o in g["offers"]]
    assert offers and all(o["backend"] == "gcp" and not o["spot"] for o in offers)


def test_cli_file_with_errors_exits_1_listing_them(tmp_path):
    service = tmp_path / "service.yml"
    service.write_text("type: service\nport: 8000\nresources:\n  gpu: A100:foo:bar\n")
    result = run("-f", str(service))
    assert result.exit_code == 1
    assert "resources.gpu" in result.stderr and "commands" in result.stderr


# ---- matching: instance types and zones ---------------------------------------------------------------------------

def test_instance_types_keep_only_those_types_and_say_so_when_none_fits():
    kept = match_offers(CATALOG, res(gpu="A10G"), instance_types=["g5.xlarge"])
    assert types(kept) == {"g5.xlarge"} and {o.region for o in kept} == {"us-east-1", "eu-west-1"}
    assert not match_offers(CATALOG, res(gpu="A10G"), instance_types=["g4dn.xlarge"])
    assert describe_mismatch(CATALOG, res(gpu="A10G"), instance_types=["g4dn.xlarge"]) == \
        "no offer has a GPU named A10G together with instance type g4dn.xlarge"


def test_zones_keep_the_offers_placed_there_and_only_those_zones():
    zoned = [offer("m5.xlarge", 4, 16, 0.192).model_copy(update={"zones": ["us-east-1a", "us-east-1b"]}),
             offer("n2-standard-4", 4, 16, 0.19, backend="gcp", region="us-central1").model_copy(update={"zones": []})]
    kept = match_offers(zoned, res(cpu=4), zones=["us-east-1b", "us-central1-f"])
    assert [(o.instance_type, o.zones) for o in kept] == [("n2-standard-4", ["us-central1-f"]),  # none listed: by region
                                                         ("m5.xlarge", ["us-east-1b"])]
    assert not match_offers(zoned, res(cpu=4), zones=["eu-west-1a"])


# ---- matching: reservations ---------------------------------------------------------------------------------------

def reservation(backend="aws", name="cr-0123456789abcdef0", zone="us-east-1b", instance_type="g5.xlarge", **kw):
    fields = dict(backend=backend, name=name, region=zone[:-1] if backend == "aws" else zone.rsplit("-", 1)[0],
                  zone=zone, instance_type=instance_type,
                  kind="capacity-reservation" if backend == "aws" else "reservation",
                  state="active" if backend == "aws" else "READY", total=2, in_use=0)
    return Reservation(**{**fields, **kw})


def lookup(*found: Reservation, name="cr-0123456789abcdef0", notes=()) -> ReservationLookup:
    return ReservationLookup(name=name, found=list(found), notes=list(notes))


def test_a_reservation_keeps_its_type_on_demand_in_its_zone_whatever_zones_the_catalog_lists():
    kept = match_offers(CATALOG, res(gpu="A10G"), spot_policy="auto", reservation=lookup(reservation()))
    assert [(o.instance_type, o.region, o.spot, o.zones, o.reservation) for o in kept] == \
        [("g5.xlarge", "us-east-1", False, ["us-east-1b"], "cr-0123456789abcdef0")]
    assert not [o for o in CATALOG if o.reservation]  # the catalog's offers are left as they were
    # With availability_zones too, both must hold.
    assert match_offers(CATALOG, res(gpu="A10G"), reservation=lookup(reservation()), zones=["us-east-1b"])
    assert not match_offers(CATALOG, res(gpu="A10G"), reservation=lookup(reservation()), zones=["us-east-1a"])


def test_a_reservation_that_ended_or_holds_another_type_is_said_to_be_why_nothing_fits():
    ended = lookup(reservation(state="expired"))
    assert not match_offers(CATALOG, res(gpu="A10G"), reservation=ended)
    assert describe_mismatch(CATALOG, res(gpu="A10G"), reservation=ended) == \
        "no offer has reservation cr-0123456789abcdef0 open to launches (us-east-1b: it is expired)"
    assert describe_mismatch(CATALOG, res(gpu="H100"), reservation=lookup(reservation())) == (
        "no offer has a GPU named H100 together with the instance type of reservation cr-0123456789abcdef0 "
        "(g5.xlarge in us-east-1b, 2 of 2 free), an on-demand price")
    nowhere = lookup(notes=["aws: not found in us-east-1", "gcp: not configured in config.yml"])
    assert describe_mismatch(CATALOG, res(), reservation=nowhere) == ("no offer has reservation "
                                                                     "cr-0123456789abcdef0 (aws: not found in "
                                                                     "us-east-1; gcp: not configured in config.yml)")


def test_a_full_reservation_still_matches_the_launch_finds_it_full():
    # Its instances are the service's own while it runs: the plan of an update must not lose its offers.
    kept = match_offers(CATALOG, res(gpu="A10G"), reservation=lookup(reservation(in_use=2)))
    assert [o.zones for o in kept] == [["us-east-1b"]]


def test_a_gcp_reservation_of_an_n1_machine_takes_only_the_gpu_it_reserves():
    n1 = [offer("n1-standard-4", 4, 15, 0.54, backend="gcp", region="us-central1", gpu=("T4", 16, 1)),
          offer("n1-standard-4", 4, 15, 2.67, backend="gcp", region="us-central1", gpu=("V100", 16, 1)),
          offer("n1-standard-4", 4, 15, 0.19, backend="gcp", region="us-central1")]
    t4 = reservation("gcp", "t4-pool", "us-central1-c", "n1-standard-4", accelerators={"nvidia-tesla-t4": 1})
    assert [o.gpu_name for o in match_offers(n1, res(), reservation=lookup(t4, name="t4-pool"))] == ["T4"]
    bare = reservation("gcp", "cpu-pool", "us-central1-c", "n1-standard-4")
    assert [o.gpu_count for o in match_offers(n1, res(), reservation=lookup(bare, name="cpu-pool"))] == [0]
    # A machine type that comes with its GPUs is matched by the type (and the count, if the reservation lists it).
    a2 = reservation("gcp", "a2-pool", "us-central1-f", "a2-highgpu-1g")
    assert types(match_offers(CATALOG, res(), reservation=lookup(a2, name="a2-pool"))) == {"a2-highgpu-1g"}


def test_a_reservation_in_several_zones_keeps_those_that_can_launch_now():
    found = lookup(reservation(zone="us-east-1a", state="cancelled"), reservation(zone="us-east-1c"))
    assert [o.zones for o in match_offers(CATALOG, res(gpu="A10G"), reservation=found)] == [["us-east-1c"]]


def test_cli_reservation_looked_up_nowhere_says_where_and_a_malformed_one_exits_1(tmp_path):
    result = CliRunner().invoke(_app(), ["offers", "--gpu", "A10G", "--reservation", "cr-0123456789abcdef0"],
                                env={"COLUMNS": "200", "DURASTACK_HOME": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert "reservation cr-0123456789abcdef0: aws: not configured in config.yml; gcp: not configured in " \
           "config.yml" in result.stdout
    assert "No offers fit" in result.stdout
    bad = run("--gpu", "A10G", "--reservation", "CR_1")
    assert bad.exit_code == 1 and "invalid --reservation" in bad.stderr and "'CR_1'" in bad.stderr
