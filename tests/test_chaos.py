"""Chaos under the default restart flags: streaming clients (the official openai client, no
retries) run greedy completions back to back while the worker or the scheduler is SIGKILLed
at random, more often than the old budget of 5 restarts allowed. Nothing is lost, every text
equals the fault-free run, a killed tokenizer is back within 15 s, and killing the launcher
leaves no process behind.

`python -m pytest -q -s -n 0 tests/test_chaos.py` prints the restart timeline (docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import psutil

from tests.helpers import Server, wait_until
from tests.workload import BASE, child
from trident.restart_policy import SETTLE_S

KILLS = 6
"""One more than the default --max-restarts: the old policy gave up at the sixth."""
CLIENTS = 4
MAX_TOKENS = 24
PROMPTS = [f"Story {i}: the {w} walked into the" for i, w in enumerate(["cat", "ship", "king", "storm", "river"])]
VICTIMS = {"worker": "trident::worker[tp0]", "scheduler": "trident::scheduler"}


class Load:
    """Clients streaming completions back to back; every received chunk's time is kept."""

    def __init__(self, server: Server, model: str) -> None:
        self.client = server.client(timeout=120)
        self.model = model
        self.arrivals: list[float] = []
        self.done: list[tuple[int, str]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._next = itertools.count()

    def stream(self, i: int) -> str:
        chunks = self.client.completions.create(
            model=self.model,
            prompt=PROMPTS[i],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = []
        for chunk in chunks:
            self.arrivals.append(time.monotonic())
            text.extend(c.text for c in chunk.choices)
        return "".join(text)

    def client_loop(self) -> None:
        while not self.stop.is_set():
            i = next(self._next) % len(PROMPTS)
            try:
                self.done.append((i, self.stream(i)))
            except Exception as e:  # noqa: BLE001 - any failure is a lost request, reported below
                self.errors.append(f"prompt {i}: {type(e).__name__}: {e}")

    def first_token_after(self, t: float, timeout: float = 90) -> float:
        assert wait_until(lambda: self.arrivals and self.arrivals[-1] > t, timeout, interval=0.02)
        return min(a for a in self.arrivals if a > t)


def ready_after(server: Server, role: str, wall: float) -> float | None:
    """Wall time of the first "<role> ready" launcher line logged after `wall`."""
    name = " worker[" if role == "worker" else f" {role} ready"
    for line in server.output:
        if name not in line or " ready (pid" not in line:
            continue
        stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if stamp > wall:
            return stamp
    return None


def wait_for_ready(server: Server, role: str, wall: float) -> float:
    assert wait_until(lambda: ready_after(server, role, wall), 90), server.log_tail()
    return ready_after(server, role, wall)


def test_random_sigkills_under_default_flags_lose_nothing_and_change_no_text(fault_model):
    server = Server(["--model", fault_model, *BASE])
    try:
        load = Load(server, os.path.basename(fault_model))
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            reference = list(pool.map(load.stream, range(len(PROMPTS))))
        rng = random.Random(28)
        timeline = []
        # The restart policy settles each unit on its own (restart_policy.py): a victim is
        # killed once it has served SETTLE_S since its own last ready, however recently the
        # other one came back. Both were ready before the server answered.
        ready_at = dict.fromkeys(VICTIMS, time.monotonic())
        with ThreadPoolExecutor(CLIENTS) as pool:
            clients = [pool.submit(load.client_loop) for _ in range(CLIENTS)]
            try:
                last = load.first_token_after(time.monotonic())
                for _ in range(KILLS):
                    jitter = rng.uniform(0, 2)
                    role = rng.choice(sorted(VICTIMS))
                    # Past the settle time since the target was last ready: a fault, not a crash loop.
                    time.sleep(max(0.0, ready_at[role] + SETTLE_S + 1 + jitter - time.monotonic()))
                    victim = child(server, VICTIMS[role])
                    killed, killed_wall = time.monotonic(), time.time()
                    victim.send_signal(signal.SIGKILL)
                    ready_at[role] = killed + wait_for_ready(server, role, killed_wall) - killed_wall
                    last = load.first_token_after(ready_at[role])  # not one already on its way before the kill
                    timeline.append((role, ready_at[role] - killed, last - killed))
            finally:
                load.stop.set()
            for c in clients:
                c.result()
        print_timeline(timeline)
        assert load.errors == [], load.errors[:5]
        assert len(load.done) >= 2 * KILLS
        assert [text for i, text in load.done if text != reference[i]] == []
        log = server.log_tail(10_000)
        assert "giving up" not in log and log.count("restarting after:") >= KILLS
        assert "quick failure" not in log  # each kill came after its victim settled: a fault

        killed = time.monotonic()
        child(server, "trident::tokenizer").send_signal(signal.SIGKILL)
        probe = server.client(timeout=5)

        def serving() -> bool:
            try:
                r = probe.completions.create(model=load.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
                return r.choices[0].text == reference[0]
            except Exception:  # noqa: BLE001 - not back yet
                return False

        assert wait_until(serving, 15, interval=0.2), server.log_tail()
        print(f"tokenizer SIGKILL -> serving again: {time.monotonic() - killed:.1f} s")

        tree = server.process_tree()
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree), 3)
    finally:
        server.stop()


def print_timeline(timeline: list[tuple[str, float, float]]) -> None:
    print("\n| kill | victim | kill -> ready again (s) | kill -> first token after (s) |")
    print("|---|---|---|---|")
    for n, (role, ready, first) in enumerate(timeline, 1):
        print(f"| {n} | {role} | {ready:.1f} | {first:.1f} |")
