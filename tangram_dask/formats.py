"""Reading workload and cluster files (format v1, see resources/bench/WORKLOAD.md).

Pure: no Dask import. Every problem raises :class:`FileFormatError` naming
the file and the key (``tools[1].units.max``), and what would be right.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from .errors import FileFormatError


class Reader:
    """Walks a parsed YAML mapping, checking keys and values as it reads them."""

    def __init__(self, path: str, data: Any, where: str = ""):
        self.path = path
        self.where = where
        if not isinstance(data, Mapping):
            raise FileFormatError(path, where or "<top>", f"must be a mapping, got {type(data).__name__}")
        self.data = data
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def fail(self, name: str, problem: str) -> FileFormatError:
        return FileFormatError(self.path, self.key(name), problem)

    def has(self, name: str) -> bool:
        return name in self.data

    def get(self, name: str, conv: Callable[[Any, str], Any], default: Any = ...) -> Any:
        self.seen.add(name)
        if name not in self.data:
            if default is ...:
                raise self.fail(name, "required key is missing")
            return default
        try:
            return conv(self.data[name], name)
        except FileFormatError:
            raise
        except (TypeError, ValueError) as e:
            raise self.fail(name, str(e)) from None

    def child(self, name: str, default: Any = ...) -> "Reader | None":
        self.seen.add(name)
        if name not in self.data:
            if default is ...:
                raise self.fail(name, "required key is missing")
            return default
        return Reader(self.path, self.data[name], self.key(name))

    def items(self, name: str, default: Any = ...) -> list["Reader"]:
        self.seen.add(name)
        if name not in self.data:
            if default is ...:
                raise self.fail(name, "required key is missing")
            return default
        seq = self.data[name]
        if not isinstance(seq, list):
            raise self.fail(name, f"must be a list, got {type(seq).__name__}")
        return [Reader(self.path, x, f"{self.key(name)}[{i}]") for i, x in enumerate(seq)]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen, key=str)
        if unknown:
            raise self.fail(str(unknown[0]), f"unknown key (known here: {', '.join(sorted(self.seen))})")


# -- value converters: (value, key name) -> value, raising ValueError with a reason
def number(lo: float | None = None, hi: float | None = None, *, open_lo: bool = False) -> Callable[[Any, str], float]:
    def conv(v: Any, _: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v!r}")
        if lo is not None and (v < lo or (open_lo and v == lo)):
            raise ValueError(f"must be {'>' if open_lo else '>='} {lo}, got {v!r}")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= {hi}, got {v!r}")
        return float(v)
    return conv


def whole(lo: int = 0) -> Callable[[Any, str], int]:
    def conv(v: Any, _: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be a whole number, got {v!r}")
        if v < lo:
            raise ValueError(f"must be >= {lo}, got {v!r}")
        return v
    return conv


def text(v: Any, _: str) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty string, got {v!r}")
    return v


def choice(*options: str) -> Callable[[Any, str], str]:
    def conv(v: Any, _: str) -> str:
        if v not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {v!r}")
        return v
    return conv


def load_yaml(path: str | Path) -> Any:
    p = Path(path)
    try:
        with open(p) as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise FileFormatError(str(p), "<file>", "no such file") from None
    except yaml.YAMLError as e:
        raise FileFormatError(str(p), "<file>", f"is not valid YAML: {e}") from None
