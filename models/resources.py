"""``resources``: cpu, memory, disk, shm_size and gpu, in their short forms."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional

from pydantic import BeforeValidator, Field

from models.common import IntRange, Model, Range, SizeRange, count_range, parse_size_gb, size_range

CPUArch = Literal["x86", "arm"]
GPUVendor = Literal["nvidia", "amd", "google", "intel", "tenstorrent"]

_VENDOR_ALIASES = {"nvidia": "nvidia", "amd": "amd", "google": "google", "tpu": "google", "intel": "intel",
                   "tt": "tenstorrent", "tenstorrent": "tenstorrent"}
_ARCH_ALIASES = {"x86": "x86", "x86_64": "x86", "amd64": "x86", "arm": "arm", "arm64": "arm", "aarch64": "arm"}

# GPU names whose vendor is known, so that `gpu: H100` implies NVIDIA.
KNOWN_GPU_VENDORS = {
    **{n: "nvidia" for n in ("t4", "v100", "a10", "a10g", "a100", "h100", "h200", "l4", "l40", "l40s", "b200",
                             "a4000", "a5000", "a6000", "rtx4090", "rtx3090", "p100", "k80")},
    **{n: "amd" for n in ("mi300x", "mi250x", "mi210", "mi325x")},
    **{n: "google" for n in ("v4", "v5e", "v5p", "v6e")},
}


def parse_cpu(value: Any) -> Any:
    """``4``, ``2..8``, ``arm:8``, ``x86:4..`` or ``{arch, count}``."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and ":" in value:
        arch, count = None, None
        for token in (t.strip() for t in value.split(":")):
            if token.lower() in _ARCH_ALIASES:
                if arch is not None:
                    raise ValueError(f"two CPU architectures in {value!r}")
                arch = _ARCH_ALIASES[token.lower()]
            else:
                if count is not None:
                    raise ValueError(f"two CPU counts in {value!r}")
                count = count_range(token)
        return {"arch": arch, "count": count if count is not None else {"min": 2, "max": None}}
    if isinstance(value, str) and value.strip().lower() in _ARCH_ALIASES:
        return {"arch": _ARCH_ALIASES[value.strip().lower()]}
    return {"count": value}


class CPUSpec(Model):
    arch: Optional[CPUArch] = Field(None, description="CPU architecture: x86 or arm; unset means any.")
    count: IntRange = Field(Range[int](min=2), description="Number of vCPUs, e.g. 4 or 2..8.")

    def __str__(self) -> str:
        return f"{self.arch + ':' if self.arch else ''}{self.count}"


def parse_gpu(value: Any) -> Any:
    """Shorthand tokens separated by ``:`` in any order, an int count, or a mapping."""
    if isinstance(value, dict):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected a GPU spec like A100:80GB:2, got {value!r}")
    if isinstance(value, int):
        return {"count": value}
    if not isinstance(value, str):
        raise ValueError(f"expected a GPU spec like A100:80GB:2, got {type(value).__name__}")
    spec: dict[str, Any] = {}

    def put(key: str, val: Any, token: str) -> None:
        if key in spec:
            raise ValueError(f"GPU {key} is given twice in {value!r} (at {token!r})")
        spec[key] = val

    for token in (t.strip() for t in value.split(":")):
        if not token:
            raise ValueError(f"empty token in GPU spec {value!r}")
        if token.lower() in _VENDOR_ALIASES:
            put("vendor", _VENDOR_ALIASES[token.lower()], token)
        elif token[0].isalpha():
            names = [n.strip() for n in token.split(",")]
            if not all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", n) for n in names):
                raise ValueError(f"invalid GPU name list {token!r}")
            put("name", names, token)
        elif re.search(r"[A-Za-z]", token):
            put("memory", size_range(token), token)
        else:
            put("count", count_range(token), token)
    return spec


def _names(value: Any) -> Any:
    if isinstance(value, str):
        return [n.strip() for n in value.split(",")]
    return value


class GPUSpec(Model):
    vendor: Optional[GPUVendor] = Field(None, description="GPU vendor: nvidia, amd, google (tpu), intel, tenstorrent.")
    name: Optional[Annotated[list[str], BeforeValidator(_names)]] = Field(
        None, description="Accepted GPU names, e.g. [H100, A100].")
    count: IntRange = Field(Range[int](min=1), description="Number of GPUs; 1.. when a GPU is named.")
    memory: Optional[SizeRange] = Field(None, description="Memory per GPU, e.g. 80GB or 24GB..")
    total_memory: Optional[SizeRange] = Field(None, description="Total memory of all GPUs.")
    compute_capability: Optional[str] = Field(None, description="Minimum CUDA compute capability, e.g. 8.0.")

    def effective_vendor(self) -> Optional[str]:
        if self.vendor:
            return self.vendor
        vendors = {KNOWN_GPU_VENDORS.get(n.lower()) for n in self.name or []}
        return vendors.pop() if len(vendors) == 1 and None not in vendors else None

    def __str__(self) -> str:
        parts = [",".join(self.name)] if self.name else []
        if self.memory:
            parts.append(_gb(self.memory))
        parts.append(str(self.count))
        return ":".join(parts)


class ResourcesSpec(Model):
    cpu: Annotated[CPUSpec, BeforeValidator(parse_cpu)] = Field(
        CPUSpec(), description="vCPUs: a count or range, optionally with an arch (arm:8, x86:4..). Default 2..")
    memory: SizeRange = Field(Range[float](min=8.0), description="RAM in GB, e.g. 16GB or 8GB.. Default 8GB..")
    disk: Optional[SizeRange] = Field(
        None, description="Disk in GB, e.g. 200GB..; unset means 100GB.. on clouds and no check on this machine.")
    shm_size: Optional[Annotated[float, BeforeValidator(parse_size_gb)]] = Field(
        None, description="Shared memory size, e.g. 16GB.")
    gpu: Optional[Annotated[GPUSpec, BeforeValidator(parse_gpu)]] = Field(
        None, description="GPUs, e.g. A100:80GB:2, H100,A100:1..2, 24GB.., or 2. Unset means no GPU is needed.")

    @property
    def gpu_count(self) -> Range[int]:
        """Unset ``gpu`` means ``0..``: a GPU is allowed but not needed."""
        return self.gpu.count if self.gpu else Range[int](min=0)

    def summary(self) -> str:
        parts = [f"cpu={self.cpu}", f"mem={_gb(self.memory)}"] + ([f"disk={_gb(self.disk)}"] if self.disk else [])
        if self.gpu:
            parts.append(f"gpu={self.gpu}")
        return " ".join(parts)


def _gb(rng: Range) -> str:
    """``16GB``, ``8GB..``, ``..64GB``, ``24GB..80GB``."""
    lo = "" if rng.min is None else f"{rng.min:g}GB"
    hi = "" if rng.max is None else f"{rng.max:g}GB"
    return lo if rng.min == rng.max else f"{lo}..{hi}"


__all__ = ["CPUSpec", "GPUSpec", "ResourcesSpec", "parse_cpu", "parse_gpu"]
