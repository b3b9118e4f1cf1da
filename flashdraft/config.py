"""The one typed config system: dataclasses filled from YAML plus `key=value` overrides, strict.

    cfg = load_config(TrainConfig, "run.yaml", ["optim.lr=3e-4", "data.max_length=2048"])

Unknown keys are errors that name the closest valid key; values are coerced to the field's
annotated type (int, float, bool, str, lists, Optional, nested dataclasses); a float must be finite
(`optim.lr=nan` is an error naming the field). A key that was removed
(a section's `REMOVED`) is still read from configs saved before the removal when its value did
nothing (e.g. `false`), and ignored; any other value is an error that says it was removed and why.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from flashdraft.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Removed:
    """A config key that no longer exists. Run folders keep their config.yaml (resumed or read back), so a
    value in `inert` (what the key's "off" was), or any value when `inert` is None, is accepted and ignored;
    another value is refused: it asked for behaviour the code no longer has."""

    why: str  # one clause: the measurement that removed it
    inert: tuple[Any, ...] | None = ()

    def accepts(self, value: Any) -> bool:
        return self.inert is None or any(value == v and type(value) is type(v) for v in self.inert)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot parse {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _from_dict(tp, value, where)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_coerce(v.strip() if isinstance(v, str) else v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if typing.get_origin(tp) is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if not math.isfinite(f) or f != int(f):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        try:
            f = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if not math.isfinite(f):
            raise ConfigError(f"{where}: {value!r} is not a finite number")
        return f
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _from_dict(cls: type[T], raw: dict[str, Any], where: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    removed: dict[str, Removed] = getattr(cls, "REMOVED", {})
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else key
        if key in removed:
            if removed[key].accepts(value):
                continue
            why = removed[key].why
            raise ConfigError(f"config key {path!r} was removed ({why}): delete it from the config")
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (valid: {', '.join(names)})"
            raise ConfigError(f"unknown config key {path!r}{hint}")
        kw[key] = _coerce(value, hints[key], path)
    try:
        return cls(**kw)
    except TypeError as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings onto a nested dict (values parsed as YAML scalars)."""
    out = dict(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node[p] = dict(node.get(p) or {})
            node = node[p]
        try:
            node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            node[parts[-1]] = value
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{p}: not a text YAML file (byte {e.start} is not UTF-8): pass a YAML config such as configs/smollm2-b16.yaml"
            ) from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read the config ({e.strerror})") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{p}:{line} invalid YAML ({getattr(e, 'problem', e)})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        raw = loaded or {}
    raw = apply_overrides(raw, overrides or [])
    try:
        return _from_dict(cls, raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def save_config(cfg: Any, path: str | Path) -> None:
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(p)
