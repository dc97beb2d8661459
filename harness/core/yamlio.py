"""Load YAML once, keeping the line of every key so errors can name it."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import HarnessError


@dataclass(frozen=True)
class Doc:
    """A parsed YAML document: plain data plus the line of each key path."""

    source: str
    data: Any
    lines: dict[tuple, int] = field(default_factory=dict)

    def line(self, path: tuple) -> int | None:
        """Line of the nearest enclosing key path that has one."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get(())

    def error(self, path: tuple, message: str, fix: str | None = None) -> HarnessError:
        """Build a HarnessError located at a key path."""
        return HarnessError(message, source=self.source, key=format_path(path) or None,
                            line=self.line(path), fix=fix)


def format_path(path: tuple) -> str:
    """Render ('tests', 0, 'prompt') as tests[0].prompt."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def read_text(path: Path, what: str) -> str:
    """Read a UTF-8 text file, turning every OS problem into a HarnessError."""
    if not path.exists():
        raise HarnessError(f"{what} not found", source=str(path), fix="check the path")
    if path.is_dir():
        raise HarnessError(f"{what} is a directory, expected a file", source=str(path),
                           fix="name a .yaml file inside it")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise HarnessError(f"cannot read {what}: {exc.strerror}", source=str(path)) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise HarnessError(f"not valid UTF-8 (byte {exc.start})", source=str(path), line=line,
                           fix="save the file as UTF-8") from None


def load_yaml_file(path: Path | str, what: str = "YAML file") -> Doc:
    """Parse a YAML file into a Doc, or raise a HarnessError with the line."""
    path = Path(path)
    return parse_yaml(read_text(path, what), str(path))


def parse_yaml(text: str, source: str) -> Doc:
    """Parse YAML text; duplicate keys and non-finite numbers are errors."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise HarnessError(f"invalid YAML: {problem}", source=source,
                           line=mark.line + 1 if mark else None,
                           fix="fix the syntax at that line") from None
    lines: dict[tuple, int] = {}
    if node is None:
        return Doc(source, None, lines)
    data = _construct(node, (), lines, source)
    return Doc(source, data, lines)


_SCALAR = yaml.SafeLoader("")


def _construct(node: yaml.Node, path: tuple, lines: dict, source: str) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _construct_scalar(key_node, source)
            if isinstance(key, (list, dict)) or key is None:
                raise HarnessError("mapping keys must be plain words", source=source,
                                   line=key_node.start_mark.line + 1,
                                   fix="write each key as a word followed by a colon")
            if key in out:
                raise HarnessError(f"duplicate key {key!r}", source=source,
                                   line=key_node.start_mark.line + 1,
                                   key=format_path(path + (key,)), fix="keep only one")
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, path + (key,), lines, source)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(child, path + (i,), lines, source) for i, child in enumerate(node.value)]
    return _construct_scalar(node, source)


def _construct_scalar(node: yaml.Node, source: str) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        raise HarnessError("mapping keys must be plain words", source=source,
                           line=node.start_mark.line + 1,
                           fix="write each key as a word followed by a colon")
    try:
        value = _SCALAR.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:
        raise HarnessError(f"invalid value {node.value!r}: {exc}", source=source,
                           line=node.start_mark.line + 1,
                           fix="quote it if it is meant as text") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise HarnessError(f"non-finite number {node.value!r}", source=source,
                           line=node.start_mark.line + 1, fix="use a finite number")
    return value


def did_you_mean(word: object, choices: list[str]) -> str | None:
    """Suggest the closest known word, for unknown keys and names."""
    if not isinstance(word, str):
        return None
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else None


def check_keys(doc: Doc, path: tuple, mapping: dict, known: list[str],
               required: tuple[str, ...] = ()) -> None:
    """Refuse unknown keys (with a suggestion) and missing required ones."""
    for key in mapping:
        if key not in known:
            hint = did_you_mean(key, known) or "known keys: " + ", ".join(known)
            raise doc.error(path + (key,), "unknown key", fix=hint)
    for key in required:
        if key not in mapping:
            raise doc.error(path, f"missing required key {key!r}", fix=f"add {key}: ...")


def want_int(doc: Doc, path: tuple, value: object, *, minimum: int | None = None,
             maximum: int | None = None) -> int:
    """Return value as an int in range, or raise an error naming the key."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise doc.error(path, f"expected a whole number, got {_show(value)}",
                            fix="write digits without quotes, e.g. 8")
    if minimum is not None and value < minimum:
        raise doc.error(path, f"{value} is too small", fix=f"use at least {minimum}")
    if maximum is not None and value > maximum:
        raise doc.error(path, f"{value} is too large", fix=f"use at most {maximum:,}")
    return value


def want_float(doc: Doc, path: tuple, value: object, *, minimum: float | None = None,
               maximum: float | None = None, exclusive_min: bool = False) -> float:
    """Return value as a finite float in range, or raise an error naming the key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise doc.error(path, f"expected a number, got {_show(value)}",
                        fix="write a number without quotes, e.g. 1.0e-6")
    value = float(value)
    if minimum is not None and (value < minimum or (exclusive_min and value == minimum)):
        bound = "above" if exclusive_min else "at least"
        raise doc.error(path, f"{value:g} is out of range", fix=f"use a number {bound} {minimum:g}")
    if maximum is not None and value > maximum:
        raise doc.error(path, f"{value:g} is out of range", fix=f"use at most {maximum:g}")
    return value


def want_bool(doc: Doc, path: tuple, value: object) -> bool:
    """Return value as a bool, or raise an error naming the key."""
    if not isinstance(value, bool):
        raise doc.error(path, f"expected true or false, got {_show(value)}",
                        fix="write true or false")
    return value


def want_str(doc: Doc, path: tuple, value: object) -> str:
    """Return value as a non-empty string, or raise an error naming the key."""
    if not isinstance(value, str) or not value.strip():
        raise doc.error(path, f"expected a non-empty string, got {_show(value)}",
                        fix="write some text, quoted if it looks like a number")
    return value


def want_mapping(doc: Doc, path: tuple, value: object) -> dict:
    """Return value as a mapping, or raise an error naming the key."""
    if not isinstance(value, dict):
        raise doc.error(path, f"expected a mapping of keys to values, got {_show(value)}",
                        fix="write `key: value` lines")
    return value


def _show(value: object) -> str:
    text = repr(value)
    kind = type(value).__name__ if value is not None else "nothing"
    return f"{kind} {text[:40]}" if value is not None else kind
