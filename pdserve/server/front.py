"""One server front: tokenizer, DP worker pool, dispatcher, role and request path together.

The request path, shared by every route and every role: `Generator.start(items)` checks the
items against the workers' limits, asks the role where each goes and sends them; nothing is
sent unless every item passes (else a PDServeError). It returns the request's `ActiveRequest`
(request_state.py), which folds the worker outputs that come back. Metrics are fed on dispatch.

Lifecycle (driven by the app's lifespan): the tokenizer is read at construction (a bad model
dir fails at once); `start()` runs the role's before_workers hook, starts the workers
(deadline), builds the request path from their limits, then starts the role. `stop()` stops
the role, then the workers; it is idempotent and never raises.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass, replace
from typing import Callable

from .. import __version__
from ..core.config import ServerConfig
from ..core.envs import Envs
from ..core.errors import BadRequest, PDServeError, Unavailable
from ..core.host import HostInfo
from ..core.log_format import new_instance_id
from ..core.messages import WorkerReady
from ..core.netaddr import resolve_advertise_host
from ..core.sampling import SamplingParams
from .limits import RETRY_AFTER_S, Admission, AdmissionLimits, Slot
from .metrics import FrontMetrics
from .protocol import RequestItem
from .request_state import ActiveRequest, item_cost
from .role_table import make_role
from .roles import Dispatch, DPDispatcher, FrontRole, RoleContext
from .tokenizer import ServerTokenizer
from .worker_cmd import DEFAULT_WORKER_MODULE
from .worker_pool import WorkerPool

log = logging.getLogger(__name__)
METRICS_STATS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Limits:
    max_context: int  # prompt + output tokens, the smallest over the ranks
    vocab_size: int
    output_timeout_s: float = 900.0  # a request with no output for this long fails with 504


class Generator:
    def __init__(self, pool: WorkerPool, dispatcher: DPDispatcher, role: FrontRole,
                 tokenizer: ServerTokenizer, limits: Limits, metrics: FrontMetrics):
        self.pool = pool
        self.dispatcher = dispatcher
        self.role = role
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics

    def check(self, item: RequestItem) -> RequestItem:
        """Validate one item against vocabulary and context; fit a default max_new_tokens."""
        n_prompt = len(item.input_ids)
        if n_prompt == 0:
            raise BadRequest(f"the prompt of item {item.index} is empty")
        vocab = self.limits.vocab_size
        bad = next((t for t in item.input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} in the prompt of item {item.index} is outside the "
                             f"vocabulary [0, {vocab})")
        ctx = self.limits.max_context
        room = ctx - n_prompt
        if room < 1:
            raise BadRequest(f"the prompt of item {item.index} has {n_prompt} tokens; the context "
                             f"length is {ctx}, leaving no room to generate")
        want = item.sampling.max_new_tokens
        if want > room:
            if item.max_new_tokens_given:
                raise BadRequest(f"prompt ({n_prompt} tokens) + max_new_tokens ({want}) exceeds the "
                                 f"context length {ctx}")
            item = replace(item, sampling=item.sampling.replace(max_new_tokens=room))
        return item

    def start(self, items: list[RequestItem], pinned: Dispatch | None = None) -> ActiveRequest:
        """Check, dispatch and send every item (no await: atomic on the event loop).
        `pinned` bypasses the role (health checks)."""
        dispatches: list[Dispatch] = []
        try:
            items = [self.check(it) for it in items]
            for it in items:
                d = pinned or self.role.dispatch(it, self.dispatcher)
                self.dispatcher.started(d.dp_rank, item_cost(it))
                dispatches.append(d)
            self.pool.check_free([it.rid for it in items])
        except BaseException as e:
            for it, d in zip(items, dispatches):
                self.dispatcher.finished(d.dp_rank, item_cost(it))
            self.role.rejected(items, e)
            if isinstance(e, Exception):
                self.metrics.rejected(e, len(items))
            raise
        active = ActiveRequest(self, items, dispatches)
        self.metrics.items_started(len(items))
        try:
            active.send_all()
        except BaseException:
            active.close("a worker was not reachable")
            raise
        return active


def advertised_host(cfg: ServerConfig, envs: Envs) -> str:
    """What this server's peers are told (flags win over their env vars, as a pair)."""
    host, nic = cfg.advertise_host, cfg.advertise_interface
    if not host and not nic:
        host, nic = envs.advertise_host, envs.advertise_interface
    return resolve_advertise_host(cfg.host, host, nic)


class Front:
    def __init__(self, cfg: ServerConfig, model_dir: str, worker_module: str = DEFAULT_WORKER_MODULE,
                 role: FrontRole | None = None, start_timeout_s: float = 600.0,
                 stats_timeout_s: float = 10.0, health_timeout_s: float = 30.0):
        cfg = replace(cfg, instance_id=cfg.instance_id or new_instance_id(),  # workers log it too
                      advertise_host=advertised_host(cfg, Envs.read()))  # raises AddressError
        self.cfg = cfg
        self.model_dir = os.path.abspath(model_dir)
        self.tokenizer = ServerTokenizer.from_dir(self.model_dir)
        self.role = role or make_role(cfg)
        self.dispatcher = DPDispatcher(cfg.dp_size, self.role.lb_method())
        self.pool = WorkerPool(cfg, self.model_dir, worker_module, start_timeout_s)
        self.admission = Admission(AdmissionLimits.from_config(cfg))
        self.metrics = FrontMetrics(self.role.role.value, cfg.instance_id, __version__)
        self.stats_timeout_s = stats_timeout_s
        self.health_timeout_s = health_timeout_s
        self.ready: list[WorkerReady] = []
        self._generator: Generator | None = None
        self._health_rank = 0
        self._role_started = False

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def served_names(self) -> tuple[str, ...]:
        """--served-model-name, or the model directory's name: what `model` may say."""
        return self.cfg.served_model_name or (os.path.basename(self.model_dir.rstrip("/")) or self.model_dir,)

    @property
    def generator(self) -> Generator:
        if self._generator is None:
            raise Unavailable("the server is not ready: its workers are starting or stopping")
        return self._generator

    async def start(self, should_abort: Callable[[], bool] | None = None) -> None:
        self._role_started = True  # stop() must stop the role from here on
        await self.role.before_workers()
        self.ready = await self.pool.start(should_abort)
        vocab = min((r.info.get("vocab_size") or self.tokenizer.vocab_size) for r in self.ready)
        limits = Limits(max_context=min(r.max_context for r in self.ready), vocab_size=vocab)
        self._generator = Generator(self.pool, self.dispatcher, self.role, self.tokenizer, limits,
                                    self.metrics)
        await self.role.start(RoleContext(list(self.ready), self.pool.send))
        self.pool.on_dead.append(self._worker_gone)
        log.info("front ready: role=%s dp_size=%d method=%s context=%d vocab=%d", self.role.role.value,
                 self.cfg.dp_size, self.dispatcher.method.value, limits.max_context, vocab)

    async def stop(self) -> None:
        self._generator = None
        if self._role_started:
            self._role_started = False
            try:
                await self.role.stop()
            except Exception:
                log.exception("role stop failed")
        await self.pool.stop()

    async def admit(self, items: list[RequestItem]) -> Slot:
        """A slot for one generation request (waits in the queue); a refusal (429) fails its PD
        rooms at once, like any other refused request."""
        try:
            return await self.admission.acquire()
        except PDServeError as e:
            self.role.rejected(items, e)
            raise

    def _worker_gone(self, rank: int, reason: str) -> None:
        # The prefill role publishes it (bootstrap /health) so decodes waiting on that rank fail
        # at once.
        self.role.worker_gone(rank, reason)

    def healthy(self) -> bool:
        return self._generator is not None and not self.pool.dead

    async def health_generate(self) -> None:
        """One 1-token greedy generation on the next rank (round robin), PD fields unset."""
        gen = self.generator
        rank = self._health_rank
        self._health_rank = (rank + 1) % self.cfg.dp_size
        ids = self.tokenizer.encode("Hi", add_special_tokens=True)[-4:] or [0]
        item = RequestItem(0, f"health_generate_{uuid.uuid4().hex}", ids,
                           SamplingParams(max_new_tokens=1, temperature=0.0), True)
        active = gen.start([item], Dispatch(rank, "health_generate", health_check=True))
        try:
            async def run():
                async for prog in active.events():
                    if prog.error:
                        raise Unavailable(f"health_generate on dp rank {rank} failed: {prog.error.message}")
            await asyncio.wait_for(run(), self.health_timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"health_generate on dp rank {rank} did not finish within "
                              f"{self.health_timeout_s}s") from None
        finally:
            active.close("health check ended")

    async def metrics_text(self) -> bytes:
        """The /metrics page, with the per-rank gauges refreshed from the workers (bounded wait:
        a busy or dead rank keeps its last values, and `pdserve_worker_up` says which is dead)."""
        if self._generator is not None:
            try:
                self.metrics.worker_stats(await self.pool.stats(METRICS_STATS_TIMEOUT_S))
            except PDServeError as e:
                log.warning("metrics: worker stats not refreshed: %s", e.message)
        self.metrics.worker_liveness(self.cfg.dp_size, self.pool.dead)
        return self.metrics.render()

    async def flush_cache(self) -> dict:
        """Empty the prefix cache of every live DP rank. Requests in flight are not disturbed:
        they keep the pages they hold, which are freed rather than cached when they finish."""
        stats = await self.pool.stats(self.stats_timeout_s, flush_cache=True)
        ranks = [{"dp_rank": s.dp_rank, "flushed_pages": s.extra.get("flushed_pages", 0),
                  "free_pages": s.free_pages, "cached_pages": s.cached_pages} for s in stats]
        log.info("prefix cache flushed: %s", ", ".join(f"rank {r['dp_rank']} {r['flushed_pages']} pages"
                                                      for r in ranks))
        return {"success": True, "message": "Cache flushed.",
                "flushed_pages": sum(r["flushed_pages"] for r in ranks), "workers": ranks,
                "dead_workers": sorted(self.pool.dead)}

    def model_info(self) -> dict:
        return {"model_path": self.model_dir, "tokenizer_path": self.model_dir, "is_generation": True,
                "served_model_name": self.model_name}

    async def server_info(self) -> dict:
        stats = await self.pool.stats(self.stats_timeout_s)
        page_size = self.ready[0].page_size if self.ready else self.cfg.page_size
        limits = self.generator.limits
        workers = []
        plans = {r.dp_rank: r.info.get("cpu_plan") for r in self.ready}
        for s in stats:
            load = self.dispatcher.loads[s.dp_rank]
            workers.append({"dp_rank": s.dp_rank, "total_pages": s.total_pages, "free_pages": s.free_pages,
                            "cached_pages": s.cached_pages, "running_requests": s.running_requests,
                            "waiting_requests": s.waiting_requests,
                            "inflight_transfers": s.inflight_transfers,
                            "front_inflight_requests": load.requests, "front_inflight_tokens": load.tokens,
                            "cpu_plan": plans.get(s.dp_rank), "extra": s.extra})
        info = {
            "model_path": self.model_dir, "tokenizer_path": self.model_dir,
            "served_model_name": self.model_name, "role": self.role.role.value,
            "disaggregation_mode": self.role.disaggregation_mode, "dp_size": self.cfg.dp_size, "tp_size": 1,
            "load_balance_method": self.dispatcher.method.value, "page_size": page_size,
            "bootstrap_port": self.cfg.bootstrap_port, "transfer_backend": self.cfg.transfer_backend,
            "version": __version__, "instance_id": self.cfg.instance_id, "host": self.cfg.host, "port": self.cfg.port,
            "context_length": limits.max_context, "vocab_size": limits.vocab_size,
            "max_total_num_tokens": min(s.total_pages for s in stats) * page_size,
            "disable_radix_cache": self.cfg.disable_prefix_cache,  # SGLang's name for the prefix cache
            "workers": workers,  # live ranks only; the dead ones are under dead_workers
            "dead_workers": [{"dp_rank": r, "reason": why} for r, why in sorted(self.pool.dead.items())],
            "admission": self.admission.stats(),
            "cpu": {**HostInfo.read().summary(),
                    "wait_policy": self.pool.wait.summary() if self.pool.wait else None},
        }
        info.update(self.role.server_info())
        return info


def error_from(info) -> PDServeError:
    """A worker's ErrorInfo as an exception carrying its status and type."""
    err = PDServeError(info.message)
    err.status = info.status
    err.type = info.type
    if info.status == 429:  # a worker's back-pressure (decode admission): tell when to retry
        err.retry_after = RETRY_AFTER_S
    return err
