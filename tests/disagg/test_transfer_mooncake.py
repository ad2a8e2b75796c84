"""What only the mooncake transfer backend does: its descriptor (a TransferEngine session), its
protocol option, the engine's failure codes (driven with a stand-in engine class) and what an
import failure tells the user (a stubbed import). The contract every backend keeps (pages,
messages, validation, refusals, close) is test_transfer_contract.py, which runs it on two real
TransferEngines here. Skipped (with the reason) only when Mooncake's engine cannot be imported.
"""

from __future__ import annotations

import sys
import threading

import pytest

from pdserve.core.envs import Envs
from pdserve.transfer import TransferError, create_backend
from pdserve.transfer import mooncake as mc
from tests.harness.transfer_pools import Pool  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TRANSFER_BACKEND = "mooncake"  # of the `pair` the module's tests share (conftest.py)
if (_problem := mc.import_problem()) is not None:
    pytest.skip(f"mooncake backend unavailable: {_problem}", allow_module_level=True)


def test_descriptor_names_session_and_pool(pair):
    ep = pair.b_ep
    assert ep["protocol"] == "tcp" and ep["version"] >= 1
    assert ep["base_ptr"] == pair.b_pool.layout.base_ptr
    host, port = ep["session"].rsplit(":", 1)
    assert host == ep["ip"] == "127.0.0.1" and int(port) > 0
    assert ep["session"] != pair.a_ep["session"] and ep["instance"] != pair.a_ep["instance"]


def test_protocol_and_descriptor_mismatch_refused(fresh):
    with pytest.raises(TransferError, match=r"uses mooncake protocol 'rdma', this endpoint uses 'tcp'"):
        fresh.a.send({**fresh.b_ep, "protocol": "rdma"}, {"x": 1})
    with pytest.raises(TransferError, match="needs session"):
        fresh.a.write_pages({k: v for k, v in fresh.b_ep.items() if k != "session"}, fresh.b_layout, [0], [0])
    with pytest.raises(TransferError, match="not the expected"):  # the peer "restarted"
        fresh.a.write_pages({**fresh.b_ep, "instance": "0" * 16}, fresh.b_layout, [0], [0])
    assert not fresh.b_pool.arr.any()


class _FailingEngine:
    """Stands in for mooncake.engine.TransferEngine: returns `codes` for the named calls."""

    codes: dict = {}

    def initialize(self, *args):
        return self.codes.get("initialize", 0)

    def register_memory(self, ptr, size):
        return self.codes.get("register_memory", 0)

    def get_rpc_port(self):
        return 1

    def unregister_memory(self, ptr):
        return 0


@pytest.mark.parametrize("call,code", [("initialize", -1), ("register_memory", -7)])
def test_engine_failures_carry_the_engine_code(call, code):
    before = set(threading.enumerate())
    b = create_backend("mooncake")
    b._engine_class = type("E", (_FailingEngine,), {"codes": {call: code}})
    with pytest.raises(TransferError, match=rf"{call}.* failed with code {code}"):
        b.start(Pool(2, 4, 64).layout)
    assert set(threading.enumerate()) <= before  # its control channel is stopped already
    b.close()


def test_options_protocol_and_envs():
    with pytest.raises(TransferError, match="'bogus' is not supported; use one of tcp, rdma"):
        create_backend("mooncake", protocol="bogus")
    envs = Envs.read({"PDSERVE_MOONCAKE_PROTOCOL": "rdma", "PDSERVE_MOONCAKE_DEVICE": "mlx5_0"})
    opts = mc.MooncakeBackend.env_options(envs)
    assert opts == {"protocol": "rdma", "device": "mlx5_0"}
    assert mc.MooncakeBackend.env_options(Envs.read({})) == {"protocol": "tcp", "device": ""}
    b = create_backend("mooncake", **opts)
    assert (b.protocol, b.device) == ("rdma", "mlx5_0")
    b.close()


class _BlockEngineImport:
    """A meta-path finder that fails `import mooncake.engine` with a given ImportError."""

    def __init__(self, error: ImportError):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "mooncake.engine":
            raise self.error
        return None


def test_import_errors_say_what_to_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BlockEngineImport(ImportError(
        "libibverbs.so.1: cannot open shared object file: No such file or directory")), *sys.meta_path])
    with pytest.raises(TransferError, match=r"apt-get install libibverbs1"):
        create_backend("mooncake")
    sys.meta_path[0] = _BlockEngineImport(ModuleNotFoundError("No module named 'mooncake'", name="mooncake"))
    with pytest.raises(TransferError, match=r"pip install 'pdserve\[mooncake\]'"):
        create_backend("mooncake")
    assert "pip install" in mc.import_problem()
