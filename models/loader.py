"""Read a service YAML file into a ``ServiceConfiguration`` with errors that name path and line.

Never raises on bad input: every problem — unreadable file, bad YAML, a 10 MB file, an alias
bomb, wrong types, broken rules — comes back as a ``ConfigError`` in ``LoadResult.errors``.
"""

from __future__ import annotations

import copy
import datetime
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from models.resources import ResourcesSpec
from models.service import ReplicaGroup, ServiceConfiguration
from models.validation import Issue, validate_service, validate_volume, warnings_for
from models.volumes import VolumeConfiguration

MAX_FILE_BYTES = 1024 * 1024
MAX_NODES = 100_000  # an alias bomb expands past this long before memory suffers
MAX_DEPTH = 64


@dataclass(frozen=True)
class ConfigError:
    path: str
    line: Optional[int]
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        line = f" (line {self.line})" if self.line else ""
        return f"{where}{self.message}{line}"

    def to_json(self) -> dict:
        return {"path": self.path, "line": self.line, "message": self.message}


@dataclass
class LoadResult:
    config: Optional[ServiceConfiguration] = None
    errors: list[ConfigError] = field(default_factory=list)
    warnings: list[ConfigError] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.config is not None and not self.errors


class _TooBig(Exception):
    pass


def load_config_file(path: str | Path) -> LoadResult:
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            return _fail(f"{path} is {size / 1e6:.1f} MB; a service file may be at most {MAX_FILE_BYTES // 1024} KiB")
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return _fail(f"{path}: no such file")
    except (OSError, UnicodeDecodeError) as e:
        return _fail(f"{path}: cannot read the file ({e})")
    return load_config_text(text)


def load_config_text(text: str) -> LoadResult:
    read = _read(text)
    return read if isinstance(read, LoadResult) else load_config_data(*read)


def _read(text: str) -> LoadResult | tuple[Any, dict[tuple, int]]:
    """The YAML document as plain values, with each key's and item's line; or why it cannot be read."""
    if len(text.encode("utf-8", errors="replace")) > MAX_FILE_BYTES:
        return _fail(f"the file is larger than {MAX_FILE_BYTES // 1024} KiB")
    try:
        doc = YAML(typ="rt").load(text)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        return _fail(f"invalid YAML: {e.problem or e.context}", mark.line + 1 if mark else None)
    except (YAMLError, ValueError, TypeError, RecursionError) as e:
        return _fail(f"invalid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    lines: dict[tuple, int] = {}
    try:
        return _plain(doc, (), lines, [0]), lines
    except _TooBig as e:
        return _fail(str(e))


def file_type(path: str | Path) -> Optional[str]:
    """The ``type`` a configuration file declares (``service``, ``volume``, …); None when it cannot be read or
    declares none (the loader then says why)."""
    try:
        read = _read(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    data = None if isinstance(read, LoadResult) else read[0]
    return data.get("type") if isinstance(data, dict) and isinstance(data.get("type"), str) else None


@dataclass
class VolumeLoadResult:
    config: Optional[VolumeConfiguration] = None
    errors: list[ConfigError] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.config is not None and not self.errors


def load_volume_file(path: str | Path) -> VolumeLoadResult:
    """A ``type: volume`` file, with errors naming the field and its line as a service file's do."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return VolumeLoadResult(errors=[ConfigError("", None, f"{path}: cannot read the file ({e})")])
    read = _read(text)
    if isinstance(read, LoadResult):
        return VolumeLoadResult(errors=read.errors)
    data, lines = read
    if not isinstance(data, dict):
        return VolumeLoadResult(errors=[ConfigError("", None, "the file must be a mapping of fields (type: volume, "
                                                              "name: …)")])
    spelling = _Spelling(data)
    try:
        config = VolumeConfiguration.model_validate(data)
    except ValidationError as e:
        return VolumeLoadResult(errors=[_from_pydantic(err, spelling, lines, VolumeConfiguration)
                                        for err in e.errors(include_url=False)])
    errors = [_from_issue(i, spelling, lines) for i in validate_volume(config)]
    return VolumeLoadResult(config=None if errors else config, errors=errors)


def load_config_data(data: Any, lines: Optional[dict[tuple, int]] = None) -> LoadResult:
    """Validate already-parsed data; ``lines`` maps raw paths to YAML line numbers."""
    lines = lines or {}
    if data is None:
        return _fail("the file is empty; a service needs at least `type: service`, `port` and `commands`")
    if not isinstance(data, dict):
        return _fail(f"the file must be a mapping of fields (type: service, port: …), got a {_kind(data)}")
    if data.get("type") not in (None, "service"):
        also = "; a `type: volume` file is applied with `durastack apply -f`" if data["type"] == "volume" else ""
        return LoadResult(errors=[ConfigError("type", lines.get(("type",)),
                                              f"durastack runs services (type: service), got {data['type']!r}{also}")])
    spelling = _Spelling(data)
    if isinstance(data.get("replicas"), list) and data.get("groups") is not None:
        return LoadResult(errors=[ConfigError("groups", lines.get(("groups",)),
                                              "`replicas` (a list of groups) and `groups` are mutually exclusive")])
    data = copy.deepcopy(data)  # the second pass below edits it; the caller's dict stays as given
    try:
        config = ServiceConfiguration.model_validate(data)
    except ValidationError as e:
        errors = [_from_pydantic(err, spelling, lines) for err in e.errors(include_url=False)]
        return LoadResult(errors=_unique(errors + _rules_despite(e, data, spelling, lines)))
    errors = [_from_issue(i, spelling, lines) for i in validate_service(config)]
    warnings = [_from_issue(i, spelling, lines) for i in warnings_for(config)]
    return LoadResult(config=None if errors else config, errors=_unique(errors), warnings=warnings)


def _rules_despite(error: ValidationError, data: dict, spelling: "_Spelling", lines: dict) -> list[ConfigError]:
    """Also report rule violations elsewhere in a file whose fields have errors.

    The fields that failed are removed and the rest validated again; rule issues that touch a
    removed path are dropped, since they may only be echoes of the first error.
    """
    removed: list[tuple] = []
    for _ in range(3):
        locs = [_loc(err) for err in error.errors()]
        if any(err["type"] == "missing" for err in error.errors()) or not all(_remove(data, loc) for loc in locs):
            return []
        removed += locs
        try:
            config = ServiceConfiguration.model_validate(data)
        except ValidationError as again:
            error = again
            continue
        return [_from_issue(i, spelling, lines) for i in validate_service(config) if not _touches(i, removed)]
    return []


def _touches(issue: Issue, removed: list[tuple]) -> bool:
    return any(p[:len(r)] == r or r[:len(p)] == p for p in (issue.path, *issue.about) for r in removed)


def _remove(data: Any, loc: tuple) -> bool:
    """Delete the value at a pydantic ``loc`` from a copy-on-write walk of ``data``; False if not found."""
    if not loc:
        return False
    node = data
    for part in loc[:-1]:
        if part == "groups" and isinstance(node, dict) and "groups" not in node and "replicas" in node:
            part = "replicas"
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    last = loc[-1]
    if isinstance(node, dict) and last == "count" and "replicas" in node:
        last = "replicas"
    if isinstance(node, dict) and last in node:
        del node[last]
        return True
    return False


def _fail(message: str, line: Optional[int] = None) -> LoadResult:
    return LoadResult(errors=[ConfigError("", line, message)])


def _kind(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "value")


def _unique(errors: list[ConfigError]) -> list[ConfigError]:
    return list(dict.fromkeys(errors))


def _plain(node: Any, path: tuple, lines: dict[tuple, int], budget: list[int]) -> Any:
    """ruamel round-trip nodes → plain Python, recording each key's and item's line."""
    budget[0] += 1
    if budget[0] > MAX_NODES:
        raise _TooBig(f"the document has more than {MAX_NODES} values (YAML aliases that expand too much?)")
    if len(path) > MAX_DEPTH:
        raise _TooBig(f"the document is nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, CommentedMap):
        out = {}
        for key in node:
            name = key if isinstance(key, str) else str(key)
            lines[path + (name,)] = node.lc.key(key)[0] + 1
            out[name] = _plain(node[key], path + (name,), lines, budget)
        return out
    if isinstance(node, (CommentedSeq, list)):
        out_list = []
        for i, item in enumerate(node):
            if isinstance(node, CommentedSeq):
                lines[path + (i,)] = node.lc.item(i)[0] + 1
            out_list.append(_plain(item, path + (i,), lines, budget))
        return out_list
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, (datetime.date, datetime.datetime)):
        return node.isoformat()
    if isinstance(node, dict):  # plain dicts (e.g. from merge keys) still need their lines looked up by parent
        return {str(k): _plain(v, path + (str(k),), lines, budget) for k, v in node.items()}
    return str(node)


class _Spelling:
    """Maps model paths back to the keys the user wrote (`replicas:` list, group `replicas` vs `count`)."""

    def __init__(self, data: dict):
        self.groups_key = "replicas" if isinstance(data.get("replicas"), list) else "groups"
        items = data.get(self.groups_key)
        self.count_keys = {i: ("replicas" if isinstance(g, dict) and "replicas" in g else "count")
                           for i, g in enumerate(items)} if isinstance(items, list) else {}
        env = data.get("env")
        # `env` as a list of NAME=value items: an entry's line is its item's.
        self.env_items = {str(item).partition("=")[0]: i for i, item in enumerate(env)} \
            if isinstance(env, list) else {}

    def raw(self, path: tuple) -> tuple:
        out = list(path)
        if out and out[0] == "groups":
            out[0] = self.groups_key
            if len(out) > 2 and out[2] == "count" and isinstance(out[1], int):
                out[2] = self.count_keys.get(out[1], "count")
        return tuple(out)


def render_path(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line(path: tuple, lines: dict[tuple, int]) -> Optional[int]:
    for n in range(len(path), 0, -1):
        if path[:n] in lines:
            return lines[path[:n]]
    return None


def _from_issue(issue: Issue, spelling: _Spelling, lines: dict[tuple, int]) -> ConfigError:
    raw = spelling.raw(issue.path)
    at = raw
    if len(raw) == 2 and raw[0] == "env" and raw[1] in spelling.env_items:
        at = ("env", spelling.env_items[raw[1]])
    return ConfigError(render_path(raw), _line(at, lines), issue.message)


def _loc(err: dict) -> tuple:
    """The error's path; a mapping key's own error (an env name) is about the key's entry."""
    return tuple(part for part in err["loc"] if part != "[key]")


def _from_pydantic(err: dict, spelling: _Spelling, lines: dict[tuple, int], top: type = ServiceConfiguration
                   ) -> ConfigError:
    loc = _loc(err)
    raw = spelling.raw(loc)
    return ConfigError(render_path(raw), _line(raw, lines), _message(err, loc, top))


def _message(err: dict, loc: tuple, top: type = ServiceConfiguration) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return "unknown field" + _suggest(loc, top)
    if kind == "missing":
        return "required field is missing"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if msg.startswith("Assertion failed, "):
        msg = msg[len("Assertion failed, "):]
    return msg[0].lower() + msg[1:] if msg[:1].isupper() and not msg[1:2].isupper() else msg


def _suggest(loc: tuple, top: type = ServiceConfiguration) -> str:
    """Point at the field the user probably meant (``comands`` → ``commands``)."""
    name = loc[-1] if loc and isinstance(loc[-1], str) else None
    parent = loc[:-1]
    if name is None:
        return ""
    if not parent:
        candidates = list(top.model_fields)
    elif len(parent) == 2 and parent[0] == "groups":
        if name in ServiceConfiguration.model_fields:  # env, volumes, port…: dstack's service-level fields
            return f"; `{name}` is set at the service level only (it applies to every group)"
        candidates = list(ReplicaGroup.model_fields) + ["replicas"]
    elif parent[-1] == "resources":
        candidates = list(ResourcesSpec.model_fields)
    else:
        return ""
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean `{close[0]}`?" if close else ""
