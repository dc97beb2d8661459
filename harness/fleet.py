"""Fleet runs: one scenario on every node of a Ray cluster, one run directory per node.

The driver checks each chosen node with a small task (versions, the scenario, RAM and disk on
that node's own hardware), then starts one task per node that reserves all of the node's CPUs
and runs the scenario there with the local runner. Every record the node writes is streamed
back the moment it exists and appended to FLEET/LABEL/results.jsonl, the same JSONL a local
run writes, so a node that dies loses only its measurement in flight and `--resume` continues
each node where its records stop. Only this module imports Ray.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import __version__
from .core.errors import HarnessError
from .core.records import Measurement
from .core.yamlio import NAME_RULE, is_name
from .engine.measure import now_iso
from .engine.results import (
    RESULTS_FILE,
    Records,
    RunWriter,
    begin_run,
    file_record,
    identity_differences,
    machine_identity,
    read_records,
)

LABEL_KEY = "harness-label"  # a Ray node label (ray start --labels) naming the node's run dir
INSTALL_FIX = "install it with: pip install 'harness[ray]'"
FLEET_FILE = "fleet.json"
CHECK_SECONDS = 300  # the per-node check loads llama.cpp and the scenario: seconds, not minutes


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster, as the fleet names it."""

    node_id: str
    label: str
    hostname: str
    cpus: float


@dataclass
class NodeState:
    """What the driver knows of one node's run."""

    node: Node
    writer: RunWriter
    total: int
    status: str = "running"  # running, done, failed, cancelled
    error: str | None = None
    task: object = None
    thread: threading.Thread | None = field(default=None, repr=False)


# --- versions and the node side ------------------------------------------------------------

def versions() -> dict:
    """What must match between the driver and a node: harness and llama.cpp."""
    from .engine.llama import version_info

    info = version_info()
    return {"harness": __version__, "llama_cpp_python": info["llama_cpp_python"],
            "ggml_commit": info.get("ggml_commit")}


def version_mismatch(own: dict, expected: dict) -> str | None:
    """One line saying what differs, or None."""
    diff = [f"{k} {own.get(k)} (driver: {expected.get(k)})" for k in expected
            if own.get(k) != expected.get(k)]
    return ", ".join(diff) or None


def _load_plan(scenario_text: str, scenario_path: str):
    """The shipped scenario, validated on this node (threads: auto follows its own cores),
    recorded under the driver's path."""
    from .engine.env import physical_cores
    from .engine.scenario import load_scenario

    with tempfile.TemporaryDirectory(prefix="harness-fleet-") as tmp:
        path = Path(tmp) / Path(scenario_path).name
        path.write_text(scenario_text, encoding="utf-8")
        try:
            return replace(load_scenario(path, physical_cores()), path=Path(scenario_path))
        except HarnessError as exc:
            if exc.source == str(path):
                exc.source = scenario_path  # name the driver's file, not the copy
            raise


def node_check(scenario_text: str, scenario_path: str, expected: dict,
               cache_dir: str | None) -> dict:
    """On a node: refuse other versions, validate and preflight the scenario there."""
    from .engine.env import collect_env
    from .runner import preflight

    info = {"hostname": socket.gethostname(), "identity": machine_identity(collect_env())}
    mismatch = version_mismatch(versions(), expected)
    if mismatch:
        return info | {"ok": False, "error": f"other versions here: {mismatch}",
                       "fix": "install the driver's harness and llama-cpp-python on the node"}
    try:
        plan = _load_plan(scenario_text, scenario_path)
        preflight(plan, list(plan.measurements), Path(cache_dir) if cache_dir else None)
    except HarnessError as exc:
        return info | {"ok": False, "error": exc.render(), "fix": None}
    return info | {"ok": True}


class StreamWriter:
    """RunWriter's interface on a node: records are filed in memory and queued for the
    driver, which writes them to disk."""

    def __init__(self, prior: list[dict], out: queue.Queue, label: str) -> None:
        self.records = Records()
        self.dir, self.kind = Path(label), "measurement"
        self._out = out
        for record in prior:
            file_record(self.records, record)

    def append(self, record: dict) -> None:
        file_record(self.records, record)
        self._out.put(record)

    def begin(self, header: dict, argv: list[str]) -> None:
        begin_run(self, header, argv)


def node_run(scenario_text: str, scenario_path: str, prior: list[dict], label: str,
             strict: bool, cache_dir: str | None) -> Iterator[dict]:
    """On a node: run the scenario, yielding each record as it is written (and console lines
    as {"type": "console"} items the driver prints but does not store)."""
    from .engine.env import collect_env
    from .report.tables import round_line
    from .runner import Console, run_scenario

    out: queue.Queue = queue.Queue()
    writer = StreamWriter(prior, out, label)

    def say(level: str) -> Callable[[str], None]:
        return lambda text: out.put({"type": "console", "level": level, "text": text})

    console = Console(warn=say("warning"), info=say("info"),
                      round=lambda p: out.put({"type": "console", "level": "round",
                                               "text": round_line(p)}))

    def work() -> None:
        try:
            plan = _load_plan(scenario_text, scenario_path)
            run_scenario(plan, writer, collect_env(), strict=strict,
                         cache_dir=Path(cache_dir) if cache_dir else None, console=console,
                         argv=["harness", "run", scenario_path, "--ray", f"(node {label})"])
        except HarnessError as exc:
            out.put({"type": "node_error", "error": exc.render()})
        except Exception as exc:  # reported to the driver, which records the node as failed
            out.put({"type": "node_error", "error": f"{type(exc).__name__}: {exc}"})
        finally:
            out.put(None)

    threading.Thread(target=work, name="harness-node-run", daemon=True).start()
    while (item := out.get()) is not None:
        yield item


# --- the driver ----------------------------------------------------------------------------

def import_ray():
    try:
        import ray
    except ImportError:
        raise HarnessError("--ray needs Ray, which is not installed", key="--ray",
                           fix=INSTALL_FIX) from None
    return ray


LOOPBACK = "127.0.0.1"


def _local_cluster_auth() -> None:
    """Token authentication for the one-node cluster `--ray local` starts: the node advertises
    127.0.0.1, but Ray's GCS and raylet listen on every interface, and without a token anyone
    who reaches those ports can run code here. A random token, in this process' environment,
    reaches the cluster's processes and no one else (a RAY_AUTH_MODE of the user's is kept)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    try:  # the module token authentication came with (Ray 2.5x)
        import ray._private.authentication.authentication_token_setup  # noqa: F401
        from ray._raylet import Config
    except ImportError:
        raise HarnessError("this Ray has no token authentication: a local cluster's ports "
                           "would take commands from anyone who reaches them", key="--ray",
                           fix="pip install -U 'ray>=2.52'") from None
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    Config.initialize("")  # Ray caches its configuration at import: read the mode again


def connect(ray, address: str) -> None:
    """Join the cluster at address (`auto`: the one this machine belongs to; `local`: start a
    one-node cluster here, without the dashboard)."""
    if address == "local":
        _local_cluster_auth()
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _node_ip_address=LOOPBACK)
        return
    if address != "auto":
        _check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise HarnessError(f"could not join a Ray cluster at {address!r} ({exc})", key="--ray",
                           fix="start one with `ray start --head`, pass its address, or use "
                               "--ray local") from None


def _check_reachable(address: str, seconds: float = 5.0) -> None:
    """Fail fast on an address nothing answers at (ray.init would retry for a minute)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise HarnessError(f"{address!r} is not HOST:PORT", key="--ray",
                           fix="pass the head node's address, e.g. 10.0.0.5:6379, or auto or "
                               "local")
    try:
        socket.create_connection((host, int(port)), timeout=seconds).close()
    except OSError as exc:
        raise HarnessError(f"nothing answers at {address} ({exc.strerror or exc})",
                           key="--ray", fix="check the head node's address and that "
                                            "`ray start --head` runs there") from None


def alive_nodes(raw: list[dict]) -> list[Node]:
    """The alive nodes from ray.nodes(), each labelled by its harness-label or, without one,
    its hostname and an index among that host's nodes."""
    alive = sorted((n for n in raw if n.get("Alive")),
                   key=lambda n: (n.get("NodeManagerHostname", ""),
                                  n.get("NodeManagerAddress", ""),
                                  n.get("NodeManagerPort", 0), n["NodeID"]))
    per_host: dict[str, int] = {}
    out = []
    for n in alive:
        host = n.get("NodeManagerHostname") or n.get("NodeManagerAddress") or "node"
        label = (n.get("Labels") or {}).get(LABEL_KEY)
        if not label:
            label = f"{host}-{per_host.get(host, 0)}"
            per_host[host] = per_host.get(host, 0) + 1
        if not is_name(label):
            raise HarnessError(f"node {n['NodeID'][:12]} has the label {label[:40]!r}, which "
                               "cannot name a directory", key=LABEL_KEY, fix=f"use {NAME_RULE}")
        out.append(Node(n["NodeID"], label, host, float(n.get("Resources", {}).get("CPU", 0))))
    return out


def select_nodes(nodes: list[Node], wanted: list[str]) -> list[Node]:
    """The nodes --nodes names (by label or node id, or an id's first 8+ characters)."""
    if not nodes:
        raise HarnessError("the cluster has no alive node", key="--ray",
                           fix="start a node with `ray start`")
    if not wanted:
        return nodes
    chosen: list[Node] = []
    for w in wanted:
        hits = [n for n in nodes if w == n.label or w == n.node_id
                or (len(w) >= 8 and n.node_id.startswith(w))]
        if not hits:
            raise HarnessError(f"{w!r} matches no alive node", key="--nodes",
                               fix="alive nodes: " + ", ".join(
                                   f"{n.label} ({n.node_id[:12]})" for n in nodes))
        chosen += [n for n in hits if n not in chosen]
    return chosen


def _on_node(ray, node: Node, fn: Callable, **options):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)
    return ray.remote(fn).options(scheduling_strategy=strategy, max_retries=0, **options)


def check_nodes(ray, nodes: list[Node], scenario: Path, expected: dict,
                cache_dir: Path | None) -> dict[str, dict]:
    """Refuse the run (exit 2) if any chosen node has other versions or fails preflight;
    returns each node's machine identity by label."""
    text = scenario.read_text(encoding="utf-8")
    refs = [_on_node(ray, n, node_check, num_cpus=0).remote(
        text, str(scenario), expected, str(cache_dir) if cache_dir else None) for n in nodes]
    try:
        results = ray.get(refs, timeout=CHECK_SECONDS)
    except ray.exceptions.GetTimeoutError:
        raise HarnessError(f"the nodes did not answer the check within {CHECK_SECONDS} s",
                           key="--ray", fix="see `ray status`: a node may be busy or "
                                            "unreachable; --nodes can leave it out") from None
    for n, result in zip(nodes, results, strict=True):
        if not result["ok"]:
            raise HarnessError(f"node {n.label} ({result['hostname']}) refused: "
                               f"{result['error']}", key="--ray", fix=result["fix"])
    return {n.label: result["identity"] for n, result in zip(nodes, results, strict=True)}


def same_machines(nodes: list[Node], identities: dict[str, dict], req: FleetRequest,
                  echo: Callable[[str], None]) -> list[Node]:
    """On --resume, every node must be the machine its label's earlier records came from: a
    different one is refused (exit 2) or, with --relabel, recorded under a new label."""
    out = []
    for n in nodes:
        ident = identities[n.label]
        before = stored_identity(req.fleet_dir / n.label) if req.resume else None
        diff = identity_differences(ident, before) if before else []
        if not diff:
            out.append(n)
            continue
        if not req.relabel:
            raise HarnessError(f"node {n.label} is not the machine its earlier results came "
                               f"from: {', '.join(diff)}", key="--resume",
                               fix=f"rejoin that machine as {n.label}, or pass --relabel to "
                                   "record this one under a new label")
        label = _new_label(req.fleet_dir, n.label, ident)
        echo(f"[{n.label}] another machine than before ({', '.join(diff)}): recorded as {label}")
        out.append(replace(n, label=label))
    return out


def stored_identity(run_dir: Path) -> dict | None:
    """The machine a run directory's records came from (its header's), or None if empty."""
    path = run_dir / RESULTS_FILE
    header = read_records(path).header if path.exists() else None
    return machine_identity(header.env or {}) if header else None


def _new_label(fleet_dir: Path, label: str, ident: dict) -> str:
    """LABEL.2, LABEL.3, ...: the first that holds this machine's records or none at all."""
    for i in range(2, 10_000):
        candidate = f"{label}.{i}"
        before = stored_identity(fleet_dir / candidate)
        if before is None or not identity_differences(ident, before):
            return candidate
    raise HarnessError(f"no free label after {label}", key="--relabel",
                       fix="choose another --out")


def read_fleet(fleet_dir: Path) -> dict:
    path = fleet_dir / FLEET_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_fleet(fleet_dir: Path, scenario: Path, states: dict[str, NodeState]) -> None:
    """fleet.json: each node's id, host and status, replaced atomically."""
    data = read_fleet(fleet_dir) | {"scenario": str(scenario), "updated": now_iso()}
    nodes = data.setdefault("nodes", {})
    for label, s in states.items():
        nodes[label] = {"node_id": s.node.node_id, "hostname": s.node.hostname,
                        "cpus": s.node.cpus, "status": s.status, "error": s.error,
                        "measurements": len(s.writer.records.measured_ids), "of": s.total}
    tmp = fleet_dir / (FLEET_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(fleet_dir / FLEET_FILE)


def _consume(ray, state: NodeState, echo: Callable[[str], None]) -> None:
    """Append each record the node streams to its run directory; a node that dies or is
    removed ends here with its failure recorded (what arrived before stays)."""
    label = state.node.label
    try:
        for ref in state.task:
            item = ray.get(ref)
            kind = item.get("type")
            if kind == "console":
                echo(f"[{label}] {item['level'] + ': ' if item['level'] == 'warning' else ''}"
                     f"{item['text']}")
            elif kind == "node_error":
                state.status, state.error = "failed", item["error"]
            elif not _store(ray, state, item, echo):
                break
            elif kind == "measurement":
                echo(f"[{label}] {progress_line(state, state.writer.records.measurements[-1])}")
        if state.status == "running":
            state.status = "done"
    except Exception as exc:  # Ray's errors for a dead node, worker or cancelled task
        if state.status == "running":
            state.status = "cancelled" if "Cancel" in type(exc).__name__ else "failed"
            state.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            echo(f"[{label}] {state.status}: {state.error}; the other nodes go on")
    if state.status != "done":
        try:
            state.writer.append({"type": "node_failure", "node": label,
                                 "node_id": state.node.node_id, "status": state.status,
                                 "error": state.error, "at": now_iso()})
        except Exception as exc:  # noqa: BLE001 - the disk that failed may fail again
            echo(f"[{label}] its failure could not be recorded either ({exc})")


def _store(ray, state: NodeState, item: dict, echo: Callable[[str], None]) -> bool:
    """Append one streamed record; if that fails, cancel the node's task (its later records
    would be lost), keep what was written, say so, and return False."""
    try:
        state.writer.append(item)
        return True
    except Exception as exc:  # noqa: BLE001 - a full disk, a removed directory, ...
        ray.cancel(state.task, force=True)
        kept = state.writer.records
        state.status = "failed"
        state.error = (f"could not append its records to {state.writer.path} "
                       f"({type(exc).__name__}: {exc}); its task is cancelled, and the "
                       f"{len(kept.measured_ids)} measurements and {len(kept.repetitions)} "
                       "repetitions written before are kept")
        echo(f"[{state.node.label}] failed: {state.error}; the other nodes go on")
        return False


def progress_line(state: NodeState, m: Measurement) -> str:
    """One node's progress: how many of its measurements are done, and the latest."""
    done = len(state.writer.records.measured_ids)
    rate = m.decode_tok_s or m.prefill_tok_s or {}
    what = "decode" if m.decode_tok_s else "prefill"
    return (f"{done}/{state.total} measured · {m.model} {m.dtype} "
            f"{m.threads} thread{'' if m.threads == 1 else 's'}: {what} "
            f"{rate.get('median', 0):.1f} tok/s")


@dataclass(frozen=True)
class FleetRequest:
    """What `harness run --ray` was asked."""

    scenario: Path
    address: str
    nodes: list[str]
    fleet_dir: Path
    resume: bool
    strict: bool
    cache_dir: Path | None
    relabel: bool = False  # on --resume, a different machine under an old label gets a new one


def start_nodes(ray, req: FleetRequest, nodes: list[Node], total: int) -> dict[str, NodeState]:
    """One run directory and one task per node; each task reserves all of its node's CPUs."""
    text = req.scenario.read_text(encoding="utf-8")
    states: dict[str, NodeState] = {}
    try:
        for n in nodes:
            run_dir = req.fleet_dir / n.label
            has_results = (run_dir / RESULTS_FILE).exists()
            writer = RunWriter(run_dir, resume=req.resume and has_results)
            states[n.label] = NodeState(n, writer, total)
    except HarnessError:
        for s in states.values():
            s.writer.close()
        raise
    for s in states.values():
        prior = _stored_records(s.writer.path)
        s.task = _on_node(ray, s.node, node_run, num_cpus=s.node.cpus,
                          num_returns="streaming").remote(
            text, str(req.scenario), prior, s.node.label, req.strict,
            str(req.cache_dir) if req.cache_dir else None)
    return states


def _stored_records(path: Path) -> list[dict]:
    """The records a node's run directory holds, as written (for the node to resume from)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except (ValueError, RecursionError):  # a cut or corrupt line is not resumed from
            continue
    return out


def run_fleet(req: FleetRequest, plan, echo: Callable[[str], None]) -> dict[str, NodeState]:
    """Run the scenario (plan: it as validated on the driver) on every chosen node; returns
    each node's final state. Ctrl-C cancels the node tasks and keeps what arrived."""
    ray = import_ray()
    connect(ray, req.address)
    try:
        nodes = select_nodes(alive_nodes(ray.nodes()), req.nodes)
        missing = _absent_labels(req, nodes)
        identities = check_nodes(ray, nodes, req.scenario, versions(), req.cache_dir)
        nodes = same_machines(nodes, identities, req, echo)
        req.fleet_dir.mkdir(parents=True, exist_ok=True)
        states = start_nodes(ray, req, nodes, len(plan.measurements))
        echo(f"{plan.title}: {len(plan.measurements)} measurements on each of {len(nodes)} "
             f"node(s) -> {req.fleet_dir}")
        for label in missing:
            echo(f"[{label}] not in the cluster now: its run waits for it (harness-label "
                 f"{label})")
        try:
            _watch(ray, states, req, echo)
        finally:
            for s in states.values():
                s.writer.close()
            write_fleet(req.fleet_dir, req.scenario, states)
        return states
    finally:
        ray.shutdown()


def _absent_labels(req: FleetRequest, nodes: list[Node]) -> list[str]:
    """On --resume: the fleet's earlier nodes that are not among the chosen ones now."""
    if not req.resume:
        return []
    known = read_fleet(req.fleet_dir).get("nodes", {})
    if not known and not (req.fleet_dir.exists() and any(req.fleet_dir.iterdir())):
        raise HarnessError("nothing to resume: no fleet run here", source=str(req.fleet_dir),
                           fix="drop --resume to start a new fleet run")
    labels = {n.label for n in nodes}
    return sorted(k for k, v in known.items() if k not in labels and v.get("status") != "done")


def _watch(ray, states: dict[str, NodeState], req: FleetRequest, echo) -> None:
    """A thread per node streams its records; Ctrl-C cancels every task still running."""
    for s in states.values():
        s.thread = threading.Thread(target=_consume, args=(ray, s, echo),
                                    name=f"harness-fleet-{s.node.label}", daemon=True)
        s.thread.start()
    try:
        for s in states.values():
            while s.thread.is_alive():
                s.thread.join(timeout=0.5)
            write_fleet(req.fleet_dir, req.scenario, states)
    except KeyboardInterrupt:
        for s in states.values():
            if s.status == "running":
                s.status, s.error = "cancelled", "interrupted on the driver (Ctrl-C)"
                ray.cancel(s.task, force=True)
        for s in states.values():
            s.thread.join(timeout=10)
        raise
