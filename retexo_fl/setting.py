"""How a run setting is declared: once, in its section, with its type, default and doc.

Every setting of :class:`~retexo_fl.config.TrainConfig` is one field of one section dataclass
(the torchtitan ``JobConfig`` pattern), written with :func:`setting`::

    @section
    class ModelSettings:
        \"\"\"The model stack.\"\"\"

        hidden: int = setting(32, "hidden width")
        norm: Literal["layer", "none"] = setting("none", "the normalization after each layer")

The flat configuration, the kebab-case run-config keys, the CLI flags with their help and
choices, the ``Args:`` block of each section's docstring and the check of ``pyproject.toml``'s
run-config table are all read from these declarations (:func:`settings_of`). A field typed
``Literal[...]`` takes only those values; :func:`check_choices` refuses the rest by name.

This module is a leaf of the package graph (no torch, no other :mod:`retexo_fl` module): each
package's ``settings`` module imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args, get_origin

_Cls = TypeVar("_Cls", bound=type)

#: Field metadata keys.
_DOC = "doc"
_PER_STAGE = "per_stage"
_MODES = "modes"
_NEEDS = "needs"


def setting(
    default: Any, doc: str, *, per_stage: bool = False, modes: tuple[str, ...] = (), needs: str = ""
) -> Any:
    """Declare a setting: its default and its one-line doc (the field's annotation is its type).

    Args:
        default (Any): the value a run takes when nothing sets it (lists are copied per config).
        doc (str): what the setting does, as the CLI help and the section's docstring show it.
        per_stage (bool, optional): the setting takes one value for every stage or a list with one
            value per stage (``"200,100"`` on the command line). (default: :obj:`False`)
        modes (tuple[str, ...], optional): the training modes that read it; empty for every one.
            A value given for a run of another mode is reported as ignored. (default: ``()``)
        needs (str, optional): another setting it acts through: ``"name"`` (set: true or
            nonzero), ``"name=value"``, ``"name=value|other"`` (any of the values), or
            ``"name="`` (read only while ``name`` is not set); a value given while that does not
            hold is reported as ignored. (default: ``""``)
    """
    meta = {_DOC: " ".join(doc.split()), _PER_STAGE: per_stage, _MODES: tuple(modes), _NEEDS: needs}
    if isinstance(default, list | dict | set):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class SettingInfo:
    """One declared setting, as the CLI, the docs and the checks read it.

    Args:
        name (str): the snake-case field name (``"local_epochs"``).
        annotation (str): the declared type, as written.
        default (Any): the default value.
        doc (str): the one-line doc.
        per_stage (bool): one value or one per stage.
        choices (tuple, optional): the values a ``Literal`` type allows; empty for any.
        kind (str, optional): ``bool``, ``int``, ``float`` or ``str`` where the type is one of them
            (or a list of one, for a per-stage setting), which :func:`check_choices` holds each
            value to; empty for any other type.
        modes (tuple[str, ...], optional): the modes that read it (empty: every one).
        needs (str, optional): the setting it acts through (:func:`setting`).
    """

    name: str
    annotation: str
    default: Any
    doc: str
    per_stage: bool
    choices: tuple[Any, ...] = ()
    kind: str = ""
    modes: tuple[str, ...] = ()
    needs: str = ""

    def needs_met(self, cfg: Any) -> bool:
        """Whether ``cfg`` reads this setting as far as :attr:`needs` goes."""
        if not self.needs:
            return True
        name, equals, wanted = self.needs.partition("=")
        value = getattr(cfg, name)
        return str(value) in wanted.split("|") if equals else bool(value)

    @property
    def needs_phrase(self) -> str:
        """When :attr:`needs` lets a run read it: ``with secure-aggregation``, ``with model gat``,
        ``without partitions`` (empty without a condition)."""
        name, equals, wanted = self.needs.partition("=")
        flag = name.replace("_", "-")
        if not self.needs:
            return ""
        if equals and not wanted:
            return f"without {flag}"
        return f"with {flag} {' or '.join(wanted.split('|'))}".rstrip()

    @property
    def key(self) -> str:
        """The kebab-case run-config key and CLI flag name (``"local-epochs"``)."""
        return self.name.replace("_", "-")


def _hints(cls: type) -> dict[str, Any]:
    module = sys.modules.get(cls.__module__)
    return typing.get_type_hints(cls, vars(module) if module else None)


def _choices(hint: Any) -> tuple[Any, ...]:
    """The values of a ``Literal`` (also inside ``X | list[X]``), else ``()``."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    for arg in get_args(hint):
        found = _choices(arg)
        if found:
            return found
    return ()


#: The scalar types :func:`check_choices` holds a setting's values to.
_KINDS = {bool: "bool", int: "int", float: "float", str: "str"}


def _kind(hint: Any) -> str:
    """``int`` for ``int`` or ``int | list[int]``, likewise ``bool``, ``float``, ``str``; else ``""``."""
    if hint in _KINDS:
        return _KINDS[hint]
    kinds = {_kind(arg) for arg in get_args(hint) if get_origin(hint) is not Literal}
    return kinds.pop() if len(kinds) == 1 else ""


@functools.cache
def settings_of(cls: type) -> tuple[SettingInfo, ...]:
    """The settings a section declares, in order (:func:`retexo_fl.config.settings`: every
    section's, the flat configuration's).

    Args:
        cls (type): a dataclass whose fields were declared with :func:`setting`.

    Cached per class: ``validate()`` reads it for every config a client parses, once a message.
    """
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if _DOC not in f.metadata:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append(
            SettingInfo(
                name=f.name,
                annotation=annotation,
                default=default,
                doc=f.metadata[_DOC],
                per_stage=bool(f.metadata[_PER_STAGE]),
                choices=_choices(hints[f.name]),
                kind=_kind(hints[f.name]),
                modes=tuple(f.metadata.get(_MODES, ())),
                needs=str(f.metadata.get(_NEEDS, "")),
            )
        )
    return tuple(out)


def check_choices(obj: Any) -> None:
    """Raise :class:`ValueError` naming the first setting of ``obj`` outside its ``Literal`` or
    its type: a flag that is not ``True`` or ``False`` (a run config's string ``"false"`` is one
    such), a whole number that is not one (``rounds 2.5``), a number that is not finite, or a
    per-stage number that is not one (``lr "0.5,x"``).

    Args:
        obj (Any): a section instance.
    """
    for info in settings_of(type(obj)):
        value = getattr(obj, info.name)
        values = value if info.per_stage and isinstance(value, list | tuple) else [value]
        if info.per_stage and isinstance(value, list | tuple) and not value:
            raise ValueError(f"{info.key} takes one value or one per stage; got an empty list")
        for v in values:
            _check_kind(info, v)
        if not info.choices:
            default = info.default
            sample = default[0] if isinstance(default, list | tuple) and default else default
            numeric = info.per_stage and isinstance(sample, int | float) and not isinstance(sample, bool)
            for v in values if numeric else ():
                if isinstance(v, bool) or not isinstance(v, int | float):
                    raise ValueError(f"{info.key} takes a number or one per stage (a comma list); got {v!r}")
            continue
        for v in values:
            if v not in info.choices:
                allowed = ", ".join(str(c) for c in info.choices)
                raise ValueError(f"{info.key} must be one of {allowed}; got {v!r}")


def _check_kind(info: SettingInfo, value: Any) -> None:
    kind = info.kind
    if kind == "bool" and not isinstance(value, bool):
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            # A run config in TOML (`--run-config "k='false'"`) quoted the word into text.
            raise ValueError(
                f"{info.key} takes true or false; got the text {value!r}: write it unquoted "
                f"({info.key}={value.strip().lower()})"
            )
        raise ValueError(f"{info.key} takes true or false; got {value!r}")
    if kind == "str" and not isinstance(value, str | os.PathLike):  # a folder may be a Path
        raise ValueError(f"{info.key} takes text; got {value!r}")
    if kind in ("int", "float") and (isinstance(value, bool) or not isinstance(value, int | float)):
        if info.per_stage:  # the per-stage message below names the comma form
            return
        wanted = "a whole number" if kind == "int" else "a number"
        raise ValueError(f"{info.key} takes {wanted}; got {value!r}")
    if kind == "int" and not isinstance(value, int):
        raise ValueError(f"{info.key} takes a whole number; got {value!r}")
    if kind == "float" and not math.isfinite(value):
        raise ValueError(f"{info.key} takes a finite number; got {value!r}")


def _args_block(cls: type) -> str:
    # Read from the fields alone: the module that declares ``cls`` is still being imported.
    lines = ["", "Args:"]
    for f in dataclasses.fields(cls):
        if _DOC in f.metadata:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"    {f.name} ({f.type}, optional): {f.metadata[_DOC]} (default: {default!r})")
    return "\n".join(lines)


def section(cls: _Cls) -> _Cls:
    """Make ``cls`` a frozen section dataclass whose docstring lists its settings (PyG style).

    Args:
        cls (type): a class whose fields are declared with :func:`setting`.
    """
    made: Callable[[_Cls], _Cls] = dataclass(frozen=True)
    out = made(cls)
    out.__doc__ = inspect.cleandoc(out.__doc__ or "") + "\n" + _args_block(out)
    return out
