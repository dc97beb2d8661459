"""The one module that speaks HTTP: streamed completions from an OpenAI-compatible server
(llama-server's extensions included), their server-sent events time-stamped as they arrive,
the server's health and its Prometheus counters. httpx does the HTTP; the SSE framing is a
dozen lines, one `data:` payload per event as llama-server and vLLM send them."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import AsyncIterator, Iterable

import httpx

from ..core.errors import HarnessError

# A server that does not accept a connection in this long is not there: a request's own
# timeout (minutes: a long prompt) must not become a wait on a typo in the endpoint.
CONNECT_TIMEOUT_S = 10.0


def client_timeout(timeout_s: float) -> httpx.Timeout:
    """A request's timeout with the connect bounded by CONNECT_TIMEOUT_S."""
    return httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))


def is_loopback_host(host: str) -> bool:
    """localhost or a loopback address (127.0.0.0/8, ::1); no name is looked up."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_endpoint(url: str, allow_remote: bool = False) -> str:
    """An http(s) URL with a host and a valid port, on this machine unless allow_remote; the
    URL without its trailing slash, or one line saying what is wrong."""
    fix = "e.g. --endpoint http://127.0.0.1:8080"
    if not url.startswith(("http://", "https://")):
        raise HarnessError(f"not an http(s) URL: {url[:80]}", key="--endpoint", fix=fix)
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise HarnessError(f"not a valid URL ({str(exc)[:80]}): {url[:80]}", key="--endpoint",
                           fix=fix) from None
    if not parsed.host:
        raise HarnessError(f"no host in {url[:80]}", key="--endpoint", fix=fix)
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise HarnessError(f"not a valid URL (port {parsed.port} is not 1-65535): {url[:80]}",
                           key="--endpoint", fix=fix)
    if not allow_remote and not is_loopback_host(parsed.host):
        raise HarnessError(f"{parsed.host} is not this machine: loading it would send "
                           "requests to another server", key="--endpoint",
                           fix="serve on 127.0.0.1, or pass --allow-remote if that server is "
                               "yours to load")
    return url.rstrip("/")


class SSEFraming:
    """Server-sent events, line by line: feed() returns an event's data when a blank line ends
    it (multi-line data joined by newlines), else None."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if line.startswith("data:"):
            self._data.append(line[5:].removeprefix(" "))
        elif not line.strip() and self._data:
            payload, self._data = "\n".join(self._data), []
            return payload
        return None

    def flush(self) -> str | None:
        """The data of an event the stream ended without a blank line after."""
        return self.feed("")


def sse_payloads(lines: Iterable[str]) -> list[str]:
    """The data payloads of a whole server-sent event stream ([DONE] included)."""
    framing = SSEFraming()
    out = [p for line in lines if (p := framing.feed(line)) is not None]
    return out + [p] if (p := framing.flush()) is not None else out


def completion_body(prompt: list[int], n_predict: int, cache_prompt: bool) -> dict:
    """A streamed /v1/completions request for exactly n_predict tokens from token ids (EOS
    ignored: a random model would stop anywhere), usage and per-chunk timings asked for, and
    llama-server's prompt progress: its first progress event leaves when a slot starts the
    prompt, so the client sees when the request stopped waiting."""
    return {"prompt": prompt, "max_tokens": n_predict, "n_predict": n_predict, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "cache_prompt": cache_prompt,
            "timings_per_token": True, "return_progress": True,
            "stream_options": {"include_usage": True}}


async def _events(response: httpx.Response) -> AsyncIterator[tuple[float, dict | None]]:
    """(arrival time, parsed event) per SSE event; None for [DONE]."""
    framing = SSEFraming()
    async for line in response.aiter_lines():
        if (payload := framing.feed(line)) is not None:
            yield time.perf_counter(), _parsed(payload)
    if (payload := framing.flush()) is not None:
        yield time.perf_counter(), _parsed(payload)


def _parsed(payload: str) -> dict | None:
    return None if payload.strip() == "[DONE]" else json.loads(payload)


def _tokens_of(event: dict, seen: int) -> tuple[int | None, int]:
    """Tokens this chunk carried, from llama-server's running predicted_n (None if absent)."""
    n = (event.get("timings") or {}).get("predicted_n")
    return (None, seen) if n is None else (n - seen, n)


async def stream_completion(client: httpx.AsyncClient, base_url: str, body: dict,
                            timeout_s: float) -> dict:
    """Send one streamed completion; return its record: send time, the arrival of the first
    prompt-progress event (None where the server sends none), each content chunk's arrival and
    tokens, end time, usage and the server's own timings, or the error."""
    record: dict = {"sent_s": time.perf_counter(), "started_s": None, "chunk_s": [],
                    "chunk_tokens": [], "usage": None, "timings": None, "error": None}
    try:
        await asyncio.wait_for(_receive(client, base_url, body, record), timeout_s)
    except asyncio.TimeoutError:
        record["error"] = f"no answer within {timeout_s:g} s"
    except (httpx.HTTPError, ServerReply, ValueError, KeyError, TypeError, AttributeError,
            IndexError) as exc:  # a reply that is not the stream asked for fails this request
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    record["end_s"] = time.perf_counter()
    return record


async def _receive(client: httpx.AsyncClient, base_url: str, body: dict, record: dict) -> None:
    seen = 0
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:200]
            raise ServerReply(f"HTTP {resp.status_code}: {text}")
        async for arrived, event in _events(resp):
            if event is None:
                break
            seen = _note_event(record, event, arrived, seen)


def _note_event(record: dict, event: dict, arrived: float, seen: int) -> int:
    if "error" in event:
        raise ServerReply(str(event["error"])[:200])
    record["usage"] = event.get("usage") or record["usage"]
    record["timings"] = event.get("timings") or record["timings"]
    if event.get("prompt_progress") is not None and record["started_s"] is None:
        record["started_s"] = arrived
    choice = (event.get("choices") or [{}])[0]
    n, seen_now = _tokens_of(event, seen)
    if choice.get("text") or (n or 0) > 0:
        record["chunk_s"].append(arrived)
        record["chunk_tokens"].append(n)
    return seen_now


class ServerReply(Exception):
    """The server answered, but not with a stream of completions."""


def healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """The server answers /health with 200 (llama-server: model loaded)."""
    try:
        return httpx.get(f"{base_url}/health", timeout=client_timeout(timeout_s)).status_code == 200
    except httpx.HTTPError:
        return False


def prometheus_counters(base_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """llama-server's /metrics as {name: value}; None where it has none (no --metrics)."""
    try:
        resp = httpx.get(f"{base_url}/metrics", timeout=client_timeout(timeout_s))
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    out = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#") and len(parts := line.split()) == 2:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                continue
    return out
