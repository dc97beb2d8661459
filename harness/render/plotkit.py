"""What every plot shares: matplotlib without a display, error bars from the medians' CIs,
axis labelling and saving as PNG and SVG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter, NullLocator  # noqa: E402

from ..core.stats import center  # noqa: E402


def ci_errors(summaries: list[dict]) -> list[list[float]]:
    """Asymmetric error bars: the distance from each median to its 95% CI's ends."""
    lows, highs = [], []
    for s in summaries:
        ci, mid = s.get("median_ci95"), center(s)
        lows.append(mid - ci[0] if ci else 0.0)
        highs.append(ci[1] - mid if ci else 0.0)
    return [lows, highs]


GIB = 2**30


def finish(ax, fig, out_dir: Path, name: str, xlabel: str, ylabel: str, title: str) -> str:
    """Label one-axes plots the same way, then save them."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out_dir, name)


# A plot re-rendered from the same records is the same file: SVG ids come from a fixed salt
# instead of random ones, and no file carries the time it was drawn.
plt.rcParams["svg.hashsalt"] = "harness"
_NO_DATE = {"png": {}, "svg": {"Date": None}}


def save(fig, out_dir: Path, name: str) -> str:
    for ext in ("png", "svg"):
        fig.savefig(out_dir / f"{name}.{ext}", dpi=120, bbox_inches="tight",
                    metadata=_NO_DATE[ext])
    plt.close(fig)
    return f"{name}.png"


def log2_pair(a1, a2, xlabel: str, ylabel1: str, ylabel2: str) -> None:
    """Two side-by-side panels over a doubling x axis (prompt lengths, batch sizes)."""
    for ax, ylabel in ((a1, ylabel1), (a2, ylabel2)):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        plain_log2(ax)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)


def plain_log2(ax) -> None:
    """A doubling x axis labelled 1, 2, 4 … 4,096 rather than 2⁰ … 2¹²."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if x >= 1 else f"{x:g}"))


def doubling_y(ax) -> None:
    """A log y axis with a tick at each doubling (…, 0.5, 1, 2, 4 …), no minor labels."""
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def plain_log_x(ax) -> None:
    """A log x axis labelled 1.2, 1.6, 2 … rather than 1.2×10⁰ (matplotlib's own choice of
    which minor ticks to label, in plain numbers)."""
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(_PlainLogMinor(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


class _PlainLogMinor(LogFormatter):
    """matplotlib's choice of which minor log ticks to label, each as a plain number."""

    def __call__(self, x, pos=None):
        return f"{x:g}" if super().__call__(x, pos) else ""


def plain_log_y(ax) -> None:
    """A log y axis labelled 6, 10, 20 … rather than 6×10⁰."""
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
