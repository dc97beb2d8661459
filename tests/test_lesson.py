"""The lesson page and the reference block: claims decided by data, prose true of the run."""

import re

import pytest
from conftest import measurement_record
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.core.records import typed
from harness.core.reference import CLAIM_TESTS
from harness.levers.batching import _batching_note
from harness.levers.threads import _knee_note
from harness.report.findings import findings
from harness.study.claims import check_claims

DRIFT = [1.0, 0.8, 1.1, 0.95, 1.2, 0.9, 1.05, 0.85, 1.0]  # the machine's, shared
NOISE = [0.01, -0.01, 0.005, -0.005, 0.0, 0.01, -0.01, 0.005, -0.005]  # each cell's own


def _ratio(x, half=0.02):
    return {"n": 9, "ratio": x, "median": x, "median_ci95": [x * (1 - half), x * (1 + half)]}


def _decode(model, n_bytes, tok_s, threads=2, copy=40.0, dtype="f32"):
    rounds = [[[0, r], tok_s * d * (1 + NOISE[(r + ord(model[0])) % 9])]
              for r, d in enumerate(DRIFT)]
    return {"id": model, "model": model, "dtype": dtype, "threads": threads, "n_prompt": 16,
            "n_gen": 64, "bytes_per_token": n_bytes, "file_bytes_per_token": n_bytes,
            "tok_s": _ratio(tok_s, 0.1), "effective_gb_s": tok_s * n_bytes / 1e9,
            "copy_ceiling": {"value": copy, "spread": 0.01}, "share_of_stream": 0.9,
            "flags": [], "round_rates": rounds}


def _prefill(model, n_prompt, tok_s, threads=2, dtype="f32"):
    return {"id": f"{model}{n_prompt}", "model": model, "dtype": dtype, "threads": threads,
            "n_prompt": n_prompt, "n_gen": 0, "tok_s": _ratio(tok_s, 0.05),
            "seconds": n_prompt / tok_s}


def _analysis(**extra):
    from harness.analysis.phases import fit_verdicts
    from harness.study.analyze import analyze

    # an analysis of nothing has every key (each empty), as every computed analysis has
    a = analyze([], {}, []) | {
        "decode": [_decode("a", 2e9, 15.0), _decode("b", 4e9, 7.4), _decode("c", 6e9, 5.1)],
        "prefill": [_prefill("a", 128, 180.0), _prefill("a", 4096, 150.0)]}
    a = a | extra
    return a | {"fits": fit_verdicts(a["decode"])}


def _claim(test, **params):
    defaults = {k: v for k, (_, v) in CLAIM_TESTS[test][0].items()}
    return {"claim": test, "test": test, "published": ""} | defaults | params


ENV = {"physical_cores": 2, "llama": {"system_info": "AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1"}}


def test_decode_follows_bytes_holds_within_tolerance_and_not_outside():
    ok = check_claims({"claims": [_claim("decode_follows_bytes")]}, _analysis(), ENV)[0]
    assert ok["verdict"] == "holds"
    assert "b ÷ a: 0.49× [0.49×–0.50×] the speed for 2.00× the bytes" in ok["measured"]
    # every pair is tested, not only neighbours: a → c is among them
    assert [c["what"] for c in ok["contrasts"]] == ["b ÷ a", "c ÷ a", "c ÷ b"]
    flat = _analysis(decode=[_decode("a", 2e9, 15.0), _decode("b", 4e9, 12.0)])
    bad = check_claims({"claims": [_claim("decode_follows_bytes")]}, flat, ENV)[0]
    assert bad["verdict"] == "does not hold" and "largest miss 60%" in bad["why"]
    # b at 1.195x its predicted speed: the point is inside ±20%, its interval is not
    edge = _analysis(decode=[_decode("a", 2e9, 15.0), _decode("b", 4e9, 7.5 * 1.195)])
    open_ = check_claims({"claims": [_claim("decode_follows_bytes")]}, edge, ENV)[0]
    assert open_["verdict"] == "undecided" and "straddles the tolerance" in open_["why"]
    one = check_claims({"claims": [_claim("decode_follows_bytes")]},
                       _analysis(decode=[_decode("a", 2e9, 15.0)]), ENV)[0]
    assert one["verdict"] == "not measured"


def test_quantization_claim_says_why_prefill_gained():
    quant = [{"dtype": "q4_0", "baseline": "f32", "decode_speedup": 4.1,
              "prefill_speedup": 1.72, "decode_speedup_ci": _ratio(4.1),
              "prefill_speedup_ci": _ratio(1.72)}]
    c = check_claims({"claims": [_claim("quant_helps_decode_not_prefill")]},
                     _analysis(quant=quant), ENV)[0]
    assert c["verdict"] == "does not hold"
    assert "prefill gained more than 1.30×" in c["why"] and "AVX512_VNNI" in c["why"]
    quant[0] |= {"prefill_speedup": 1.1, "prefill_speedup_ci": _ratio(1.1)}
    held = check_claims({"claims": [_claim("quant_helps_decode_not_prefill")]},
                        _analysis(quant=quant), ENV)[0]
    assert held["verdict"] == "holds"
    quant[0] |= {"prefill_speedup": 1.29, "prefill_speedup_ci": _ratio(1.29)}
    near = check_claims({"claims": [_claim("quant_helps_decode_not_prefill")]},
                        _analysis(quant=quant), ENV)[0]
    assert near["verdict"] == "undecided" and "±0.8% or better" in near["why"]


def test_other_claims_decide_from_the_numbers():
    batching = [{"parallel": 4, "speedup": 2.6, "speedup_ci": _ratio(2.6),
                 "per_sequence_tok_s": {"n": 6, "median": 9.0}}]
    phase = [{"phase": "prefill", "model": "a", "dtype": "f32", "compute_share": 0.9,
              "stream_share": 0.08, "compute_share_ci": _ratio(0.9)},
             {"phase": "decode", "model": "a", "dtype": "f32", "compute_share": 0.13,
              "stream_share": 0.95, "stream_share_ci": _ratio(0.95)}]
    a = _analysis(batching=batching, phase_use=phase)
    for row, share in zip(a["decode"], (0.75, 0.74, 0.77), strict=True):
        row["share_of_stream_ci"] = _ratio(share, 0.05)
    claims = [_claim("batching_gain"), _claim("prefill_compute_decode_memory"),
              _claim("long_prompt_first_token", min_tokens=200),
              _claim("decode_share_of_ceiling", low=0.5, high=0.8)]
    got = {c["claim"]: c for c in check_claims({"claims": claims}, a, ENV)}
    assert got["batching_gain"]["verdict"] == "holds"
    # the per-user cost beside the aggregate gain: 2.6x for 4 sequences is 0.65x each
    assert "each sequence 0.65×" in got["batching_gain"]["measured"]
    assert got["prefill_compute_decode_memory"]["verdict"] == "holds"
    # 4096 tokens at 150 tok/s = 27.3 s; a decode step of a is 66.7 ms: 410 steps
    assert got["long_prompt_first_token"]["verdict"] == "holds"
    assert "27.3 s before the first token, the time of 410 [" in \
        got["long_prompt_first_token"]["measured"]
    # shares of the streaming ceiling 75%, 74%, 77% (each ±5%: the band's edge at 80% lies
    # inside c's interval, so the claim cannot be decided at this precision)
    assert got["decode_share_of_ceiling"]["verdict"] == "undecided"
    assert "a 75% [71%–79%], b 74% [70%–78%], c 77% [73%–81%] of what this machine reads" in \
        got["decode_share_of_ceiling"]["measured"]
    for row, share in zip(a["decode"], (0.93, 0.9, 0.95), strict=True):
        row["share_of_stream_ci"] = _ratio(share, 0.01)
    above = check_claims({"claims": claims}, a, ENV)[-1]
    assert above["verdict"] == "does not hold" and "every one is above it" in above["why"]
    assert "against numpy's memory copy, the course's yardstick, decode reached" in above["why"]


def test_a_stored_claim_under_its_old_test_name_is_read_under_the_new_one():
    from types import SimpleNamespace

    from harness.core.reference import reference_from_header

    old = {"claim": "x", "test": "share_of_plain_memory", "low": 0.5, "high": 0.8}
    header = SimpleNamespace(scenario={"reference": {"source": "s", "hardware": "h",
                                                     "claims": [old]}})
    (claim,) = reference_from_header(header)["claims"]
    assert claim["test"] == "decode_share_of_ceiling" and claim["low"] == 0.5


def test_knee_note_with_two_thread_counts_says_what_it_cannot_show():
    assert "cannot show where the gain ends" in _knee_note("decode", "m", "f32", 2, 2)
    assert "knee at 2 threads of 8" in _knee_note("decode", "m", "f32", 2, 8)


def test_batching_note_beyond_the_measured_range_is_an_estimate():
    def row(b, tok_s, ridge):
        return {"parallel": b, "tok_s": {"n": 6, "median": tok_s}, "ridge_parallel": ridge,
                "stream_gb_s": 30.0, "compute_gflop_s": 150.0, "share_of_bound": 0.5}

    group = [row(1, 15.0, 11.3), row(8, 63.0, 11.3), row(16, 85.1, 11.3)]
    text = _batching_note(("m", "f32", 2), group)
    assert "from 8 to 16 sequences the aggregate still grew by +35%" in text
    assert "inside the measured range" in text
    short = _batching_note(("m", "f32", 2), group[:2])
    assert "beyond the largest batch measured (8)" in short and "(estimated)" in short
    assert "gain stops" not in short


def test_a_single_model_page_has_no_size_sentence():
    data = {"analysis": _analysis(decode=[_decode("a", 2e9, 15.0)]), "main": ("a", "f32", 2),
            "claims": []}
    text = " ".join(findings(data))
    assert "fit" not in text and "Decode slowed" not in text
    assert "each decoded token took as long as 12 prompt tokens" in text  # 66.7 / 5.6 ms


NUMBER = re.compile(r"(\d+(?:\.\d+)?)(%|×)")


@settings(max_examples=60, deadline=None)
@given(st.floats(0.05, 1.5), st.floats(0.05, 1.5), st.floats(0.01, 0.6), st.floats(0.3, 1.3),
       st.floats(1.0, 6.0), st.floats(0.8, 3.0), st.floats(1.0, 8.0))
def test_every_share_and_speedup_in_the_findings_is_in_the_data(pc, ps, dc, ds, qd, qp, bs):
    """No sentence prints a percentage or a speed-up that the data does not hold."""
    phase = [{"phase": "prefill", "model": "a", "dtype": "f32", "compute_share": pc,
              "stream_share": ps, "threads": 2},
             {"phase": "decode", "model": "a", "dtype": "f32", "compute_share": dc,
              "stream_share": ds, "threads": 2}]
    quant = [{"dtype": "q4_0", "baseline": "f32", "decode_speedup": qd, "prefill_speedup": qp,
              "bits_per_weight": 5.0, "byte_reduction": 5.7, "bytes_per_token": 1e8}]
    batching = [{"parallel": 4, "speedup": bs, "per_sequence_tok_s": {"n": 6, "median": 3.0}}]
    data = {"analysis": _analysis(phase_use=phase, quant=quant, batching=batching),
            "main": ("a", "f32", 2), "claims": []}
    allowed = {f"{v:.0%}" for v in (pc, ps, dc, ds)}
    allowed |= {f"{v:.2f}×" for v in (qd, qp, bs)} | {"5.7×", "100%"}  # 100%: the threshold
    for line in findings(data):
        for value, unit in NUMBER.findall(line):
            assert f"{value}{unit}" in allowed, (value + unit, line)


def _lesson_page():
    import os
    from pathlib import Path

    from harness.core.reference import reference_from_header
    from harness.report.files import analysis_of, load_run
    from harness.report.lesson import lesson_data, render_lesson

    runs = Path(__file__).resolve().parent / "fixtures" / "runs"
    golden = Path(__file__).resolve().parent / "fixtures" / "golden" / "tiny_lesson.md"
    _, records = load_run(runs / "tiny_lesson")
    data = lesson_data(records, analysis_of(records), reference_from_header(records.header))
    text = render_lesson(data, ["decode_vs_bytes.png", "prefill_vs_prompt.png",
                                "decode_per_token.png"])
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    return records, text, golden.read_text()


def test_lesson_page_matches_golden_and_its_numbers_follow_from_the_samples():
    import statistics

    records, text, golden = _lesson_page()
    assert text == golden
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[0] == "## Findings"  # findings first, diagnostics last
    assert sections[-1] == "## Appendix: diagnostics"
    assert "## The lesson's claims, checked on this machine" in sections
    # the side-by-side table: each prefill row's tok/s is the median of its raw samples
    for m in records.measurements:
        if m.model == "tiny-qwen2" and m.dtype == "f32" and not m.n_gen \
                and m.parallel == 1:
            rate = statistics.median(m.n_prompt / s for s in m.samples["prefill_s"])
            row = next(line for line in text.splitlines()
                       if line.startswith(f"| prefill | {m.n_prompt:,} prompt tokens"))
            assert f"| {rate:.2f} (" in row
    assert "no fit" not in text


def test_lever_findings_say_what_each_lever_did():
    a = _analysis(
        kv_depth=[{"model": "a", "kv_type": "f16", "depth": 8192, "predicted_slowdown": 1.05,
                   "measured_slowdown": {"n": 6, "median": 1.41}}],
        threads=[{"phase": "decode", "model": "a", "threads": 1, "speedup": 1.0},
                 {"phase": "decode", "model": "a", "threads": 2, "speedup": 1.75}],
        prefix=[{"shared_prefix": 2048, "recompute_s": {"n": 6, "median": 15.66},
                 "seq_copy_s": {"n": 6, "median": 0.49}, "seq_copy_saving": 0.969}])
    text = " ".join(findings({"analysis": a, "main": None, "claims": []}))
    assert "With 8,192 tokens already cached, decode of a ran 1.41× slower" in text
    assert "predict 1.05×" in text
    assert "Decode of a ran 1.75× faster on 2 threads than on 1." in text
    assert "from 15.66 s to 0.49 s (a saving of 97%)" in text


def test_stability_finds_two_regimes_and_disturbed_rounds():
    from harness.analysis.machine import stability

    reads = [[30.0, 31.0]] * 6 + [[48.0, 50.0]] * 4
    m = measurement_record(samples={"read_gb_s": reads})
    rounds = [typed({"type": "round", "round": i, "idle_other_cores": 0.5 if i == 3 else 0.0})
              for i in range(10)]
    st_ = stability([m], rounds, noisy_cores=0.1)
    assert st_["n_reads"] == 20 and st_["disturbed_rounds"] == [3]
    (slow, fast) = st_["regimes"]
    # medians on the log scale: the geometric mean of the two middle values
    assert slow["median_gb_s"] == pytest.approx(30.5, rel=1e-3) and slow["share"] == 0.6
    assert fast["median_gb_s"] == pytest.approx(49.0, rel=1e-3) and fast["share"] == 0.4
    steady = stability([measurement_record(samples={"read_gb_s": [[30.0, 31.0]] * 10})], [], 0.1)
    assert "regimes" not in steady


def test_no_table_of_the_lesson_page_is_wider_than_eight_columns():
    _, text, _ = _lesson_page()
    headers = [line for i, line in enumerate(text.splitlines()[:-1])
               if line.startswith("|") and text.splitlines()[i + 1].startswith("|---")]
    assert headers
    for header in headers:
        assert header.count("|") - 1 <= 8, header
    import re

    spans = [span for line in text.splitlines() if line.startswith("|")
             for span in re.findall(r"`[^`]*`", line)]
    assert all("|" not in span for span in spans), spans  # a | ends a GitHub table cell
    assert "SSE3 = 1, SSSE3 = 1" in text  # llama.cpp's system line, its | as commas


def test_the_lesson_refuses_workloads_far_beyond_its_prompts():
    records, text, _ = _lesson_page()
    from harness.core.reference import reference_from_header
    from harness.report.files import analysis_of
    from harness.report.lesson import lesson_data

    data = lesson_data(records, analysis_of(records), reference_from_header(records.header))
    claim = next(c for c in data["claims"] if c["claim"].startswith("chat is decode"))
    # the tiny run's longest prompt is far shorter than half of any workload's
    assert claim["verdict"] == "not measured"
    assert claim["why"] == "every named workload lies beyond the prompts measured"
    assert "## Where the time goes in typical requests" in text


def _workload(name, n_prompt, share, modelled=True):
    return {"model": "a", "dtype": "f32", "threads": 2, "workload": name, "n_prompt": n_prompt,
            "n_gen": 300, "prefill_s": 1.0, "decode_s": 1.0, "prefill_share": share,
            "prefill_share_ci": [share - 0.05, share + 0.05], "prefill_rate_from": 128,
            "decode_rate_at": 48, "modelled": ["m"] if modelled else []}


@pytest.mark.parametrize("chat_share", [0.13, 0.7])
def test_workload_balance_decides_what_it_can_and_names_what_it_cannot(chat_share):
    a = _analysis(workloads=[_workload("chat", 500, chat_share),
                             _workload("classification", 500, 0.98),
                             _workload("RAG, long context", 10000, 0.8)])
    claim = _claim("workload_balance", prefill_bound="rag, long context; classification",
                   decode_bound="chat")
    (got,) = check_claims({"claims": [claim]}, a, ENV)
    # the longest prompt measured is 4,096: 10,000 tokens is 2.4x beyond it
    assert "not tested, too far to model: RAG, long context (2.4× the longest prompt " \
           "measured, 4,096 tokens)" in got["why"]
    assert "RAG" not in got["measured"] and got["modelled"] and got["scope"] == \
        "2 of 3 workloads"
    assert got["verdict"] == ("holds" if chat_share < 0.5 else "does not hold")
    assert f"chat {chat_share:.0%} prefill (modelled)" in got["measured"]


def test_model_names_in_the_lesson_tables_do_not_break():
    from harness.report.lesson import unbreakable

    md = ("| model | note |\n|---|---|\n| qwen2.5-0.5b F32 | long-form chat, llama-3.2-1b |\n"
          "prose qwen2.5-0.5b")
    out = unbreakable(md).split("\n")
    assert out[1] == "|---|---|" and out[3] == "prose qwen2.5-0.5b"
    assert out[2] == "| qwen2.5\u20110.5b F32 | long-form chat, llama\u20113.2\u20111b |"


def test_a_one_token_answer_spends_no_time_in_decode():
    # the first generated token comes from the prefill's logits: 1 token, 0 decode steps
    records, _, _ = _lesson_page()
    from harness.report.files import analysis_of

    rows = [w for w in analysis_of(records)["workloads"] if w["n_gen"] == 1]
    assert rows and all(w["decode_s"] == 0 and w["prefill_share"] == 1 for w in rows)
    assert all(w["decode_s"] > 0 for w in analysis_of(records)["workloads"] if w["n_gen"] > 1)


def test_a_published_figure_reads_the_same_in_either_unit():
    from harness.core.reference import published_decode_tok_s, published_prefill

    assert published_decode_tok_s({"ms_per_token": 80}) == 12.5
    assert published_decode_tok_s({"decode_tok_s": 11.66, "ms_per_token": 86}) == 11.66
    assert published_decode_tok_s({"size_gib": 1.84}) is None
    assert published_prefill({"prompt": 128, "prefill_s": 0.64}) == (200.0, 0.64)
    assert published_prefill({"prompt": 1024, "prefill_tok_s": 256}) == (256, 4.0)
    assert published_prefill({"prompt": 128, "decode_tok_s": 9.0}) is None
