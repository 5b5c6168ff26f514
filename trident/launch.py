"""Start, supervise and stop trident: `python launch.py [--model PATH] [--port N] ...`.

launch.py parses the command line, resolves the model, makes the private run directory
(mode 0700) that holds every ipc:// endpoint, and hands the processes to `supervisor.py`,
which starts the worker ranks, the schedulers and the tokenizer, waits for each to report
ready and restarts what dies. SIGINT/SIGTERM drain and stop every child and remove the
run directory.

Across nodes, every node runs launch.py with the same flags but its own --node-rank; node 0
serves HTTP and the others (node_agent.py) run only their worker ranks and /health. With
--distributed-executor ray, launch.py runs once, on a node of a Ray cluster, and Ray places
the worker ranks (ray_workers.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import NoReturn

from trident.flags import build_parser, flag_values
from trident.foreign_flags import log_foreign_flags
from trident.generation_config import resolve_sampling_defaults
from trident.model_source import ModelNotFound, read_chat_template, resolve_model, resolve_tokenizer
from trident.node_agent import NodeAgent
from trident.supervisor import Launcher, StartupError
from trident.wire.cluster import ClusterError, ClusterLayout, layout_of, parse_dist_init_addr
from trident.wire.server_args import ServerArgs, write_server_args
from trident.wire.signing import new_secret, read_secret_file

__all__ = ["Launcher", "StartupError", "build_parser", "main", "run_and_exit", "server_args_from_cli"]


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


def ray_cluster_values(ns: argparse.Namespace) -> dict[str, str | int]:
    """--distributed-executor ray: joins (or starts) the Ray cluster; the head's address and
    ports that workers on any node reach, and the key that signs their frames."""
    try:
        from trident.ray_workers import connect, free_port_block
    except ImportError:
        raise UsageError("--distributed-executor ray needs Ray: pip install 'trident[ray]'") from None
    if ns.nnodes > 1:
        raise UsageError("--distributed-executor ray places ranks on the Ray cluster's nodes: drop --nnodes")
    head = connect(ns.ray_address)
    host, port = parse_dist_init_addr(ns.dist_init_addr) if ns.dist_init_addr else (head, 0)
    ports = ClusterLayout(ns.dp_size, ns.tp_size, 1, 0, host, 1, ranks_anywhere=True).port_count
    secret = read_secret_file(ns.cluster_secret_file).hex() if ns.cluster_secret_file else new_secret().hex()
    return dict(dist_init_host=host, dist_init_port=port or free_port_block(host, ports), cluster_secret=secret)


def server_args_from_cli(ns: argparse.Namespace, model_path: str, served_name: str, run_dir: str) -> ServerArgs:
    """The ServerArgs of the command line, with what launch resolves filled in; raises
    ClusterError or UsageError for values that cannot be used."""
    values = flag_values(ns)
    if ns.distributed_executor == "ray":
        cluster = ray_cluster_values(ns)
    else:
        host, port = parse_dist_init_addr(ns.dist_init_addr) if ns.dist_init_addr else ("127.0.0.1", 0)
        cluster = dict(dist_init_host=host, dist_init_port=port, cluster_secret=cluster_secret_from_cli(ns))
    if not 1 <= ns.speculative_ngram_min <= ns.speculative_ngram_max:
        raise UsageError(
            f"--speculative-ngram-min {ns.speculative_ngram_min} and --speculative-ngram-max "
            f"{ns.speculative_ngram_max}: need 1 <= min <= max"
        )
    names = ns.served_model_name or [served_name]
    try:
        sampling_defaults = resolve_sampling_defaults(ns.generation_config, ns.override_generation_config, model_path)
        chat_template = read_chat_template(ns.chat_template) if ns.chat_template else None
        tokenizer_path = resolve_tokenizer(ns.tokenizer_path) if ns.tokenizer_path else None
    except (ValueError, ModelNotFound) as e:  # GenerationConfigError, read_chat_template's, resolve_tokenizer's
        raise UsageError(str(e)) from None
    values.update(
        model_path=model_path,
        served_model_name=names[0],
        served_model_aliases=tuple(names[1:]),
        sampling_defaults=sampling_defaults,
        chat_template=chat_template,
        tokenizer_path=tokenizer_path,
        sim_profile=resolve_sim_profile(ns.sim_profile) if ns.sim_profile else None,
        record_batches=os.path.abspath(ns.record_batches) if ns.record_batches else None,
        run_dir=run_dir,
        **cluster,
    )
    args = ServerArgs(**values)
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


def cuda_missing() -> str | None:
    """Why `--device cuda` cannot run here, or None. torch is imported only when CUDA is
    asked for (it costs every other start a second)."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"--device cuda, but torch {torch.__version__} is a CPU-only build (docs/serving.md: 'On a GPU')"
    return f"--device cuda, but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.device == "cuda" and (why := cuda_missing()):
        print(f"error: {why}", file=sys.stderr)
        return 2
    if ns.tp_size < 1 or ns.dp_size < 1:
        print(f"error: --tp-size and --dp-size must be at least 1, not {ns.tp_size} and {ns.dp_size}", file=sys.stderr)
        return 2
    if (ns.worker == "simulated") != (ns.sim_profile is not None):
        print("error: --worker simulated and --sim-profile PROFILE.json go together", file=sys.stderr)
        return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s trident::launch %(levelname)s %(message)s")
    log_foreign_flags(ns)
    try:
        model_path, served_name = resolve_model(ns.model_path, ns.gguf_file)
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
    # Python writes a byte to this pair on each signal, which wakes the supervisor's poll at
    # once instead of at its next timeout (up to half a second later).
    launcher.signal_wakeup, signal_writer = socket.socketpair()
    signal_writer.setblocking(False)
    previous_wakeup_fd = signal.set_wakeup_fd(signal_writer.fileno())
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
        signal.set_wakeup_fd(previous_wakeup_fd)  # main() may run inside another program (tests)
        signal_writer.close()
        launcher.signal_wakeup.close()
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


def run_and_exit(argv: list[str] | None = None) -> NoReturn:
    """`main`, then exit without the interpreter's final garbage collection, a noticeable
    part of every stop; by then every child is gone and every file and socket is closed."""
    code = main(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
