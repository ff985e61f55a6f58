"""Strict readers for YAML mappings: unknown keys, wrong types and bad values become PlanErrors
that name the field (``source: path.to.field``) and the fix. Hand-rolled rather than pydantic so
the messages can carry a concrete fix and the CLI starts fast."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from megatron_hybridep.plan.errors import PlanError

_MISSING = object()


class FieldReader:
    """Reads typed values from one mapping and, at :meth:`done`, rejects keys nobody asked for."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise PlanError(f"{where}: expected a mapping (key: value), got {type(data).__name__}; "
                            "fix: write it as 'key: value' lines")
        self.data = data
        self.where = where
        self.seen: set[str] = set()

    def field(self, key: str) -> str:
        return f"{self.where}.{key}"

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self.seen.add(key)
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                raise PlanError(f"{self.field(key)}: required field is missing; fix: add '{key}: <value>'")
            return default
        return self.data[key]

    def string(self, key: str, default: Any = _MISSING) -> Any:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str) or not value:
            raise PlanError(f"{self.field(key)}: expected a non-empty string, got {value!r}")
        return value

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int | None = None,
                fix: str = "") -> Any:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        return check_int(value, self.field(key), minimum=minimum, fix=fix)

    def number(self, key: str, default: Any = _MISSING, *, positive: bool = False,
               non_negative: bool = False, fix: str = "") -> Any:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        return check_number(value, self.field(key), positive=positive, non_negative=non_negative, fix=fix)

    def done(self) -> None:
        unknown = [str(k) for k in self.data if k not in self.seen]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, sorted(self.seen), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(self.seen))}"
            raise PlanError(f"{self.field(key)}: unknown key; fix: remove it ({hint})")


def check_int(value: Any, field: str, *, minimum: int | None = None, fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise PlanError(f"{field}: expected an integer, got {value!r}" + (f"; fix: {fix}" if fix else ""))
    if minimum is not None and value < minimum:
        raise PlanError(f"{field}: must be >= {minimum}, got {value}" + (f"; fix: {fix}" if fix else ""))
    return int(value)


def check_number(value: Any, field: str, *, positive: bool = False, non_negative: bool = False,
                 fix: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlanError(f"{field}: expected a finite number, got {value!r}" + (f"; fix: {fix}" if fix else ""))
    if positive and value <= 0:
        raise PlanError(f"{field}: must be > 0, got {value}" + (f"; fix: {fix}" if fix else ""))
    if non_negative and value < 0:
        raise PlanError(f"{field}: must be >= 0, got {value}" + (f"; fix: {fix}" if fix else ""))
    return float(value)


def load_yaml(path: str) -> Any:
    """Parse a YAML file; a missing file or a syntax error becomes a PlanError naming the path."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise PlanError(f"{path}: file not found; fix: pass an existing YAML file "
                        "(presets live in configs/topologies/ and configs/models/)") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{path}: not valid YAML ({exc}); fix: correct the syntax") from None
