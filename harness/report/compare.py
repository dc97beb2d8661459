"""Compare runs with the run's statistical model (harness.core.stats): the same
measurements side by side, and the same contrasts side by side. Two runs share no round, so
each comparison is unpaired: a ratio of two runs' figures with an interval combining their
intervals on the log scale (drift included), a difference beyond the noise when that interval
excludes 1."""

from __future__ import annotations

from ..core.records import Measurement
from ..core.stats import center, log_half_width, unpaired

ENV_KEYS = ("cpu_model", "physical_cores", "ram_total_bytes", "os")


def beyond_noise(ratio: dict | None) -> bool | None:
    """Whether a ratio's 95% interval excludes 1 (None without an interval)."""
    ci = (ratio or {}).get("median_ci95")
    if not ci:
        return None
    return ci[0] > 1 or ci[1] < 1


def contrast_rows(runs: list[tuple[str, object]], analyses: list[dict]) -> list[dict]:
    """Every contrast of the first run that another run also has: each run's ratio with its
    interval, and the other's ÷ the first's."""
    def keyed(a: dict) -> dict:
        return {(c["numerator"], c["denominator"], c["metric"]): c
                for c in a["contrasts"]}

    base = keyed(analyses[0])
    others = [keyed(a) for a in analyses[1:]]
    rows = []
    for key, c in base.items():
        row = {"name": c["name"], "metric": c["metric"], runs[0][0]: _as_summary(c),
               "others": []}
        for (name, _), theirs in zip(runs[1:], others, strict=True):
            o = theirs.get(key)
            ratio = unpaired(_as_summary(o), _as_summary(c)) if o else None
            row["others"].append({"run": name, "summary": _as_summary(o), "ratio": ratio,
                                  "exceeds_noise": bool(beyond_noise(ratio))})
        rows.append(row)
    return rows


def _as_summary(c: dict | None) -> dict | None:
    """A contrast of the JSON shape as a summary (median, interval)."""
    if not c:
        return None
    return {"n": c.get("n", 1), "median": c["ratio"], "median_ci95": c.get("ci95")}


def other_context(m: Measurement, rec) -> str | None:
    """Where another run measured the same cell at another context (or before contexts were
    recorded): never paired, but named so the reader knows why it is missing."""
    bare = m.cell.without_context()
    for x in rec.measurements:
        if x.id != m.id and x.cell.without_context() == bare:
            return f"n_ctx {x.n_ctx}" if x.n_ctx is not None else "n_ctx not recorded"
    return None


def compare_runs(runs: list[tuple[str, object]], analyses: list[dict] | None = None) -> dict:
    """runs: (name, Records). Rows per measurement id and metric present in the first run,
    and per contrast of the first run (analyses: each run's, when given)."""
    base_name, base = runs[0]
    rows = []
    for m in base.measurements:
        for metric in ("prefill_tok_s", "decode_tok_s"):
            a = getattr(m, metric)
            if not a:
                continue
            row = {"id": m.id, "metric": metric, base_name: a, "others": []}
            for name, rec in runs[1:]:
                other = next((x for x in rec.measurements if x.id == m.id), None)
                b = getattr(other, metric) if other else None
                if not b:
                    row["others"].append({"run": name, "summary": None,
                                          "other_context": other_context(m, rec)})
                    continue
                ratio = unpaired(b, a)
                row["others"].append({"run": name, "summary": b, "ratio": ratio,
                                      "exceeds_noise": bool(beyond_noise(ratio))})
            rows.append(row)
    env_diff = {}
    for key in ENV_KEYS + ("llama",):
        values = [str(((rec.header.env if rec.header else None) or {}).get(key))
                  for _, rec in runs]
        if len(set(values)) > 1:
            env_diff[key] = values
    return {"runs": [n for n, _ in runs], "rows": rows, "env_differences": env_diff,
            "contrasts": contrast_rows(runs, analyses) if analyses else []}


def render_compare_markdown(c: dict) -> str:
    base = c["runs"][0]
    head = ["measurement", "metric", base]
    for name in c["runs"][1:]:
        head += [name, f"ratio {name} / {base}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in c["rows"]:
        shown = r["id"].replace("|", " ")  # a bare | would split the table cell
        cells = [f"`{shown}`", r["metric"].replace("_tok_s", " tok/s"), _stat(r[base])]
        for o in r["others"]:
            if o["summary"] is None and o.get("other_context"):
                cells += [f"only at {o['other_context']}", "not compared"]
            elif o["summary"] is None:
                cells += ["missing", "–"]
            else:
                cells += [_stat(o["summary"]), _ratio(o)]
        lines.append("| " + " | ".join(cells) + " |")
    out = ["# Run comparison", "", *lines, "",
           "Figures are medians with the 95% interval of their long-run median (drift "
           "included). Two runs share no round, so a ratio between runs is unpaired: its "
           "interval combines the two intervals on the log scale, and a difference exceeds "
           "the noise when that interval excludes 1. Cells are compared only at the same "
           "context size (n_ctx, part of every measurement's id): the context alone changes "
           "prefill speed.", ""]
    out += _contrast_lines(c)
    if c["env_differences"]:
        out += ["## The runs come from different environments", ""]
        out += [f"- {k}: " + " vs ".join(v) for k, v in c["env_differences"].items()]
    else:
        out.append("All runs come from the same machine and versions.")
    return "\n".join(out) + "\n"


def _contrast_lines(c: dict) -> list[str]:
    """The contrasts both runs drew, side by side: what a lesson compares, drift cancelled
    within each run."""
    if not c.get("contrasts"):
        return []
    base = c["runs"][0]
    head = ["contrast", base]
    for name in c["runs"][1:]:
        head += [name, f"ratio {name} / {base}"]
    lines = ["## Contrasts", "", "| " + " | ".join(head) + " |",
             "|---|" + "---:|" * (len(head) - 1)]
    for r in c["contrasts"]:
        cells = [r["name"].replace("|", " "), _stat(r[base], 3)]
        for o in r["others"]:
            cells += (["missing", "–"] if o["summary"] is None else
                      [_stat(o["summary"], 3), _ratio(o)])
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", "Each contrast is a ratio of two cells of one run, round by round "
                    "(harness.core.stats); between runs the contrasts are compared unpaired.",
                    ""]


def _ratio(o: dict) -> str:
    r = o["ratio"]
    if not r:
        return "–"
    ci = r.get("median_ci95")
    mark = (" **(exceeds noise)**" if o["exceeds_noise"] else
            " (within noise)" if ci else " (no interval)")
    return f"{r['ratio']:.3f}×" + (f" [{ci[0]:.3f}–{ci[1]:.3f}]" if ci else "") + mark


def _stat(s: dict, digits: int = 2) -> str:
    mid, half = center(s), log_half_width(s)
    if half is None:
        return f"{mid:.{digits}f} (n={s['n']})"
    return f"{mid:.{digits}f} (±{half:.1%}, n={s['n']})"
