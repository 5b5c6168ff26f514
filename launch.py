"""Start, supervise and stop trident: `python launch.py [--model PATH] [--port N] ...`.

launch.py parses the command line, resolves the model, makes the private run directory
(mode 0700) that holds every ipc:// endpoint, and hands the processes to `supervisor.py`,
which starts the worker ranks, the scheduler and the tokenizer, waits for each to report
ready and restarts what dies. SIGINT/SIGTERM drain and stop every child and remove the
run directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile

from model_source import ModelNotFound, resolve_model
from supervisor import Launcher, StartupError, free_port
from wire.server_args import ServerArgs, write_server_args

__all__ = ["Launcher", "StartupError", "build_parser", "main", "server_args_from_cli"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch.py",
        description="trident: an OpenAI-compatible LLM server (tokenizer, scheduler, workers).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=None,
        help="a .gguf file or a Hugging Face-style directory; default: the bundled SmolLM2-135M",
    )
    m.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    m.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the workers run")
    m.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weight and KV dtype; auto is bfloat16 on CUDA and on CPUs with AVX-512, else float32",
    )
    m.add_argument("--context-length", type=int, default=0, help="max prompt+output tokens; 0: the model's")
    m.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address the HTTP server binds")
    h.add_argument("--port", type=int, default=30000, help="HTTP port")
    h.add_argument(
        "--api-key",
        default=os.environ.get("TRIDENT_API_KEY"),
        help="require `Authorization: Bearer KEY` (env TRIDENT_API_KEY)",
    )
    h.add_argument("--max-queued-requests", type=int, default=1024, help="beyond this, answer 503")
    s = p.add_argument_group("scheduling and memory")
    s.add_argument("--max-running-requests", type=int, default=64, help="requests in the batch at once")
    s.add_argument("--max-total-tokens", type=int, default=0, help="KV pool size in tokens; 0: use --mem-fraction")
    s.add_argument(
        "--mem-fraction",
        type=float,
        default=0.1,
        help="fraction of free host (cpu) or GPU (cuda) memory for the KV pool",
    )
    s.add_argument("--page-size", type=int, default=1, help="tokens per KV page")
    s.add_argument("--chunked-prefill-size", type=int, default=512, help="max prompt tokens of one request per step")
    s.add_argument("--max-prefill-tokens", type=int, default=2048, help="max prompt tokens per step")
    s.add_argument(
        "--schedule-policy",
        choices=["fcfs", "lpm"],
        default="fcfs",
        help="queue order: first come first served, or longest cached prefix first",
    )
    s.add_argument("--disable-radix-cache", action="store_true", help="do not reuse KV of shared prefixes")
    s.add_argument(
        "--disable-overlap",
        action="store_true",
        help="plain loop: build step N+1 only after step N's results are processed",
    )
    s.add_argument(
        "--check-seq-lens",
        action="store_true",
        help="debug: assert the scheduler's seq_lens mirror against the worker's every step",
    )
    sp = p.add_argument_group("speculative decoding")
    sp.add_argument(
        "--speculative-algorithm",
        choices=["ngram"],
        default=None,
        help="ngram: draft from the request's own history (prompt lookup), verify in one forward",
    )
    sp.add_argument("--speculative-num-draft-tokens", type=int, default=4, help="draft tokens per step (K)")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (one worker process each)")
    par.add_argument("--base-gpu-id", type=int, default=0, help="with --device cuda, rank r uses GPU base-gpu-id + r")
    o = p.add_argument_group("processes")
    o.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    o.add_argument("--startup-timeout", type=float, default=300.0, help="seconds each process may take to be ready")
    o.add_argument(
        "--watchdog-timeout",
        type=float,
        default=60.0,
        help="a step with no result for this long counts as a hung worker, which is restarted",
    )
    o.add_argument("--max-restarts", type=int, default=5, help="restarts allowed within --restart-window")
    o.add_argument("--restart-window", type=float, default=300.0, help="seconds over which restarts are counted")
    o.add_argument("--record-batches", metavar="FILE", default=None,
                   help="record every descriptor and step result (replay: python -m gpu_worker.replay FILE)")
    o.add_argument("--profile-steps", action="store_true",
                   help="log scheduler, wire, forward and worker idle time of every step")
    o.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM/Ctrl-C, seconds open requests may finish before they are aborted",
    )
    return p


def server_args_from_cli(ns: argparse.Namespace, model_path: str, served_name: str, run_dir: str) -> ServerArgs:
    return ServerArgs(
        model_path=model_path,
        served_model_name=ns.served_model_name or served_name,
        device=ns.device,
        dtype=ns.dtype,
        context_length=ns.context_length,
        seed=ns.seed,
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        max_queued_requests=ns.max_queued_requests,
        max_running_requests=ns.max_running_requests,
        max_total_tokens=ns.max_total_tokens,
        mem_fraction=ns.mem_fraction,
        page_size=ns.page_size,
        chunked_prefill_size=ns.chunked_prefill_size,
        max_prefill_tokens=ns.max_prefill_tokens,
        schedule_policy=ns.schedule_policy,
        disable_radix_cache=ns.disable_radix_cache,
        disable_overlap=ns.disable_overlap,
        check_seq_lens=ns.check_seq_lens,
        speculative_algorithm=ns.speculative_algorithm,
        speculative_num_draft_tokens=ns.speculative_num_draft_tokens,
        tp_size=ns.tp_size,
        run_dir=run_dir,
        log_level=ns.log_level,
        startup_timeout_s=ns.startup_timeout,
        watchdog_timeout_s=ns.watchdog_timeout,
        max_restarts=ns.max_restarts,
        restart_window_s=ns.restart_window,
        shutdown_timeout_s=ns.shutdown_timeout,
        record_batches=os.path.abspath(ns.record_batches) if ns.record_batches else None,
        profile_steps=ns.profile_steps,
        dist_init_port=free_port() if ns.tp_size > 1 else 0,
        base_gpu_id=ns.base_gpu_id,
    )


def ready_banner(args: ServerArgs) -> str:
    url = f"http://{args.host}:{args.port}"
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    return (
        f"trident ready: {url} serving {args.served_model_name!r}. Try: curl {url}/v1/completions"
        f' -H \'Content-Type: application/json\'{auth} -d \'{{"model": "{args.served_model_name}", '
        f'"prompt": "The capital of France is", "max_tokens": 16}}\''
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.tp_size < 1:
        print(f"error: --tp-size must be at least 1, not {ns.tp_size}", file=sys.stderr)
        return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s trident::launch %(levelname)s %(message)s")
    try:
        model_path, served_name = resolve_model(ns.model)
    except ModelNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = tempfile.mkdtemp(prefix="trident-")  # mode 0700
    stop = {"requested": False}

    def on_signal(signum, _frame) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    args = server_args_from_cli(ns, model_path, served_name, run_dir)
    args_file = os.path.join(run_dir, "server_args.msgpack")
    write_server_args(args, args_file)
    launcher = Launcher(args, args_file)
    code = 0
    try:
        launcher.start_all()
        print(ready_banner(args), flush=True)
        code = launcher.supervise(lambda: stop["requested"])
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        launcher.stop_all()
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
