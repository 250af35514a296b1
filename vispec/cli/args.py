"""Command-line flags built from config dataclasses: one ``--flag`` per field.

A field ``num_images: int = 4`` becomes ``--num-images`` (``type=int``, default 4). The type comes from the
field's annotation:

* ``int``, ``float``, ``str``: one value of that type; ``Optional[...]`` fields default to ``None``;
* ``bool``: a switch, ``--name`` (``store_true``) when the default is False, ``--no-name`` (``store_false``)
  when it is True;
* ``tuple[X, ...]``: a list, comma-separated and/or space-separated (``--rows 16,128`` and ``--rows 16 128``),
  each item converted to ``X``; an empty list is a user error;
* ``dict`` fields are not flags.

Flags store into the field's name, so :func:`config_from_args` builds the config from the parsed namespace.
List and conversion errors raise ``ValueError`` while parsing (the CLI prints them as one ``vispec: error:`` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable, Iterable, Mapping, Optional

Splitter = Callable[[str, str], tuple[str, ...]]


def split_list(text: str, flag: str) -> tuple[str, ...]:
    """``"a, b,c"`` as ``("a", "b", "c")``: stripped, non-empty items; an empty list is a ``ValueError`` naming ``flag``."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    if not items:
        raise ValueError(f"{flag} is empty")
    return items


_TYPE_WORDS = {int: "integers", float: "numbers"}


class _ListAction(argparse.Action):
    """``nargs="+"`` values joined with commas, split by ``split`` and converted item by item to ``item_type``."""

    def __init__(self, option_strings, dest, *, split: Splitter, item_type: type, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.split, self.item_type = split, item_type

    def __call__(self, parser, namespace, values, option_string=None):
        flag = option_string or self.dest
        items = self.split(",".join(values), flag)
        if self.item_type is not str:
            try:
                items = tuple(self.item_type(item) for item in items)
            except ValueError:
                raise ValueError(f"{flag} must be a comma-separated list of {_TYPE_WORDS[self.item_type]}, "
                                 f"got {','.join(values)!r}") from None
        setattr(namespace, self.dest, items)


def _unwrap_optional(kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def _default_text(default: Any) -> str:
    if isinstance(default, tuple):
        return ",".join(str(item) for item in default)
    return "none" if default is None else str(default)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def add_config_args(
    parser: argparse.ArgumentParser,
    config_cls: type,
    *,
    only: Optional[Iterable[str]] = None,
    skip: Iterable[str] = (),
    flags: Optional[Mapping[str, str]] = None,
    help: Optional[Mapping[str, str]] = None,  # noqa: A002 - argparse's word
    splitters: Optional[Mapping[str, Splitter]] = None,
    defaults: Optional[Mapping[str, Any]] = None,
) -> None:
    """One flag per field of the dataclass ``config_cls`` (module docstring).

    ``only``: these fields, in this order (default: all but ``skip``); ``flags``: flag names that differ from
    ``--field-name`` (e.g. ``{"caches": "--cache"}``); ``help``: per-field help text, to which ``(default: ...)``
    is added unless it speaks of the default itself; ``splitters``: per-field list parsers ``(text, flag) ->
    tuple`` (default :func:`split_list`); ``defaults``: defaults that differ from the dataclass's."""
    flags, help, splitters, defaults = flags or {}, help or {}, splitters or {}, defaults or {}
    hints = typing.get_type_hints(config_cls)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    names = list(only) if only is not None else [name for name in fields if name not in set(skip)]
    for name in names:
        kind = _unwrap_optional(hints[name])
        origin = typing.get_origin(kind)
        if kind is dict or origin is dict:
            if only is not None:
                raise TypeError(f"{config_cls.__name__}.{name} is a dict: no flag for it")
            continue
        default = defaults.get(name, _field_default(fields[name]))
        text = help.get(name, "")
        if default is not dataclasses.MISSING and kind is not bool and "default" not in text:
            text = f"{text} (default: {_default_text(default)})".strip()
        text = text.replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": name, "help": text}
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        on = kind is bool and default is not dataclasses.MISSING and bool(default)  # a switch that defaults to on
        flag = flags.get(name) or ("--no-" if on else "--") + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action="store_false" if on else "store_true", **kwargs)
        elif origin is tuple:
            parser.add_argument(flag, nargs="+", action=_ListAction, split=splitters.get(name, split_list),
                                item_type=typing.get_args(kind)[0], metavar=name.upper(), **kwargs)
        else:
            if kind in (int, float):
                kwargs["type"] = kind
            parser.add_argument(flag, **kwargs)


def config_flag(config_cls: type, field: str, flags: Optional[Mapping[str, str]] = None) -> str:
    """The flag :func:`add_config_args` gives ``config_cls``'s ``field`` (``flags`` as passed to it): what an error
    about the field should name on the command line. A name that is not a field is returned as it is."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    if flags and field in flags:
        return flags[field]
    if field not in fields:
        return field
    kind = _unwrap_optional(typing.get_type_hints(config_cls)[field])
    default = _field_default(fields[field])
    on = kind is bool and default is not dataclasses.MISSING and bool(default)
    return ("--no-" if on else "--") + field.replace("_", "-")


def config_from_args(config_cls: type, args: argparse.Namespace, **overrides: Any):
    """``config_cls`` from the fields ``args`` holds (the flags :func:`add_config_args` made), plus ``overrides``."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    return config_cls(**{**values, **overrides})

