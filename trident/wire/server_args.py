"""The server arguments every process receives, written once by launch.py.

launch.py parses the command line into a `ServerArgs`, writes it as MessagePack into the
private run directory, and each child reads it back with `load_server_args`. Nothing
mutates it after launch: it is configuration, not state.
"""

from __future__ import annotations

import msgspec

from trident.wire.codec import decode_plain, encode_plain


class ServerArgs(msgspec.Struct, kw_only=True, frozen=True):
    """Configuration shared by the tokenizer, the scheduler and the workers."""

    # Model
    model_path: str
    """Resolved model location: a `.gguf` file or a Hugging Face-style directory."""
    served_model_name: str = "smollm2-135m"
    """The name clients pass as `model`; other names get a 404."""
    device: str = "cpu"
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16; the worker resolves auto per device."""
    weight_dtype: str = "auto"
    """auto (the same as dtype) | int8 (weight-only int8 linear layers, CPU)."""
    linear_weights: str = "auto"
    """auto | packed | plain: CPU linear weights pre-packed for oneDNN (auto: in bf16 and
    float32 on CPU) or kept plain for torch's F.linear (gpu_worker/packed_linear.py)."""
    compile_decode: str = "auto"
    """auto | on | off: torch.compile of decode steps (gpu_worker/compiled_decode.py)."""
    decode_attention: str = "auto"
    """auto | kernel | torch: decode attention through the C++ kernel on CPU (auto: when it
    builds; kernel: fail at start-up if it does not) or through torch ops (attention.py)."""
    context_length: int = 0
    """Maximum prompt + output tokens per request; 0 means the model's own limit."""
    seed: int = 0

    # HTTP front door
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_queued_requests: int = 1024
    max_request_body_bytes: int = 4 * 1024 * 1024

    # Scheduling and memory
    max_running_requests: int = 64
    max_total_tokens: int = 0
    """KV pool size in tokens; 0 derives it from mem_fraction."""
    mem_fraction: float = 0.1
    """Fraction of free host (cpu) or device (cuda) memory given to the KV pool."""
    page_size: int = 1
    chunked_prefill_size: int = 512
    max_prefill_tokens: int = 2048
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    disable_overlap: bool = False
    check_seq_lens: bool = False
    speculative_algorithm: str | None = None
    """None, or "ngram" (prompt-lookup drafts verified in one forward)."""
    speculative_num_draft_tokens: int = 4

    # Parallelism (wire/cluster.py lays the processes out over nodes)
    tp_size: int = 1
    dp_size: int = 1
    """Independent scheduler + TP-group replicas behind the one tokenizer."""
    load_balance_method: str = "round_robin"
    """How the tokenizer picks a replica: round_robin | shortest_queue | longest_prefix."""
    nnodes: int = 1
    node_rank: int = 0
    dist_init_host: str = "127.0.0.1"
    dist_init_port: int = 0
    """--dist-init-addr: the base of every cross-node port; 0 (single node, no address given)
    means each worker group rendezvous on a free loopback port chosen by the supervisor."""
    cluster_secret: str = ""
    """Hex HMAC key that signs every cross-node frame; empty on a single node."""
    base_gpu_id: int = 0
    """With device cuda, rank r runs on cuda:{base_gpu_id + r} (per node)."""

    # Simulation
    worker: str = "model"
    """model: workers run the model; simulated: workers sleep for the step time sim_profile
    predicts and produce pseudo-tokens (gpu_worker/simulated.py)."""
    sim_profile: str | None = None
    """Step-time profile JSON of the simulated workers (profiles/, gpu_worker.fit_profile)."""
    sim_step_spread: bool = True
    """Scale each simulated step by a draw from the profile's measured spread of step times
    (StepProfile.step_time_ratios); False: every step takes the prediction exactly."""

    # Processes
    run_dir: str = ""
    """Private (0700) directory holding the ipc:// endpoints of this run."""
    log_level: str = "info"
    startup_timeout_s: float = 300.0
    watchdog_timeout_s: float = 60.0
    """A step that does not finish within this long counts as a hung worker."""
    max_restarts: int = 5
    restart_window_s: float = 300.0
    """More than max_restarts within this window: stop restarting, report unhealthy."""
    shutdown_timeout_s: float = 10.0
    """On SIGTERM, how long open requests may run before they are aborted."""

    # Measurement
    record_batches: str | None = None
    """Append every frame sent to the workers, and every result, to this file."""
    profile_steps: bool = False
    """Log scheduler, wire, forward and worker idle time of every step."""


def write_server_args(args: ServerArgs, path: str) -> None:
    with open(path, "wb") as f:
        f.write(encode_plain(args))


def load_server_args(path: str) -> ServerArgs:
    with open(path, "rb") as f:
        return decode_plain(f.read(), ServerArgs)
