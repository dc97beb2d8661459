"""Scenario files: validated once at load, expanded into the list of measurements to make."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.cell import CellId
from ..core.dtypes import KV_CACHE_TYPES, KV_NEEDS_FLASH_ATTN, get_dtype, kv_block_problem
from ..core.errors import HarnessError
from ..core.options import PAGE_TEMPLATES
from ..core.reference import load_reference
from ..core.rounds import PAIRING_FIELDS
from ..core.specs import looks_like_path, resolve_spec
from ..core.yamlio import (
    Doc,
    check_keys,
    format_path,
    parse_yaml,
    read_text,
    want_bool,
    want_float,
    want_int,
    want_mapping,
    want_name,
    want_str,
)

MAX_TOKENS = 1 << 20
MAX_REPETITIONS = 1000
MAX_THREADS = 1024
MAX_PARALLEL = 256  # LLAMA_MAX_SEQ in llama.cpp's llama-cparams.h
_TOP_KEYS = ["name", "title", "description", "models", "dtypes", "threads", "repetitions",
             "target_ci", "target", "min_repetitions", "max_repetitions", "max_seconds",
             "warmup", "seed", "n_batch", "n_ubatch", "n_ctx", "flash_attn", "reference",
             "mmap", "interleave", "template", "memory", "tests"]
_MEMORY_KEYS = ["models", "dtypes", "context", "kv_cache_type", "users", "weights"]
_OVERRIDES = ["threads", "repetitions", "target_ci", "min_repetitions", "max_repetitions",
              "warmup", "n_batch", "n_ubatch", "n_ctx", "flash_attn"]
# Contexts are sized as deployments size them (llama-server's default is 4,096 cells), in whole
# blocks of 256: llama.cpp pads every context to 256 cells, but first clamps n_batch and
# n_ubatch to the size asked for, and a 64-token prompt prefilled 1.2x (Xeon) to 1.5x (EPYC)
# slower in an 88-token ubatch than in one of 80 or 96 (docs/scenarios.md, Contexts): an
# exactly sized context draws false dips into a sweep of prompt lengths.
CONTEXT_STEP = 256


def whole_blocks(n_cells: int) -> int:
    """n_cells rounded up to a multiple of CONTEXT_STEP."""
    return -(-n_cells // CONTEXT_STEP) * CONTEXT_STEP
MAX_SECONDS = 7 * 24 * 3600
# The dtypes of a {twin_of: PATH} entry's models: the real file, and the random-weight files it
# is timed against (its twin, and with `random: built` the builder's file of its header's spec)
TWIN_PAIR = ("real", "twin", "built")
RANDOM_KINDS = TWIN_PAIR[1:]
RANDOM_WORDS = {"twin": "its random-weight twin",
                "built": "the random-weight file the builder makes from its header's spec"}
_LEVERS = ["depth", "kv_cache_type", "parallel", "shared_prefix"]
_TEST_KEYS = ["name", "prompt", "generate", "models", "dtypes", *_LEVERS, *_OVERRIDES]


@dataclass(frozen=True)
class ModelRef:
    """A model named by a scenario: a spec (built on demand), a GGUF file, or a random-weight
    stand-in for one ({twin_of: PATH} names the file, as dtype "real", and its twin, dtype
    "twin", or the builder's file of the spec its header gives, dtype "built")."""

    ref: str
    spec_name: str | None  # None for a .gguf path or a twin
    gguf_path: Path | None  # the file measured; None for a spec or a twin (built on demand)
    dtype: str  # the dtype to build; "file" for a .gguf path; "real", "twin" or "built" in a pair
    max_context: int  # the model's trained context length
    head_dim: int = 0  # per-head K/V size, which a quantized KV cache's blocks must divide
    twin_of: Path | None = None  # the real file a twin copies

    @property
    def file(self) -> Path | None:
        """The GGUF file the model's shapes are read from (None for a spec)."""
        return self.gguf_path or self.twin_of

    @property
    def label(self) -> str:
        return self.spec_name or self.file.stem

    @property
    def in_twin_pair(self) -> bool:
        return self.dtype in TWIN_PAIR

    @property
    def key(self) -> str:
        """label|dtype: how results name one model file."""
        return f"{self.label}|{self.dtype}"


@dataclass(frozen=True)
class Settings:
    """The knobs a test may override."""

    threads: int
    repetitions: int | None  # None: auto (until target_ci, min/max_repetitions, the budget)
    warmup: int
    n_batch: int
    n_ubatch: int
    flash_attn: bool | None  # None = llama.cpp's auto
    target_ci: float = 0.03
    n_ctx: int | None = None  # KV cells per sequence; None: its tokens rounded up to 256
    min_repetitions: int = 6
    max_repetitions: int = 200

    @property
    def policy(self):
        from ..core.rounds import Policy

        return Policy(self.repetitions, self.target_ci, self.min_repetitions,
                      self.max_repetitions)


@dataclass(frozen=True)
class Measurement:
    """One cell of the cross product: what to run, on what, how often."""

    model: ModelRef
    n_prompt: int
    n_gen: int
    settings: Settings
    test_name: str
    depth: int = 0  # tokens already in the KV cache, filled untimed before the timed work
    kv_type: str = "f16"  # the KV cache's type (K and V alike)
    parallel: int = 1  # independent sequences decoded together, one seq id each
    shared_prefix: int = 0  # tokens of a cached prefix before the prompt (time to first token)

    @property
    def cell(self) -> CellId:
        s = self.settings
        return CellId(self.model.label, self.model.dtype, s.threads, s.n_batch, s.n_ubatch,
                      s.flash_attn, self.n_ctx, self.n_prompt, self.n_gen, self.depth,
                      self.kv_type, self.parallel, self.shared_prefix)

    @property
    def id(self) -> str:
        return str(self.cell)

    @property
    def pairing_key(self) -> tuple:
        """Every setting but the context (which follows the others), in the order of
        harness.core.rounds.PAIRING_FIELDS: cells whose keys differ in one place are compared."""
        cell = self.cell
        return tuple(getattr(cell, name) for name in PAIRING_FIELDS)

    @property
    def phase(self) -> str:
        """The phase the cell is judged and compared on: decode when it decodes (its short
        prompt only sets the context), else prefill (time to first token, for a prefix
        test), as the levers pick their rows."""
        return "decode" if self.n_gen else "prefill"

    @property
    def n_seq_ctx(self) -> int:
        """Positions one sequence uses: cached prefix or depth, prompt, generation."""
        return self.shared_prefix + self.depth + self.n_prompt + self.n_gen

    @property
    def n_cells_needed(self) -> int:
        """KV cells one sequence's share of the cache must hold (a prefix test's unified cache
        holds the prefix and two copies of the question)."""
        if self.kind == "prefix_cache":
            return self.shared_prefix + 2 * self.n_prompt
        return self.n_seq_ctx

    @property
    def n_ctx(self) -> int:
        """KV cells each sequence gets (llama.cpp's n_ctx_seq): the scenario's n_ctx, or the
        cells needed rounded up to a whole number of CONTEXT_STEP blocks."""
        if self.settings.n_ctx is not None:
            return self.settings.n_ctx
        return whole_blocks(self.n_cells_needed)

    @property
    def n_seq_max(self) -> int:
        """Sequences the context holds: a depth test keeps a second, depth-0 sequence beside
        it for its paired baseline; a prefix test shares one unified cache between two."""
        if self.kind == "prefix_cache" or self.depth:
            return 2
        return self.parallel

    @property
    def n_ctx_total(self) -> int:
        """KV cells of the whole context (llama.cpp's n_ctx): one share per sequence, or one
        unified buffer for a prefix test."""
        return self.n_ctx * (1 if self.kind == "prefix_cache" else self.n_seq_max)

    @property
    def kind(self) -> str:
        if self.shared_prefix:
            return "prefix_cache"
        return "batched" if self.parallel > 1 else "single"


@dataclass(frozen=True)
class MemoryPlan:
    """A scenario's `memory:` block: each model loaded at each weight type, its cache at each
    type, and several users' caches, every load in a fresh process (mmap off)."""

    models: tuple[str, ...]  # spec names
    dtypes: tuple[str, ...]  # the weights table's types
    context: int  # tokens in each user's cache
    kv_types: tuple[str, ...]  # the cache types (f16 first)
    users: tuple[int, ...]  # sequences of `context` tokens loaded together
    weights: str  # the weight type users are served at (one of dtypes)

    def loads(self) -> list[tuple[str, str, str, int]]:
        """Every (model, dtype, cache type, users) to load, each once."""
        out = [(m, d, "f16", 1) for m in self.models for d in self.dtypes]
        out += [(m, self.weights, k, 1) for m in self.models for k in self.kv_types]
        out += [(m, self.weights, "f16", u) for m in self.models for u in self.users]
        return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Scenario:
    """A validated scenario: its verbatim text and the measurements it expands to."""

    path: Path
    text: str
    name: str
    title: str
    description: str
    seed: int
    measurements: tuple[Measurement, ...]
    max_seconds: float | None = None  # the time budget of a run's rounds
    reference: dict | None = None  # published figures and claims (harness.reference)
    target: str = "contrasts"  # what target_ci applies to: "contrasts" or "absolute"
    mmap: bool = True  # models read from the mapped file (llama.cpp's default) or copied in
    interleave: str = "step"  # decode steps of a round's cells in turn, or whole repetitions
    template: str | None = None  # the page's Jinja2 template, beside the scenario file
    memory: MemoryPlan | None = None  # the footprints to measure after the rounds

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def load_scenario(path: Path | str, physical_cores: int) -> Scenario:
    """Parse, validate and expand a scenario file; every error names file, line and key."""
    path = Path(path)
    text = read_text(path, "scenario")
    doc = parse_yaml(text, str(path))
    data = want_mapping(doc, (), doc.data)
    check_keys(doc, (), data, _TOP_KEYS, ("name", "models", "tests"))
    name = want_name(doc, ("name",), data["name"])
    models = _models(doc, data)
    base = _settings(doc, (), data, None, physical_cores)
    tests = _list(doc, ("tests",), data["tests"])
    measurements = []
    for i, test in enumerate(tests):
        own = isinstance(test, dict) and ("models" in test or "dtypes" in test)
        test_models = (_models(doc, {"models": data["models"]} | test, ("tests", i),
                               data.get("dtypes")) if own else models)
        measurements += _expand_test(doc, ("tests", i), test, test_models, base,
                                     physical_cores)
    _check_unique(doc, measurements)
    return Scenario(
        path=path, text=text, name=name,
        title=want_str(doc, ("title",), data.get("title", name)),
        description=str(data.get("description") or ""),
        seed=want_int(doc, ("seed",), data.get("seed", 0), minimum=0, maximum=2**63 - 1),
        measurements=tuple(measurements),
        max_seconds=(want_float(doc, ("max_seconds",), data["max_seconds"], minimum=1,
                                maximum=MAX_SECONDS) if "max_seconds" in data else None),
        reference=(load_reference(doc, data["reference"]) if "reference" in data else None),
        target=_choice(doc, data, "target", TARGETS),
        mmap=want_bool(doc, ("mmap",), data.get("mmap", True)),
        interleave=_choice(doc, data, "interleave", INTERLEAVES),
        template=_template(doc, data, path) if "template" in data else None,
        memory=_memory(doc, data, models) if "memory" in data else None,
    )


def _memory(doc: Doc, data: dict, models: list[ModelRef]) -> MemoryPlan:
    """The `memory:` block, validated against its models' shapes."""
    path = ("memory",)
    block = want_mapping(doc, path, data["memory"])
    check_keys(doc, path, block, _MEMORY_KEYS, ("context",))
    refs = ([want_str(doc, path + ("models", i), r) for i, r in
             enumerate(_list(doc, path + ("models",), block["models"], allow_scalar=True))]
            if "models" in block else list(dict.fromkeys(m.ref for m in models)))
    specs = []
    for i, ref in enumerate(refs):
        try:
            specs.append(resolve_spec(ref))
        except HarnessError as exc:
            where = path + ("models", i) if "models" in block else ("models",)
            raise doc.error(where, exc.render(), fix="memory: loads built models; name a "
                            "built-in spec or a spec file") from None
    dtypes = [get_dtype(d, source=doc.source, key=format_path(path + ("dtypes", i))).name
              for i, d in enumerate(_list(doc, path + ("dtypes",), block.get("dtypes", ["f32"]),
                                          allow_scalar=True))]
    shortest = min(s.max_position_embeddings for s in specs)
    context = want_int(doc, path + ("context",), block["context"], minimum=1, maximum=shortest)
    kv_types = list(dict.fromkeys(["f16", *_kv_types(doc, path,
                                                     block.get("kv_cache_type", ["f16"]))]))
    for kv in kv_types:
        for spec in specs:
            if problem := kv_block_problem(kv, spec.head_dim, spec.name):
                raise doc.error(path + ("kv_cache_type",), problem, fix="leave it out")
    users = _counts(doc, path + ("users",), block.get("users", [1]), 1, MAX_PARALLEL)
    weights = block.get("weights", dtypes[0])
    if weights not in dtypes:
        raise doc.error(path + ("weights",), f"{weights!r} is not among memory's dtypes",
                        fix="name one of " + ", ".join(dtypes))
    return MemoryPlan(tuple(s.name for s in specs), tuple(dtypes), context, tuple(kv_types),
                      tuple(dict.fromkeys(users)), weights)


def _template(doc: Doc, data: dict, path: Path) -> str:
    """The page template a scenario names: a built-in one, or a file (relative to the
    scenario's folder) whose Jinja2 syntax parses; its names are checked when the page
    renders."""
    import jinja2

    name = want_str(doc, ("template",), data["template"])
    if name in PAGE_TEMPLATES:
        return name
    file = path.parent / name
    if not file.is_file():
        raise doc.error(("template",), f"no template file at {file}",
                        fix="name a built-in template (" + ", ".join(PAGE_TEMPLATES) + ") or a "
                            "file beside the scenario, e.g. one printed by `harness template "
                            "lesson`")
    try:
        jinja2.Environment().parse(file.read_text(encoding="utf-8"))
    except (jinja2.TemplateSyntaxError, UnicodeDecodeError) as exc:
        line = getattr(exc, "lineno", None)
        raise doc.error(("template",), f"{file}{f':{line}' if line else ''}: the template does "
                        f"not parse ({getattr(exc, 'message', exc)})",
                        fix="fix its Jinja2 syntax") from None
    return str(file)


TARGETS = ("contrasts", "absolute")
# What `auto` repetitions run until: the report's contrasts (cells differing in one setting)
# within target_ci, or every cell's own figure (`absolute`).
INTERLEAVES = ("step", "round")
# How a round runs its cells: their decode steps in turn, one step of each (`step`), so two
# cells compared are timed within a second of each other; or one whole repetition after
# another (`round`), as runs before schema 2 did.


def _choice(doc: Doc, data: dict, key: str, choices: tuple[str, ...]) -> str:
    """A key taking one of a few words, the first its default."""
    value = data.get(key, choices[0])
    if value not in choices:
        raise doc.error((key,), f"expected {' or '.join(choices)}, got {value!r}",
                        fix=f"write {key}: {choices[0]} (the default) or {key}: "
                            + f" or {key}: ".join(choices[1:]))
    return value


def _list(doc: Doc, path: tuple, value: object, *, allow_scalar: bool = False) -> list:
    if allow_scalar and not isinstance(value, (list, dict)):
        value = [value]
    if not isinstance(value, list):
        raise doc.error(path, f"expected a list, got {type(value).__name__}",
                        fix="write [a, b] or one `- item` line per entry")
    if not value:
        raise doc.error(path, "empty list", fix="give at least one entry")
    return value


def _models(doc: Doc, data: dict, path: tuple = (), default_dtypes: object = None
            ) -> list[ModelRef]:
    """The models × dtypes of the scenario (path ()) or of one test that names its own."""
    refs = _list(doc, path + ("models",), data["models"], allow_scalar=True)
    dtypes = _list(doc, path + ("dtypes",), data.get("dtypes", default_dtypes or ["f32"]),
                   allow_scalar=True)
    kinds = [get_dtype(d, source=doc.source, key=format_path(path + ("dtypes", i))).name
             for i, d in enumerate(dtypes)]
    if len(set(kinds)) != len(kinds):
        raise doc.error(path + ("dtypes",), "a dtype is listed twice", fix="list each once")
    out: list[ModelRef] = []
    for i, ref in enumerate(refs):
        key = path + ("models", i)
        random = _random_kinds(doc, key, ref) if isinstance(ref, dict) else None
        if random:
            key, ref = key + ("twin_of",), ref["twin_of"]
        ref = beside(want_str(doc, key, ref), Path(doc.source).parent)
        try:
            out += _resolve_twin(ref, random) if random else resolve_model_ref(ref, kinds)
        except HarnessError as exc:
            raise doc.error(key, exc.render()) from None
    labels = [(m.label, m.dtype) for m in out]
    if len(set(labels)) != len(labels):
        raise doc.error(path + ("models",), "a model is listed twice", fix="list each once")
    return out


def beside(ref: str, scenario_dir: Path) -> str:
    """A relative file path names a file beside the scenario when one is there, else as given
    (from the working directory); spec names stay names."""
    if not looks_like_path(ref) or Path(ref).is_absolute():
        return ref
    candidate = scenario_dir / ref
    return str(candidate) if candidate.exists() else ref


def resolve_model_ref(ref: str, dtypes: list[str]) -> list[ModelRef]:
    """A scenario's model (a .gguf file, a spec name or spec file) at each dtype, validated."""
    if ref.endswith(".gguf"):
        from ..weights.gguf_inspect import spec_from_gguf
        from .build import check_gguf_file

        path = Path(ref)
        check_gguf_file(path)
        spec = spec_from_gguf(path)  # refuses unsupported architectures now, not mid-run
        return [ModelRef(ref, None, path, "file", spec.max_position_embeddings, spec.head_dim)]
    spec = resolve_spec(ref)
    return [ModelRef(ref, spec.name, None, d, spec.max_position_embeddings, spec.head_dim)
            for d in dtypes]


def twin_scenario_text(real: Path, threads: int | str, prompt: int, generate: int,
                       repetitions: int | str, min_repetitions: int, max_repetitions: int,
                       target_ci: float, mmap: bool = True,
                       random: tuple[str, ...] = ("twin",)) -> str:
    """The scenario `harness twin` runs: the real file beside its twin (or the spec-built
    file, or both), one test."""
    import yaml

    doc = {"name": f"twin-{real.stem}",
           "title": f"{real.stem}: random weights against real weights",
           "description": f"{real.name} and " + " and ".join(RANDOM_WORDS[k] for k in random)
                          + ", timed round by round (written by harness twin).",
           "models": [{"twin_of": str(real.resolve())}
                      | ({"random": list(random)} if tuple(random) != ("twin",) else {})],
           "threads": threads,
           "repetitions": repetitions, "min_repetitions": min_repetitions,
           "max_repetitions": max_repetitions, "target_ci": target_ci, "mmap": mmap,
           "tests": [{"name": "prefill and decode", "prompt": prompt, "generate": generate}]}
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def _random_kinds(doc: Doc, path: tuple, entry: dict) -> list[str]:
    """The random-weight files a {twin_of: PATH, random: ...} entry times the real file
    against: its twin (the default), the spec-built file, or both."""
    check_keys(doc, path, entry, ["twin_of", "random"], ("twin_of",))
    kinds = _list(doc, path + ("random",), entry.get("random", ["twin"]), allow_scalar=True)
    for i, kind in enumerate(kinds):
        if kind not in RANDOM_KINDS:
            raise doc.error(path + ("random", i), f"unknown random-weight file {kind!r}",
                            fix="write twin, built, or [twin, built]")
    if len(set(kinds)) != len(kinds):
        raise doc.error(path + ("random",), "a kind is listed twice", fix="list each once")
    return kinds


def _resolve_twin(ref: str, random: list[str]) -> list[ModelRef]:
    """A real GGUF file and its random-weight stand-ins, compared on every phase."""
    if not ref.endswith(".gguf"):
        raise HarnessError("twin_of names a GGUF file", fix="write twin_of: path/to/model.gguf")
    real = resolve_model_ref(ref, [])[0]
    if "built" in random:
        from ..weights.gguf_inspect import file_dtype

        file_dtype(real.gguf_path)  # refuses a file type the builder cannot make, now
    return [replace(real, dtype="real")] + [
        replace(real, gguf_path=None, dtype=kind, twin_of=real.gguf_path) for kind in random]


def _threads(doc: Doc, path: tuple, value: object, physical_cores: int) -> list[int]:
    out = []
    for i, item in enumerate(_list(doc, path, value, allow_scalar=True)):
        if item == "auto":
            out.append(physical_cores)
        elif isinstance(item, str) and ".." in item:
            out += _thread_range(doc, path + (i,), item, physical_cores)
        else:
            out.append(want_int(doc, path + (i,), item, minimum=1, maximum=MAX_THREADS))
    return out


def _thread_range(doc: Doc, path: tuple, text: str, physical_cores: int) -> list[int]:
    """"1..auto" or "1..8": every thread count from the first to the last."""
    ends = []
    for part in text.split("..", 1):
        part = part.strip()
        if part == "auto":
            ends.append(physical_cores)
        elif part.isdigit() and 1 <= int(part) <= MAX_THREADS:
            ends.append(int(part))
        else:
            raise doc.error(path, f"bad thread range {text!r}",
                            fix=f'write "FIRST..LAST" with whole numbers from 1 to {MAX_THREADS} '
                                'or auto, e.g. "1..auto"')
    if ends[0] > ends[1]:
        raise doc.error(path, f"thread range {text!r} runs backwards",
                        fix="put the smaller count first")
    return list(range(ends[0], ends[1] + 1))


def _settings(doc: Doc, path: tuple, data: dict, base: Settings | None,
              physical_cores: int) -> list[Settings]:
    """Scenario-level defaults (base None) or a test's overrides of them, one per thread count."""
    def get_int(key: str, default: int | None, minimum: int, maximum: int) -> int | None:
        if key not in data:
            return default
        return want_int(doc, path + (key,), data[key], minimum=minimum, maximum=maximum)

    b = base or Settings(physical_cores, 5, 1, 2048, 512, None)
    b = replace(b, **_policy(doc, path, data, b))
    fa = b.flash_attn
    if "flash_attn" in data:
        fa = data["flash_attn"]
        if fa == "auto":
            fa = None
        elif not isinstance(fa, bool):
            raise doc.error(path + ("flash_attn",), f"expected true, false or auto, got {fa!r}",
                            fix="write true, false or auto")
    s = replace(b, warmup=get_int("warmup", b.warmup, 0, MAX_REPETITIONS),
                n_batch=get_int("n_batch", b.n_batch, 1, MAX_TOKENS),
                n_ubatch=get_int("n_ubatch", b.n_ubatch, 1, MAX_TOKENS), flash_attn=fa,
                n_ctx=get_int("n_ctx", b.n_ctx, 1, MAX_TOKENS))
    if s.n_ctx is not None and s.n_ctx % CONTEXT_STEP:
        up = whole_blocks(s.n_ctx)
        raise doc.error(path + ("n_ctx",), f"n_ctx {s.n_ctx:,} is not a multiple of "
                        f"{CONTEXT_STEP}: llama.cpp would pad it to {up:,} cells after clamping "
                        f"n_batch to {s.n_ctx:,}", fix=f"set n_ctx to a multiple of "
                        f"{CONTEXT_STEP}, e.g. {up:,}")
    if s.n_ubatch > s.n_batch:
        raise doc.error(path + ("n_ubatch",), f"n_ubatch {s.n_ubatch} exceeds n_batch {s.n_batch}",
                        fix="n_ubatch must be at most n_batch")
    threads = (_threads(doc, path + ("threads",), data["threads"], physical_cores)
               if "threads" in data else None)
    if base is None:
        return [replace(s, threads=t) for t in (threads or [physical_cores])]
    return [replace(s, threads=t) for t in (threads or [b.threads])]


def _policy(doc: Doc, path: tuple, data: dict, b: Settings) -> dict:
    """repetitions (a count or auto), target_ci, min_repetitions and max_repetitions."""
    out = {}
    if "repetitions" in data:
        value = data["repetitions"]
        if isinstance(value, str) and value != "auto":
            raise doc.error(path + ("repetitions",), f"expected a whole number or auto, got "
                            f"{value!r}", fix="write a count such as 5, or auto (until the "
                            "confidence interval reaches target_ci)")
        out["repetitions"] = None if value == "auto" else want_int(
            doc, path + ("repetitions",), value, minimum=1, maximum=MAX_REPETITIONS)
    if "target_ci" in data:
        out["target_ci"] = want_float(doc, path + ("target_ci",), data["target_ci"],
                                      minimum=0.001, maximum=1.0)
    for key in ("min_repetitions", "max_repetitions"):
        if key in data:
            out[key] = want_int(doc, path + (key,), data[key], minimum=1,
                                maximum=MAX_REPETITIONS)
    low = out.get("min_repetitions", b.min_repetitions)
    high = out.get("max_repetitions", b.max_repetitions)
    if low > high:
        key = "min_repetitions" if "min_repetitions" in out else "max_repetitions"
        raise doc.error(path + (key,), f"min_repetitions {low} exceeds max_repetitions {high}",
                        fix="make min_repetitions at most max_repetitions")
    return out


def _expand_test(doc: Doc, path: tuple, test: object, models: list[ModelRef],
                 bases: list[Settings], physical_cores: int) -> list[Measurement]:
    test = want_mapping(doc, path, test)
    check_keys(doc, path, test, _TEST_KEYS, ("prompt",))
    prompts = _token_counts(doc, path + ("prompt",), test["prompt"])
    gens = _token_counts(doc, path + ("generate",), test.get("generate", 0))
    levers = _levers(doc, path, test)
    label = want_str(doc, path + ("name",), test.get("name", f"test {path[-1] + 1}"))
    # A test's own threads replace the scenario's list, so keep each setting once.
    settings_list = list(dict.fromkeys(
        s for base in bases for s in _settings(doc, path, test, base, physical_cores)))
    out = []
    for settings in settings_list:
        for model, n_prompt, n_gen, lever in itertools.product(models, prompts, gens, levers):
            if n_prompt + n_gen == 0:
                raise doc.error(path + ("prompt",), "prompt and generate are both 0",
                                fix="measure at least one token")
            m = Measurement(model, n_prompt, n_gen, settings, label, **lever)
            _check_lever(doc, path, m)
            _check_context(doc, path, m, path + ("n_ctx",) if "n_ctx" in test else ("n_ctx",))
            out.append(m)
    return out


def _kv_types(doc: Doc, path: tuple, value: object) -> list[str]:
    """A `kv_cache_type:` (one type or a list) under path, each a known cache type."""
    out = []
    for i, v in enumerate(_list(doc, path + ("kv_cache_type",), value, allow_scalar=True)):
        key = path + ("kv_cache_type",) + ((i,) if isinstance(value, list) else ())
        if not isinstance(v, str) or v.lower() not in KV_CACHE_TYPES:
            raise doc.error(key, f"unknown KV cache type {v!r}",
                            fix="valid KV cache types: " + ", ".join(KV_CACHE_TYPES))
        out.append(v.lower())
    return out


def _levers(doc: Doc, path: tuple, test: dict) -> list[dict]:
    """The cross product of a test's depth, KV cache type, parallel and shared_prefix lists."""
    depths = _token_counts(doc, path + ("depth",), test.get("depth", 0))
    kv_types = _kv_types(doc, path, test.get("kv_cache_type", "f16"))
    parallels = _counts(doc, path + ("parallel",), test.get("parallel", 1), 1, MAX_PARALLEL)
    prefixes = _token_counts(doc, path + ("shared_prefix",), test.get("shared_prefix", 0))
    return [{"depth": d, "kv_type": k, "parallel": p, "shared_prefix": x}
            for d, k, p, x in itertools.product(depths, kv_types, parallels, prefixes)]


def _check_lever(doc: Doc, path: tuple, m: Measurement) -> None:
    """Combinations the runner cannot measure honestly are refused at load."""
    s = m.settings
    if m.kv_type in KV_NEEDS_FLASH_ATTN and s.flash_attn is False:
        raise doc.error(path + ("kv_cache_type",), f"a {m.kv_type} KV cache needs flash "
                        "attention (llama.cpp dequantizes V inside it)",
                        fix="set flash_attn: true (or auto), or use kv_cache_type: f16")
    problem = kv_block_problem(m.kv_type, m.model.head_dim, m.model.label)
    if problem:
        raise doc.error(path + ("kv_cache_type",), problem,
                        fix="use kv_cache_type: f16 for this model")
    if m.parallel > 1 and (m.depth or m.shared_prefix):
        raise doc.error(path + ("parallel",), "parallel sequences cannot be combined with "
                        "depth or shared_prefix in one test", fix="measure them in separate tests")
    if m.parallel > s.n_batch:
        raise doc.error(path + ("parallel",), f"{m.parallel} sequences do not fit one batch of "
                        f"n_batch {s.n_batch}", fix=f"set n_batch to at least {m.parallel}")
    if m.shared_prefix and m.n_gen:
        raise doc.error(path + ("generate",), "a shared_prefix test times the first token only",
                        fix="set generate: 0 in this test")
    if m.shared_prefix and not m.n_prompt:
        raise doc.error(path + ("prompt",), "a shared_prefix test needs a prompt (the question "
                        "after the prefix)", fix="set prompt to at least 1")
    if m.shared_prefix and m.depth:
        raise doc.error(path + ("depth",), "depth and shared_prefix both fill the cache before "
                        "the prompt", fix="use one of them")


def _token_counts(doc: Doc, path: tuple, value: object) -> list[int]:
    return _counts(doc, path, value, 0, MAX_TOKENS)


def _counts(doc: Doc, path: tuple, value: object, minimum: int, maximum: int) -> list[int]:
    if isinstance(value, list):
        return [want_int(doc, path + (i,), v, minimum=minimum, maximum=maximum)
                for i, v in enumerate(_list(doc, path, value))]
    return [want_int(doc, path, value, minimum=minimum, maximum=maximum)]


def _check_context(doc: Doc, path: tuple, m: Measurement, n_ctx_path: tuple) -> None:
    limit, n = m.model.max_context, m.n_seq_ctx
    parts = [k for k, v in (("shared_prefix", m.shared_prefix), ("depth", m.depth),
                            ("prompt", True), ("generate", True)) if v]
    if n > limit:
        raise doc.error(path + ("prompt",), f"{' + '.join(parts)} = {n:,} tokens exceeds "
                        f"{m.model.label}'s context length {limit:,}",
                        fix=f"keep {' + '.join(parts)} at most {limit:,}")
    given, need = m.settings.n_ctx, m.n_cells_needed
    if given is None:
        return
    if given < need:
        what = ("shared_prefix + 2 × prompt (the prefix and two copies of the question)"
                if m.kind == "prefix_cache" else " + ".join(parts))
        raise doc.error(n_ctx_path, f"n_ctx {given:,} cannot hold {what} = {need:,} tokens "
                        f"of {m.test_name}", fix=f"set n_ctx to at least {need:,}, or leave it "
                        f"out (each context is then its tokens rounded up to {CONTEXT_STEP})")
    if given > limit:
        raise doc.error(n_ctx_path, f"n_ctx {given:,} exceeds {m.model.label}'s context "
                        f"length {limit:,}", fix=f"set n_ctx to at most {limit:,}")


def _check_unique(doc: Doc, measurements: list[Measurement]) -> None:
    seen: dict[str, str] = {}
    for m in measurements:
        if m.id in seen:
            raise doc.error(("tests",), f"{m.test_name} repeats a measurement of {seen[m.id]}: "
                            f"{m.id}", fix="remove the duplicate")
        seen[m.id] = m.test_name
