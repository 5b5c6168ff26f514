"""launch.py starts real processes and takes every one of them down again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from tests.helpers import REPO_ROOT, Server, wait_until


def run_dir_of(server: Server) -> str:
    return server.http().get("/server_info").json()["run_dir"]


def mapped_libraries(process: psutil.Process) -> set[str]:
    return {os.path.basename(m.path) for m in process.memory_maps()}


def test_sigterm_leaves_no_process_and_no_run_directory(tmp_path):
    server = Server(["--dtype", "float32", "--max-total-tokens", "2048"])
    try:
        children = {" ".join(p.cmdline()).strip(): p for p in server.process_tree()[1:]}
        assert sorted(children) == ["trident::scheduler", "trident::tokenizer", "trident::worker[tp0]"]
        # The tokenizer tokenizes without torch (tokenizer_proc/torchless.py): loading it was
        # most of that process's start-up CPU, taken from the worker loading beside it.
        assert "libtorch_cpu.so" in mapped_libraries(children["trident::worker[tp0]"])
        assert "libtorch_cpu.so" not in mapped_libraries(children["trident::tokenizer"])
        run_dir = run_dir_of(server)
        assert os.stat(run_dir).st_mode & 0o777 == 0o700
        res = server.client().completions.create(
            model="smollm2-135m", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert res.usage.completion_tokens == 4
        tree = server.process_tree()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=10) == 0
        assert wait_until(lambda: not any(p.is_running() and p.status() != "zombie" for p in tree), 2)
        assert not os.path.exists(run_dir)
    finally:
        server.stop()


def test_missing_model_is_a_one_line_error():
    res = subprocess.run(
        [sys.executable, "launch.py", "--model", "/nonexistent/model.gguf"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["error: /nonexistent/model.gguf: no such file or directory"]


def test_corrupt_model_is_a_one_line_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    res = subprocess.run(
        [sys.executable, "launch.py", "--model", str(bad)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2
    assert "not a GGUF file" in res.stderr and "Traceback" not in res.stderr


def test_help_explains_every_flag():
    res = subprocess.run(
        [sys.executable, "launch.py", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    for flag in [
        "--model",
        "--model-path",
        "--host",
        "--port",
        "--device",
        "--dtype",
        "--max-running-requests",
        "--max-total-tokens",
        "--mem-fraction",
        "--log-level",
        "--page-size",
        "--chunked-prefill-size",
    ]:
        assert flag in res.stdout
