"""Pages as Jinja2 templates: the words live in templates, the numbers in a typed result, the
formatting in filters. Rendering is pure (data -> str); a template error is one line naming the
template file, its line and the name, exit 2."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from ..core.errors import HarnessError
from ..core.options import PAGE_TEMPLATES
from ..core.stats import center

TEMPLATES = resources.files("harness.report") / "templates"
BUILT_IN = PAGE_TEMPLATES
LESSON_PAGES = ("lesson", "memory_lesson")  # templates over a lesson's typed result
SECTION_PAGES = tuple(n for n in BUILT_IN if n not in LESSON_PAGES)  # over a FullPage's sections
SUFFIX = ".md.j2"
GIB = 2**30


@dataclass(frozen=True)
class Section:
    """One part of a full report: its name (for a template to pick) and its markdown."""

    name: str
    markdown: str

    @classmethod
    def of(cls, name: str, lines: list[str]) -> Section:
        """A section from its lines."""
        return cls(name, "\n".join(lines))


@dataclass(frozen=True)
class FullPage:
    """A full report as named sections, rendered by templates/full.md.j2 (or a lever's)."""

    title: str
    sections: tuple[Section, ...]


@dataclass(frozen=True)
class Figure:
    """A measured or modelled figure with its 95% interval (low, high) where it has one."""

    value: float
    low: float | None = None
    high: float | None = None

    @classmethod
    def of(cls, summary: dict | None, scale: float = 1.0) -> Figure | None:
        if not summary:
            return None
        ci = summary.get("median_ci95")
        return cls(center(summary) * scale, *(v * scale for v in ci) if ci else (None, None))

    def inverse(self, scale: float = 1.0) -> Figure:
        """scale ÷ the figure (ms per token from tok/s), its interval inverted with it."""
        if self.low is None:
            return Figure(scale / self.value)
        return Figure(scale / self.value, scale / self.high, scale / self.low)


@dataclass(frozen=True)
class Provenance:
    date: str
    cpu: str
    cores: int | None
    ram_gib: float | None
    llama_commit: str
    llama_dirty: bool
    bindings: str
    harness_commit: str
    harness_dirty: bool
    scenario_path: str


def provenance(header, env: dict, scenario: dict) -> Provenance:
    """Where and when a run was measured, and from which code."""
    llama = env.get("llama") or {}
    commit = str(llama.get("ggml_commit") or "unknown")
    source = env.get("harness_source") or {}
    return Provenance(
        date=(header.created or "")[:10], cpu=str(env.get("cpu_model") or "an unnamed CPU"),
        cores=env.get("physical_cores"),
        ram_gib=env["ram_total_bytes"] / GIB if env.get("ram_total_bytes") else None,
        llama_commit=commit.removesuffix("-dirty"), llama_dirty=commit.endswith("-dirty"),
        bindings=f"llama-cpp-python {llama.get('llama_cpp_python') or 'unknown'}",
        harness_commit=str(source.get("commit") or "unknown")[:12],
        harness_dirty=bool(source.get("dirty")),
        scenario_path=str(scenario.get("path") or "SCENARIO"))


# --- filters: every number a page prints goes through one of these -------------------------

def tok_s(value: float | None) -> str:
    """Tokens per second with the digits a reader can use: 129, 12.1, 0.87."""
    if value is None:
        return "–"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def num(value: float | None, digits: int = 1) -> str:
    """A plain number with thousands separators."""
    return "–" if value is None else f"{value:,.{digits}f}"


def pct(value: float | None, digits: int = 0) -> str:
    """A share as a percentage."""
    return "–" if value is None else f"{value:.{digits}%}"


def times(value: float | None, digits: int = 2) -> str:
    """A ratio: 2.79×."""
    return "–" if value is None else f"{value:.{digits}f}×"


def gb(n_bytes: float | None, digits: int = 2) -> str:
    """Bytes as GB (10⁹)."""
    return "–" if n_bytes is None else f"{n_bytes / 1e9:.{digits}f} GB"


def mib(value: float | None, digits: int = 2) -> str:
    """Mebibytes (2²⁰ bytes), as llama.cpp logs its buffers: 327.83 MiB."""
    return "–" if value is None else f"{value:,.{digits}f} MiB"


def seconds(value: float | None) -> str:
    """A duration: 46.5 s, 0.99 s, 83 ms."""
    if value is None:
        return "–"
    if value >= 10:
        return f"{value:,.1f} s"
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.0f} ms" if value < 0.1 \
        else f"{value:.2f} s"


def interval(figure, fmt: str = "num", *args) -> str:
    """A figure's 95% interval in brackets, formatted like the figure: [10.7–13.6]."""
    if figure is None or figure.low is None:
        return "(no interval)"
    f = FILTERS[fmt]
    return f"[{f(figure.low, *args)}–{f(figure.high, *args)}]"


def with_interval(figure, fmt: str = "num", *args) -> str:
    """A figure and its interval: 12.1 [10.7–13.6]."""
    if figure is None:
        return "–"
    f = FILTERS[fmt]
    return f"{f(figure.value, *args)} {interval(figure, fmt, *args)}"


def nobreak(name: str) -> str:
    """A model name with non-breaking hyphens (U+2011, the same glyph), so a narrow table
    column of an 860 px page never splits qwen2.5-0.5b."""
    return name.replace("-", "\u2011")


FILTERS = {"nobreak": nobreak, "tok_s": tok_s, "num": num, "pct": pct, "times": times, "gb": gb,
           "mib": mib, "seconds": seconds, "interval": interval, "ci": with_interval}


# --- the environment -----------------------------------------------------------------------

def template_path(name: str) -> Path:
    """The file of a built-in template."""
    return Path(str(TEMPLATES / f"{name}{SUFFIX}"))


def template_text(name: str) -> str:
    """A built-in template's source, for `harness template NAME`."""
    if name not in BUILT_IN:
        raise HarnessError(f"no built-in template {name!r}", key="NAME",
                           fix="one of " + ", ".join(BUILT_IN))
    return template_path(name).read_text(encoding="utf-8")


def _environment(folder: Path) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(folder), str(TEMPLATES)]),
                             undefined=jinja2.StrictUndefined, autoescape=False,
                             keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters.update(FILTERS)
    return env


def resolve(template: str | Path) -> Path:
    """A built-in template's file (by name), or the file given."""
    return template_path(str(template)) if str(template) in BUILT_IN else Path(template)


def render(template: str | Path, data) -> str:
    """Render a built-in template (by name) or a template file over a typed result."""
    path = resolve(template)
    if not path.is_file():
        raise HarnessError("no template file here", source=str(path),
                           fix="pass a file, or print a built-in one with `harness template`")
    env = _environment(path.parent)
    try:
        compiled = env.from_string(path.read_text(encoding="utf-8"))
        return compiled.render(template_names(data))
    except jinja2.TemplateSyntaxError as exc:
        raise HarnessError(f"template syntax error: {exc.message}", source=str(path),
                           line=exc.lineno, fix="fix the template's Jinja2 syntax") from None
    except (jinja2.UndefinedError, AttributeError, TypeError, KeyError) as exc:
        raise HarnessError(f"{exc}", source=str(path), line=_template_line(exc),
                           fix="use only the names docs/templates.md lists") from None


def template_names(data) -> dict:
    """The names a template sees: the result's fields and its properties (derived figures)."""
    names = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
    return names | {name: getattr(data, name) for name in dir(type(data))
                    if isinstance(getattr(type(data), name), property)}


def _template_line(exc: BaseException) -> int | None:
    """The template line an error was raised on, from the traceback Jinja2 rewrites."""
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
