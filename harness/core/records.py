"""Every record a run's results.jsonl holds, as frozen types (a tagged union on `type`), the
schema's one version, and the one migration that brings any older record to today's shape.

Readers get these types, never the dicts of the file: a field an old record lacks takes its
default here, once (pyperf's way). Nested parts whose keys belong to another module stay
dicts: a summary (core.stats.summarize), the environment (engine.env), a probe's result
(engine.probe), a request's server timings (llama-server's)."""

from __future__ import annotations

from typing import Any

import msgspec

from .cell import CellId

# 1: the first; 2: headers name their run kind, a served model has a key, the analysis is no
# longer stored (it is recomputed from the records on every read).
SCHEMA_VERSION = 2

Summary = dict[str, Any]  # core.stats.summarize: median, median_ci95, n, mean, stdev, cv, ...


class Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """What every record has: its place in the file (from 1; filled in when it is read)."""

    seq: int = 0


class Header(Record, tag="header", kw_only=True):
    """The first record of a run: what kind of run, from what, on which machine."""

    kind: str  # measurement | serving
    schema_version: int = 1
    harness: str | None = None
    created: str | None = None
    argv: list[str] = []
    env: dict[str, Any] | None = None
    scenario: dict[str, Any] | None = None
    plan: list[str] = []  # measurement: the cells' ids
    # serving only: the server, its load and the levels asked for
    python: str | None = None
    model: str | None = None
    url: str | None = None
    server: dict[str, Any] | None = None
    workload: dict[str, Any] | None = None
    slo: dict[str, Any] | None = None
    system_info: dict[str, Any] | None = None
    levels: list[dict[str, Any]] = []


class Resume(Record, tag="resume", kw_only=True):
    at: str | None = None
    argv: list[str] = []
    env: dict[str, Any] | None = None


class Model(Record, tag="model", kw_only=True):
    """A model file as loaded: its bytes and parameters by type, its spec."""

    key: str
    path: str | None = None
    model: str | None = None
    dtype: str | None = None
    file_n_bytes: int | None = None
    sha256: str | None = None
    n_params: int | None = None
    model_n_bytes: int | None = None
    description: str | None = None
    weights_n_bytes: int | None = None
    decode_weight_n_bytes: int | None = None
    expert_n_bytes: int | None = None
    kv_n_bytes_per_token_f16: float | None = None
    decode_type_n_bytes: dict[str, int] = {}
    matmul_type_n_params: dict[str, int] = {}
    tensor_type_n_bytes: dict[str, int] = {}
    tensor_type_n_params: dict[str, int] = {}
    spec: dict[str, Any] | None = None
    huge_mapped_n_bytes: int | None = None
    mmap: bool = True
    routing: dict[str, Any] | None = None
    twin_of: str | None = None
    real_sha256: str | None = None
    calibration: dict[str, Any] | None = None
    error: str | None = None  # serving: a file whose architecture could not be read


class Measurement(Record, tag="measurement", kw_only=True):
    """One cell: its settings, every repetition's raw samples, and their summaries (recomputed
    from the samples when read: engine.records.summarized)."""

    id: str
    test: str | None = None
    model: str
    model_key: str
    dtype: str
    threads: int
    n_batch: int | None = None
    n_ubatch: int = 512  # llama.cpp's default, for records before it was kept
    n_ctx: int | None = None
    n_ctx_total: int | None = None
    n_seq_max: int | None = None
    flash_attn: bool | None = None
    flash_attn_used: bool | None = None
    n_prompt: int
    n_gen: int
    kind: str = "single"
    depth: int = 0
    kv_type: str = "f16"
    parallel: int = 1
    shared_prefix: int = 0
    repetitions: int = 0
    warmup: int = 0
    n_params: int | None = None
    model_bytes: int | None = None
    setup: dict[str, Any] | None = None
    samples: dict[str, Any] = {}
    warmup_samples: dict[str, Any] = {}
    noise: dict[str, Any] = {}
    started: str | None = None
    finished: str | None = None
    stopped_by: str | None = None
    policy: dict[str, Any] | None = None
    span_seq: list[int] | None = None
    ci_reached: float | None = None
    target: str | None = None
    partners: list[list[str]] = []
    interleave: str = "round"  # "step": its decode steps ran in turn with the round's others
    ram_group: int = 0  # the RAM group it ran in (a grouping record's), filled on read
    # summaries of the samples
    ttft_s: Summary | None = None
    prefill_tok_s: Summary | None = None
    decode_tok_s: Summary | None = None
    decode_ms_per_token: Summary | None = None
    per_sequence_tok_s: Summary | None = None
    baseline_decode_tok_s: Summary | None = None
    paired_slowdown: Summary | None = None
    ttft_reuse_s: dict[str, Summary] | None = None
    flags: list[str] = []

    @property
    def cell(self) -> CellId:
        """The cell this measures (its id, printed from the same settings)."""
        return CellId.of(self)


class Repetition(Record, tag="repetition", kw_only=True):
    id: str
    round: int
    position: int = 0
    rep: dict[str, Any]
    elapsed_s: float = 0.0
    at: str | None = None


class Round(Record, tag="round", kw_only=True):
    round: int
    order: list[str] = []
    idle_other_cores: float | None = None
    at: str | None = None


class Probe(Record, tag="probe", kw_only=True):
    """The machine's ceilings, measured by ggml's kernels (a failed probe keeps its error)."""

    when: str
    threads: list[int] = []
    round: int | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    at: str | None = None


class Failure(Record, tag="failure", kw_only=True):
    model_key: str
    step: str | None = None
    error: str
    ids: list[str] = []
    at: str | None = None


class Grouping(Record, tag="grouping", kw_only=True):
    groups: list[list[str]]
    split: list[list[str]] = []  # compared model pairs put in different groups (never paired)
    why: str | None = None
    at: str | None = None


class Load(Record, tag="load", kw_only=True):
    round: int | None = None
    order: list[str] = []
    recached: bool = False
    huge_mapped_n_bytes: dict[str, Any] = {}
    at: str | None = None


class NodeFailure(Record, tag="node_failure", kw_only=True):
    node: str | None = None
    node_id: str | None = None
    status: str | None = None
    error: str | None = None
    at: str | None = None


class Request(Record, tag="request", kw_only=True):
    """One served request: when it was sent, its chunks, and what the server said."""

    level: str
    round: int = 0
    index: int | None = None
    slot: int | None = None
    sent_s: float | None = None
    started_s: float | None = None
    chunk_s: list[float] = []
    chunk_tokens: list[int] = []
    end_s: float | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None


class Level(Record, tag="level", kw_only=True):
    """One load level of a serving run, summarized; complete: its server lived to its end."""

    level: str
    label: str | None = None
    concurrency: int | None = None
    rate: float | None = None
    pinned_slots: bool = False
    summary: dict[str, Any] = {}
    server_prompt_ms: list[float] = []
    steady_decode: dict[str, Any] | None = None
    inprocess_decode_tok_s: list[float] | None = None
    rounds: dict[str, Any] | None = None
    counters: dict[str, Any] | None = None
    errors: list[str] = []
    probe_seqs: list[int] = []
    complete: bool = True


class Footprint(Record, tag="footprint", kw_only=True):
    """One load of a scenario's `memory:` block, in a fresh process: the file's weights by
    type (core.memory.WeightType's fields), llama.cpp's buffers and the process's resident
    memory stage by stage (engine.footprint.Footprint's fields), or the error that stopped
    it."""

    model: str
    dtype: str
    kv_type: str
    n_users: int
    context: int  # tokens in each user's cache, as asked
    path: str
    file_n_bytes: int
    weights: list[dict[str, Any]] = []
    footprint: dict[str, Any] | None = None
    ram_available_n_bytes: int | None = None  # psutil's available memory before the load
    error: str | None = None
    at: str | None = None


RECORD_TYPES = (Header, Resume, Model, Measurement, Repetition, Round, Probe, Failure,
                Grouping, Load, NodeFailure, Request, Level, Footprint)
AnyRecord = (Header | Resume | Model | Measurement | Repetition | Round | Probe | Failure
             | Grouping | Load | NodeFailure | Request | Level | Footprint)


def migrate(record: dict) -> dict | None:
    """A record of any schema as today's (None: a kind no longer stored). Schema 1: a header
    without its run kind, a served model without a key, the analysis stored."""
    kind = record.get("type")
    if kind == "analysis":
        return None  # recomputed from the records on every read
    if kind == "header" and "kind" not in record:
        return record | {"kind": "serving" if "workload" in record else "measurement"}
    if kind == "model" and "key" not in record:
        return record | {"key": "served"}
    return record


def typed(record: dict) -> AnyRecord:
    """A (migrated) record as its type; ValidationError when it is not one."""
    return msgspec.convert(record, AnyRecord)


def to_dict(record: AnyRecord) -> dict:
    """The record as written: its tag first, its place in the file left out."""
    out = msgspec.to_builtins(record)
    out.pop("seq", None)
    return out
