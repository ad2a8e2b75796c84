"""`pdserve up`: a PD cluster on this machine (router + one prefill + one decode server).

Starts the three as child processes, waits until each answers /health, prints the URL and an
example request, and stops every child on Ctrl-C or SIGTERM. `--ask TEXT` sends one chat
request through the router, prints the answer, and stops everything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="router port")
    p.add_argument("--prefill-port", type=int, default=30001)
    p.add_argument("--decode-port", type=int, default=30002)
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument("--prefill-dp", type=int, default=2)
    p.add_argument("--decode-dp", type=int, default=2)
    p.add_argument("--transfer-backend", default="tcp", choices=["tcp", "mooncake"])
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool tokens per worker")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--ask", default=None, help="send this chat message, print the answer, then stop")
    p.add_argument("--max-tokens", type=int, default=64, help="for --ask")
    return p


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Cluster:
    def __init__(self, a: argparse.Namespace, model_dir: str):
        self.a = a
        self.model_dir = model_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def _spawn(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "pdserve", *args]
        self.procs.append((name, subprocess.Popen(cmd, start_new_session=True)))

    def start(self) -> None:
        a = self.a
        common = ["--model", self.model_dir, "--host", a.host, "--transfer-backend", a.transfer_backend,
                  "--max-total-tokens", str(a.max_total_tokens), "--dtype", a.dtype]
        self._spawn("prefill", ["serve", "--role", "prefill", "--port", str(a.prefill_port),
                                "--dp-size", str(a.prefill_dp), "--bootstrap-port", str(a.bootstrap_port),
                                *common])
        self._spawn("decode", ["serve", "--role", "decode", "--port", str(a.decode_port),
                               "--dp-size", str(a.decode_dp), *common])
        self._wait(f"http://{a.host}:{a.prefill_port}/health", "prefill")
        self._wait(f"http://{a.host}:{a.decode_port}/health", "decode")
        self._spawn("router", ["router", "--pd-disaggregation", "--host", a.host, "--port", str(a.port),
                               "--prefill", f"http://{a.host}:{a.prefill_port}", str(a.bootstrap_port),
                               "--decode", f"http://{a.host}:{a.decode_port}", "--policy", a.policy])
        self._wait(f"http://{a.host}:{a.port}/health", "router")

    def _wait(self, url: str, name: str) -> None:
        deadline = time.monotonic() + self.a.start_timeout
        while time.monotonic() < deadline:
            for n, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{n} exited with code {p.returncode} during start-up")
            if _get(url) == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{name} did not become healthy at {url} within {self.a.start_timeout:.0f}s")

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    from .core.envs import Envs
    from .model_files.resolve import ModelNotFound, resolve_model

    try:
        model_dir = resolve_model(a.model, Envs.read().cache_dir)  # convert once here, not in each child
    except ModelNotFound as e:
        sys.exit(f"pdserve up: {e}")
    cluster = Cluster(a, model_dir)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    url = f"http://{a.host}:{a.port}"
    try:
        cluster.start()
        example = {"model": "default", "messages": [{"role": "user", "content": a.ask or "What is the capital of France?"}],
                   "max_tokens": a.max_tokens, "temperature": 0}
        if a.ask is not None:
            reply = _post(f"{url}/v1/chat/completions", example)
            print(reply["choices"][0]["message"]["content"])
            return
        print(f"pdserve is up: router {url}  (prefill :{a.prefill_port} dp={a.prefill_dp}, "
              f"decode :{a.decode_port} dp={a.decode_dp})\ntry:\n  curl {url}/v1/chat/completions "
              f"-H 'Content-Type: application/json' -d '{json.dumps(example)}'", flush=True)
        while not stop["now"] and all(p.poll() is None for _, p in cluster.procs):
            time.sleep(0.5)
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        cluster.stop()
