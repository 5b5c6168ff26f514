"""Start, supervise and stop trident: `python launch.py [--model PATH] [--port N] ...`.

launch.py parses the command line, resolves the model, makes the private run directory
(mode 0700) that holds every ipc:// endpoint, and hands the processes to `supervisor.py`,
which starts the worker ranks, the schedulers and the tokenizer, waits for each to report
ready and restarts what dies. SIGINT/SIGTERM drain and stop every child and remove the
run directory.

Across nodes, every node runs launch.py with the same flags but its own --node-rank; node 0
serves HTTP and the others (node_agent.py) run only their worker ranks and /health.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile

from trident.model_source import ModelNotFound, resolve_model
from trident.node_agent import NodeAgent
from trident.supervisor import Launcher, StartupError
from trident.wire.cluster import ClusterError, layout_of, parse_dist_init_addr
from trident.wire.server_args import ServerArgs, write_server_args
from trident.wire.signing import new_secret, read_secret_file

__all__ = ["Launcher", "StartupError", "build_parser", "main", "server_args_from_cli"]


class UsageError(ValueError):
    """A flag value that cannot be used: a one-line error at launch, exit code 2."""


PROFILES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def packaged_profiles() -> list[str]:
    return sorted(name.removesuffix(".json") for name in os.listdir(PROFILES_DIR) if name.endswith(".json"))


def resolve_sim_profile(profile: str) -> str:
    """A profile file as given, else a packaged profile named with or without `.json`."""
    if os.path.isfile(profile):
        return os.path.abspath(profile)
    packaged = os.path.join(PROFILES_DIR, os.path.basename(profile).removesuffix(".json") + ".json")
    if os.path.isfile(packaged):
        return packaged
    raise UsageError(
        f"--sim-profile {profile}: no such file, and no packaged profile of that name "
        f"({', '.join(packaged_profiles())})"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trident serve",
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
        help="weight and KV dtype; auto is bfloat16 on CUDA and on CPUs with AVX-512 or AVX2, else float32",
    )
    m.add_argument(
        "--weight-dtype",
        choices=["auto", "int8"],
        default="auto",
        help="int8: linear layers as weight-only int8 with per-channel scales (CPU; faster at batch 1, "
        "slower from ~8 running requests)",
    )
    m.add_argument(
        "--linear-weights",
        choices=["auto", "packed", "plain"],
        default="auto",
        help="CPU linear layers: weights packed once at load for oneDNN (auto: bf16 and float32 on CPU; "
        "2x faster decode matmuls here; bf16 on a CPU without bf16 instructions: our AVX2 kernel instead) "
        "or plain, re-packed by F.linear on every call",
    )
    compiled = m.add_mutually_exclusive_group()
    compiled.add_argument(
        "--compile",
        dest="compile_decode",
        action="store_const",
        const="on",
        default="auto",
        help="torch.compile the decoder layer for decode steps (tp 1; ~25 s of compiling at start-up)",
    )
    compiled.add_argument(
        "--disable-compile",
        dest="compile_decode",
        action="store_const",
        const="off",
        help="run every step eager (the default)",
    )
    m.add_argument(
        "--decode-attention",
        choices=["auto", "kernel", "torch"],
        default="auto",
        help="decode attention on CPU: a C++ kernel reading the paged KV pool in place (built on first "
        "use, ~20 s, then cached; auto falls back to torch ops if it cannot be built) or torch ops",
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
    par.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="data-parallel replicas: each its own scheduler and TP group, behind one tokenizer",
    )
    par.add_argument(
        "--load-balance-method",
        choices=["round_robin", "shortest_queue", "longest_prefix"],
        default="round_robin",
        help="how the tokenizer picks a replica for each request (with --dp-size > 1)",
    )
    par.add_argument(
        "--base-gpu-id", type=int, default=0, help="with --device cuda, the first GPU this node uses (one per worker)"
    )
    par.add_argument("--nnodes", type=int, default=1, help="nodes the server spans")
    par.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node: 0 runs HTTP, tokenizer and schedulers; others only worker ranks",
    )
    par.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="node 0's address: torch.distributed rendezvous and every cross-node port from PORT up",
    )
    par.add_argument(
        "--cluster-secret-file",
        default=None,
        help="hex key signing cross-node frames (HMAC-SHA256); node 0 makes and prints one if absent",
    )
    sim = p.add_argument_group("simulation")
    sim.add_argument(
        "--worker",
        choices=["model", "simulated"],
        default="model",
        help="simulated: workers load no model, sleep for the profile's step time, emit pseudo-tokens",
    )
    sim.add_argument(
        "--sim-profile",
        metavar="PROFILE",
        default=None,
        help="step-time profile of simulated workers: a JSON file (python -m gpu_worker.fit_profile) or the "
        f"name of a packaged one ({', '.join(packaged_profiles())})",
    )
    sim.add_argument(
        "--sim-exact-steps",
        action="store_true",
        help="simulated steps take exactly the predicted time, without the spread a fitted profile measured",
    )
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
    o.add_argument(
        "--record-batches",
        metavar="FILE",
        default=None,
        help="record every descriptor and step result (replay: python -m gpu_worker.replay FILE)",
    )
    o.add_argument(
        "--profile-steps", action="store_true", help="log scheduler, wire, forward and worker idle time of every step"
    )
    o.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM/Ctrl-C, seconds open requests may finish before they are aborted",
    )
    return p


def cluster_secret_from_cli(ns: argparse.Namespace) -> str:
    """The hex key of a multi-node server: from --cluster-secret-file, or made by node 0 and
    printed once for the other nodes."""
    if ns.cluster_secret_file:
        try:
            return read_secret_file(ns.cluster_secret_file).hex()
        except (OSError, ValueError) as e:
            raise ClusterError(f"cannot read --cluster-secret-file: {e}") from None
    if ns.nnodes == 1:
        return ""
    if ns.node_rank != 0:
        raise ClusterError("nodes other than 0 need --cluster-secret-file (node 0 prints the secret)")
    secret = new_secret().hex()
    print(f"trident cluster secret (give it to the other nodes in --cluster-secret-file): {secret}", flush=True)
    return secret


def server_args_from_cli(ns: argparse.Namespace, model_path: str, served_name: str, run_dir: str) -> ServerArgs:
    """The ServerArgs of the command line; raises ClusterError for an impossible layout."""
    dist_host, dist_port = parse_dist_init_addr(ns.dist_init_addr) if ns.dist_init_addr else ("127.0.0.1", 0)
    cluster_secret = cluster_secret_from_cli(ns)
    args = ServerArgs(
        model_path=model_path,
        served_model_name=ns.served_model_name or served_name,
        device=ns.device,
        dtype=ns.dtype,
        weight_dtype=ns.weight_dtype,
        linear_weights=ns.linear_weights,
        compile_decode=ns.compile_decode,
        decode_attention=ns.decode_attention,
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
        dp_size=ns.dp_size,
        load_balance_method=ns.load_balance_method,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        dist_init_host=dist_host,
        dist_init_port=dist_port,
        cluster_secret=cluster_secret,
        worker=ns.worker,
        sim_profile=resolve_sim_profile(ns.sim_profile) if ns.sim_profile else None,
        sim_step_spread=not ns.sim_exact_steps,
        run_dir=run_dir,
        log_level=ns.log_level,
        startup_timeout_s=ns.startup_timeout,
        watchdog_timeout_s=ns.watchdog_timeout,
        max_restarts=ns.max_restarts,
        restart_window_s=ns.restart_window,
        shutdown_timeout_s=ns.shutdown_timeout,
        record_batches=os.path.abspath(ns.record_batches) if ns.record_batches else None,
        profile_steps=ns.profile_steps,
        base_gpu_id=ns.base_gpu_id,
    )
    layout_of(args)  # validates the layout
    return args


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
    if ns.tp_size < 1 or ns.dp_size < 1:
        print(f"error: --tp-size and --dp-size must be at least 1, not {ns.tp_size} and {ns.dp_size}", file=sys.stderr)
        return 2
    if (ns.worker == "simulated") != (ns.sim_profile is not None):
        print("error: --worker simulated and --sim-profile PROFILE.json go together", file=sys.stderr)
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
    try:
        args = server_args_from_cli(ns, model_path, served_name, run_dir)
    except (ClusterError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        shutil.rmtree(run_dir, ignore_errors=True)
        return 2
    args_file = os.path.join(run_dir, "server_args.msgpack")
    write_server_args(args, args_file)
    launcher = Launcher(args, args_file)
    launcher.stop_requested = lambda: stop["requested"]
    code = 0
    try:
        if args.node_rank > 0:
            code = run_worker_node(launcher, lambda: stop["requested"])
        else:
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


def run_worker_node(launcher: Launcher, stop_requested) -> int:
    agent = NodeAgent(launcher)
    try:
        url = agent.serve_health()
    except OSError as e:
        raise StartupError(f"cannot serve /health on {launcher.args.host}:{launcher.args.port}: {e}") from e
    print(f"trident node {launcher.args.node_rank} ready: health at {url}; waiting for node 0", flush=True)
    try:
        return agent.run(stop_requested)
    finally:
        agent.close()


if __name__ == "__main__":
    sys.exit(main())
