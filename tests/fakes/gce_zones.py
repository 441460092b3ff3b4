"""Which zones Compute Engine has in durastack's six GCP regions, and which machine types and accelerator types each
zone offers: written by hand from Google's published documentation, so that the fake Compute server
(tests/fakes/gce.py) and tests/test_gce_catalog.py can check the shipped offers catalog against data that did not
come from the catalog.

Sources, read 2026-12-04:

- Zones of each region: "Regions and zones", https://cloud.google.com/compute/docs/regions-zones (the region table:
  us-central1 a b c f; us-east1 b c d; us-east4 a b c; europe-west4 a b c; asia-east1 a b c; asia-southeast1 a b c).
- Which GPU each machine series carries: "GPU machine types" (formerly "GPU platforms"),
  https://cloud.google.com/compute/docs/gpus, and "About GPUs", https://cloud.google.com/compute/docs/gpus/about-gpus:
  G2 has NVIDIA L4 (nvidia-l4) built in,
  A2 Standard (a2-highgpu) A100 40GB (nvidia-tesla-a100), A2 Ultra (a2-ultragpu) A100 80GB (nvidia-a100-80gb),
  A3 High (a3-highgpu) H100 80GB (nvidia-h100-80gb); T4 (nvidia-tesla-t4), V100 (nvidia-tesla-v100), P4 and P100 are
  attached to N1 machine types only, never to the shared-core f1-micro and g1-small, and "GPUs can't be used with
  other machine series".
- Which zone has which GPU platform: "GPU locations" (GPU regions and zones availability),
  https://cloud.google.com/compute/docs/gpus/gpu-regions-zones, its table "Zone | Location | GPU machine type".
  The page could not be fetched from here. It was read in two copies of the same table, and they disagree in places:
    copy A: the page's HTML table as recorded in the public repository sean-reid/cloud-atlas,
            tests/fixtures/gcp-gpu-zones.html (commit bec943e8d907);
    copy B: a per-region transcription of the table in a public data file of the code index (file id 34267403162;
            its repository could not be identified).
  GPU_PLATFORMS below lists a platform in a zone when either copy does; UNSETTLED names each entry that only one copy
  lists. Every UNSETTLED entry is also in the zone per the Compute API's own zonal lists, as recorded by the SkyPilot
  catalog (skypilot-org/skypilot-catalog, catalogs/v8/gcp/vms.csv), which is why the fake accepts them.
- General-purpose machine types: the E2, N1 and N2 predefined shapes of "General-purpose machine family",
  https://cloud.google.com/compute/docs/general-purpose-machines (that page could not be read here; the shapes are
  the long-standing predefined ones). These series are in every zone of the six regions: cross-checked against the
  API-derived SkyPilot rows for e2-standard-8 and n1-standard-8 (all 19 zones) and n2-standard-96 (the US and
  europe-west4 zones; the asia rows were not read).

Out of scope: other GPU platforms (A3 Mega/Ultra/Edge, A4, G4, N1+P4, N1+P100) and other machine series. a2-megagpu-16g
(A2 Standard) is left out on purpose: it is in fewer zones than the a2-highgpu types and the table does not say which.
"""

from __future__ import annotations

from typing import Optional

REGIONS = {"us-central1": "abcf", "us-east1": "bcd", "us-east4": "abc", "europe-west4": "abc", "asia-east1": "abc",
           "asia-southeast1": "abc"}
ZONES = tuple(f"{region}-{letter}" for region, letters in REGIONS.items() for letter in letters)

# GPU platform, as the GPU-locations table names it → (accelerator type, machine types carrying it built in).
# The N1 platforms have none of their own: the GPU is attached to an N1 machine type.
PLATFORMS = {
    "G2": ("nvidia-l4", tuple(f"g2-standard-{n}" for n in (4, 8, 12, 16, 24, 32, 48, 96))),
    "A2 Standard": ("nvidia-tesla-a100", tuple(f"a2-highgpu-{n}g" for n in (1, 2, 4, 8))),
    "A2 Ultra": ("nvidia-a100-80gb", tuple(f"a2-ultragpu-{n}g" for n in (1, 2, 4, 8))),
    "A3 High": ("nvidia-h100-80gb", tuple(f"a3-highgpu-{n}g" for n in (1, 2, 4, 8))),
    "N1+T4": ("nvidia-tesla-t4", ()),
    "N1+V100": ("nvidia-tesla-v100", ()),
}
N1_ATTACHABLE = frozenset({"nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p4", "nvidia-tesla-p100"})

# Every zone of the six regions has these (E2, N1, N2 predefined shapes).
GENERAL_PURPOSE = frozenset(
    [f"e2-standard-{n}" for n in (2, 4, 8, 16, 32)] + [f"e2-highmem-{n}" for n in (2, 4, 8, 16)]
    + [f"e2-highcpu-{n}" for n in (2, 4, 8, 16, 32)] + ["e2-micro", "e2-small", "e2-medium"]
    + [f"n1-standard-{n}" for n in (1, 2, 4, 8, 16, 32, 64, 96)]
    + [f"n1-{kind}-{n}" for kind in ("highmem", "highcpu") for n in (2, 4, 8, 16, 32, 64, 96)]
    + [f"n2-standard-{n}" for n in (2, 4, 8, 16, 32, 48, 64, 80, 96)]
    + [f"n2-{kind}-{n}" for kind in ("highmem", "highcpu") for n in (2, 4, 8, 16, 32, 48, 64, 80, 96)])

# Zone → the GPU platforms the table lists for it (either copy; see UNSETTLED).
GPU_PLATFORMS = {
    "us-central1-a": {"A3 High", "A2 Ultra", "A2 Standard", "G2", "N1+T4", "N1+V100"},
    "us-central1-b": {"A3 High", "A2 Standard", "G2", "N1+T4", "N1+V100"},
    "us-central1-c": {"A3 High", "A2 Ultra", "A2 Standard", "G2", "N1+T4", "N1+V100"},
    "us-central1-f": {"A2 Standard", "N1+T4", "N1+V100"},
    "us-east1-b": {"A2 Standard", "G2", "N1+T4", "N1+V100"},
    "us-east1-c": {"G2", "N1+T4", "N1+V100"},
    "us-east1-d": {"G2", "N1+T4"},
    "us-east4-a": {"A3 High", "G2", "N1+T4"},
    "us-east4-b": {"A3 High", "N1+T4"},
    "us-east4-c": {"A3 High", "A2 Ultra", "G2", "N1+T4"},
    "europe-west4-a": {"A2 Ultra", "A2 Standard", "G2", "N1+T4", "N1+V100"},
    "europe-west4-b": {"A3 High", "A2 Standard", "G2", "N1+T4", "N1+V100"},
    "europe-west4-c": {"A3 High", "G2", "N1+T4", "N1+V100"},
    "asia-east1-a": {"G2", "N1+T4"},
    "asia-east1-b": {"G2"},
    "asia-east1-c": {"A3 High", "G2", "N1+T4", "N1+V100"},
    "asia-southeast1-a": {"A2 Standard", "G2", "N1+T4"},
    "asia-southeast1-b": {"A3 High", "A2 Standard", "G2", "N1+T4"},
    "asia-southeast1-c": {"A3 High", "A2 Ultra", "A2 Standard", "G2", "N1+T4"},
}

# (zone, platform) that only one copy of the table lists; the other copy's row for that zone leaves it out.
UNSETTLED = {
    ("us-central1-b", "A3 High"): "copy A lists it, copy B does not",
    ("us-east1-b", "N1+T4"): "copy A lists it, copy B does not",
    ("us-east1-b", "N1+V100"): "copy A lists it, copy B does not",
    ("us-east1-c", "N1+V100"): "copy B lists it, copy A does not (A has V100 in us-east1-b only)",
    ("us-east1-d", "G2"): "copy B lists it, copy A does not (A lists no G2, T4 or V100 in us-east1-d)",
    ("us-east1-d", "N1+T4"): "copy B lists it, copy A does not (A lists no G2, T4 or V100 in us-east1-d)",
    ("us-east4-c", "A3 High"): "copy A lists it, copy B does not (B has A3 High in us-east4-a and -b only)",
    ("europe-west4-b", "A3 High"): "copy A lists it, copy B does not (B has A3 High in europe-west4-c only)",
    ("asia-southeast1-a", "A2 Standard"): "copy A lists it, copy B does not",
    ("asia-southeast1-b", "A2 Standard"): "copy B lists it, copy A does not (A has A2 Standard in -a and -c)",
}


def machine_types(zone: str) -> frozenset[str]:
    """Machine types Compute has in ``zone`` (empty for a zone it does not have)."""
    if zone not in GPU_PLATFORMS:
        return frozenset()
    return GENERAL_PURPOSE | {m for p in GPU_PLATFORMS[zone] for m in PLATFORMS[p][1]}


def accelerator_types(zone: str) -> frozenset[str]:
    """Accelerator types Compute has in ``zone``, built in or attachable."""
    return frozenset(PLATFORMS[p][0] for p in GPU_PLATFORMS.get(zone, ()))


def built_in_accelerator(machine_type: str) -> Optional[str]:
    """The GPU an accelerator-optimized machine type carries (``g2-standard-8`` → ``nvidia-l4``), else None."""
    return next((acc for acc, machines in PLATFORMS.values() if machine_type in machines), None)


def attachable(machine_type: str, accelerator: str) -> bool:
    """Whether an instance of ``machine_type`` may list ``accelerator`` in guestAccelerators: an N1 GPU on an N1
    machine type, or an accelerator-optimized type's own GPU."""
    if machine_type.startswith("n1-"):
        return accelerator in N1_ATTACHABLE
    return accelerator == built_in_accelerator(machine_type)


def platform(machine_type: str, accelerator: Optional[str]) -> Optional[str]:
    """The table's name for a machine type with a GPU (``n1-standard-4`` + T4 → ``N1+T4``), else None."""
    for name, (acc, machines) in PLATFORMS.items():
        if machine_type in machines or (machine_type.startswith("n1-") and not machines and acc == accelerator):
            return name
    return None
