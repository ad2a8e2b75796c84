"""The chaos soak's short seeded form (`pdserve bench chaos`, pdserve/bench/chaos.py): a router,
two prefill and two decode servers (tiny model), load for 16 s while workers and servers are
killed and restarted, prefill workers stalled and router<->server connections cut (these two
drawn more often: a restart costs seconds). No request
may hang or come back wrong, no page may be stranded, every server must come back, the fds and
threads of the router and of every server process that lived through the run stay flat. The long
run and its figures are in docs/reliability.md.
"""

from __future__ import annotations

import pytest

from pdserve.bench import chaos
from tests.harness.fault_tools import shared_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.soak, pytest.mark.timeout(300)]

SERVER_ARGS = "--dtype float32 --num-threads 1 --max-total-tokens 2048 --page-size 4 --chunked-prefill-size 64"


def test_chaos_soak_short(tmp_path_factory, capsys):
    model = shared_tiny_model(tmp_path_factory)
    logs = tmp_path_factory.mktemp("chaos")
    a = chaos.build_parser().parse_args([
        "--model", model, "--server-args", SERVER_ARGS, "--duration-s", "16", "--fault-every-s", "1.5",
        "--down-s", "0.5", "--stall-s", "1", "--concurrency", "4", "--seed", "7", "--request-timeout-s", "45",
        "--faults", "cut,stall,cut,stall,kill_worker,kill_server", "--distinct-prompts", "12", "--log-dir", str(logs)])
    r = chaos.run(a)
    chaos.print_report(r)
    out = capsys.readouterr().out
    assert len(r.faults) >= 2, out
    assert r.outcomes["hung"] == 0 and r.outcomes["wrong"] == 0, out
    assert r.stranded_pages == 0 and not r.unhealthy_servers, out
    assert r.flat and r.survivor_growth["processes"] >= 1, out
    assert r.requests > 50 and r.success_rate >= 0.9, out
    # every error is a clear one: a message naming what failed
    assert all(("server" in s or "worker" in s or "room" in s) for s in r.error_samples), out
