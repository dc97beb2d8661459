"""harness: measure how LLM inference uses a machine's hardware."""

__version__ = "0.2.0"
