"""The run directory: an append-only JSON-lines file, flushed record by record."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from filelock import FileLock, Timeout

from ..core.errors import HarnessError
from ..core.records import (
    SCHEMA_VERSION,
    AnyRecord,
    Failure,
    Header,
    Measurement,
    Model,
    Probe,
    Repetition,
    Round,
    migrate,
    to_dict,
    typed,
)
from .records import summarized

__all__ = ["SCHEMA_VERSION", "RESULTS_FILE", "Records", "RunWriter", "read_records"]
RESULTS_FILE = "results.jsonl"


@dataclass
class Records:
    """Everything a results file holds, typed (harness.core.records), and whether its last
    line was cut off."""

    header: Header | None = None
    models: dict[str, Model] = field(default_factory=dict)  # by model key
    measurements: list[Measurement] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    repetitions: list[Repetition] = field(default_factory=list)  # one per timed repetition
    rounds: list[Round] = field(default_factory=list)
    n_records: int = 0  # lines read or written (a record's seq is its line)
    other: list[AnyRecord] = field(default_factory=list)  # resume, grouping, request, level …
    truncated_bytes: int = 0  # a partial last line (a crash mid-write) is skipped

    @property
    def measured_ids(self) -> set[str]:
        return {m.id for m in self.measurements}

    def of_type(self, kind: type) -> list:
        """The records of one of the other types (Level, Request, Grouping …), in file order."""
        return [r for r in self.other if isinstance(r, kind)]


def read_records(path: Path) -> Records:
    """Parse a results file, tolerating a truncated last line; every record migrated to
    today's schema and typed, every measurement's summaries recomputed from its samples."""
    records = Records()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise HarnessError(f"cannot read results: {exc.strerror}", source=str(path),
                           fix="check the file's permissions") from None
    complete, _, tail = raw.rpartition(b"\n")
    records.truncated_bytes = len(tail)
    lines = complete.split(b"\n") if complete else []
    for number, line in enumerate(lines, start=1):
        try:
            file_record(records, _parsed(line))
        except (ValueError, RecursionError, KeyError, TypeError, ZeroDivisionError,
                msgspec.ValidationError):  # not JSON, too deep, not a record of any kind
            raise HarnessError("corrupt results line", source=str(path), line=number,
                               fix="restore the file or start a new run") from None
    if records.header is None and lines:
        raise HarnessError("results file has no header record", source=str(path),
                           fix="pass a results.jsonl written by `harness run`")
    return records


def _parsed(line: bytes) -> dict:
    """One line as a record, a measurement's summaries recomputed from its samples (every run
    shown in today's statistical convention); file_record migrates it."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise TypeError("not a record")
    return summarized(record) if record.get("type") == "measurement" else record


def file_record(records: Records, record: dict | None) -> None:
    """File one record into records (by its type), numbering it in file order (seq: its
    line, so analysis can find the probes beside a measurement)."""
    records.n_records += 1
    record = migrate(record) if record is not None else None
    if record is None:
        return
    # A serving run of schema 1 numbered its probes and levels itself: those numbers are kept.
    record = typed(dict(record, seq=record.get("seq", records.n_records)))
    if isinstance(record, Header):
        records.header = records.header or record
    elif isinstance(record, Model):
        records.models[record.key] = record
    elif isinstance(record, Measurement):
        records.measurements.append(record)
    elif isinstance(record, Failure):
        records.failures.append(record)
    elif isinstance(record, Probe):
        records.probes.append(record)
    elif isinstance(record, Repetition):
        records.repetitions.append(record)
    elif isinstance(record, Round):
        records.rounds.append(record)
    else:
        records.other.append(record)


# What makes a run's machine the same machine as before: host, machine id (a rescheduled pod
# keeps its hostname, not its /etc/machine-id), CPU, cores, RAM, ggml commit.
IDENTITY_KEYS = ("hostname", "machine_id", "cpu_model", "physical_cores", "ram_total_bytes",
                 "ggml_commit")
RAM_TOLERANCE = 0.01  # the kernel's reserved memory moves total RAM by megabytes between boots


def machine_identity(env: dict) -> dict:
    """The identity fields of an environment record (engine/env.collect_env)."""
    return {key: (env.get("llama") or {}).get(key) if key == "ggml_commit" else env.get(key)
            for key in IDENTITY_KEYS}


def identity_differences(now: dict, before: dict) -> list[str]:
    """What differs between two machine identities, each as 'key now (was before)'."""
    out = []
    for key in IDENTITY_KEYS:
        a, b = now.get(key), before.get(key)
        if key == "ram_total_bytes" and a and b and abs(a - b) <= RAM_TOLERANCE * b:
            continue
        if key == "machine_id" and b is None:  # recorded before harness kept it
            continue
        if a != b:
            out.append(f"{key} {_shown(key, a)} (was {_shown(key, b)})")
    return out


def _shown(key: str, value: object) -> object:
    return f"{value / 2**30:.1f} GiB" if key == "ram_total_bytes" and value else value


def run_kind(header: Header | None) -> str | None:
    """measurement or serving: what kind of run a header starts (None: no header)."""
    return header.kind if header else None


# Per run kind, the header fields a resume must find unchanged (the machine's identity too).
RESUME_KEYS = {"measurement": ("scenario.sha256",),
               "serving": ("model", "server", "workload", "slo")}
# A server's command line names its run folder's log and a free port: not part of its identity.
_SERVER_VOLATILE = ("command", "port")


def header_differences(kind: str, new: dict, old: dict) -> list[str]:
    """What a resume would change: each header field of RESUME_KEYS[kind] and the machine."""
    out = []
    for dotted in RESUME_KEYS[kind]:
        a, b = _field(new, dotted), _field(old, dotted)
        if dotted == "server" and isinstance(a, dict) and isinstance(b, dict):
            a, b = ({k: v for k, v in x.items() if k not in _SERVER_VOLATILE} for x in (a, b))
        if a != b:
            out.append("the scenario file changed" if dotted == "scenario.sha256"
                       else _what_differs(dotted, a, b))
    if new.get("env") and old.get("env"):
        out += identity_differences(machine_identity(new["env"]), machine_identity(old["env"]))
    return out


def _field(record: dict, dotted: str):
    for part in dotted.split("."):
        record = record.get(part) if isinstance(record, dict) else None
    return record


def _what_differs(name: str, a, b) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
        return ", ".join(f"{name}.{k} {a.get(k)} (was {b.get(k)})" for k in keys)
    return f"{name} {a} (was {b})"


class RunWriter:
    """The one writer of every run's results.jsonl (measurement, serving, a fleet node's):
    holds the folder's lock, pushes each record to disk before the next, drops a cut last line
    and takes back a failed append, and refuses a folder holding another kind of run or, on
    resume, another run's header."""

    def __init__(self, run_dir: Path, *, resume: bool, kind: str = "measurement") -> None:
        self.dir, self.kind = run_dir, kind
        self.path = run_dir / RESULTS_FILE
        exists = _refuse_presence(run_dir, resume)
        self._lock = _lock(run_dir)
        try:
            self.records = read_records(self.path) if exists else Records()
            _refuse_kind(self.records, kind, run_dir)
            if self.records.truncated_bytes:
                # A crash cut the last record short: drop the fragment so appends stay lines.
                _truncate(self.path, self.path.stat().st_size - self.records.truncated_bytes)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except BaseException:
            self._lock.release()
            raise

    def begin(self, header: dict, argv: list[str]) -> None:
        begin_run(self, header, argv)

    def keep_through(self, closes_unit) -> None:
        """On resume, drop every record after the last that closes a unit of work: a unit cut
        short is done again, whole, not pooled with its fragment."""
        lines = self.path.read_bytes().split(b"\n")[: self.records.n_records]
        last = max((i for i, line in enumerate(lines)
                    if (r := migrate(json.loads(line))) and closes_unit(typed(r))), default=-1)
        if last + 1 < len(lines):
            _truncate(self.path, sum(len(line) + 1 for line in lines[: last + 1]))
            self.records = read_records(self.path)

    def append(self, record: dict) -> None:
        """Write one record and push it to disk before anything else happens; a write that
        fails (a full disk) is taken back to the last whole line before the error goes on."""
        data = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise
        file_record(self.records, record)

    def close(self) -> None:
        os.close(self._fd)
        self._lock.release()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_folder(run_dir: Path, *, resume: bool, kind: str, header: dict | None = None
                 ) -> None:
    """Everything RunWriter and begin_run would refuse of run_dir, refused without locking or
    writing anything (a serving run asks before it builds or starts): results there without
    resume, none with it, another kind of run, and (given the header) a resume that differs."""
    path = run_dir / RESULTS_FILE
    records = read_records(path) if path.is_file() and path.stat().st_size > 0 else Records()
    _refuse_kind(records, kind, run_dir)  # first: resuming would not help
    _refuse_presence(run_dir, resume)
    if header is not None:
        check_resume(records, run_dir, kind, header)


def _refuse_presence(run_dir: Path, resume: bool) -> bool:
    """Whether run_dir holds results; refused when that is not what the run expects."""
    path = run_dir / RESULTS_FILE
    exists = path.is_file() and path.stat().st_size > 0
    if exists and not resume:
        raise HarnessError("the run directory already holds results", source=str(run_dir),
                           fix="pass --resume to continue it, or choose another --out")
    if resume and not exists:
        raise HarnessError("nothing to resume: no results in the run directory",
                           source=str(run_dir), fix="drop --resume to start a new run")
    return exists


def _refuse_kind(records: Records, kind: str, run_dir: Path) -> None:
    found = run_kind(records.header)
    if found not in (None, kind):
        raise HarnessError(f"the run directory holds a {found} run's results, not a {kind} "
                           "run's", source=str(run_dir), fix="choose another --out")


def begin_run(writer, header: dict, argv: list[str]) -> None:
    """Write a new run's header, or check a resumed run's against it (exit 2 naming what
    differs) and record the resume, once per writer; writer: a RunWriter or a fleet node's
    stream."""
    if getattr(writer, "begun", False):
        return
    if writer.records.header is None:
        writer.append(header)
        writer.begun = True
        return
    check_resume(writer.records, writer.dir, writer.kind, header)
    writer.append({"type": "resume", "at": header.get("created"), "argv": argv,
                   "env": header.get("env")})
    writer.begun = True


def check_resume(records: Records, run_dir: Path, kind: str, header: dict) -> None:
    """Refuse (exit 2, naming what differs) to resume a run whose stored header differs from
    this one in what RESUME_KEYS names, the machine or the schema; nothing is written."""
    if records.header is None:
        return
    old = to_dict(records.header)
    if old.get("schema_version") != header["schema_version"]:
        raise HarnessError(f"this run was written by another harness (results schema "
                           f"{old.get('schema_version')}, this one writes "
                           f"{header['schema_version']})", source=str(run_dir),
                           fix="start a new run with another --out")
    if diff := header_differences(kind, header, old):
        raise HarnessError(f"cannot resume: {'; '.join(diff)} since this run started",
                           source=str(run_dir),
                           fix="resume with the same scenario on the same machine, or start "
                               "a new run with another --out")


def _lock(run_dir: Path) -> FileLock:
    """The run directory's lock: two runs never write into one folder."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(run_dir / ".lock"), timeout=0)
        lock.acquire()
        return lock
    except Timeout:
        raise HarnessError("another run is writing into this run directory",
                           source=str(run_dir), fix="wait for it or choose another --out"
                           ) from None
    except OSError as exc:
        raise HarnessError(f"run directory is not writable ({exc.strerror})",
                           source=str(run_dir), fix="choose another --out") from None


def _truncate(path: Path, n_bytes: int) -> None:
    with path.open("r+b") as f:
        f.truncate(n_bytes)
