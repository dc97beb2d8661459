"""One measurement: warm up, then time every repetition of its kind of work.

Kinds: single (prompt then decode, optionally at a context depth filled untimed), batched
(B sequences decoded together, one token each per llama_decode) and prefix_cache (time to
first token with a shared prefix recomputed, shared by a sequence copy, or restored from a
saved state).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Generator
from dataclasses import asdict

import numpy as np

from ..core.errors import MeasurementError
from ..core.stats import windows
from . import noise
from .records import summarized
from .scenario import Measurement

FIRST_TOKEN = 259  # skip <unk>, <s>, </s> and the byte tokens: random "text" ids only
REUSE_METHODS = ("seq_copy", "state_restore")
# A warm-up runs the prompt and at most this many decode steps: each step reads every weight,
# so one already touches the pages, builds the graph and wakes the threads; more only spend
# the run's budget (a depth cell's warm-up stays whole, its baseline beside it).
WARMUP_STEPS = 16


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def context_params(m: Measurement):
    """The context of a cell: n_ctx cells per sequence (Measurement.n_ctx), a unified cache
    for a prefix test (seq 1 shares seq 0's prefix cells), one share per sequence otherwise
    (a depth test's seq 1 runs the same work from empty, paired in every repetition)."""
    from .llama import ContextParams

    s = m.settings
    return ContextParams(n_ctx=m.n_ctx_total, n_seq_max=m.n_seq_max,
                         kv_unified=m.kind == "prefix_cache", n_batch=s.n_batch,
                         n_ubatch=s.n_ubatch, n_threads=s.threads, flash_attn=s.flash_attn,
                         type_k=m.kv_type, type_v=m.kv_type)


class Cell:
    """One measurement's context, alive across the rounds of a run: set up and warmed up once
    (every new context gets its untimed warm-up), then one timed repetition per round."""

    def __init__(self, model, m: Measurement, seed: int, pages=None) -> None:
        from .llama import Context

        self.m, self.pages = m, pages
        self.started = now_iso()
        self.ctx = Context(model, context_params(m))
        _check_context_made(self.ctx, m)
        rng = np.random.default_rng([seed, m.n_prompt, m.n_gen, m.depth, m.parallel,
                                     m.shared_prefix])
        try:
            self.setup, self._repetition = WORKLOADS[m.kind](self.ctx, m, rng)
            self.setup["flash_attn_used"] = self.ctx.flash_attn_used
            # llama.cpp clamps n_batch and n_ubatch to the context: what the prompt ran in
            self.setup |= {"n_batch_used": self.ctx.n_batch, "n_ubatch_used": self.ctx.n_ubatch}
            self.warmups = [_exhaust(self._repetition(0, WARMUP_STEPS))
                            for _ in range(m.settings.warmup)]
        except MeasurementError as exc:
            self.close()
            raise _named(exc, m) from None

    @property
    def steps_apart(self) -> bool:
        """Whether its decode steps can join a step rotation: a single sequence from an empty
        cache, or a batch; a depth cell's decode is paired with its own baseline inside the
        repetition, and a prefix test has no decode."""
        return bool(self.m.n_gen) and (self.m.kind == "batched"
                                       or (self.m.kind == "single" and not self.m.depth))

    def run(self, round_index: int, position: int) -> dict:
        """One timed repetition, whole."""
        return _exhaust(self.steps(round_index, position, "round"))

    def steps(self, round_index: int, position: int, interleave: str
              ) -> Generator[None, None, dict]:
        """One timed repetition as a generator: it yields once its prompt is in (the cell is
        ready to decode) and after each decode step, so a round can run several cells' steps in
        turn, and returns the repetition; a decode is bracketed by reads of the model's own
        pages."""
        from .llama import check_abort

        check_abort()
        reads = []
        before = noise.snapshot()
        try:
            if self.pages is not None and self.m.n_gen:
                reads.append(self.pages.read(self.m.settings.threads))
            rep = yield from self._repetition(round_index)
            if self.pages is not None and self.m.n_gen:
                reads.append(self.pages.read(self.m.settings.threads))
        except MeasurementError as exc:
            raise _named(exc, self.m) from None
        return rep | {"round": round_index, "position": position, "read_gb_s": reads or None,
                      "during_other_cores": noise.other_cores(before, noise.snapshot()),
                      "interleave": interleave if self.steps_apart else "round"}

    def close(self) -> None:
        self.ctx.close()


def _exhaust(steps: Generator):
    """Run a repetition's generator to its end: its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def round_series(m: Measurement, reps: list, phase: str | None = None
                 ) -> dict[int, float]:
    """A cell's tok/s of one phase (the one it is judged on by default) keyed by round."""
    phase = phase or m.phase
    if phase == "decode":
        n = m.parallel * m.n_gen
        return {r.round: n / sum(r.rep["decode_s"]) for r in reps
                if r.rep["decode_s"] and sum(r.rep["decode_s"]) > 0}
    n = m.parallel * (m.shared_prefix + m.n_prompt)
    return {r.round: n / r.rep["prefill_s"] for r in reps if r.rep["prefill_s"]}


def window_series(m: Measurement, reps: list, phase: str | None = None
                  ) -> dict[tuple[int, int], float]:
    """A cell's decode tok/s per window of adjacent steps, keyed by (round, window), in the
    repetitions whose steps ran in turn with other cells' (empty for prefill)."""
    if (phase or m.phase) != "decode":
        return {}
    return {(r.round, w): x for r in reps if r.rep.get("interleave") == "step"
            for w, x in enumerate(windows(r.rep["decode_s"], m.parallel))}


def _check_context_made(ctx, m: Measurement) -> None:
    """The context must be the one the measurement's id names, or its numbers would be
    filed under a context they were not measured in."""
    per_seq = ctx.n_ctx_seq
    if per_seq is None:  # a llama.cpp without llama_n_ctx_seq: the share it would give
        per_seq = ctx.n_ctx if m.kind == "prefix_cache" else ctx.n_ctx // m.n_seq_max
    if (ctx.n_ctx, per_seq) != (m.n_ctx_total, m.n_ctx):
        ctx.close()
        raise _named(MeasurementError(
            f"llama.cpp made a context of {ctx.n_ctx} cells ({per_seq} per sequence), not the "
            f"planned {m.n_ctx_total} ({m.n_ctx} per sequence)", source=str(ctx.model.path),
            fix="this llama.cpp sizes contexts otherwise: pin the llama-cpp-python of "
                "constraints.txt"), m)


def _named(exc: MeasurementError, m: Measurement) -> MeasurementError:
    exc.step = f"{exc.step} in {m.id}" if exc.step != "run" else f"measure {m.id}"
    return exc


def _tokens(rng, n_vocab: int, shape) -> list:
    return rng.integers(FIRST_TOKEN, n_vocab, shape).tolist()


def _expect_cached(ctx, seq: int, n: int, when: str) -> None:
    """The cache must hold exactly what the measurement put there, or its numbers are wrong."""
    got = ctx.n_cached(seq)
    if got != n:
        raise MeasurementError(f"sequence {seq} holds {got} cached positions {when}, "
                               f"expected {n}", source=str(ctx.model.path))


def _single(ctx, m: Measurement, rng):
    """Prompt then decode on one sequence, after `depth` tokens filled once, untimed."""
    prompt, gen = _tokens(rng, ctx.n_vocab, m.n_prompt), _tokens(rng, ctx.n_vocab, m.n_gen)
    setup = {}
    if m.depth:
        setup["depth_fill_s"] = ctx.prefill(_tokens(rng, ctx.n_vocab, m.depth))

    def repetition(round_index: int, n_steps: int | None = None
                   ) -> Generator[None, None, dict]:
        out = {}
        baseline_first = round_index % 2 == 0  # ABBA: the pair's order alternates by round
        if m.depth and baseline_first:
            out["baseline_decode_s"] = _baseline(ctx, m, prompt, gen)
        if m.depth:
            ctx.trim(0, m.depth)  # back to exactly the filled depth
            _expect_cached(ctx, 0, m.depth, "after trimming to the depth")
            ctx.reset_perf()
        else:
            ctx.clear()  # no KV reuse between repetitions: every prefill starts from empty
        prefill_s = ctx.prefill(prompt) if prompt else None
        decode_s = []
        if gen and not m.depth:  # a depth cell's decode stays beside its baseline, whole
            yield
            for token in gen[:n_steps]:
                decode_s += ctx.decode([token])
                yield
        elif gen:
            decode_s = ctx.decode(gen)
        perf = asdict(ctx.perf())
        n_cached = m.depth + m.n_prompt + len(decode_s)
        _expect_cached(ctx, 0, n_cached, "after the repetition")
        if m.depth and not baseline_first:
            out["baseline_decode_s"] = _baseline(ctx, m, prompt, gen)
        return out | {"prefill_s": prefill_s, "decode_s": decode_s, "perf": perf,
                      "n_cached": n_cached}

    return setup, repetition


def _baseline(ctx, m: Measurement, prompt: list, gen: list) -> list[float]:
    """The same prompt and decode from an empty sequence (seq 1) in the same context, beside
    the timed work at depth (before it in even rounds, after it in odd ones): the pair's ratio
    is the slowdown, free of drift."""
    ctx.trim(1, 0)
    if prompt:
        ctx.prefill_seqs([prompt], first_seq=1)
    steps = ctx.decode_parallel([[t] for t in gen], m.n_prompt, first_seq=1) if gen else []
    _expect_cached(ctx, 1, m.n_prompt + m.n_gen, "after the depth-0 baseline")
    return steps


def _batched(ctx, m: Measurement, rng):
    """B sequences: their prompts packed into batches, then n_gen steps of B tokens each."""
    prompts = [_tokens(rng, ctx.n_vocab, m.n_prompt) for _ in range(m.parallel)]
    steps = _tokens(rng, ctx.n_vocab, (m.n_gen, m.parallel))

    def repetition(round_index: int, n_steps: int | None = None
                   ) -> Generator[None, None, dict]:
        ctx.clear()
        prefill_s = ctx.prefill_seqs(prompts) if m.n_prompt else None
        decode_s = []
        yield
        for k, step in enumerate(steps[:n_steps]):
            decode_s += ctx.decode_parallel([step], m.n_prompt + k)
            yield
        for seq in (0, m.parallel - 1):
            _expect_cached(ctx, seq, m.n_prompt + len(decode_s), "after the batched decode")
        return {"prefill_s": prefill_s, "decode_s": decode_s, "perf": asdict(ctx.perf())}

    return {}, repetition


def _prefix_cache(ctx, m: Measurement, rng):
    """Time to first token of prefix + question: recomputed, shared by a sequence copy in a
    unified cache (no data moves), and restored from a saved sequence state (a copy in)."""
    prefix = _tokens(rng, ctx.n_vocab, m.shared_prefix)
    question = _tokens(rng, ctx.n_vocab, m.n_prompt)
    ctx.clear()
    ctx.prefill(prefix)
    state = ctx.save_seq(0)
    n_prefix = m.shared_prefix

    def repetition(round_index: int, n_steps: int | None = None
                   ) -> Generator[None, None, dict]:
        ctx.clear()
        recompute_s = ctx.prefill(prefix + question)
        ctx.trim(0, n_prefix)
        start = time.perf_counter_ns()
        ctx.copy_seq(0, 1)
        ctx.prefill_seqs([question], first_seq=1, first_pos=n_prefix)
        seq_copy_s = (time.perf_counter_ns() - start) / 1e9
        _expect_cached(ctx, 1, n_prefix + m.n_prompt, "after the sequence copy")
        ctx.clear()
        start = time.perf_counter_ns()
        ctx.restore_seq(state, 0)
        ctx.prefill(question)
        restore_s = (time.perf_counter_ns() - start) / 1e9
        _expect_cached(ctx, 0, n_prefix + m.n_prompt, "after the state restore")
        yield from ()  # a generator like the others, with no step to share
        return {"prefill_s": recompute_s, "decode_s": [], "perf": asdict(ctx.perf()),
                "reuse_s": {"seq_copy": seq_copy_s, "state_restore": restore_s}}

    return {"state_n_bytes": len(state)}, repetition


WORKLOADS = {"single": _single, "batched": _batched, "prefix_cache": _prefix_cache}


def make_record(m: Measurement, info: dict, warmups: list[dict], reps: list[dict],
                setup: dict | None, noise_reading: dict, started: str,
                run: dict | None = None) -> dict:
    """The measurement record of a cell: every repetition's raw samples in round order, and
    their summaries; run: how its rounds went (policy, why it stopped, its span of records)."""
    s = m.settings
    reps = sorted(reps, key=lambda r: (r.get("round", 0), r.get("position", 0)))
    record = {
        "type": "measurement", "id": m.id, "test": m.test_name, "model": m.model.label,
        "model_key": m.model.key, "dtype": m.model.dtype,
        "threads": s.threads, "n_batch": s.n_batch, "n_ubatch": s.n_ubatch,
        "n_ctx": m.n_ctx, "n_ctx_total": m.n_ctx_total, "n_seq_max": m.n_seq_max,
        "flash_attn": s.flash_attn, "flash_attn_used": (setup or {}).get("flash_attn_used"),
        "n_prompt": m.n_prompt, "n_gen": m.n_gen, "kind": m.kind,
        "depth": m.depth, "kv_type": m.kv_type, "parallel": m.parallel,
        "shared_prefix": m.shared_prefix, "repetitions": len(reps), "warmup": s.warmup,
        "n_params": info.n_params, "model_bytes": info.model_n_bytes,
        "setup": setup,
        "samples": {"prefill_s": [r["prefill_s"] for r in reps if r["prefill_s"] is not None],
                    "decode_s": [r["decode_s"] for r in reps],
                    "perf": [r["perf"] for r in reps],
                    "n_cached": [r.get("n_cached") for r in reps],
                    "rounds": [r.get("round") for r in reps],
                    "positions": [r.get("position") for r in reps],
                    "read_gb_s": [r.get("read_gb_s") for r in reps],
                    "interleave": [r.get("interleave", "round") for r in reps]},
        "warmup_samples": {"prefill_s": [r["prefill_s"] for r in warmups],
                           "decode_s": [r["decode_s"] for r in warmups]},
        "noise": noise_reading, "started": started, "finished": now_iso(),
        "interleave": "step" if any(r.get("interleave") == "step" for r in reps) else "round",
    } | (run or {})
    if m.depth:
        record["samples"]["baseline_decode_s"] = [r["baseline_decode_s"] for r in reps]
        record["warmup_samples"]["baseline_decode_s"] = [r["baseline_decode_s"]
                                                         for r in warmups]
    if m.kind == "prefix_cache":
        record["samples"]["reuse_s"] = {k: [r["reuse_s"][k] for r in reps]
                                        for k in REUSE_METHODS}
        record["warmup_samples"]["reuse_s"] = {k: [r["reuse_s"][k] for r in warmups]
                                               for k in REUSE_METHODS}
    return summarized(record)


