"""Every option a serving run takes, once: a scenario's `serve:` key, the plan's field, its
default and its bounds. The serving scenario loader (harness.servescenario) and harness serve's
command-line options both read these tables, so a default is stated in one place."""

from __future__ import annotations

MAX_TOKENS = 1 << 20
MAX_CONCURRENCY = 4096
REQUEST_TIMEOUT_S = 300.0  # a request that stalls this long fails (engine/load)

# key: (ServePlan field, default, minimum, maximum)
SERVE_NUMBERS = {
    "slots": ("slots", 4, 1, 256),
    "requests": ("n_requests", 32, 1, 100_000),
    "duration_s": ("duration_s", 120.0, 1, 86_400),
    "prompt": ("n_prompt", 128, 1, MAX_TOKENS),
    "generate": ("n_generate", 64, 1, MAX_TOKENS),
    "warmup": ("warmup", 1, 0, 100),
    "threads": ("threads", 0, 0, 1024),  # 0: the physical cores
    "rounds": ("rounds", 3, 1, 1000),
    "timeout_s": ("timeout_s", REQUEST_TIMEOUT_S, 1, 86_400),
}
SERVE_FLAGS = {"prefix_cache": False, "inprocess": True, "pin_slots": True}

# The built-in page templates (harness/report/templates): the course page, the full report and
# one page per lever. A scenario's `template:` and `harness report --template` take one of these
# names or a template file.
PAGE_TEMPLATES = ("lesson", "memory_lesson", "full", "experts", "quant", "kv_depth", "batching",
                  "threads", "prefix", "twins")
