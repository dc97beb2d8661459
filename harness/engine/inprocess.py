"""The in-process yardstick of a served level: the same file decoding the same number of
sequences together through the bindings, with the server's settings (threads, batch and
ubatch, per-sequence context, flash attention auto, F16 KV cache, mmap)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .llama import Context, ContextParams, Model

FIRST_TOKEN = 3  # after the synthetic vocabulary's <unk>, <s>, </s>


class BatchedDecode:
    """A loaded model whose repeat(c) times c sequences prefilled then decoded together."""

    def __init__(self, path: Path, n_prompt: int, n_gen: int, per_seq_ctx: int, threads: int,
                 n_ubatch: int = 512, n_batch: int = 2048, seed: int = 0) -> None:
        self.model = Model(path)
        self.n_prompt, self.n_gen, self.per_seq_ctx = n_prompt, n_gen, per_seq_ctx
        self.threads, self.n_ubatch, self.n_batch = threads, n_ubatch, n_batch
        self.rng = np.random.default_rng([seed, 11])

    def aggregate_tok_s(self, n_seq: int) -> float:
        """One repetition: n_seq fresh random prompts prefilled, then n_gen steps of n_seq
        tokens; generated tokens ÷ the decode steps' time (synchronized, as the server's)."""
        vocab = self.model.info().n_vocab
        params = ContextParams(n_ctx=n_seq * self.per_seq_ctx, n_batch=self.n_batch,
                               n_ubatch=self.n_ubatch, n_threads=self.threads, n_seq_max=n_seq)
        ctx = Context(self.model, params)
        try:
            prompts = self.rng.integers(FIRST_TOKEN, vocab, (n_seq, self.n_prompt)).tolist()
            steps = self.rng.integers(FIRST_TOKEN, vocab, (self.n_gen, n_seq)).tolist()
            ctx.prefill_seqs(prompts)
            seconds = sum(ctx.decode_parallel(steps, self.n_prompt))
        finally:
            ctx.close()
        return n_seq * self.n_gen / seconds

    def close(self) -> None:
        self.model.close()
