"""The gallery: one page that compares machines, from any runs however they were collected (a
fleet directory, or result folders people sent in). Is decode tok/s ≈ ceiling ÷ bytes on every
machine? Pure: runs in, data and markdown out; writing files is in report.files."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..analysis.phases import longest_decodes
from ..core.stats import center
from ..core.yamlio import load_yaml_file
from ..render.plotkit import plt, save
from ..render.tabular import Column, Table, ceiling_share_notes, markdown_table

CEILINGS = (("read_gb_s", ("read_gb_s",)), ("copy_gb_s", ("copy_gb_s",)),
            ("stream_f32_gb_s", ("ggml", "f32", "stream_gb_s")))


def machine_key(env: dict) -> tuple:
    """What makes two runs the same machine: host, CPU and cores."""
    return (env.get("hostname"), env.get("cpu_model"), env.get("physical_cores"))


def _ceiling(analysis: dict, threads: int, what: tuple) -> float | None:
    return next((c["before"] for c in analysis["ceilings"]
                 if c["threads"] == threads and tuple(c["what"]) == what and c["before"]), None)


def machine_rows(runs: list[tuple[str, dict, dict]]) -> dict:
    """One machine from its runs (name, env, analysis): ceilings at its most threads, every
    decode configuration (its longest decode, from the run with the most repetitions), fits
    and prefill GFLOP/s."""
    env = runs[0][1]
    threads = max((r["threads"] for _, _, a in runs for r in a["decode"]), default=1)
    ceilings = {name: _median([_ceiling(a, threads, what) for _, _, a in runs])
                for name, what in CEILINGS}
    decode: dict[tuple, dict] = {}
    for name, _, a in runs:
        for r in longest_decodes(a["decode"]):
            key = (r["model"], r["dtype"], r["threads"])
            if key not in decode or r["tok_s"]["n"] > decode[key]["tok_s"]["n"]:
                decode[key] = r | {"run": name}
    prefill = [r["gflop_s"] for _, _, a in runs for r in a["prefill"] if r.get("gflop_s")]
    fits = [(name, f) for name, _, a in runs for f in a["fits"]]
    return {"env": env, "threads": threads, "ceilings": ceilings, "decode": decode,
            "fits": fits, "prefill_gflop_s": max(prefill, default=None),
            "runs": [name for name, _, _ in runs]}


def _median(values: list) -> float | None:
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def gallery_data(runs: list[tuple[str, dict, dict]], reference: list[dict]) -> dict:
    """Machines keyed by label, the model/type pairs all of them measured, and the machines
    that share no model and type with any other (listed, not dropped)."""
    grouped: dict[tuple, list] = {}
    for run in runs:
        grouped.setdefault(machine_key(run[1]), []).append(run)
    machines = {}
    for i, (key, group) in enumerate(grouped.items()):
        label = f"{key[0]}" if sum(k[0] == key[0] for k in grouped) == 1 else f"{key[0]}-{i}"
        machines[label] = machine_rows(group)
    pairs = {label: {(k[0], k[1]) for k in m["decode"]} for label, m in machines.items()}
    common = set.intersection(*pairs.values()) if pairs else set()
    apart = [label for label, mine in pairs.items() if len(pairs) > 1 and not mine & set().union(
        *(theirs for other, theirs in pairs.items() if other != label))]
    return {"machines": machines, "common": sorted(common), "apart": apart,
            "reference": reference}


def machines_table(data: dict) -> Table:
    rows = []
    for label, m in data["machines"].items():
        env, c = m["env"], m["ceilings"]
        rows.append({"machine": label, "cpu": env.get("cpu_model") or "not reported",
                     "cores": f"{m['threads']} of {env.get('physical_cores')}",
                     "read": c["read_gb_s"], "copy": c["copy_gb_s"],
                     "stream": c["stream_f32_gb_s"], "prefill": m["prefill_gflop_s"],
                     "fit": "; ".join(f"{name}: {f['fit']['gb_s']:.1f} GB/s"
                                      + (f" (R² {f['fit']['r2']:.2f})" if f["fit"]["r2"]
                                         is not None else "") for name, f in m["fits"]) or "–",
                     "runs": len(m["runs"])})
    return Table("machines", "Machines", [
        Column("machine", "machine"), Column("CPU", "cpu"), Column("threads used", "cores"),
        Column("numpy read GB/s", "read", "f1"), Column("numpy copy GB/s", "copy", "f1"),
        Column("ggml F32 streaming GB/s", "stream", "f1"),
        Column("best prefill GFLOP/s", "prefill", "f1"), Column("decode fit", "fit"),
        Column("runs", "runs", "int")], rows,
        ["Ceilings: the probes before the measurements at the most threads each machine used "
         "(median over its runs). GB = 10⁹ bytes."])


def decode_table(data: dict) -> Table:
    rows = []
    for label, m in data["machines"].items():
        for (model, dtype, threads), r in sorted(m["decode"].items()):
            predicted = (r["stream_ceiling"]["value"] * 1e9 / r["bytes_per_token"]
                         if r["stream_ceiling"]["value"] else None)
            rows.append({"machine": label, "model": model, "dtype": dtype, "threads": threads,
                         "tok_s": r["tok_s"], "gb_s": r["effective_gb_s"],
                         "share": r["share_of_stream_ci"] or (
                             {"n": 1, "median": r["share_of_stream"]}
                             if r["share_of_stream"] is not None else None),
                         "predicted": predicted,
                         "common": "yes" if (model, dtype) in set(data["common"]) else "",
                         "run": r["run"],
                         "flag": "above ceiling" if "above-ceiling" in r["flags"] else ""})
    return Table("gallery_decode", "Decode on every machine", [
        Column("machine", "machine"), Column("model", "model"), Column("dtype", "dtype"),
        Column("threads", "threads", "int"), Column("decode tok/s", "tok_s", "stat"),
        Column("effective GB/s", "gb_s", "f1"), Column("share of streaming ceiling", "share",
                                                        "pctci"),
        Column("ceiling ÷ bytes (tok/s)", "predicted", "f1"),
        Column("on every machine", "common"), Column("run", "run"),
        *([Column("notes", "flag")] if any(r["flag"] for r in rows) else [])], rows,
        ["ceiling ÷ bytes: the tok/s the machine's own streaming ceiling (llama.cpp's kernel, "
         "measured in the run) predicts for the bytes one decode step reads. tok/s carries the "
         "95% interval of its machine's long-run median, the share its round-by-round "
         "interval (harness.core.stats); machines share no round, so between machines "
         "only such intervals compare."]
        + ceiling_share_notes([(r["share_of_stream"], r["stream_ceiling"].get("spread"),
                                "above-ceiling" in r["flags"])
                               for m in data["machines"].values()
                               for r in m["decode"].values()]))


def render_gallery(data: dict, plot: str | None) -> str:
    out = ["# Machines compared: decode tok/s against ceiling ÷ bytes", ""]
    n = len(data["machines"])
    out += [f"{n} machine{'s' if n != 1 else ''}; every number below was measured by the "
            "harness on that machine, except the published points, which are marked.", ""]
    if data["apart"]:
        out += ["> Measured no model and weight type in common with the others (listed, not "
                "compared): " + ", ".join(data["apart"]), ""]
    out += [markdown_table(machines_table(data)), "", markdown_table(decode_table(data)), ""]
    if plot:
        out += [f"![Measured decode tok/s against each machine's ceiling ÷ bytes]({plot})", ""]
    if data["reference"]:
        out += ["### Published reference points (not measured by this harness)", ""]
        out += [f"- {p['hardware']}, {p['model']} ({p['size_gib']} GiB): {p['tok_s']} tok/s at "
                f"{p['bandwidth_gb_s']} GB/s spec bandwidth. Source: {p['source']}"
                for p in data["reference"]]
        out.append("")
    return "\n".join(out)


def rule_of_thumb_plot(data: dict, out_dir: Path) -> str | None:
    """Measured decode tok/s against ceiling ÷ bytes, every machine and model, log-log, with
    the y = x line; published points hollow."""
    points = [(label, r["stream_ceiling"]["value"] * 1e9 / r["bytes_per_token"],
               center(r["tok_s"])) for label, m in data["machines"].items()
              for r in m["decode"].values() if r["stream_ceiling"]["value"]]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 5))
    for label in data["machines"]:
        xs = [(x, y) for lab, x, y in points if lab == label]
        ax.plot([x for x, _ in xs], [y for _, y in xs], "o", label=f"{label} (measured)")
    ref = [(p["bandwidth_gb_s"] * 1e9 / (p["size_gib"] * 2**30), p["tok_s"])
           for p in data["reference"]]
    if ref:
        ax.plot([x for x, _ in ref], [y for _, y in ref], "o", mfc="none", color="0.3",
                label="published (spec bandwidth ÷ size), not measured here")
    every = [v for _, x, y in points for v in (x, y)] + [v for p in ref for v in p]
    lo, hi = min(every) / 1.5, max(every) * 1.5
    ax.plot([lo, hi], [lo, hi], "--", color="0.6", label="measured = ceiling ÷ bytes")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ceiling ÷ bytes per decode step (tok/s)")
    ax.set_ylabel("measured decode tok/s")
    share = statistics.median(y / x for _, x, y in points)
    n = len(data["machines"])
    ax.set_title(f"Measured decode reached a median {share:.0%} of ceiling ÷ bytes "
                 f"({len(points)} points, {n} machine{'s' if n != 1 else ''})", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, out_dir, "rule_of_thumb")


REFERENCE_KEYS = ("hardware", "model", "size_gib", "tok_s", "bandwidth_gb_s", "source")


def load_reference_points(path: Path) -> list[dict]:
    """Published points from a YAML list; each needs every key of REFERENCE_KEYS."""
    doc = load_yaml_file(path, "reference points file")
    points = doc.data.get("points") if isinstance(doc.data, dict) else None
    if not isinstance(points, list):
        raise doc.error(("points",), "expected a mapping with a `points:` list",
                        fix="see data/reference_points.yaml for the format")
    for i, p in enumerate(points):
        missing = [k for k in REFERENCE_KEYS if not isinstance(p, dict) or k not in p]
        if missing:
            raise doc.error(("points", i), f"lacks {', '.join(missing)}",
                            fix="give every point " + ", ".join(REFERENCE_KEYS))
        bad = [k for k in ("size_gib", "tok_s", "bandwidth_gb_s")
               if not isinstance(p[k], (int, float)) or p[k] <= 0]
        if bad:
            raise doc.error(("points", i, bad[0]), "must be a positive number",
                            fix=f"give {bad[0]} as a number, e.g. 6.67")
    return points
