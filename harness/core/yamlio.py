"""Load YAML once, keeping the line of every key so errors can name it."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import stat
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


# What a hand-written YAML file needs, far below what exhausts memory or Python's stack: a
# scenario or spec is a few KB, nests 4-5 levels, and names no anchor more than a few times.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000  # values after aliases are expanded (a "billion laughs" file stops here)
MAX_ALIASES = 100
MAX_NUMBER_CHARS = 64  # a number written with more characters is a typo or an attack


def read_text(path: Path, what: str) -> str:
    """Read a UTF-8 regular file of at most MAX_FILE_BYTES, turning every OS problem into a
    HarnessError (a device, FIFO or socket is refused unread: it may never end)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise HarnessError(f"{what} not found", source=str(path), fix="check the path") from None
    except OSError as exc:
        raise HarnessError(f"cannot read {what}: {exc.strerror}", source=str(path)) from None
    if stat.S_ISDIR(info.st_mode):
        raise HarnessError(f"{what} is a directory, expected a file", source=str(path),
                           fix="name a .yaml file inside it")
    if not stat.S_ISREG(info.st_mode):
        raise HarnessError(f"{what} is not a regular file (a device, pipe or socket)",
                           source=str(path), fix="name a .yaml file")
    if info.st_size > MAX_FILE_BYTES:
        raise HarnessError(f"{what} is {info.st_size:,} bytes, above the limit of "
                           f"{MAX_FILE_BYTES:,}", source=str(path),
                           fix="a scenario or spec is a few KB: check the path")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise HarnessError(f"cannot read {what}: {exc.strerror}", source=str(path)) from None
    if len(raw) > MAX_FILE_BYTES:  # it grew since stat
        raise HarnessError(f"{what} is above the limit of {MAX_FILE_BYTES:,} bytes",
                           source=str(path), fix="a scenario or spec is a few KB")
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
    """Parse YAML text within the limits above; duplicate keys and non-finite numbers are
    errors."""
    if len(text) > MAX_FILE_BYTES:
        raise HarnessError(f"above the limit of {MAX_FILE_BYTES:,} characters", source=source,
                           fix="a scenario or spec is a few KB")
    try:
        node = _compose(text, source)
    except yaml.reader.ReaderError as exc:  # a control character: no mark, a position
        char = (f"U+{exc.character:04X}" if isinstance(exc.character, int)
                else repr(exc.character))
        raise HarnessError(f"invalid YAML: character {char} is not allowed",
                           source=source, line=text[: exc.position].count("\n") + 1,
                           fix="remove it, or save the file as plain text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise HarnessError(f"invalid YAML: {problem}", source=source,
                           line=mark.line + 1 if mark else None,
                           fix="fix the syntax at that line") from None
    lines: dict[tuple, int] = {}
    if node is None:
        return Doc(source, None, lines)
    data = _construct(node, (), lines, source, [0])
    return Doc(source, data, lines)


class _LimitedLoader(yaml.SafeLoader):
    """PyYAML's safe composer, refusing nesting deeper than MAX_DEPTH and more than
    MAX_ALIASES aliases as it goes (its recursion would otherwise end in a RecursionError)."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self.source, self.depth, self.aliases = source, 0, 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _limit(self.source, self.peek_event(),
                             f"more than {MAX_ALIASES} aliases (*name)", "write the values out")
            return super().compose_node(parent, index)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _limit(self.source, self.peek_event(),
                             f"nested deeper than {MAX_DEPTH} levels", "flatten it")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _compose(text: str, source: str) -> yaml.Node | None:
    loader = _LimitedLoader(text, source)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def _limit(source: str, where, what: str, fix: str) -> HarnessError:
    return HarnessError(f"{what}, the limit for a scenario or spec", source=source,
                        line=where.start_mark.line + 1, fix=fix)


_SCALAR = yaml.SafeLoader("")


def _construct(node: yaml.Node, path: tuple, lines: dict, source: str, count: list) -> Any:
    """Plain data from a node, counting every value made (aliases expand into copies, and an
    anchor may hold itself) against MAX_NODES and MAX_DEPTH."""
    count[0] += 1
    if count[0] > MAX_NODES or len(path) > MAX_DEPTH:
        what = (f"more than {MAX_NODES:,} values once aliases are expanded"
                if count[0] > MAX_NODES else f"nested deeper than {MAX_DEPTH} levels")
        raise _limit(source, node, what, "write the values out without aliases")
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
            out[key] = _construct(value_node, path + (key,), lines, source, count)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(child, path + (i,), lines, source, count)
                for i, child in enumerate(node.value)]
    return _construct_scalar(node, source)


def _construct_scalar(node: yaml.Node, source: str) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        raise HarnessError("mapping keys must be plain words", source=source,
                           line=node.start_mark.line + 1,
                           fix="write each key as a word followed by a colon")
    numeric = node.tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    if numeric and len(node.value) > MAX_NUMBER_CHARS:
        raise HarnessError(f"a number of {len(node.value):,} characters, above the limit of "
                           f"{MAX_NUMBER_CHARS}", source=source, line=node.start_mark.line + 1,
                           fix="write a shorter number, or quote it if it is meant as text")
    try:
        value = _SCALAR.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:
        raise HarnessError(f"invalid value {node.value[:40]!r}: {str(exc)[:80]}",
                           source=source, line=node.start_mark.line + 1,
                           fix="quote it if it is meant as text") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise HarnessError(f"non-finite number {node.value!r}", source=source,
                           line=node.start_mark.line + 1, fix="use a finite number")
    return value


def parse_json(text: str, source: str) -> Any:
    """Parse JSON text within the YAML limits' spirit: numbers of at most MAX_NUMBER_CHARS
    characters, no NaN or Infinity, and nesting Python's parser can take; one error line."""
    def number(kind):
        def parse(literal: str):
            if len(literal) > MAX_NUMBER_CHARS:
                raise _JSONLimit(f"a number of {len(literal):,} characters, above the limit "
                                 f"of {MAX_NUMBER_CHARS}")
            return kind(literal)
        return parse

    def constant(name: str):
        raise _JSONLimit(f"non-finite number {name}")

    try:
        return json.loads(text, parse_int=number(int), parse_float=number(float),
                          parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise HarnessError(f"invalid JSON: {exc.msg}", source=source, line=exc.lineno,
                           fix="fix the syntax at that line") from None
    except _JSONLimit as exc:
        raise HarnessError(str(exc), source=source, fix="write a finite number of a few "
                                                        "digits") from None
    except RecursionError:
        raise HarnessError("nested too deeply to read", source=source,
                           fix="a config or record nests a few levels") from None


class _JSONLimit(ValueError):
    """A JSON value beyond parse_json's limits."""


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


# A name becomes a file or folder name (run folders, cached builds): no separators, no
# leading dot, nothing a shell or a file system reads as more than a name.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NAME_RULE = ("letters, digits, '.', '-' and '_', starting with a letter or digit, at most 100 "
             "characters")


def is_name(value: object) -> bool:
    """Whether value may be a scenario, spec, fleet or serving name (NAME_PATTERN)."""
    return isinstance(value, str) and NAME_PATTERN.fullmatch(value) is not None


def safe_name(text: str) -> str:
    """A name made from free text (a file's stem): every other character run becomes '-'."""
    if is_name(text):
        return text
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).lstrip("._-")[:100].rstrip("-")
    return name or "model"


def not_a_name(name: str) -> str:
    """What is wrong with a string that is not a name, in the words every refusal uses."""
    return f"{name[:40]!r} is not a name: {NAME_RULE}"


def want_name(doc: Doc, path: tuple, value: object) -> str:
    """Return value as a name (NAME_PATTERN), or raise an error naming the key."""
    name = want_str(doc, path, value)
    if not is_name(name):
        raise doc.error(path, not_a_name(name), fix=f"e.g. {safe_name(name)}")
    return name


def want_mapping(doc: Doc, path: tuple, value: object) -> dict:
    """Return value as a mapping, or raise an error naming the key."""
    if not isinstance(value, dict):
        # the whole file is not echoed: it may be any file the user can read
        shown = _show(value) if path else _kind(value)
        raise doc.error(path, f"expected a mapping of keys to values, got {shown}",
                        fix="write `key: value` lines")
    return value


def _kind(value: object) -> str:
    return type(value).__name__ if value is not None else "nothing"


def _show(value: object) -> str:
    return f"{_kind(value)} {repr(value)[:40]}" if value is not None else _kind(value)
