"""Bind vs advertise (core/netaddr.py) and the tcp backend over IPv6, in-process on loopback."""

from __future__ import annotations

import argparse
import socket
import time

import numpy as np
import pytest

from pdserve.core import netaddr
from pdserve.core.config import ServerConfig, add_dataclass_args, dataclass_from_args
from pdserve.core.envs import Envs
from pdserve.core.kv_layout import KVLayout
from pdserve.core.netaddr import AddressError, check_reachable, local_connect_host, resolve_advertise_host
from pdserve.server.front import advertised_host
from pdserve.transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(60)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_given_advertise_host_wins_and_is_checked():
    assert resolve_advertise_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert resolve_advertise_host("::", "[fd00::5]") == "fd00::5"
    with pytest.raises(AddressError, match="wildcard"):
        resolve_advertise_host("0.0.0.0", "0.0.0.0")
    with pytest.raises(AddressError, match="not both"):
        resolve_advertise_host("0.0.0.0", "10.1.2.3", "eth0")


def test_a_specific_bind_advertises_itself():
    assert resolve_advertise_host("127.0.0.2") == "127.0.0.2"
    assert resolve_advertise_host("[::1]") == "::1"
    assert local_connect_host("127.0.0.2") == "127.0.0.2"
    assert local_connect_host("0.0.0.0") == "127.0.0.1" and local_connect_host("") == "127.0.0.1"
    assert local_connect_host("::") == "::1"


def test_wildcard_takes_the_default_route_then_the_only_address(monkeypatch):
    monkeypatch.setattr(netaddr, "_route_address", lambda fam: "192.0.2.7")
    assert resolve_advertise_host("0.0.0.0") == "192.0.2.7"
    monkeypatch.setattr(netaddr, "_route_address", lambda fam: None)  # no default route
    monkeypatch.setattr(netaddr, "interface_addresses", lambda: {"lo": ["127.0.0.1", "::1"], "veth0": ["10.9.0.2"]})
    assert resolve_advertise_host("0.0.0.0") == "10.9.0.2"
    monkeypatch.setattr(netaddr, "interface_addresses", lambda: {"lo": ["127.0.0.1"]})
    assert resolve_advertise_host("0.0.0.0") == "127.0.0.1"  # loopback only: peers can only be local
    monkeypatch.setattr(netaddr, "interface_addresses",
                        lambda: {"lo": ["127.0.0.1"], "a": ["10.9.0.2"], "b": ["10.8.0.2"]})
    with pytest.raises(AddressError, match=r"10\.8\.0\.2, 10\.9\.0\.2.*--advertise-host or --advertise-interface"):
        resolve_advertise_host("0.0.0.0")


def test_advertise_interface(monkeypatch):
    monkeypatch.setattr(netaddr, "interface_addresses", lambda: {"lo": ["127.0.0.1", "::1"], "eth1": ["10.9.0.2",
                                                                                                      "fd00::9"]})
    assert resolve_advertise_host("0.0.0.0", interface="eth1") == "10.9.0.2"
    assert resolve_advertise_host("::", interface="eth1") == "fd00::9"
    assert resolve_advertise_host("10.9.0.2", interface="eth1") == "10.9.0.2"
    with pytest.raises(AddressError, match="not --host 10.7.0.1"):
        resolve_advertise_host("10.7.0.1", interface="eth1")
    with pytest.raises(AddressError, match="no such network interface.*eth1, lo"):
        resolve_advertise_host("0.0.0.0", interface="eth9")


def test_this_hosts_interfaces_include_loopback():
    assert "127.0.0.1" in netaddr.interface_addresses()["lo"]


def test_flags_win_over_their_env_vars_as_a_pair():
    env = Envs.read({"SGLANG_HOST_IP": "10.1.1.1"})  # SGLang's name for it
    assert advertised_host(ServerConfig(host="0.0.0.0", cpu_bind="none"), env) == "10.1.1.1"
    assert advertised_host(ServerConfig(host="0.0.0.0", advertise_host="10.2.2.2", cpu_bind="none"), env) == "10.2.2.2"
    env = Envs.read({"PDSERVE_ADVERTISE_INTERFACE": "lo"})
    assert advertised_host(ServerConfig(host="0.0.0.0", cpu_bind="none"), env) == "127.0.0.1"


def test_cli_flags_and_sglang_aliases():
    p = argparse.ArgumentParser()
    add_dataclass_args(p, ServerConfig)
    cfg = dataclass_from_args(ServerConfig, p.parse_args(
        ["--host", "::", "--advertise-host", "fd00::2", "--disaggregation-bootstrap-port", "9001",
         "--disaggregation-transfer-backend", "mooncake", "--transfer-port", "17000", "--cpu-bind", "none"]))
    assert (cfg.host, cfg.advertise_host, cfg.bootstrap_port, cfg.transfer_backend, cfg.transfer_port) == \
        ("::", "fd00::2", 9001, "mooncake", 17000)
    with pytest.raises(ValueError, match="--transfer-port 65535"):
        ServerConfig(transfer_port=65535, dp_size=2, cpu_bind="none")


def test_check_reachable_names_what_cannot_be_reached():
    with socket.create_server(("127.0.0.1", 0)) as lst:
        check_reachable("127.0.0.1", lst.getsockname()[1], "x")
        port = lst.getsockname()[1]
    with pytest.raises(AddressError, match=r"the bootstrap service advertises 127\.0\.0\.1:\d+, which cannot"):
        check_reachable("127.0.0.1", port, "the bootstrap service")


def _pool(pages: int, page_bytes: int, seed: int):
    arr = np.random.default_rng(seed).integers(0, 256, pages * page_bytes, dtype=np.uint8)
    return arr, KVLayout(base_ptr=arr.ctypes.data, num_regions=1, num_pages=pages, page_bytes=page_bytes,
                         region_stride=pages * page_bytes, page_size=16, dtype="bfloat16")


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("bind", ["::1", "::"])
def test_tcp_backend_over_ipv6(bind):
    (src, src_l), (dst, dst_l) = _pool(8, 128, 1), _pool(8, 128, 2)
    a, b = TcpBackend(connect_timeout=2.0), TcpBackend(connect_timeout=2.0)
    try:
        a.start(src_l, host=bind, advertise="::1" if bind == "::" else "")
        b_ep = b.start(dst_l, host=bind, advertise="::1" if bind == "::" else "")
        assert b_ep["ip"] == "::1"
        a.write_pages(b_ep, dst_l, [0, 1, 5], [2, 3, 7])
        a.send(b_ep, {"done": 1})
        got, end = [], time.monotonic() + 10
        while not got and time.monotonic() < end:
            got = b.recv(0.1)
        assert got and got[0][1] == {"done": 1}
        d, s = dst.reshape(8, 128), src.reshape(8, 128)
        assert (d[[2, 3, 7]] == s[[0, 1, 5]]).all()
    finally:
        a.close()
        b.close()


def test_tcp_backend_advertises_what_it_is_told():
    _, lay = _pool(2, 64, 3)
    be = TcpBackend()
    try:
        assert be.start(lay, host="0.0.0.0", advertise="127.0.0.1")["ip"] == "127.0.0.1"
    finally:
        be.close()
