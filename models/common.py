"""Small value types shared by the configuration: ranges, sizes, durations.

Each has a *parse* function used as a pydantic ``BeforeValidator`` so that users may write the
short forms of the spec (``0..2``, ``24GB..``, ``5m``) and always get one plain model back.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Generic, Optional, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

T = TypeVar("T", int, float)


class Model(BaseModel):
    """Base of every configuration model: unknown fields are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Range(Model, Generic[T]):
    """``N`` (exactly N), ``a..b``, ``a..`` or ``..b``; ``None`` means unbounded."""

    min: Optional[T] = None
    max: Optional[T] = None

    def contains(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def __str__(self) -> str:
        lo = "" if self.min is None else _fmt(self.min)
        hi = "" if self.max is None else _fmt(self.max)
        return lo if self.min == self.max and lo else f"{lo}..{hi}"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


_RANGE_RE = re.compile(r"^\s*([^.]*?)\s*\.\.\s*([^.]*?)\s*$")


def split_range(value: str) -> tuple[str, str] | None:
    """``"a..b"`` → ``("a", "b")``; no ``..`` → ``None``."""
    m = _RANGE_RE.match(value)
    return (m.group(1), m.group(2)) if m else None


def make_range(lo: Optional[float], hi: Optional[float], number=float) -> dict:
    if lo is None and hi is None:
        raise ValueError("a range needs at least one bound ('..' alone is not a range)")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"invalid range order: {_fmt(lo)} > {_fmt(hi)}")
    return {"min": lo, "max": hi}


def parse_range_with(value: Any, parse_one, what: str) -> Any:
    """Parse ``value`` as a range whose bounds are read by ``parse_one``."""
    if isinstance(value, (Range, dict)):
        if isinstance(value, dict):
            unknown = set(value) - {"min", "max"}
            if unknown:
                raise ValueError(f"a {what} range mapping takes only min and max, not {sorted(unknown)}")
            lo = None if value.get("min") is None else parse_one(value["min"])
            hi = None if value.get("max") is None else parse_one(value["max"])
            return make_range(lo, hi)
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected a {what} or a range like 1..4, got {value!r}")
    if isinstance(value, (int, float)):
        v = parse_one(value)
        return {"min": v, "max": v}
    if isinstance(value, str):
        parts = split_range(value)
        if parts is None:
            v = parse_one(value)
            return {"min": v, "max": v}
        lo = parse_one(parts[0]) if parts[0] else None
        hi = parse_one(parts[1]) if parts[1] else None
        return make_range(lo, hi)
    raise ValueError(f"expected a {what} or a range like 1..4, got {type(value).__name__}")


def parse_count(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {value!r}")
    if value < 0:
        raise ValueError(f"must be greater than or equal to 0, got {value}")
    return value


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]B?|[KMGT]i?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS_GB = {"k": 1 / 1024 / 1024, "m": 1 / 1024, "g": 1.0, "t": 1024.0}


def parse_size_gb(value: Any) -> float:
    """``16GB``, ``512MB``, ``1TB``, or a plain number of GB → GB as a float."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 16GB, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a size must not be negative, got {value}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size like 16GB, got {type(value).__name__}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"expected a size like 16GB, 512MB or 1TB, got {value!r}")
    unit = (m.group(2) or "G")[0].lower()
    return float(m.group(1)) * _SIZE_UNITS_GB[unit]


_DURATION_RE = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: Any) -> int:
    """``30s``, ``5m``, ``1h``, ``2d``, ``1w`` or plain seconds → seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s or 5m, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a duration must not be negative, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            return int(m.group(1)) * _DURATION_UNITS[m.group(2)]
    raise ValueError(f"expected a duration like 30s, 5m, 1h or a number of seconds, got {value!r}")


def duration_or_off(value: Any) -> Optional[int]:
    """A duration, or ``off`` / ``false`` for a limit that is switched off: None, as if it were not set."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    try:
        return parse_duration(value)
    except ValueError as e:
        raise ValueError(f"{e} (or off)") from None


def format_duration(seconds: int) -> str:
    """Seconds in the largest unit that divides them: 7200 → ``2h``, 5400 → ``90m``, 45 → ``45s``."""
    for unit in ("w", "d", "h", "m"):
        size = _DURATION_UNITS[unit]
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def count_range(value: Any) -> Any:
    return parse_range_with(value, parse_count, "count")


def size_range(value: Any) -> Any:
    return parse_range_with(value, parse_size_gb, "size")


IntRange = Annotated[Range[int], BeforeValidator(count_range)]
SizeRange = Annotated[Range[float], BeforeValidator(size_range)]
Duration = Annotated[int, BeforeValidator(parse_duration), PlainSerializer(int)]

