"""A worker that loads no model: `launch.py --worker simulated --sim-profile PROFILE.json`.

It runs the same descriptor loop as the model worker (worker_loop.py): the same
BatchState, the same seq_lens sync before an overlapped step, the same replies, so the
real tokenizer and scheduler cannot tell it from a model worker, except by its tokens.
Instead of a forward it sleeps for the step time its profile predicts from the step's
shape (step_profile.py), and it allocates no KV tensors, so a KV pool of millions of
tokens costs nothing.

Tokens are a hash of the token fed and its position (and the request's seed): like a
greedy model, a request's output depends only on its own tokens, so it is the same
across runs, with overlap on or off, after a retraction or a restart (resumed requests
feed the same tokens at the same positions), and with speculation on or off (a verifying
row accepts a hash-chosen number of drafts, and the accepted tokens are the same chain).
Tokens avoid EOS and the low ids (special and single-byte tokens), so requests run to
their length limit and every token detokenizes to text.

The rest of the host's share of the cores. A real worker on a CPU shares its cores with the
tokenizer and the scheduler, and with whatever else runs on the host (a benchmark's
client), and every moment they run during a step is taken from the forward; a sleeping
worker feels none of it. Where the profile says how many threads the real worker ran on how
many cores (StepProfile.contention), each step is stretched, live, by the CPU every other
process on the host but the server's workers used during it (sibling_cpu.py), less the
core-time the profiled worker's own threads left idle in a step of that shape, and
stretched again by what they used during the stretch, until it settles: the cost follows
whatever the front end and the client do on each step. A profile with a fitted
`frontend` share adds that instead; one with neither simulates a worker alone.

What it does not model (docs/benchmarks.md, "Simulated-worker fidelity", has them
measured): when the other processes run within a step (the idle core-time absorbs their CPU
wherever it falls), load that lasts the whole step (a sustained neighbour shares the cores
fairly; the stretch charges it as bursts, which overstates it), memory bandwidth another process
takes, the host's own speed drifting between the sweep and the run, the cost of tokens'
content (every token costs the same), and KV retraction pressure beyond what the
advertised pool implies.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from gpu_worker.model.weights import load_config
from gpu_worker.runtime.batch_state import BatchState, StepPlan
from gpu_worker.runtime.pooling import Pooler
from gpu_worker.runtime.sampler import SamplingTable
from gpu_worker.runtime.worker_loop import WorkerLoop
from gpu_worker.sim.sibling_cpu import SiblingCpu
from gpu_worker.sim.step_profile import StepProfile
from trident.wire.backend import BatchDescriptor, StepResult, WorkerError
from trident.wire.child import ChildContext
from trident.wire.logprobs import PromptLogprobs

logger = logging.getLogger(__name__)

LOWEST_TOKEN = 1000
"""Below this, byte-level BPE vocabularies keep special and single-byte tokens."""
_ACCEPT_SALT = 0x5BD1E995
MAX_STRETCHES = 4
"""Times a step is stretched for the front end's CPU during its previous stretch: each
stretch is a fraction of the last (the front end's share of a core), so a few settle it."""
SETTLED_S = 2e-4
"""A stretch shorter than this ends the step: a sleep that short costs about as much."""
_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(prev: np.ndarray, positions: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """splitmix64 of (token, position, seed): well spread, deterministic, vectorised."""
    with np.errstate(over="ignore"):
        x = prev.astype(np.uint64) * _M1 ^ positions.astype(np.uint64) * _M2 ^ seeds.astype(np.uint64) * _M3
        x ^= x >> np.uint64(30)
        x *= _M2
        x ^= x >> np.uint64(27)
        x *= _M3
        return x ^ (x >> np.uint64(31))


class SimulatedWorker(WorkerLoop):
    def __init__(self, ctx: ChildContext) -> None:
        super().__init__(ctx)
        args = ctx.args
        self.profile = StepProfile.load(args.sim_profile)
        # Draws from the profile's measured spread: a fixed sequence per rank, so that a rerun
        # of the same workload sleeps the same times.
        self._spread_draws = np.random.default_rng([args.seed, ctx.dp_rank, ctx.rank]) if args.sim_step_spread else None
        cfg = load_config(args.model_path)  # the header only: vocabulary, EOS, context length
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(cfg.eos_token_ids)
        self.context_length = min(args.context_length or cfg.max_position, cfg.max_position)
        self.lowest_token = LOWEST_TOKEN if cfg.vocab_size > 2 * LOWEST_TOKEN else 1
        pool_tokens = args.max_total_tokens or self.profile.kv_pool_tokens
        self.num_pages = pool_tokens // args.page_size + 1  # page 0 is the padding page
        self.num_draft_tokens = args.speculative_num_draft_tokens if args.speculative_algorithm else 0
        max_pages_per_row = -(-(self.context_length + 2 * self.num_draft_tokens + 2) // args.page_size) + 1
        cpu = torch.device("cpu")
        self.sampling = SamplingTable(args.max_running_requests, cfg.vocab_size, self.eos_token_ids, cpu)
        self.state = BatchState(args.max_running_requests, max_pages_per_row, args.page_size, self.sampling, cpu)
        self.pooler = Pooler(args.pooling, cfg.hidden_size, args.max_running_requests, cpu)
        self._row_offset = np.zeros(args.max_running_requests, dtype=np.int64)
        self.contention = self.profile.contention()
        self.others_cpu = SiblingCpu() if self.contention else None
        self.open_sockets(ctx)

    def summary(self) -> str:
        return f"simulated: {self.profile.description or self.args.sim_profile}"

    def draft_tokens(self, slot: int) -> np.ndarray:
        """Placeholders: only how many drafts a row verifies matters to a simulated step."""
        return np.zeros(self.num_draft_tokens, dtype=np.int64)

    def step(self, desc: BatchDescriptor) -> StepResult | WorkerError:
        if self.others_cpu is not None:
            self.others_cpu.mark()
        return super().step(desc)

    def forward_and_sample(self, plan: StepPlan | None) -> tuple[list[np.ndarray], list, list[PromptLogprobs]]:
        accepted: list[np.ndarray] = []
        # Placeholders, as its tokens are: a certain prediction of each scored prompt token.
        scored = (
            []
            if plan is None
            else [PromptLogprobs(start, [0.0] * len(t), [1] * len(t)) for _, start, t in plan.scored_chunks]
        )
        if plan is not None:
            accepted = self._pseudo_tokens(plan)
            if plan.pooled_rows:
                self.pooler.pool(plan, self._pseudo_states(plan))
            self.state.advance(plan, accepted)
        # Sleep out what this step costs, less what it already took.
        alone = self.step_seconds()
        self._sleep_until(self.step_started + alone)
        if self.others_cpu is not None and self.last_step_features[0]:
            self._stretch_for_other_processes(alone)
        return accepted, [], scored

    def _stretch_for_other_processes(self, alone: float) -> None:
        """Extends the step by what the other processes' CPU during it (the front end's, a
        client's) would have taken from a real worker (Contention.lost_seconds), including
        during the extension itself."""
        assert self.others_cpu is not None and self.contention is not None
        end = self.step_started + alone
        idle = self.profile.idle_core_seconds(self.last_step_features, alone)
        for _ in range(MAX_STRETCHES):
            elapsed = time.perf_counter() - self.step_started
            lost = self.contention.lost_seconds(self.others_cpu.since_mark(), elapsed, idle)
            new_end = self.step_started + alone + lost
            if new_end - end < SETTLED_S:
                return
            end = new_end
            self._sleep_until(end)

    @staticmethod
    def _sleep_until(deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def step_seconds(self) -> float:
        """This step's time before any live stretch: the profile's prediction for its shape
        (`last_step_features`), plus the fitted front-end share where the profile carries one,
        scaled by the next draw from the profile's measured spread unless --sim-exact-steps."""
        shape = self.last_step_features
        predicted = float(self.profile.predict(shape)) + self.profile.frontend_seconds(shape)
        if self._spread_draws is not None:
            predicted *= self.profile.spread(self._spread_draws.random())
        return predicted

    def _pseudo_tokens(self, plan: StepPlan) -> list[np.ndarray]:
        if not plan.sampling_slots:  # only prompt chunks that do not end their prompt
            return []
        state = self.state
        slots = np.asarray(plan.sampling_slots, dtype=np.int64)
        num_logits = np.asarray(plan.num_logits, dtype=np.int64)
        first_logit = np.cumsum(num_logits) - num_logits
        self._row_offset[plan.computing_slots] = np.cumsum(plan.q_lens) - plan.q_lens
        # The token each row feeds at its first logit position, and that position.
        fed = plan.host_ids[np.asarray(plan.logit_positions, dtype=np.int64)[first_logit]]
        decoding = state.decoding[slots]
        fed[decoding] = state.last_token[torch.from_numpy(slots[decoding])].numpy()
        positions = state.row_lens_host[slots] + np.asarray(plan.logit_positions)[first_logit] - self._row_offset[slots]
        seeds = np.asarray([self.sampling.params[s].seed or 0 for s in plan.sampling_slots], dtype=np.int64)
        num_accepted = 1 + mix64(fed, positions, seeds ^ _ACCEPT_SALT) % num_logits.astype(np.uint64)
        chain = []
        for k in range(int(num_logits.max())):
            fed = self._token_of(mix64(fed, positions + k, seeds))
            chain.append(fed)
        tokens = np.stack(chain, axis=1)
        return [tokens[i, :n] for i, n in enumerate(num_accepted.astype(np.int64).tolist())]

    def _pseudo_states(self, plan: StepPlan) -> torch.Tensor:
        """Final hidden states for the pooler: each token's one-hot at its id, so that an
        embedding depends only on its own tokens, as a model's would."""
        ids = plan.host_ids[self.pooler.positions(plan)] % self.pooler.dim
        return torch.nn.functional.one_hot(torch.from_numpy(ids), self.pooler.dim).float()

    def _token_of(self, hashed: np.ndarray) -> np.ndarray:
        span = np.uint64(self.vocab_size - self.lowest_token)
        tokens = (self.lowest_token + hashed % span).astype(np.int64)
        for eos in self.eos_token_ids:  # move off EOS to the next id (in range: EOS ids are low or last)
            tokens[tokens == eos] = self.lowest_token + (eos + 1 - self.lowest_token) % int(span)
        return tokens
