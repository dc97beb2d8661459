"""The roofline of a decode step, shared by the batching lever and the serving page: its two
floors, which binds, where they meet, and a serving level set against it."""

import pytest
from conftest import probe_record

from harness.analysis.serving import level_roofline
from harness.core.costs import decode_bound, decode_flops_per_token, model_costs
from harness.core.records import to_dict, typed
from harness.core.specs import resolve_spec
from harness.report.serving import roofline_findings, roofline_table


def test_the_bound_is_the_larger_floor_and_the_floors_meet_at_the_ridge():
    # 1 GB of weights, 1 MB of KV per sequence, 1 GFLOP per token; 10 GB/s and 100 GFLOP/s
    solo = decode_bound(1e9, 1e6, 1e9, 1, 10, 100)
    assert solo.memory_s == pytest.approx(0.1001) and solo.compute_s == pytest.approx(0.01)
    assert solo.limiter == "memory bandwidth" and solo.tok_s == pytest.approx(1 / 0.1001)
    # memory = compute where (1e9 + B 1e6) / 1e10 = B 1e9 / 1e11: B = 0.1 / (0.01 - 0.0001)
    assert solo.ridge_sequences == pytest.approx(0.1 / 0.0099)
    many = decode_bound(1e9, 1e6, 1e9, 16, 10, 100)
    assert many.limiter == "compute" and many.tok_s == pytest.approx(16 / 0.16)
    # a sequence whose KV bytes cost more than its FLOPs: memory bounds every batch
    assert decode_bound(1e9, 1e9, 1e9, 4, 10, 100).ridge_sequences is None


def _probe(seq: int, stream_gb_s: float, compute_gflop_s: float) -> dict:
    figures = {"stream_gb_s": stream_gb_s, "stream_samples_gb_s": [stream_gb_s] * 3,
               "compute_gflop_s": compute_gflop_s,
               "compute_samples_gflop_s": [compute_gflop_s] * 3}
    return probe_record(seq=seq, result={"threads": {"1": {"ggml": {"f16": figures}}}})


def _model():
    from harness.core.costs import TensorEntry
    from harness.core.specs import tensor_plan

    spec = resolve_spec("tiny-llama")
    table = [TensorEntry(t.name, tuple(t.shape), "F16", 2 * _n(t.shape)) for t in
             tensor_plan(spec)]
    return typed({"type": "model", "key": "served", "spec": spec.to_dict(),
                  **model_costs(table, spec)})


def _n(shape) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


WORKLOAD = {"n_prompt": 8, "n_generate": 4, "prefix_cache": False}


def _level(concurrency: int, served_tok_s: float, probe_seqs: list[int], inprocess=None,
           per_round=None) -> dict:
    """A level's page row: its record's fields (every one, as read) as a dict."""
    return to_dict(typed(_level_fields(concurrency, served_tok_s, probe_seqs, inprocess,
                                       per_round))) | {"seq": probe_seqs[-1] + 1}


def _level_fields(concurrency, served_tok_s, probe_seqs, inprocess, per_round) -> dict:
    return {"type": "level", "level": f"c{concurrency}", "label": f"{concurrency} in flight",
            "concurrency": concurrency, "seq": probe_seqs[-1] + 1, "probe_seqs": probe_seqs,
            "server_prompt_ms": [2.0, 4.0, 3.0],
            "steady_decode": {"tok_s": served_tok_s, "window_s": 1.0, "n_tokens": 9},
            "inprocess_decode_tok_s": inprocess,
            "rounds": {"per_round": per_round} if per_round else None,
            "summary": {"n_ok": 3, "tpot_s": {"p50": 1 / served_tok_s * concurrency},
                        "ttft_s": {"p50": 0.01 * concurrency}}}


def test_a_serving_level_against_the_bound_round_by_round():
    model, spec = _model(), resolve_spec("tiny-llama")
    # a machine speeding up: each round between two probes of its own
    streams = [10.0, 12.0, 14.0, 16.0]
    probes = [_probe(seq, gb_s, 100.0) for seq, gb_s in zip((1, 3, 5, 7), streams, strict=True)]
    context = 8 + (4 + 1) / 2
    flops = decode_flops_per_token(spec, context)
    kv = model.kv_n_bytes_per_token_f16 * context

    def bound(gb_s: float) -> float:
        return decode_bound(model.decode_weight_n_bytes, kv, flops, 1, gb_s, 100.0).tok_s

    # each round's bound from the probes either side (their passes pooled: the geometric
    # mean of two equal-pass medians); served at 50, 60 and 70% of it
    bounds = [bound((a * b) ** 0.5) for a, b in zip(streams, streams[1:], strict=False)]
    per_round = [{"served_tok_s": f * b, "inprocess_tok_s": 0.9 * b}
                 for f, b in zip((0.5, 0.6, 0.7), bounds, strict=True)]
    level = _level(1, 1000.0, [1, 3, 5, 7], [1.0, 1.0, 1.0, 1.0], per_round)
    roof = level_roofline(typed(level), model, probes, WORKLOAD, threads=1, slots=2)
    assert roof["limiter"] == "memory bandwidth"
    assert roof["served_share"] == pytest.approx((0.5 * 0.6 * 0.7) ** (1 / 3))
    stat = roof["served_share_stat"]
    assert stat["n"] == 3 and stat["median_ci95"][0] < 0.6 < stat["median_ci95"][1]
    assert roof["inprocess_share"] == pytest.approx(0.9)
    assert not roof["above"] and roof["ceiling_range"] == pytest.approx([10.0, 16.0])
    # the table's bound pools every probe of the level
    assert roof["stream"]["value"] == pytest.approx((12.0 * 14.0) ** 0.5)
    assert roof["memory_s"] == pytest.approx(
        (model.decode_weight_n_bytes + kv) / (roof["stream"]["value"] * 1e9))
    assert roof["compute_s"] == pytest.approx(flops / 100e9)
    assert roof["bound_tok_s"] == pytest.approx(1 / max(roof["memory_s"], roof["compute_s"]))
    assert roof["prefill"]["prompt_s"] == pytest.approx(0.003)  # the median prompt_ms
    # a level of one round: its steady window over the level's bound
    single = level_roofline(typed(_level(1, 1000.0, [1, 3])), model, probes, WORKLOAD, 1, 2)
    assert single["served_share"] == pytest.approx(1000 / single["bound_tok_s"])
    assert single["served_share_stat"] is None
    # an open loop has no steady number of sequences: no bound
    open_loop = typed({"type": "level", "level": "r4", "concurrency": None,
                       "probe_seqs": [1, 3]})
    assert level_roofline(open_loop, model, probes, WORKLOAD, 1, 2) is None
    # no ceiling for the model's type: missing, with the reason, never guessed
    missing = level_roofline(typed(level), model, [], WORKLOAD, 1, 2)
    assert missing["missing"].startswith("no ggml ceiling for f16")
    unread = level_roofline(typed(level), typed({
        "type": "model", "key": "served", "error": "GGUF architecture 'rwkv6' is not supported"}),
        probes, WORKLOAD, 1, 2)
    assert "No roofline bound: the served file's costs could not be read (GGUF architecture " \
        "'rwkv6' is not supported)." in roofline_findings([level | {"roofline": unread}], 2)


def test_the_page_names_what_bounds_decode_and_prefill_and_where_the_slots_hold_back():
    model = _model()
    probes = [_probe(seq, 10.0, 100.0) for seq in (1, 2, 4, 5, 7, 8)]
    levels = [_level(1, 1000.0, [1, 2], [1000.0]), _level(2, 1500.0, [4, 5], [1500.0]),
              _level(4, 1600.0, [7, 8])]
    for lv in levels:
        lv["roofline"] = level_roofline(typed(lv), model, probes, WORKLOAD, 1, 2)
        lv["summary"] |= {"ttft_outside_prompt_s": {"p50": 0.01 * lv["concurrency"]}}
    text = " ".join(roofline_findings(levels, slots=2))
    roof = levels[1]["roofline"]
    assert f"Decode is bounded by {roof['limiter']}" in text
    assert f"the bound is {roof['bound_tok_s']:.1f} tok/s" in text
    assert "Per user, the bound at 2 sequences is" in text and "Prefill is bound by" in text
    # served and in-process fell alike against their bounds: not the serving's doing
    assert "so each user lost more speed than the bound's bytes and FLOPs account for" in text
    assert "as far, so the shortfall is llama.cpp's batched decode, not the serving" in text
    assert "At 4 in flight the 2 slots are the limit: 2 requests decode together and 2 wait" \
        in text and "p50 40 ms against 20 ms at 2 in flight" in text
    assert ("At 2 in flight TTFT p50 was 20 ms, of which the server's own prompt time 3 ms "
            "(p50), 1.00× its 3 ms at 1 in flight." in text)  # the same: nothing to explain
    levels[1]["server_prompt_ms"] = [6.0, 6.2, 5.8]
    levels[1]["summary"]["ttft_s"] = {"p50": 0.0065}
    shared = " ".join(roofline_findings(levels, slots=2))
    assert ("At 2 in flight TTFT p50 was 6 ms, of which the server's own prompt time 6 ms "
            "(p50), 2.00× its 3 ms at 1 in flight: about what 2 prompts take") in shared
    for lv in levels:  # with the server's progress events, the wait itself is named
        lv["summary"]["wait_s"] = {"p50": 0.1 * lv["concurrency"], "p99": 0.5}
    assert ("At 4 in flight the 2 slots are the limit: 2 requests decode together and 2 wait; "
            "a request waited 400 ms (p50) before a slot started its prompt, against 200 ms at "
            "2 in flight.") in " ".join(roofline_findings(levels, slots=2))
    levels[1]["summary"] |= {"wait_on_prompt_s": {"n": 1, "p50": 0.64},
                             "wait_otherwise_s": {"n": 19, "p50": 0.009}}
    levels[2]["summary"] |= {"wait_on_prompt_s": {"n": 16, "p50": 5.9}}  # the slots bind there
    behind = " ".join(roofline_findings(levels, slots=2))
    assert ("waited for that step: 1 of 20 at 2 in flight (640 ms, against p50 9 ms for the "
            "other 19). llama-server takes up a new request only between its steps") in behind
    assert "at 4 in flight (" not in behind
    # a prompt faster than the compute ceiling allows is said to be, with the probes' range
    fast_prompt = _level(1, 1000.0, [1, 2]) | {"server_prompt_ms": [1e-6]}
    fast_prompt["roofline"] = level_roofline(typed(fast_prompt), model, probes, WORKLOAD, 1, 2)
    prefill = next(x for x in roofline_findings([fast_prompt], 2) if x.startswith("Prefill"))
    assert "— above that ceiling beyond its spread; the level's compute probes ranged " \
        "100–100 GFLOP/s" in prefill
    table = roofline_table(levels)
    assert [r["sequences"] for r in table.rows] == [1, 2, 2]
    # a served figure above its bound by more than the ceiling's spread is said, not hidden
    fast = _level(1, 1e9, [1, 2])
    fast["roofline"] = level_roofline(typed(fast), model, probes, WORKLOAD, 1, 2)
    assert fast["roofline"]["above"]
    said = roofline_findings([fast], 2)[0]
    assert "Above the bound beyond its uncertainty at 1 in flight (the level's probes ranged " \
        "10.0–10.0 GB/s)" in said and "the bound is a yardstick here, not a limit" in said
    table = roofline_table([fast])
    assert table.rows[0]["flag"] == "⚠ served above the bound"
    assert any("flagged above-ceiling when its whole 95% interval" in n for n in table.notes)


def test_whose_shortfall_follows_how_far_the_in_process_share_fell():
    from harness.report.serving import _inprocess_fall

    assert _inprocess_fall(0.73, 0.73).endswith("as far, so the shortfall is llama.cpp's "
                                                 "batched decode, not the serving")
    assert "further" in _inprocess_fall(0.60, 0.73)
    most = _inprocess_fall(0.78, 0.73)  # the committed run: in-process fell 22%, served 27%
    assert most == ("; in-process the share fell to 0.78× against the server's 0.73×: most of "
                    "the shortfall is llama.cpp's batched decode itself, the rest the serving's")
    assert _inprocess_fall(0.95, 0.73).endswith("most of the shortfall is the serving's")
