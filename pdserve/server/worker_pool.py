"""A front's DP worker processes and the ZMQ channels to them.

Lifecycle: `start()` binds one PUSH socket per rank and one PULL socket (ipc:// in a private
temp dir), spawns one process per rank, and waits (deadline; fail fast when a process exits)
for WorkerReady or WorkerFailed from every rank. While serving, `submit`/`abort`/`stats` talk
to ranks and a reader task routes each TokenOutput to the sink of its rid; a monitor fails the
requests of a rank whose process died and calls the `on_dead` hooks. `stop()` sends
ShutdownReq, waits, then kills by pid.
The workers die with the front however it dies (core/child_process.py: a parent-death signal
armed for the thread that runs `start()`, the front's event loop thread, which outlives them).
Messages are core.messages dataclasses, pickled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from ..core.child_process import spawn_child
from ..core.config import ServerConfig
from ..core.errors import BadRequest, Timeout, Unavailable
from ..core.messages import (
    AbortReq,
    ErrorInfo,
    GenerateReq,
    OutputBatch,
    ShutdownReq,
    StatsReq,
    TokenOutput,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
)
from ..core.wait_policy import WaitChoice
from .worker_cmd import DEFAULT_WORKER_MODULE, wait_choice, worker_command, worker_env

log = logging.getLogger(__name__)
ABORT_GRACE_S = 60.0  # how long an aborted rid stays reserved waiting for the worker's last output
MONITOR_PERIOD_S = 0.2


class WorkerStartError(RuntimeError):
    pass


@dataclass
class _Stream:
    rank: int
    sink: asyncio.Queue | None  # None once aborted: outputs are dropped until the final one
    aborted_at: float = 0.0


@dataclass
class _StatsRound:
    future: asyncio.Future
    want: set[int]  # the ranks alive when the round started
    got: dict[int, WorkerStats] = field(default_factory=dict)

    def check(self) -> None:
        if self.want <= set(self.got) and not self.future.done():
            self.future.set_result(None)


class WorkerPool:
    def __init__(self, cfg: ServerConfig, model_dir: str, worker_module: str = DEFAULT_WORKER_MODULE,
                 start_timeout_s: float = 600.0, stop_timeout_s: float = 10.0):
        self.cfg = cfg
        self.model_dir = model_dir
        self.worker_module = worker_module
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.dp_size = cfg.dp_size
        self.procs: list[subprocess.Popen] = []
        self.ready: dict[int, WorkerReady] = {}
        self.failed: dict[int, str] = {}
        self.dead: dict[int, str] = {}  # rank -> why it is gone (while serving)
        self.on_dead: list[Callable[[int, str], None]] = []  # called once per rank that dies serving
        self._streams: dict[str, _Stream] = {}
        self._stats: dict[int, _StatsRound] = {}
        self._stats_ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._tmp: str | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._pushes: list[zmq.Socket] = []
        self._pull: zmq.asyncio.Socket | None = None
        self._stopping = False
        self.wait: WaitChoice | None = None  # how workers' OpenMP threads wait (server_info "cpu")

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, should_abort: Callable[[], bool] | None = None) -> list[WorkerReady]:
        try:
            if self.wait is None:  # may run probes for seconds the first time on a host
                self.wait = await asyncio.to_thread(wait_choice, self.cfg, os.environ)
            self._spawn()
            await self._wait_ready(should_abort)
        except BaseException:
            await self.stop()
            raise
        self._tasks.append(asyncio.create_task(self._monitor(), name="worker-monitor"))
        return [self.ready[r] for r in range(self.dp_size)]

    def _spawn(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="pdserve-front-")
        self._actx = zmq.asyncio.Context()
        sync_ctx = zmq.Context.shadow(self._actx.underlying)
        out_addr = f"ipc://{self._tmp}/out"
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(out_addr)
        # Secrets reach the workers through their environment, not their command lines (ps shows those).
        wcfg = dataclasses.replace(self.cfg, api_key="", bootstrap_token="")
        token = self.cfg.bootstrap_token
        secrets = {"PDSERVE_BOOTSTRAP_TOKEN": token} if token else {}
        for r in range(self.dp_size):
            push = sync_ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
            push.setsockopt(zmq.LINGER, 0)
            in_addr = f"ipc://{self._tmp}/in{r}"
            push.bind(in_addr)
            self._pushes.append(push)
            cmd = worker_command(self.worker_module, r, wcfg, self.model_dir, in_addr, out_addr)
            placement = worker_env(self.wait, os.environ)
            wenv = {**os.environ, **placement, **secrets}
            self.procs.append(spawn_child(cmd, stdin=subprocess.DEVNULL, env=wenv))
            log.info("started dp worker rank %d (pid %d, module %s)", r, self.procs[-1].pid, self.worker_module)
        self._tasks.append(asyncio.create_task(self._read_loop(), name="worker-reader"))

    async def _wait_ready(self, should_abort: Callable[[], bool] | None) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while len(self.ready) < self.dp_size:
            exited = [(r, p) for r, p in enumerate(self.procs) if p.poll() is not None and r not in self.ready]
            if exited and not self.failed:
                await asyncio.sleep(0.2)  # let a WorkerFailed sent just before exit arrive first
            if self.failed:
                r, msg = sorted(self.failed.items())[0]
                raise WorkerStartError(f"dp worker rank {r} failed to start: {msg}")
            if exited:
                r, p = exited[0]
                raise WorkerStartError(f"dp worker rank {r} (pid {p.pid}) exited with code "
                                       f"{p.returncode} during start-up")
            if should_abort is not None and should_abort():
                raise WorkerStartError("start-up interrupted by a shutdown request")
            if time.monotonic() > deadline:
                missing = [r for r in range(self.dp_size) if r not in self.ready]
                raise WorkerStartError(f"dp worker ranks {missing} not ready within {self.start_timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Idempotent: ShutdownReq to every ready rank (SIGTERM to one still starting), wait,
        SIGKILL leftovers by pid, close the channels."""
        if self._stopping:
            return
        self._stopping = True
        for r, p in enumerate(self.procs):
            if p.poll() is None and r in self.ready:
                self._send(r, ShutdownReq(), quiet=True)
            elif p.poll() is None:  # still starting: it may not read its channel yet
                p.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.kill_all()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._fail_streams(lambda s: True, "the server is shutting down", 503, "unavailable_error")
        for s in [*self._pushes, self._pull]:
            if s is not None:
                s.close(0)
        if self._actx is not None:
            self._actx.term()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def kill_all(self) -> None:
        """Synchronous last resort (also for atexit): SIGKILL every live worker and reap it."""
        for p in self.procs:
            if p.poll() is None:
                log.warning("killing dp worker pid %d", p.pid)
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("dp worker pid %d did not die", p.pid)

    # ---- requests ----------------------------------------------------------------------------
    def is_free(self, rid: str) -> bool:
        return rid not in self._streams

    def check_free(self, rids: list[str]) -> None:
        busy = [r for r in rids if r in self._streams]
        if busy:
            raise BadRequest(f"rid {busy[0]!r} is already in flight on this server")

    def submit(self, rank: int, req: GenerateReq, sink: asyncio.Queue) -> None:
        """Send one request; its TokenOutputs go to `sink` until the finished one."""
        if rank in self.dead:
            raise Unavailable(f"dp worker rank {rank} is gone: {self.dead[rank]}")
        self.check_free([req.rid])
        self._streams[req.rid] = _Stream(rank, sink)
        if not self._send(rank, req):
            del self._streams[req.rid]
            raise Unavailable(f"dp worker rank {rank} is not reachable (rid {req.rid})")

    def abort(self, rid: str, reason: str) -> None:
        """Ask the worker to drop `rid`; later outputs are discarded, the rid stays reserved
        until the worker's final output (or a grace period) so it cannot be mixed up."""
        st = self._streams.get(rid)
        if st is None or st.sink is None:
            return
        st.sink = None
        st.aborted_at = time.monotonic()
        self._send(st.rank, AbortReq(rid, reason), quiet=True)

    def in_flight(self) -> int:
        return sum(1 for s in self._streams.values() if s.sink is not None)

    async def stats(self, timeout_s: float = 5.0, flush_cache: bool = False) -> list[WorkerStats]:
        """A fresh WorkerStats from every live rank, in rank order (the dead ones are in `dead`);
        `flush_cache`: each rank empties its prefix cache first (extra["flushed_pages"])."""
        live = {r for r in range(self.dp_size) if r not in self.dead}
        if not live:
            raise Unavailable(f"every dp worker is gone: {self.dead}")
        req_id = next(self._stats_ids)
        rnd = _StatsRound(asyncio.get_running_loop().create_future(), live)
        self._stats[req_id] = rnd
        try:
            for r in sorted(live):
                self._send(r, StatsReq(req_id, flush_cache))
            await asyncio.wait_for(asyncio.shield(rnd.future), timeout_s)
        except asyncio.TimeoutError:
            missing = sorted(rnd.want - set(rnd.got))
            raise Timeout(f"dp worker ranks {missing} did not answer a stats request within {timeout_s}s") from None
        finally:
            self._stats.pop(req_id, None)
        return [rnd.got[r] for r in sorted(rnd.got)]

    def send(self, rank: int, msg) -> bool:
        """Queue any core.messages object for one rank (never blocks); False if it failed."""
        return self._send(rank, msg)

    # ---- internals ---------------------------------------------------------------------------
    def _send(self, rank: int, msg, quiet: bool = False) -> bool:
        try:
            self._pushes[rank].send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if not quiet:
                log.warning("send %s to dp worker rank %d failed: %s", type(msg).__name__, rank, e)
            return False

    async def _read_loop(self) -> None:
        assert self._pull is not None
        while True:
            raw = await self._pull.recv()
            try:
                self._on_message(pickle.loads(raw))
            except Exception:  # a bad message must not stop the reader
                log.exception("bad message from a dp worker")

    def _on_message(self, msg) -> None:
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                st = self._streams.get(out.rid)
                if st is None:
                    continue
                if st.sink is not None:
                    st.sink.put_nowait(out)
                if out.finished:
                    del self._streams[out.rid]
        elif isinstance(msg, WorkerStats):
            rnd = self._stats.get(msg.req_id)
            if rnd is not None:
                rnd.got[msg.dp_rank] = msg
                rnd.check()
        elif isinstance(msg, WorkerReady):
            self.ready[msg.dp_rank] = msg
        elif isinstance(msg, WorkerFailed):
            self.failed[msg.dp_rank] = msg.message
            if msg.dp_rank in self.ready:
                self._mark_dead(msg.dp_rank, msg.message)
        else:
            log.warning("unexpected message from a dp worker: %r", type(msg).__name__)

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_PERIOD_S)
            for r, p in enumerate(self.procs):
                if r not in self.dead and p.poll() is not None and not self._stopping:
                    self._mark_dead(r, f"process pid {p.pid} exited with code {p.returncode}")
            now = time.monotonic()
            stale = [rid for rid, s in self._streams.items()
                     if s.sink is None and now - s.aborted_at > ABORT_GRACE_S]
            for rid in stale:
                del self._streams[rid]

    def _mark_dead(self, rank: int, why: str) -> None:
        log.error("dp worker rank %d is gone: %s", rank, why)
        self.dead[rank] = why
        self._fail_streams(lambda s: s.rank == rank, f"dp worker rank {rank} is gone: {why}", 500,
                           "worker_error")
        for rnd in self._stats.values():  # a stats round in progress stops waiting for it
            rnd.want.discard(rank)
            rnd.check()
        for hook in self.on_dead:
            try:
                hook(rank, why)
            except Exception:  # noqa: BLE001 - a hook must not stop the monitor
                log.exception("dead-worker hook failed for rank %d", rank)

    def _fail_streams(self, pick, message: str, status: int, type_: str) -> None:
        for rid, st in list(self._streams.items()):
            if not pick(st):
                continue
            if st.sink is not None:
                st.sink.put_nowait(TokenOutput(rid=rid, finished=True,
                                               finish_reason={"type": "abort", "message": message},
                                               error=ErrorInfo(status, f"{message} (rid {rid})", type_)))
            del self._streams[rid]
