"""Serving scenarios: a YAML file with a `serve:` mapping, validated once at load (every error
names the file, the line and the key), run by `harness run` like any scenario."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .core.serving import SLO_KEYS
from .core.yamlio import (
    Doc,
    check_keys,
    parse_yaml,
    read_text,
    want_bool,
    want_float,
    want_int,
    want_mapping,
    want_str,
)
from .engine.load import REQUEST_TIMEOUT_S, Level

TOP_KEYS = ["name", "title", "description", "model", "dtype", "seed", "serve"]
SERVE_KEYS = ["server", "endpoint", "slots", "concurrency", "rate", "requests", "duration_s",
              "prompt", "generate", "warmup", "threads", "prefix_cache", "inprocess",
              "rounds", "timeout_s", "slo", "pin_slots"]
MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class ServePlan:
    """A validated serving scenario."""

    path: Path | None  # None: made from harness serve's options
    name: str
    title: str
    description: str
    model: str
    dtype: str
    seed: int
    levels: tuple[Level, ...]
    server: str = "xllamacpp"
    endpoint: str | None = None
    slots: int = 4
    n_requests: int = 32
    duration_s: float = 120.0
    n_prompt: int = 128
    n_generate: int = 64
    warmup: int = 1
    threads: int = 0
    prefix_cache: bool = False
    inprocess: bool = True
    timeout_s: float = REQUEST_TIMEOUT_S
    pin_slots: bool = True
    rounds: int = 3
    slo: dict = field(default_factory=dict)


def is_serving_scenario(path: Path) -> bool:
    """The file parses to a mapping with a `serve:` key (a plain scenario has none)."""
    try:
        data = parse_yaml(read_text(path, "scenario"), str(path)).data
    except Exception:  # the measurement loader reports what is wrong with it
        return False
    return isinstance(data, dict) and "serve" in data


def load_serving_scenario(path: Path) -> ServePlan:
    """Parse and validate a serving scenario."""
    text = read_text(path, "scenario")
    doc = parse_yaml(text, str(path))
    data = want_mapping(doc, (), doc.data)
    check_keys(doc, (), data, TOP_KEYS, ("name", "model", "serve"))
    serve = want_mapping(doc, ("serve",), data["serve"])
    check_keys(doc, ("serve",), serve, SERVE_KEYS)
    name = want_str(doc, ("name",), data["name"])
    model = _beside(want_str(doc, ("model",), data["model"]), path.parent)
    return ServePlan(
        path=path, name=name, title=want_str(doc, ("title",), data.get("title", name)),
        description=str(data.get("description") or ""), model=model,
        dtype=want_str(doc, ("dtype",), data.get("dtype", "f16")),
        seed=want_int(doc, ("seed",), data.get("seed", 0), minimum=0, maximum=2**63 - 1),
        levels=_levels(doc, serve), **_serve_options(doc, serve))


def _serve_options(doc: Doc, s: dict) -> dict:
    p = ("serve",)
    out = {
        "server": want_str(doc, p + ("server",), s.get("server", "xllamacpp")),
        "endpoint": _endpoint(doc, s.get("endpoint")),
        "slots": want_int(doc, p + ("slots",), s.get("slots", 4), minimum=1, maximum=256),
        "n_requests": want_int(doc, p + ("requests",), s.get("requests", 32), minimum=1,
                               maximum=100_000),
        "duration_s": want_float(doc, p + ("duration_s",), s.get("duration_s", 120.0),
                                 minimum=1, maximum=86_400),
        "n_prompt": want_int(doc, p + ("prompt",), s.get("prompt", 128), minimum=1,
                             maximum=MAX_TOKENS),
        "n_generate": want_int(doc, p + ("generate",), s.get("generate", 64), minimum=1,
                               maximum=MAX_TOKENS),
        "warmup": want_int(doc, p + ("warmup",), s.get("warmup", 1), minimum=0, maximum=100),
        "threads": want_int(doc, p + ("threads",), s.get("threads", 0), minimum=0,
                            maximum=1024),
        "prefix_cache": want_bool(doc, p + ("prefix_cache",), s.get("prefix_cache", False)),
        "inprocess": want_bool(doc, p + ("inprocess",), s.get("inprocess", True)),
        "pin_slots": want_bool(doc, p + ("pin_slots",), s.get("pin_slots", True)),
        "rounds": want_int(doc, p + ("rounds",), s.get("rounds", 3), minimum=1, maximum=1000),
        "timeout_s": want_float(doc, p + ("timeout_s",), s.get("timeout_s", REQUEST_TIMEOUT_S),
                                minimum=1, maximum=86_400),
        "slo": _slo(doc, s.get("slo", {})),
    }
    return out


def _endpoint(doc: Doc, value: object) -> str | None:
    if value is None:
        return None
    url = want_str(doc, ("serve", "endpoint"), value)
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise doc.error(("serve", "endpoint"), f"not an http(s) URL: {url}",
                        fix="write e.g. endpoint: http://127.0.0.1:8080")
    return url.rstrip("/")


def _slo(doc: Doc, value: object) -> dict:
    slo = want_mapping(doc, ("serve", "slo"), value)
    check_keys(doc, ("serve", "slo"), slo, list(SLO_KEYS))
    return {k: want_float(doc, ("serve", "slo", k), v, minimum=0, exclusive_min=True)
            for k, v in slo.items()}


def _levels(doc: Doc, s: dict) -> tuple[Level, ...]:
    levels = [Level(concurrency=want_int(doc, ("serve", "concurrency", i), c, minimum=1,
                                         maximum=4096))
              for i, c in enumerate(_as_list(s.get("concurrency", [1] if "rate" not in s
                                                   else [])))]
    levels += [Level(rate=want_float(doc, ("serve", "rate", i), r, minimum=0,
                                     exclusive_min=True))
               for i, r in enumerate(_as_list(s.get("rate", [])))]
    if not levels:
        raise doc.error(("serve",), "no load level", fix="add concurrency: [1, 2] or rate: [1]")
    return tuple(levels)


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else [value]


def _beside(ref: str, scenario_dir: Path) -> str:
    """A relative .gguf or spec file path names a file beside the scenario when one is there."""
    if not ref.endswith((".gguf", ".yaml", ".yml")) or Path(ref).is_absolute():
        return ref
    candidate = scenario_dir / ref
    return str(candidate) if candidate.exists() else ref
