#!/usr/bin/env python3
"""Render a report page as a course page would show it (a GitHub-like 860 px column) in
headless Chromium: a screenshot, every table whose width exceeds the column, and every
first-column cell whose first word (a model's name) is split over lines.

Needs Debian's `chromium` and the `markdown` package (`pip install markdown`); a tool for
looking at a page before committing it, not part of the harness.

    python scripts/render_page.py reports/lesson/report.md --out /tmp/lesson.png
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

COLUMN_PX = 860
CSS_TEMPLATE = """
body { font: 16px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0;
       padding: 16px; width: {width}px; box-sizing: border-box; color: #1f2328; }
table { border-collapse: collapse; display: block; width: max-content; max-width: 100%;
        overflow: auto; margin: 0 0 16px; }
th, td { border: 1px solid #d1d9e0; padding: 6px 13px; }
img { max-width: 100%; }
code { font-size: 85%; background: #eff1f3; padding: .2em .4em; border-radius: 6px; }
"""
CSS = CSS_TEMPLATE.replace("{width}", str(COLUMN_PX))
PROBE = """<script>
window.addEventListener('load', () => {
  const out = [];
  document.querySelectorAll('table').forEach((t, i) => {
    const head = t.querySelector('tr') ? t.querySelector('tr').innerText.slice(0, 60) : '';
    out.push(`${i}\\t${t.scrollWidth}\\t${t.clientWidth}\\t${head.replace(/\\s+/g, ' ')}`);
    t.querySelectorAll('tr > td:first-child').forEach(td => {
      // the cell's first word only (a model's name): a break at a space is fine
      const node = td.firstChild; if (!node || node.nodeType !== 3) return;
      const end = node.textContent.search(/\\s|$/);
      const r = document.createRange(); r.setStart(node, 0); r.setEnd(node, end);
      const lines = new Set([...r.getClientRects()].map(x => Math.round(x.top)));
      if (lines.size > 1) out.push(`${i}\\twrap\\t${td.innerText.replace(/\\s+/g, ' ')}`);
    });
  });
  const pre = document.createElement('pre'); pre.id = 'widths';
  pre.textContent = out.join('\\n'); document.body.appendChild(pre);
});
</script>"""


def html_of(markdown_file: Path) -> str:
    import markdown

    body = markdown.markdown(markdown_file.read_text(), extensions=["tables", "fenced_code"])
    return (f"<!doctype html><html><head><meta charset='utf-8'><style>{CSS}</style></head>"
            f"<body>{body}{PROBE}</body></html>")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path)
    ap.add_argument("--out", type=Path, default=Path("/tmp/page.png"))
    ap.add_argument("--height", type=int, default=12000)
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    page = args.page.resolve().parent / f".{args.page.stem}.render.html"
    page.write_text(html_of(args.page))  # beside the page, so its plots load
    try:
        flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
                 "--hide-scrollbars", f"--window-size={COLUMN_PX},{args.height}"]
        with tempfile.TemporaryDirectory() as profile:
            flags.append(f"--user-data-dir={profile}")
            dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True,
                                 text=True, timeout=120).stdout
            subprocess.run([*flags, f"--screenshot={args.out}", page.as_uri()],
                           capture_output=True, timeout=120, check=True)
    finally:
        page.unlink(missing_ok=True)
    found = re.search(r'<pre id="widths">(.*?)</pre>', dom, re.S)
    wide = wrapped = 0
    for line in (found.group(1) if found else "").splitlines():
        i, scroll, client, *head = line.split("\t", 3)
        if scroll == "wrap":
            wrapped += 1
            print(f"table {i}: its first column splits the first word of {client!r}")
        elif int(scroll) > int(client) + 1:
            wide += 1
            print(f"table {i} is {scroll} px wide in a {client} px column: {head[0]}")
    print(f"{args.out}: {'no table wider than the column' if not wide else f'{wide} too wide'}"
          f", {wrapped} first words of first-column cells split")
    return 1 if wide or wrapped else 0


if __name__ == "__main__":
    sys.exit(main())
