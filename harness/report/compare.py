"""Compare runs: the same measurements side by side, with ratios and a noise test."""

from __future__ import annotations

import re

from scipy.stats import ttest_ind_from_stats

ENV_KEYS = ("cpu_model", "physical_cores", "ram_total_bytes", "os")


def welch_significant(a: dict, b: dict) -> bool | None:
    """Welch's t-test at 95% on two summaries (mean, stdev, n), by scipy; None when it cannot
    tell."""
    if a.get("n", 0) < 2 or b.get("n", 0) < 2:
        return None
    if a["stdev"] == 0 and b["stdev"] == 0:
        return a["mean"] != b["mean"]
    result = ttest_ind_from_stats(a["mean"], a["stdev"], a["n"], b["mean"], b["stdev"], b["n"],
                                  equal_var=False)
    return bool(result.pvalue < 0.05)


def ci_overlap(a: dict, b: dict) -> bool | None:
    if not a.get("ci95") or not b.get("ci95"):
        return None
    return a["ci95"][0] <= b["ci95"][1] and b["ci95"][0] <= a["ci95"][1]


_CTX = re.compile(r"\|ctx(\d+)(?=\|)")


def other_context(m_id: str, rec) -> str | None:
    """Where another run measured the same cell at another context (or before contexts were
    recorded): never paired, but named so the reader knows why it is missing."""
    bare = _CTX.sub("", m_id)
    for x in rec.measurements:
        if x["id"] != m_id and _CTX.sub("", x["id"]) == bare:
            found = _CTX.search(x["id"])
            return f"n_ctx {found.group(1)}" if found else "n_ctx not recorded"
    return None


def compare_runs(runs: list[tuple[str, object]]) -> dict:
    """runs: (name, Records). Rows per measurement id and metric present in the first run."""
    base_name, base = runs[0]
    rows = []
    for m in base.measurements:
        for metric in ("prefill_tok_s", "decode_tok_s"):
            a = m.get(metric)
            if not a:
                continue
            row = {"id": m["id"], "metric": metric, base_name: a, "others": []}
            for name, rec in runs[1:]:
                other = next((x for x in rec.measurements if x["id"] == m["id"]), None)
                b = (other or {}).get(metric)
                if not b:
                    row["others"].append({"run": name, "summary": None,
                                          "other_context": other_context(m["id"], rec)})
                    continue
                significant = welch_significant(a, b)
                overlap = ci_overlap(a, b)
                row["others"].append({"run": name, "summary": b, "ratio": b["mean"] / a["mean"],
                                      "exceeds_noise": bool(significant) or overlap is False})
            rows.append(row)
    env_diff = {}
    for key in ENV_KEYS + ("llama",):
        values = [str((rec.header or {}).get("env", {}).get(key)) for _, rec in runs]
        if len(set(values)) > 1:
            env_diff[key] = values
    return {"runs": [n for n, _ in runs], "rows": rows, "env_differences": env_diff}


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
                mark = " **(exceeds noise)**" if o["exceeds_noise"] else " (within noise)"
                cells += [_stat(o["summary"]), f"{o['ratio']:.2f}×{mark}"]
        lines.append("| " + " | ".join(cells) + " |")
    out = ["# Run comparison", "", *lines, "",
           "A difference exceeds the noise when the 95% confidence intervals do not overlap or "
           "Welch's t-test rejects equal means at 95%. Cells are compared only at the same "
           "context size (n_ctx, part of every measurement's id): the context alone changes "
           "prefill speed.", ""]
    if c["env_differences"]:
        out += ["## The runs come from different environments", ""]
        out += [f"- {k}: " + " vs ".join(v) for k, v in c["env_differences"].items()]
    else:
        out.append("All runs come from the same machine and versions.")
    return "\n".join(out) + "\n"


def _stat(s: dict) -> str:
    ci = s.get("ci95")
    return f"{s['mean']:.2f} ± {(ci[1] - ci[0]) / 2:.2f} (n={s['n']})" if ci else \
        f"{s['mean']:.2f} (n={s['n']})"
