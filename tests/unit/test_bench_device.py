"""`--device` of `pdserve bench engine` and `pdserve bench pd` (run on a GPU by scripts/gpu_check.sh):
the flag reaches the engine's ServerConfig and every server's command line. No model is loaded."""

from __future__ import annotations

import pytest

from pdserve.bench import engine_bench
from pdserve.model_files import resolve


class _Stop(Exception):
    pass


@pytest.mark.parametrize("argv, want", [([], "cpu"), (["--device", "cuda"], "cuda")])
def test_engine_bench_device_reaches_server_config(monkeypatch, argv, want):
    from pdserve.worker import setup

    seen = []

    def build_engine(cfg, model_dir, *a, **kw):
        seen.append(cfg)
        raise _Stop

    monkeypatch.setattr(resolve, "resolve_model", lambda name, cache_dir="": "/no/model")
    monkeypatch.setattr(setup, "build_engine", build_engine)
    with pytest.raises(_Stop):
        engine_bench.main(["--threads", "1", *argv])
    assert [c.device for c in seen] == [want]
    assert seen[0].model == "/no/model"


def test_engine_bench_refuses_other_devices(capsys):
    with pytest.raises(SystemExit):
        engine_bench.main(["--device", "mps"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv, want", [([], "cpu"), (["--device", "cuda"], "cuda")])
def test_pd_bench_device_reaches_every_server(monkeypatch, argv, want):
    from pdserve.bench import pd_bench

    started = []

    class Proc:
        def __init__(self, args):
            started.append(args)

        def wait(self):
            raise _Stop

        def stop(self):
            pass

    monkeypatch.setattr(resolve, "resolve_model", lambda name, cache_dir="": "/no/model")
    monkeypatch.setattr(pd_bench, "_Proc", Proc)
    with pytest.raises(_Stop):
        pd_bench.main(argv)
    assert len(started) == 5
    for args in started:
        i = args.index("--device")
        assert args[i + 1] == want and args.count("--device") == 1
