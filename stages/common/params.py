"""Typed params: one dataclass per section of ``params.yaml``, unknown keys rejected.

Each stage declares its section as a (possibly nested) dataclass and loads it with
:func:`load_section`. Values are checked against the field's annotation (``bool`` is
never taken for an ``int``, an ``int`` is accepted where a ``float`` is asked for) and
ranges are checked in the dataclass's ``__post_init__`` through :func:`check`. Every
error is a :class:`ParamsError` (a ``ValueError``) whose message names the full key,
for example ``reconstruct.nerf.lr: must be > 0, got -1``.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")

DEFAULT_PARAMS = Path("params.yaml")


class ParamsError(ValueError):
    """A params value that is missing, unknown, of the wrong type or out of range."""


def check(condition: bool, key: str, message: str, value: Any) -> None:
    """Raise :class:`ParamsError` naming ``key`` unless ``condition`` holds.

    ``key`` is the field's name; :func:`from_dict` prefixes the section path.
    """
    if not condition:
        raise ParamsError(f"{key}: {message}, got {value!r}")


# A float with an exponent that YAML 1.1 does not know (1e-4, 5.5e1: it wants a dot and a signed exponent,
# 1.0e-4): YAML 1.2 and DVC's parser read a number, PyYAML reads a string, so `lr: 1e-4` would be refused.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ParamsError as exc:
                errors.append(str(exc))
        raise ParamsError(f"{where}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ParamsError(f"{where}: must be one of {', '.join(repr(a) for a in args)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ParamsError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ParamsError(f"{where}: expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ParamsError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            return float(value)  # 1e-4: a number to YAML 1.2 (and DVC), text to PyYAML's YAML 1.1
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamsError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ParamsError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported annotation {tp!r} in the params schema")


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass ``cls`` from a mapping, naming ``where`` in every error."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError(f"{where}: expected a mapping of keys, got {data!r}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        names = ", ".join(f"{where}.{k}" for k in unknown)
        raise ParamsError(f"unknown params key(s) {names}; known keys in {where}: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name in known:
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], f"{where}.{name}")
        elif known[name].default is dataclasses.MISSING and known[name].default_factory is dataclasses.MISSING:
            raise ParamsError(f"{where}.{name}: required key is missing")
    try:
        return cls(**kwargs)
    except ParamsError as exc:
        msg = str(exc)
        raise ParamsError(msg if msg.startswith(where + ".") else f"{where}.{msg}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (PyYAML lets
    the last one win without a word, so a forgotten earlier line would silently lose)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base loader says what is wrong
                    break
                seen[key] = line
                if first is not None:
                    raise ParamsError(f"{key_node.start_mark.name}: line {line}: duplicate key {key!r} "
                                      f"(first given on line {first}); remove one of them")
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, name: str = "<params>") -> Any:
    """YAML text as Python values, with duplicate keys refused (:class:`ParamsError`)."""
    loader = _UniqueKeyLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path = DEFAULT_PARAMS) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"params file not found: {path}")
    try:
        data = parse_yaml(path.read_text(), str(path)) or {}
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    return data


def load_section(cls: type[T], section: str, path: str | Path | None = None, data: dict | None = None) -> T:
    """Load and validate one section of params.yaml as dataclass ``cls``.

    A file without the section is an error, not the built-in defaults (a file meant for
    another purpose would otherwise run with values nobody chose); an empty section
    (``section: {}``) asks for the defaults explicitly.
    """
    where = str(path) if path is not None else "the params" if data is not None else str(DEFAULT_PARAMS)
    data = read_yaml(path or DEFAULT_PARAMS) if data is None else data
    if section not in data:
        raise ParamsError(f"{where} has no '{section}' section (it has: {', '.join(map(str, data)) or 'nothing'}); "
                          f"add one (see the project's params.yaml), or '{section}: {{}}' for the built-in defaults")
    return from_dict(cls, data[section], section)


def to_dict(obj: Any) -> dict:
    """The resolved params as plain YAML/JSON types (to save beside outputs)."""
    return dataclasses.asdict(obj)
