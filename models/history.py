"""Reading back what history holds, without the admission rules.

The models' bounds, patterns and cross-field checks are rules for what may *enter* a service (`apply`, a
signal's judge, a workflow's start). A running service carries its configuration and state in history and
reads them back on every replay and continue-as-new. Were the rules applied there too, a release that
tightens one (a lower maximum, a stricter pattern, a field removed) would fail every workflow task of a
service admitted under the old rule, for good.

So a payload that passes the models is taken as they make it, and one that does not is read by
``lenient``: each part that still passes is validated as usual (parsers and secret marks included); a
part that fails only a rule is kept as it was recorded; an unknown field is dropped. Nothing here admits
anything: a refused `apply` is refused before it reaches history.
"""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.functional_validators import BeforeValidator, PlainValidator, WrapValidator

# What turns a recorded value into a model value (a short form parsed, a secret's mark stripped), as opposed to
# a rule that judges it: kept when a part is read back leniently.
PARSERS = (BeforeValidator, PlainValidator, WrapValidator)


def lenient(annotation: Any, raw: Any) -> Any:
    """``raw`` (decoded JSON) as ``annotation``, by the models when it passes them, else part by part."""
    try:
        return _adapter(annotation).validate_python(raw)
    except ValidationError:
        return _parts(annotation, raw)


def _adapter(annotation: Any) -> TypeAdapter:
    try:
        return _cached_adapter(annotation)
    except TypeError:  # metadata that cannot be hashed
        return TypeAdapter(annotation)


@functools.lru_cache(maxsize=256)
def _cached_adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation)


def _parts(annotation: Any, raw: Any) -> Any:
    base, parsers = _split(annotation)
    if parsers:  # the parsers alone: the rules among the metadata (bounds, checks) left out
        try:
            return _adapter(Annotated[(base, *parsers)]).validate_python(raw)
        except ValidationError:
            pass
    if _is_model(base):
        raw = _before(parsers, raw)  # a short form (a port number for a mapping) made a mapping
        if isinstance(raw, dict):
            return _model(base, raw)
    origin, args = get_origin(base), get_args(base)
    if origin in (list, tuple, set, frozenset) and isinstance(raw, list) and args:
        items = [lenient(args[0], item) for item in raw]
        return items if origin is list else origin(items)
    if origin is dict and isinstance(raw, dict) and len(args) == 2:
        return {key: lenient(args[1], value) for key, value in raw.items()}
    if origin in (Union, types.UnionType):
        return _union(args, raw)
    return raw  # a value that fails only a rule: as recorded


def _before(parsers: tuple, raw: Any) -> Any:
    """``raw`` through the before-parsers (last first, as pydantic runs them) that take it."""
    for parser in reversed(parsers):
        if isinstance(parser, BeforeValidator):
            try:
                raw = parser.func(raw)  # type: ignore[call-arg]
            except (TypeError, ValueError):
                pass
    return raw


def _split(annotation: Any) -> tuple[Any, tuple]:
    """``Annotated[T, ...]`` → ``(T, its parsers)``; anything else → ``(annotation, ())``."""
    if get_origin(annotation) is not Annotated:
        return annotation, ()
    base, *meta = get_args(annotation)
    return base, tuple(m for m in meta if isinstance(m, PARSERS))


def _union(arms: tuple, raw: Any) -> Any:
    if raw is None and type(None) in arms:
        return None
    for arm in arms:  # the first arm the models take as it is
        try:
            return _adapter(arm).validate_python(raw)
        except ValidationError:
            continue
    shaped = [a for a in arms if _holds(a, raw)]  # else the first arm of raw's shape, part by part
    return _parts(shaped[0], raw) if shaped else raw


def _holds(annotation: Any, raw: Any) -> bool:
    """Whether ``annotation`` is a model, list or mapping, as ``raw`` is."""
    base = _split(annotation)[0]
    if isinstance(raw, dict):
        return get_origin(base) is dict or _is_model(base)
    return isinstance(raw, list) and get_origin(base) in (list, tuple, set, frozenset)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _model(cls: type[BaseModel], raw: dict) -> BaseModel:
    """The model from its recorded fields, each read leniently, without its cross-field checks; fields it no
    longer has are dropped, missing ones take their defaults."""
    values = {}
    for name, field in cls.model_fields.items():
        key = name if name in raw else field.alias if field.alias in raw else None
        if key is not None:
            values[name] = lenient(Annotated[(field.annotation, *field.metadata)] if field.metadata
                                   else field.annotation, raw[key])
    return cls.model_construct(**values)
