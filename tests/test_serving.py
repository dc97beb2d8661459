"""Serving: the metrics on known timings, SSE framing of llama-server's stream, and a real
llama.cpp server (xllamacpp) on loopback under closed- and open-loop load, with its faults."""

import asyncio
import json
import os
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import assert_user_error

from harness.core.records import to_dict, typed
from harness.core.serving import (
    RequestTiming,
    distribution,
    level_summary,
    meets_slo,
    steady_decode,
    waited_on_a_prompt,
)
from harness.engine.http import sse_payloads, stream_completion
from harness.engine.load import Level, Workload, run_level
from harness.serving import load_serving_run

pytest.importorskip("xllamacpp")

# Events of llama-server's /v1/completions stream as it sends them: the prompt-progress event a
# slot sends when it starts the prompt (return_progress), a chunk that carries three tokens at
# once (its running predicted_n), then the last chunk, an empty choice beside usage and timings.
LLAMA_SERVER_STREAM = "".join(f"data: {json.dumps(e) if isinstance(e, dict) else e}\n\n" for e in [
    {"choices": [{"text": "", "index": 0, "finish_reason": None}],
     "object": "text_completion",
     "timings": {"prompt_n": 0, "prompt_ms": 0.0, "predicted_n": 0, "predicted_ms": 0.0},
     "prompt_progress": {"total": 4, "cache": 0, "processed": 0, "time_ms": 0}},
    {"choices": [{"text": "\ufffdDtok439", "index": 0, "finish_reason": None}],
     "object": "text_completion",
     "timings": {"prompt_n": 4, "prompt_ms": 0.694, "predicted_n": 3, "predicted_ms": 0.354}},
    {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
     "object": "text_completion",
     "usage": {"completion_tokens": 3, "prompt_tokens": 4, "total_tokens": 7},
     "timings": {"cache_n": 0, "prompt_n": 4, "prompt_ms": 0.694, "predicted_n": 3,
                 "predicted_ms": 0.354}},
    "[DONE]"])


def test_metrics_follow_the_definitions_on_known_timings():
    # sent at 0, chunks at 0.1 (1 token), 0.3 (2 tokens), 0.4 (1 token): 4 tokens
    t = RequestTiming(0.0, (0.1, 0.3, 0.4), (1, 2, 1), 0.45, 4, 10)
    assert t.ttft_s == pytest.approx(0.1)
    assert t.tpot_s == pytest.approx((0.4 - 0.1) / 3)
    assert t.chunk_gaps_s == pytest.approx([0.2, 0.1])
    assert t.itl_s == pytest.approx([0.1, 0.1, 0.1])  # the 2-token gap split over its tokens
    assert t.e2e_s == pytest.approx(0.45)
    assert RequestTiming(0.0, (0.1,), (1,), 0.1, 1, 10).tpot_s is None
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d["p50"] == 2.5 and d["mean"] == 2.5 and d["p90"] == pytest.approx(3.7)
    assert meets_slo(t, {"ttft_ms": 101, "tpot_ms": 101}) and not meets_slo(t, {"ttft_ms": 99})


def test_level_summary_counts_throughput_and_goodput_over_the_wall_time():
    fast = RequestTiming(0.0, (0.05, 0.1), (1, 1), 0.1, 2, 8)
    slow = RequestTiming(0.0, (0.5, 0.6), (1, 1), 0.6, 2, 8)
    s = level_summary([fast, slow], n_failed=1, wall_s=2.0, slo={"ttft_ms": 100})
    assert s["n_ok"] == 2 and s["n_failed"] == 1
    assert s["output_tok_s"] == 2.0 and s["request_s"] == 1.0 and s["input_tok_s"] == 8.0
    assert s["n_good"] == 1 and s["goodput_request_s"] == 0.5
    assert s["ttft_s"]["p50"] == pytest.approx(0.275)


def test_steady_decode_counts_only_the_spans_where_every_request_decodes():
    a = RequestTiming(0.0, (0.0, 1.0, 2.0, 3.0), (1, 1, 1, 1), 3.0, 4, 8)
    b = RequestTiming(1.0, (1.5, 2.5, 3.5), (1, 1, 1), 3.5, 3, 8)
    both = steady_decode([a, b], concurrency=2)  # both decode over (1.5, 3]: 2.0, 3.0, 2.5
    assert both == {"tok_s": pytest.approx(3 / 1.5), "window_s": pytest.approx(1.5),
                    "n_tokens": 3}
    one = steady_decode([a, b], concurrency=1)  # (0, 3.5]: every token after a first
    assert one["n_tokens"] == 5 and one["window_s"] == pytest.approx(3.5)
    assert steady_decode([a], concurrency=2) is None and steady_decode([], 1) is None
    split = level_summary([RequestTiming(0.0, (0.3, 0.4), (1, 1), 0.4, 2, 8, 0.25)], 0, 1.0)
    assert split["ttft_outside_prompt_s"]["p50"] == pytest.approx(0.05)
    assert split["wait_s"] is None and split["ttft_after_prompt_s"] is None  # no progress seen


def test_ttft_splits_into_the_wait_the_servers_prompt_and_the_rest():
    # sent at 1.0, a slot started it at 1.2, prompt_ms 0.5, first token at 1.75: 0.05 after
    t = RequestTiming(1.0, (1.75, 1.8), (1, 1), 1.8, 2, 8, 0.5, started_s=1.2)
    assert t.wait_s == pytest.approx(0.2) and t.ttft_after_prompt_s == pytest.approx(0.05)
    assert t.wait_s + t.server_prompt_s + t.ttft_after_prompt_s == pytest.approx(t.ttft_s)
    late = RequestTiming(0.0, (2.1, 2.2), (1, 1), 2.2, 2, 8, 0.5, started_s=1.6)
    s = level_summary([t, late], 0, 3.0)
    assert s["wait_s"]["p50"] == pytest.approx(0.9) and s["wait_s"]["n"] == 2
    assert RequestTiming(0.0, (0.3,), (1,), 0.3, 1, 8, None, 0.1).ttft_after_prompt_s is None
    # b, sent while a's prompt ran, began only after a's first token: it waited for that step
    a = RequestTiming(0.0, (0.8, 0.9), (1, 1), 0.9, 2, 8, 0.78, started_s=0.01)
    b = RequestTiming(0.1, (1.6, 1.7), (1, 1), 1.7, 2, 8, 0.78, started_s=0.81)
    c = RequestTiming(2.0, (2.8,), (1,), 2.8, 1, 8, 0.78, started_s=2.01)
    assert waited_on_a_prompt([a, b, c]) == [False, True, False]
    s = level_summary([a, b, c], 0, 3.0)
    assert s["wait_on_prompt_s"]["n"] == 1 and s["wait_on_prompt_s"]["p50"] == pytest.approx(0.71)
    assert s["wait_otherwise_s"]["n"] == 2


def test_sse_framing_of_llama_servers_stream():
    payloads = sse_payloads(LLAMA_SERVER_STREAM.splitlines())
    assert payloads[-1] == "[DONE]" and len(payloads) == 4
    last = json.loads(payloads[2])
    assert last["choices"][0]["text"] == "" and last["usage"]["completion_tokens"] == 3
    assert sse_payloads(["data: a", "data: b", ""]) == ["a\nb"]  # multi-line data
    assert sse_payloads(["data: x"]) == ["x"]  # a stream ending without its blank line


class _Handler(BaseHTTPRequestHandler):
    mode = "stream"

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.mode == "stall":
            threading.Event().wait(5)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        body = LLAMA_SERVER_STREAM if self.mode == "stream" else "data: {not json\n\n"
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    servers = []

    def start(mode: str) -> str:
        handler = type("H", (_Handler,), {"mode": mode})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def _one(url: str, timeout_s: float = 5.0) -> dict:
    import httpx

    async def go():
        async with httpx.AsyncClient() as client:
            return await stream_completion(client, url, {"prompt": [5]}, timeout_s)
    return asyncio.run(go())


def test_the_client_times_chunks_and_keeps_the_servers_counts(fake_server):
    record = _one(fake_server("stream"))
    assert record["error"] is None
    assert record["chunk_tokens"] == [3]  # one content chunk with three tokens
    assert record["usage"]["completion_tokens"] == 3 and record["timings"]["prompt_ms"] == 0.694
    assert record["sent_s"] <= record["started_s"] <= record["chunk_s"][0] <= record["end_s"]


def test_malformed_events_and_stalls_end_as_errors_not_hangs(fake_server):
    assert "JSONDecodeError" in _one(fake_server("junk"))["error"]
    stalled = _one(fake_server("stall"), timeout_s=0.5)
    assert stalled["error"] == "no answer within 0.5 s"
    with socket.socket() as s:  # nothing listens here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "ConnectError" in _one(f"http://127.0.0.1:{port}")["error"]


@pytest.fixture(scope="module")
def served():
    from harness.core.dtypes import DTYPES
    from harness.core.specs import resolve_spec
    from harness.engine.build import build
    from harness.engine.server import ServerSpec, start_server

    path = build(resolve_spec("tiny-llama"), DTYPES["f16"]).path
    with start_server(ServerSpec("xllamacpp", path, slots=2, ctx=512, threads=1),
                      start_timeout_s=60) as server:
        yield server


def test_a_real_server_under_closed_and_open_loop_load(served):
    w = Workload(n_prompt=16, n_generate=8, n_vocab=512, n_requests=4, duration_s=30)
    for level in (Level(concurrency=1), Level(concurrency=2), Level(rate=50.0)):
        out = asyncio.run(run_level(served.url, level, w))
        assert [r["error"] for r in out["records"]] == [None] * len(out["records"])
        assert 1 <= len(out["records"]) <= 4
        for r in out["records"]:
            assert r["usage"]["completion_tokens"] == 8 and r["usage"]["prompt_tokens"] == 16
            assert sum(r["chunk_tokens"]) == 8
            assert r["timings"]["cache_n"] == 0  # unique prompts: nothing reused
            # the slot's first progress event comes after sending and before the first token
            assert r["sent_s"] < r["started_s"] < r["chunk_s"][0]
        grown = out["metrics_after"]["llamacpp:tokens_predicted_total"] - out[
            "metrics_before"]["llamacpp:tokens_predicted_total"]
        assert grown == 8 * len(out["records"])  # warm-up excluded
    assert served.alive()


@pytest.mark.serial  # its rounds need two requests decoding side by side on an idle machine
def test_serve_writes_records_and_a_page_and_stops_its_server(run_cli, tmp_path):
    before = _xserver_pids()
    result = run_cli("serve", "tiny-llama", "--concurrency", "1,2", "--rate", "40",
                     "--requests", "6", "--prompt", "8", "--generate", "64", "--slots", "2",
                     "--threads", "1", "--slo-ttft-ms", "1000", "--out", str(tmp_path / "s"))
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(x) for x in (tmp_path / "s" / "results.jsonl").read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["server"]["slots"] == 2
    levels = [x for x in lines if x["type"] == "level"]
    assert [x["level"] for x in levels] == ["c1", "c2", "r40"]
    assert all(x["summary"]["n_ok"] >= 1 for x in levels)
    assert sum(x["type"] == "request" for x in lines) == sum(x["summary"]["n_ok"] for x in levels)
    page = (tmp_path / "s" / "report.md").read_text()
    assert "## Findings" in page and "| 2 in flight |" in page and "goodput" in page
    closed = [x for x in levels if x["concurrency"]]
    # three rounds of two requests each: in-process before the first round and after each
    assert all(len(x["inprocess_decode_tok_s"]) == 4 for x in closed)
    assert all(x["rounds"]["served_of_inprocess"]["n"] == 3 for x in closed)
    assert all(x["rounds"]["served_of_inprocess"]["median_ci95"] for x in closed)
    requests = [x for x in lines if x["type"] == "request" and x["level"] == "c2"]
    assert sorted(r["round"] for r in requests) == [0, 0, 1, 1, 2, 2]
    assert len({r["index"] for r in requests}) == 6  # every round's prompts its own
    # each closed-loop worker on a slot of its own: the two in flight hold slots 0 and 1
    assert sorted(r["slot"] for r in requests) == [0, 0, 0, 1, 1, 1]
    assert all(x["pinned_slots"] == bool(x["concurrency"]) for x in levels)
    assert "rounds paired with in-process figures" in page
    assert "Why: served decode against in-process decode" in page
    # every finished request's TTFT split: the wait before its prompt, the prompt, the rest
    assert "Why: what the time to first token was made of" in page
    assert all(x["summary"]["wait_s"]["n"] == x["summary"]["n_ok"] for x in levels)
    assert "before the server started its prompt." in page
    assert (tmp_path / "s" / "latency_vs_throughput.png").exists()
    assert "latency_by_concurrency.png" in page
    # ggml's ceilings for the served file's types, probed before every round of a level and
    # after its last, set a roofline bound beside each closed level, round by round
    rounds = [f"c{c} round {r}" for c in (1, 2) for r in range(3)]
    assert [x["when"] for x in lines if x["type"] == "probe"] == [
        *rounds[:3], "c1 after", *rounds[3:], "c2 after", "r40 round 0", "r40 after"]
    assert all(x["result"]["threads"]["1"]["ggml"]["f32"]["stream_gb_s"] > 0
               for x in lines if x["type"] == "probe")
    # a level names its probes by their places in the file (seq: the line, from 1)
    assert [len(x["probe_seqs"]) for x in levels] == [4, 4, 2]
    assert all(lines[s - 1]["type"] == "probe" and lines[s - 1]["when"].startswith(x["level"])
               for x in levels for s in x["probe_seqs"])
    assert all(x["roofline"]["served_share_stat"]["n"] == 3
               for x in load_serving_run(tmp_path / "s")[1] if x["concurrency"])
    assert "Why: decode against the roofline of this machine" in page
    assert "Decode is bounded by" in page and "Prefill is bound by" in page
    assert "decode_against_bound.png" in page
    (tmp_path / "s" / "report.md").unlink()
    assert run_cli("report", str(tmp_path / "s")).exit_code == 0
    assert (tmp_path / "s" / "report.md").read_text() == page  # re-rendered from the records
    compared = run_cli("compare", str(tmp_path / "s"), str(tmp_path / "s"))
    assert compared.exit_code == 0 and "| 2 in flight | TTFT p50 ms |" in compared.stdout
    assert "| 2 in flight | waited before the prompt p50 ms |" in compared.stdout
    assert "| 1.00 |" in compared.stdout
    mixed = run_cli("compare", str(tmp_path / "s"), str(tmp_path))
    assert mixed.exit_code == 2 and "serving runs compare only" in mixed.stderr
    assert _xserver_pids() <= before  # its own server stopped


def _xserver_pids() -> set[int]:
    """The xllamacpp servers this test process started (other test workers start their own)."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"harness.engine.xserver" in cmdline and parent == os.getpid():
            pids.add(int(pid))
    return pids


def test_a_server_that_dies_mid_run_ends_in_one_line_with_the_levels_kept(tmp_path):
    from harness.core.dtypes import DTYPES
    from harness.core.errors import MeasurementError
    from harness.core.specs import resolve_spec
    from harness.engine.build import build
    from harness.engine.server import ServerSpec
    from harness.serving import ServingRun, run_serving

    path = build(resolve_spec("tiny-llama"), DTYPES["f16"]).path
    run = ServingRun((Level(concurrency=1), Level(concurrency=2)),
                     Workload(8, 4, 512, 2, 30), ServerSpec("xllamacpp", path, 2, 256, 1))

    others = _xserver_pids()

    def kill_after_first_level(line: str) -> None:
        for pid in _xserver_pids() - others:
            os.kill(pid, signal.SIGKILL)

    with pytest.raises(MeasurementError, match="no request finished at 2 in flight|exited|"
                       "warm-up request at 2 in flight failed"):
        run_serving(run, tmp_path / "d", [], say=kill_after_first_level)
    lines = (tmp_path / "d" / "results.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["type"] == "header"
    assert any(json.loads(x).get("level") == "c1" and json.loads(x)["type"] == "level"
               for x in lines)
    assert "| 1 in flight |" in (tmp_path / "d" / "report.md").read_text()


def test_bad_servers_and_urls_are_refused_in_one_line(run_cli, tmp_path):
    missing = run_cli("serve", "tiny-llama", "--server", str(tmp_path / "llama-server"))
    assert missing.exit_code == 2 and "no executable file at" in missing.stderr
    assert "Traceback" not in missing.stderr
    url = run_cli("serve", "tiny-llama", "--endpoint", "localhost:8080")
    assert url.exit_code == 2 and "not an http(s) URL" in url.stderr
    levels = run_cli("serve", "tiny-llama", "--concurrency", "1,x")
    assert levels.exit_code == 2 and "--concurrency" in levels.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    rejected = run_cli("serve", str(bad))
    assert rejected.exit_code == 2 and "Traceback" not in rejected.stderr
    assert not list(tmp_path.glob("**/results.jsonl"))


def test_a_server_that_rejects_its_model_is_named_with_its_log(tmp_path):
    from harness.core.errors import MeasurementError
    from harness.engine.server import ServerSpec, start_server

    not_a_model = tmp_path / "empty.gguf"
    not_a_model.write_bytes(b"")
    before = _xserver_pids()
    with pytest.raises(MeasurementError, match=r"the server exited \(status"):
        start_server(ServerSpec("xllamacpp", not_a_model), start_timeout_s=30)
    assert _xserver_pids() <= before


@pytest.mark.parametrize("text, where", [
    ("name: s\nmodel: tiny-llama\nserve:\n  slots: 2\n  concurency: [1]\n", ":5: serve.concurency"),
    ("name: s\nmodel: tiny-llama\nserve:\n  endpoint: localhost:80\n", ":4: serve.endpoint"),
    ("name: s\nmodel: tiny-llama\nserve:\n  slo: {ttft: 5}\n", ":4: serve.slo.ttft"),
    ("name: s\nmodel: tiny-llama\nserve:\n  rate: [1, -2]\n", ":4: serve.rate[1]"),
    ("name: s\nmodel: tiny-llama\nserve:\n  slots: 0\n", ":4: serve.slots"),
    ("name: s\nmodel: tiny-llama\nserve:\n  pin_slots: maybe\n", ":4: serve.pin_slots"),
])
def test_serving_scenario_errors_name_file_line_and_key(run_cli, tmp_path, text, where):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    result = run_cli("run", str(path), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and f"{path}{where}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_a_serving_scenario_runs_and_resumes_keeping_finished_levels(run_cli, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ntitle: Tiny under load\nmodel: tiny-llama\ndtype: f16\nserve:\n"
                    "  slots: 2\n  threads: 1\n  concurrency: [1, 2]\n  requests: 2\n"
                    "  prompt: 8\n  generate: 4\n  inprocess: false\n")
    out = tmp_path / "out"
    assert run_cli("run", str(path), "--out", str(out)).exit_code == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["scenario"]["title"] == "Tiny under load"
    assert (out / "report.md").read_text().startswith("# Tiny under load")
    # cut the run short inside level c2: its requests stay, its level record is gone
    cut = [x for x in lines if not (json.loads(x).get("type") == "level"
                                     and json.loads(x)["level"] == "c2")]
    (out / "results.jsonl").write_text("\n".join(cut) + "\n")
    result = run_cli("run", str(path), "--out", str(out), "--resume")
    assert result.exit_code == 0 and "1 in flight: kept from the earlier run" in result.stderr
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["level"] for r in records if r["type"] == "level"] == ["c1", "c2"]
    assert sum(r["type"] == "request" and r["level"] == "c2" for r in records) == 2
    assert sum(r["type"] == "header" for r in records) == 1
    # the served model's costs and c1's probes are kept; c2's records (probes and requests of
    # a level cut short) are dropped, and c2 runs again whole
    assert sum(r["type"] == "model" for r in records) == 1
    assert [r["when"] for r in records if r["type"] == "probe"] == [
        "c1 round 0", "c1 after", "c2 round 0", "c2 after"]
    assert [r["type"] for r in records].count("resume") == 1
    # a resume with another prompt length is refused before any server starts
    before = (out / "results.jsonl").read_bytes()
    path.write_text(path.read_text().replace("prompt: 8", "prompt: 16"))
    refused = run_cli("run", str(path), "--out", str(out), "--resume")
    assert_user_error(refused, "cannot resume", "workload.n_prompt 16 (was 8)")
    assert (out / "results.jsonl").read_bytes() == before
    assert "Decode is bounded by" in (out / "report.md").read_text()


def test_a_difference_between_the_builds_is_said_with_the_measured_ratios():
    from harness.report.serving import build_difference, cpu_features

    avx2 = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | REPACK = 1 | "
    avx512 = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1 |"
    assert cpu_features(avx2) == {"SSE3", "AVX2", "REPACK"}

    def level(label, served, inproc):
        summary = level_summary([RequestTiming(0.0, (0.1, 0.2), (1, 1), 0.2, 2, 8)], 0, 1.0)
        return to_dict(typed({"type": "level", "level": label, "label": label,
                              "summary": summary, "inprocess_decode_tok_s": [inproc, inproc],
                              "steady_decode": {"tok_s": served, "window_s": 1.0,
                                                "n_tokens": 9}}))

    levels = [level("1 in flight", 9.9, 10.0), level("4 in flight", 28.0, 40.0)]
    said = build_difference({"system_info": {"server": avx2, "inprocess": avx512}}, levels)
    assert "also uses AVX512, AVX512_VNNI" in said
    assert "0.99 at 1 in flight and 0.70 at 4 in flight" in said
    same = {"system_info": {"server": avx512, "inprocess": avx512}}
    assert build_difference(same, levels) is None


def test_rounds_pair_served_decode_with_the_in_process_figures_either_side():
    from harness.serving import ServingRun, _n_rounds, _paired_rounds, _share, timings_of

    def request(start: float, tok_s: float) -> dict:  # 1 + 8 tokens at tok_s
        chunks = [start + i / tok_s for i in range(9)]
        return {"error": None, "sent_s": start - 0.1, "chunk_s": chunks, "chunk_tokens":
                [1] * 9, "end_s": chunks[-1], "usage": {"completion_tokens": 9,
                                                        "prompt_tokens": 4}, "timings": {}}

    rounds = [timings_of([request(0.0, rate)]) for rate in (10.0, 20.0, 40.0)]
    # the machine doubles its speed each round; in-process figures either side follow it
    out = _paired_rounds(rounds, [9.0, 12.0, 24.0, 48.0], concurrency=1)
    assert [r["inprocess_tok_s"] for r in out["per_round"]] == pytest.approx(
        [(9 * 12) ** 0.5, (12 * 24) ** 0.5, (24 * 48) ** 0.5])
    ratios = [10 / (9 * 12) ** 0.5, 20 / (12 * 24) ** 0.5, 40 / (24 * 48) ** 0.5]
    stat = out["served_of_inprocess"]
    assert stat["n"] == 3 and stat["ratio"] == pytest.approx(
        (ratios[0] * ratios[1] * ratios[2]) ** (1 / 3))
    assert stat["median_ci95"][0] < stat["ratio"] < stat["median_ci95"][1]
    assert [_share(7, 3, i) for i in range(3)] == [3, 2, 2]
    w = Workload(n_prompt=8, n_generate=4, n_vocab=64, n_requests=6, duration_s=10)
    run = ServingRun((), w, rounds=3)
    assert _n_rounds(run, Level(concurrency=1)) == 3
    assert _n_rounds(run, Level(concurrency=4)) == 1  # a round needs a request per worker
