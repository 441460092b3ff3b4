"""Replica addresses in commands: ``${{ groups[i].replicas[j].IP_ADDRESS }}`` (pure parsing).

A group is named by its position (``groups[1]``) or, beyond dstack, by its name (``groups[decode]``,
``groups["decode"]``). ``IP_ADDRESS`` is the address the other replicas of the service reach that replica
at. ``PORT`` (also beyond dstack) is the port its app listens on there: the service's port on a cloud or
a service network, but a local replica without isolation shares the host's loopback and has a port of
its own, which another replica cannot guess.

``$${{`` is dstack's escape: a literal ``${{`` in the command run, never a reference.

Used by the configuration's rules (models.validation) and by the workflow, which substitutes the values
when it builds a replica's input (rules.addresses).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

ATTRIBUTES = ("IP_ADDRESS", "PORT")
_OPEN = "${{"
_ESCAPED = "$${{"
_EXPR = re.compile(
    r"""\$\{\{\s*groups\s*\[\s*(?:(?P<index>[0-9]+)|(?P<name>[a-z0-9][a-z0-9-]*)|(?P<q>["'])(?P<quoted>[^"']*)(?P=q))\s*\]"""
    r"""\s*\.\s*replicas\s*\[\s*(?P<replica>[0-9]+)\s*\]\s*\.\s*(?P<attr>[A-Za-z_]+)\s*\}\}""")


@dataclass(frozen=True)
class Ref:
    """One reference: ``group`` is a position (int) or a name (str), as written."""

    group: Union[int, str]
    replica: int
    attr: str

    def key(self, group_name: str) -> str:
        """The reference with its group by name: the same key however it was written."""
        return f"groups[{group_name}].replicas[{self.replica}].{self.attr}"


@dataclass(frozen=True)
class Found:
    start: int
    end: int
    text: str
    ref: Optional[Ref]  # None: malformed
    error: str = ""


def find(text: str) -> Iterator[Found]:
    """Every ``${{ … }}`` in ``text``, parsed; a malformed one comes with why."""
    pos = 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            return
        if start > 0 and text[start - 1] == "$":  # `$${{`: a literal, left for `substitute` to unescape
            pos = start + len(_OPEN)
            continue
        m = _EXPR.match(text, start)
        if m is None:
            close = text.find("}}", start)
            end = len(text) if close < 0 else close + 2
            yield Found(start, end, text[start:end], None,
                        "malformed expression: write ${{ groups[<index or name>].replicas[<n>].IP_ADDRESS }}")
        elif m.group("attr") not in ATTRIBUTES:
            end = m.end()
            yield Found(start, end, m.group(), None, f"unknown attribute {m.group('attr')}: "
                                                     f"one of {', '.join(ATTRIBUTES)}")
        else:
            end = m.end()
            group: Union[int, str]
            if m.group("index") is not None:
                group = int(m.group("index"))
            else:
                group = m.group("name") if m.group("name") is not None else m.group("quoted")
            yield Found(start, end, m.group(), Ref(group, int(m.group("replica")), m.group("attr")))
        pos = end


def refs(texts: Sequence[str]) -> list[Ref]:
    return [f.ref for t in texts for f in find(t) if f.ref is not None]


def group_name(names: Sequence[str], group: Union[int, str]) -> Optional[str]:
    """The name of the group a reference means, or None when the service has no such group."""
    if isinstance(group, int):
        return names[group] if group < len(names) else None
    return group if group in names else None


def substitute(text: str, names: Sequence[str], value: Callable[[str], str], unescape: bool = True) -> str:
    """``text`` with each reference replaced by ``value(key)`` and each ``$${{`` by ``${{`` (unless ``unescape`` is
    False: a later pass substitutes again); malformed references are left (validation refuses them)."""
    def literal(part: str) -> str:
        return part.replace(_ESCAPED, _OPEN) if unescape else part

    out, pos = [], 0
    for f in find(text):
        name = group_name(names, f.ref.group) if f.ref is not None else None
        if f.ref is None or name is None:
            continue
        out += [literal(text[pos:f.start]), value(f.ref.key(name))]
        pos = f.end
    return "".join(out) + literal(text[pos:])


def target_group(key: str) -> str:
    """The group a reference key (``Ref.key``) names: ``groups[<name>].replicas[j].ATTR`` → name."""
    return key[len("groups["):].split("].replicas[", 1)[0]


def expression(key: str) -> str:
    """A reference key written back as an expression, by group name: what a late reference stays in a job's
    commands until its launch resolves it (``fill``)."""
    name, rest = key[len("groups["):].split("].replicas[", 1)
    return '${{ groups["' + name + '"].replicas[' + rest + " }}"


def fill(commands: Sequence[str], values: dict[str, str]) -> list[str]:
    """``commands`` with the references written by ``expression`` replaced by ``values`` (keyed as ``Ref.key``)."""
    names = sorted({target_group(k) for k in values})
    return [substitute(c, names, lambda key: values[key]) for c in commands]
