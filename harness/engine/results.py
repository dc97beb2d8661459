"""The run directory: an append-only JSON-lines file, flushed record by record."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from ..core.errors import HarnessError
from .records import summarized

SCHEMA_VERSION = 1
RESULTS_FILE = "results.jsonl"


@dataclass
class Records:
    """Everything a results file holds, and whether its last line was cut off."""

    header: dict | None = None
    models: dict[str, dict] = field(default_factory=dict)  # by model key
    measurements: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)
    analyses: list[dict] = field(default_factory=list)
    repetitions: list[dict] = field(default_factory=list)  # one per timed repetition
    rounds: list[dict] = field(default_factory=list)
    n_records: int = 0
    other: list[dict] = field(default_factory=list)
    truncated_bytes: int = 0  # a partial last line (a crash mid-write) is skipped

    @property
    def measured_ids(self) -> set[str]:
        return {m["id"] for m in self.measurements}


def read_records(path: Path) -> Records:
    """Parse a results file, tolerating a truncated last line."""
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
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, a number past Python's limit, too deep
            record = None
        if not _well_formed(record):
            raise HarnessError("corrupt results line", source=str(path), line=number,
                               fix="restore the file or start a new run")
        if record["type"] == "measurement" and isinstance(record.get("samples"), dict):
            record = _resummarized(record, path, number)
        file_record(records, record)
    if records.header is None and lines:
        raise HarnessError("results file has no header record", source=str(path),
                           fix="pass a results.jsonl written by `harness run`")
    return records


def _resummarized(record: dict, path: Path, number: int) -> dict:
    """Summaries recomputed from the raw samples, so runs of every version show one
    statistical convention."""
    try:
        return summarized(record)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise HarnessError("corrupt measurement record", source=str(path), line=number,
                           fix="restore the file or start a new run") from None


# The keys each record type is filed by; a line without them was not written by a run.
_REQUIRED = {"model": ("key",), "measurement": ("id",), "header": ("scenario",),
             "repetition": ("id", "round", "rep"), "round": ("round",)}


def _well_formed(record: object) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("type"), str)
            and all(k in record for k in _REQUIRED.get(record["type"], ())))


def file_record(records: Records, record: dict) -> None:
    """File one record into records (by its type), numbering it in file order."""
    # seq: the record's place in the file, so analysis can find the probes beside a measurement
    records.n_records += 1
    record = dict(record, seq=records.n_records)
    kind = record.get("type")
    if kind == "header":
        records.header = records.header or record
    elif kind == "model":
        records.models[record["key"]] = record
    elif kind == "measurement":
        records.measurements.append(record)
    elif kind == "failure":
        records.failures.append(record)
    elif kind == "probe":
        records.probes.append(record)
    elif kind == "analysis":
        records.analyses.append(record)
    elif kind == "repetition":
        records.repetitions.append(record)
    elif kind == "round":
        records.rounds.append(record)
    else:
        records.other.append(record)


class RunWriter:
    """Appends records to results.jsonl; holds a lock so two runs never share a directory."""

    def __init__(self, run_dir: Path, *, resume: bool) -> None:
        self.dir = run_dir
        self.path = run_dir / RESULTS_FILE
        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists and not resume:
            raise HarnessError("the run directory already holds results", source=str(run_dir),
                               fix="pass --resume to continue it, or choose another --out")
        if resume and not exists:
            raise HarnessError("nothing to resume: no results in the run directory",
                               source=str(run_dir), fix="drop --resume to start a new run")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._lock = FileLock(str(run_dir / ".lock"), timeout=0)
            self._lock.acquire()
        except Timeout:
            raise HarnessError("another run is writing into this run directory",
                               source=str(run_dir), fix="wait for it or choose another --out"
                               ) from None
        except OSError as exc:
            raise HarnessError(f"run directory is not writable ({exc.strerror})",
                               source=str(run_dir), fix="choose another --out") from None
        self.records = read_records(self.path) if exists else Records()
        if self.records.truncated_bytes:
            # A crash cut the last record short: drop the fragment so appends stay valid lines.
            with self.path.open("r+b") as f:
                f.truncate(self.path.stat().st_size - self.records.truncated_bytes)
        self._file = self.path.open("a", encoding="utf-8")

    def append(self, record: dict) -> None:
        """Write one record and push it to disk before anything else happens."""
        self._file.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        file_record(self.records, record)

    def close(self) -> None:
        self._file.close()
        self._lock.release()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
