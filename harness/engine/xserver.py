"""Run llama.cpp's HTTP server from the xllamacpp wheel (llama-server's own code, continuous
batching, no compile) in a process of its own: `python -m harness.engine.xserver MODEL --port P
--slots N ...`. The harness starts it and stops it (engine/server.py); it never imports it."""

from __future__ import annotations

import argparse
import signal


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m harness.engine.xserver")
    p.add_argument("model")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--ctx", type=int, default=4096, help="context of all slots together")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--ubatch", type=int, default=512)
    args = p.parse_args(argv)
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_parallel = args.slots
    params.n_ctx = args.ctx
    params.n_ubatch = args.ubatch
    params.endpoint_metrics = True
    params.warmup = False
    if args.threads:
        params.cpuparams.n_threads = args.threads
        params.cpuparams_batch.n_threads = args.threads
    server = xllamacpp.Server(params)  # listens until the process ends
    print(f"listening {server.listening_address}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    main()
