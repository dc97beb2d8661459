"""Serving scenarios: a YAML file with a `serve:` mapping, validated once at load (every error
names the file, the line and the key), run by `harness run` like any scenario."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .core.dtypes import get_dtype
from .core.errors import HarnessError
from .core.options import MAX_CONCURRENCY, SERVE_FLAGS, SERVE_NUMBERS
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
    want_name,
    want_str,
)
from .engine.http import check_endpoint
from .engine.load import Level
from .engine.scenario import beside, resolve_model_ref

TOP_KEYS = ["name", "title", "description", "model", "dtype", "seed", "serve"]
SERVE_KEYS = ["server", "endpoint", "slots", "concurrency", "rate", "requests", "duration_s",
              "prompt", "generate", "warmup", "threads", "prefix_cache", "inprocess",
              "rounds", "timeout_s", "slo", "pin_slots"]
# The servers a scenario may name: the ones the harness installs (the xllamacpp wheel) or
# builds (harness server build). A binary of the user's own comes only from the command line.
SCENARIO_SERVERS = ("xllamacpp", "built")
SLOT_MARGIN = 16  # tokens each slot holds beyond prompt + output (serving.serving_run)


@dataclass(frozen=True, kw_only=True)
class ServePlan:
    """A validated serving scenario (or harness serve's options), built by keyword."""

    path: Path | None  # None: made from harness serve's options
    name: str
    title: str
    description: str
    model: str
    dtype: str
    seed: int
    levels: tuple[Level, ...]
    server: str
    endpoint: str | None
    slots: int
    n_requests: int
    duration_s: float
    n_prompt: int
    n_generate: int
    warmup: int
    threads: int
    prefix_cache: bool
    inprocess: bool
    timeout_s: float
    pin_slots: bool
    rounds: int
    slo: dict = field(default_factory=dict)


def is_serving_scenario(path: Path) -> bool:
    """The file parses to a mapping with a `serve:` key (a plain scenario has none)."""
    try:
        data = parse_yaml(read_text(path, "scenario"), str(path)).data
    except Exception:  # the measurement loader reports what is wrong with it
        return False
    return isinstance(data, dict) and "serve" in data


def load_serving_scenario(path: Path, allow_remote: bool = False,
                          server: str | None = None) -> ServePlan:
    """Parse and validate a serving scenario: everything `harness run` would refuse (the model,
    its dtype, the server, prompt + output against the model's context, repeated levels, a
    remote endpoint without --allow-remote) is refused here, with its line. server: the
    command line's --server (a binary's resolved path) in place of the scenario's."""
    text = read_text(path, "scenario")
    doc = parse_yaml(text, str(path))
    data = want_mapping(doc, (), doc.data)
    check_keys(doc, (), data, TOP_KEYS, ("name", "model", "serve"))
    serve = want_mapping(doc, ("serve",), data["serve"])
    check_keys(doc, ("serve",), serve, SERVE_KEYS)
    name = want_name(doc, ("name",), data["name"])
    model = beside(want_str(doc, ("model",), data["model"]), path.parent)
    dtype = want_str(doc, ("dtype",), data.get("dtype", "f16"))
    plan = ServePlan(
        path=path, name=name, title=want_str(doc, ("title",), data.get("title", name)),
        description=str(data.get("description") or ""), model=model, dtype=dtype,
        seed=want_int(doc, ("seed",), data.get("seed", 0), minimum=0, maximum=2**63 - 1),
        levels=_levels(doc, serve), **_serve_options(doc, serve, allow_remote))
    if server:
        plan = replace(plan, server=server)
    try:
        check_plan(plan)
    except HarnessError as exc:  # located at the key it names
        where = _PLAN_KEYS.get(exc.key or "", ("model",))
        raise doc.error(where, exc.message, fix=exc.fix) from None
    return plan


# check_plan's keys (the command line's) and where a scenario holds each
_PLAN_KEYS = {"MODEL": ("model",), "--dtype": ("dtype",), "--prompt": ("serve", "prompt"),
              "server": ("serve", "server")}


def check_plan(plan: ServePlan) -> None:
    """Refuse what a serving run would refuse once started: the model, its dtype, prompt +
    output beyond its context, a server not built."""
    try:
        ref = resolve_model_ref(plan.model, [get_dtype(plan.dtype, key="--dtype").name])[0]
    except HarnessError as exc:
        if exc.key == "--dtype":
            raise
        raise HarnessError(exc.render(), key="MODEL") from None
    need = plan.n_prompt + plan.n_generate + SLOT_MARGIN
    if not plan.endpoint and need > ref.max_context:
        raise HarnessError(f"prompt + generate + {SLOT_MARGIN} = {need:,} tokens per slot "
                           f"exceeds {ref.label}'s context length {ref.max_context:,}",
                           key="--prompt", fix="keep prompt + generate at most "
                                               f"{ref.max_context - SLOT_MARGIN:,}")
    if plan.server == "built" and not plan.endpoint:
        from .engine.serverbuild import built_binary

        built_binary()


def preflight_plan(plan: ServePlan, cache_dir: Path | None) -> None:
    """Refuse, before anything is built or started, a served model that does not fit: the
    disk its build still needs, and RAM for its weights (mapped once: the server and the
    in-process yardstick share the file's pages) and the KV caches of the server's slots and
    of the yardstick's sequences (compute buffers come on top)."""
    if plan.endpoint:
        return
    from .core.costs import kv_n_bytes_per_token
    from .core.dtypes import DTYPES
    from .core.specs import resolve_spec
    from .engine.build import check_build_space, estimated_n_bytes, missing_build_n_bytes
    from .engine.env import available_ram_bytes
    from .weights.gguf_inspect import spec_from_gguf

    dtype = DTYPES[plan.dtype.lower()]
    if plan.model.endswith(".gguf"):
        spec, weights = spec_from_gguf(Path(plan.model)), Path(plan.model).stat().st_size
    else:
        spec = resolve_spec(plan.model)
        weights = estimated_n_bytes(spec, dtype)
        check_build_space(missing_build_n_bytes(spec, dtype, plan.seed, cache_dir), cache_dir)
    sequences = plan.slots + (max((lv.concurrency or 0 for lv in plan.levels), default=0)
                              if plan.inprocess else 0)
    per_slot = plan.n_prompt + plan.n_generate + SLOT_MARGIN
    need = weights + kv_n_bytes_per_token(spec) * per_slot * sequences
    available = available_ram_bytes()
    if available is not None and need > available:
        raise HarnessError(f"serving {plan.model} needs at least {need / 2**30:.2f} GiB of RAM "
                           f"(weights, and the KV cache of {sequences} sequences of "
                           f"{per_slot:,} tokens), {available / 2**30:.2f} GiB is available",
                           key="MODEL", fix="use fewer slots, a shorter prompt + generate, or a "
                                            "smaller model or dtype")


def _serve_options(doc: Doc, s: dict, allow_remote: bool) -> dict:
    p = ("serve",)
    out = {"server": _server(doc, s.get("server", "xllamacpp")),
           "endpoint": _endpoint(doc, s.get("endpoint"), allow_remote),
           "slo": _slo(doc, s.get("slo", {}))}
    for key, (name, value, low, high) in SERVE_NUMBERS.items():
        want = want_float if isinstance(value, float) else want_int
        out[name] = want(doc, p + (key,), s.get(key, value), minimum=low, maximum=high)
    for key, value in SERVE_FLAGS.items():
        out[key] = want_bool(doc, p + (key,), s.get(key, value))
    return out


def _server(doc: Doc, value: object) -> str:
    server = want_str(doc, ("serve", "server"), value)
    if server not in SCENARIO_SERVERS:
        raise doc.error(("serve", "server"), f"{server[:60]!r} is not a server the harness "
                        "installs or builds (a scenario never names a program to run)",
                        fix="write server: xllamacpp or server: built; a llama-server binary "
                            "of your own goes on the command line: --server PATH")
    return server


def _endpoint(doc: Doc, value: object, allow_remote: bool) -> str | None:
    if value is None:
        return None
    url = want_str(doc, ("serve", "endpoint"), value)
    try:
        return check_endpoint(url, allow_remote)
    except HarnessError as exc:
        raise doc.error(("serve", "endpoint"), exc.message,
                        fix=(exc.fix or "").replace("--endpoint", "endpoint:")) from None


def _slo(doc: Doc, value: object) -> dict:
    slo = want_mapping(doc, ("serve", "slo"), value)
    check_keys(doc, ("serve", "slo"), slo, list(SLO_KEYS))
    return {k: want_float(doc, ("serve", "slo", k), v, minimum=0, exclusive_min=True)
            for k, v in slo.items()}


def _levels(doc: Doc, s: dict) -> tuple[Level, ...]:
    closed = _as_list(s.get("concurrency", [] if "rate" in s else [1]))
    concurrency = [want_int(doc, ("serve", "concurrency", i), v, minimum=1,
                            maximum=MAX_CONCURRENCY) for i, v in enumerate(closed)]
    rate = [want_float(doc, ("serve", "rate", i), v, minimum=0, exclusive_min=True)
            for i, v in enumerate(_as_list(s.get("rate", [])))]
    try:
        return make_levels(concurrency, rate)
    except LevelError as exc:
        where = ("serve", exc.kind, exc.index) if exc.index is not None else ("serve",)
        raise doc.error(where, exc.message, fix=exc.fix) from None


class LevelError(HarnessError):
    """A list of load levels that cannot run: which list, which entry."""

    def __init__(self, message: str, kind: str, index: int | None, fix: str) -> None:
        super().__init__(message, key="--concurrency/--rate", fix=fix)
        self.kind, self.index = kind, index


def make_levels(concurrency: list[int], rate: list[float]) -> tuple[Level, ...]:
    """The load levels of a serving run, closed loops first: each positive and listed once
    (two levels of one key would share their records), at least one."""
    levels, seen = [], set()
    for kind, values in (("concurrency", concurrency), ("rate", rate)):
        for i, value in enumerate(values):
            level = Level(concurrency=int(value)) if kind == "concurrency" else Level(rate=value)
            if (level.concurrency or 1) < 1 or (level.rate is not None and level.rate <= 0):
                raise LevelError("levels must be positive", kind, i, "e.g. 1, 2, 4")
            if (level.concurrency or 0) > MAX_CONCURRENCY:
                raise LevelError(f"at most {MAX_CONCURRENCY} requests in flight", kind, i,
                                 "e.g. 1, 2, 4")
            if level.key in seen:
                raise LevelError(f"the level {level.label} is listed twice", kind, i,
                                 "list each once")
            seen.add(level.key)
            levels.append(level)
    if not levels:
        raise LevelError("no load level", "concurrency", None,
                         "add concurrency: [1, 2] or rate: [1]")
    return tuple(levels)


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else [value]
