"""Serving metrics, with the definitions the serving benchmarks use (vLLM's benchmark_serving,
GuideLLM, NVIDIA AIPerf; docs/serving.md cites them): each from one request's record of when
its chunks arrived and how many tokens the server says it produced."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass(frozen=True)
class RequestTiming:
    """When one request was sent and its content chunks arrived (seconds, one clock), with the
    tokens each chunk carried (None where the server did not say) and its token counts."""

    sent_s: float
    chunk_s: tuple[float, ...]
    chunk_tokens: tuple[int | None, ...]
    end_s: float
    output_tokens: int
    prompt_tokens: int
    server_prompt_s: float | None = None  # the server's own prompt time (llama-server timings)
    started_s: float | None = None  # its first prompt-progress event arrived: a slot began it

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: sending to the first chunk with content."""
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def wait_s(self) -> float | None:
        """Sending to the server's first prompt-progress event: the wait for a slot and for
        the server's current step, and HTTP both ways (None where the server sent none)."""
        return None if self.started_s is None else self.started_s - self.sent_s

    @property
    def ttft_after_prompt_s(self) -> float | None:
        """What TTFT holds beyond the wait and the server's prompt time (llama-server's ends when
        the first token is sampled): sending that token back, less the progress event's trip."""
        if self.ttft_s is None or self.wait_s is None or self.server_prompt_s is None:
            return None
        return self.ttft_s - self.wait_s - self.server_prompt_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last chunk − first chunk) ÷ (output tokens −
        1), vLLM's (latency − TTFT) ÷ (output tokens − 1) with latency to the last chunk."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def chunk_gaps_s(self) -> list[float]:
        """Gaps between consecutive content chunks, as they arrived."""
        return np.diff(self.chunk_s).tolist()

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latency: each chunk gap divided by the tokens its later chunk carried
        (one where the server did not say)."""
        pairs = zip(self.chunk_gaps_s, self.chunk_tokens[1:], strict=True)
        return [gap / k for gap, n in pairs for k in [max(n or 1, 1)] for _ in range(k)]


def distribution(values: list[float]) -> dict | None:
    """n, mean and the percentiles (numpy's linear interpolation, as vLLM reports them)."""
    if not values:
        return None
    arr = np.asarray(values, dtype=float)
    out = {"n": int(arr.size), "mean": float(arr.mean())}
    out |= {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    return out


def meets_slo(t: RequestTiming, slo: dict[str, float]) -> bool:
    """Every SLO the scenario names holds for this request (DistServe's goodput criterion)."""
    got = {"ttft_ms": t.ttft_s, "tpot_ms": t.tpot_s, "e2e_ms": t.e2e_s}
    return all(got[k] is not None and got[k] * 1000 <= limit for k, limit in slo.items())


def waited_on_a_prompt(timings: list[RequestTiming]) -> list[bool]:
    """Whether another request's first token arrived while each request waited for its own
    prompt to begin: the server ran that one's prompt step first."""
    firsts = [t.chunk_s[0] for t in timings if t.chunk_s]
    return [t.started_s is not None and any(t.sent_s <= f <= t.started_s for f in firsts)
            for t in timings]


def level_summary(timings: list[RequestTiming], n_failed: int, wall_s: float,
                  slo: dict[str, float] | None = None) -> dict:
    """One load level: latency distributions, throughput over its wall time, and goodput."""
    done = [t for t in timings if t.ttft_s is not None]
    behind = [(t, d) for t, d in zip(done, waited_on_a_prompt(done), strict=True)
              if t.wait_s is not None]
    out_tokens = sum(t.output_tokens for t in done)
    summary = {
        "n_ok": len(done), "n_failed": n_failed, "wall_s": wall_s,
        "ttft_s": distribution([t.ttft_s for t in done]),
        "tpot_s": distribution([t.tpot_s for t in done if t.tpot_s is not None]),
        "itl_s": distribution([x for t in done for x in t.itl_s]),
        "chunk_gap_s": distribution([x for t in done for x in t.chunk_gaps_s]),
        "e2e_s": distribution([t.e2e_s for t in done]),
        "server_prompt_s": distribution([t.server_prompt_s for t in done
                                         if t.server_prompt_s is not None]),
        "ttft_outside_prompt_s": distribution([t.ttft_s - t.server_prompt_s for t in done
                                               if t.server_prompt_s is not None]),
        "wait_s": distribution([t.wait_s for t in done if t.wait_s is not None]),
        "wait_on_prompt_s": distribution([t.wait_s for t, d in behind if d]),
        "wait_otherwise_s": distribution([t.wait_s for t, d in behind if not d]),
        "ttft_after_prompt_s": distribution([t.ttft_after_prompt_s for t in done
                                             if t.ttft_after_prompt_s is not None]),
        "request_s": len(done) / wall_s if wall_s > 0 else None,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else None,
        "input_tok_s": sum(t.prompt_tokens for t in done) / wall_s if wall_s > 0 else None,
    }
    if slo:
        good = sum(meets_slo(t, slo) for t in done)
        summary |= {"slo": dict(slo), "n_good": good,
                    "goodput_request_s": good / wall_s if wall_s > 0 else None}
    return summary


def steady_decode(timings: list[RequestTiming], concurrency: int) -> dict | None:
    """Aggregate decode over the steady window: the spans where `concurrency` requests were
    all between their first and last token (ramp-up, a request's own prefill and the drain
    left out); tokens after each request's first that arrived inside those spans ÷ their
    length. None where the spans hold fewer than two such tokens."""
    edges = sorted([(t.chunk_s[0], 1) for t in timings if len(t.chunk_s) > 1] +
                   [(t.chunk_s[-1], -1) for t in timings if len(t.chunk_s) > 1])
    if not edges:
        return None
    spans, active = [], 0
    for (at, step), nxt in zip(edges, [*edges[1:], None], strict=True):
        active += step
        if active >= concurrency and nxt is not None and nxt[0] > at:
            spans.append((at, nxt[0]))
    arrivals = [(at, n or 1) for t in timings for at, n in
                zip(t.chunk_s[1:], t.chunk_tokens[1:], strict=True)]
    n_tokens = sum(n for at, n in arrivals if any(a < at <= b for a, b in spans))
    window_s = sum(b - a for a, b in spans)
    if n_tokens < 2 or window_s <= 0:
        return None
    return {"tok_s": n_tokens / window_s, "window_s": window_s, "n_tokens": n_tokens}
