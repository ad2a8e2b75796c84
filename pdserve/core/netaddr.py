"""Bind vs advertise: the address a listener binds (`--host`) and the one its peers are told.

Every listener of a server (HTTP front, bootstrap service, transfer endpoints) binds `--host`.
What peers are told is `--advertise-host` when given, else the bound address itself, else (for
a wildcard bind, 0.0.0.0 or ::) the address of `--advertise-interface`, of the interface on the
default route, or of the only non-loopback interface. Processes of the same server reach each
other at `local_connect_host(--host)`. Stdlib only: the server, router and workers all use it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

WILDCARDS = ("", "0.0.0.0", "::")
_SIOCGIFADDR = 0x8915
# Any address off this host: a UDP connect() to it sends nothing but picks the outbound route.
_ROUTE_PROBES = {socket.AF_INET: "198.51.100.1", socket.AF_INET6: "2001:db8::1"}


class AddressError(ValueError):
    """An address we cannot bind, advertise or reach; the message names the flag to change."""


def strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_wildcard(host: str) -> bool:
    return strip_brackets(host) in WILDCARDS


def is_loopback(host: str) -> bool:
    host = strip_brackets(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def family_of(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal (or a name that only resolves to one), else AF_INET."""
    host = strip_brackets(host)
    if host in ("", "0.0.0.0"):
        return socket.AF_INET
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return socket.AF_INET
    fams = {i[0] for i in infos}
    return socket.AF_INET if socket.AF_INET in fams else socket.AF_INET6


def host_port(host: str, port: int) -> str:
    """"host:port", an IPv6 literal bracketed (what URLs and logs show)."""
    host = strip_brackets(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_connect_host(bind_host: str) -> str:
    """Where another process of this server reaches a listener bound to `bind_host`."""
    host = strip_brackets(bind_host)
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    return "::1" if host == "::" else host


def interface_addresses() -> dict[str, list[str]]:
    """Each network interface's addresses: its IPv4 address (SIOCGIFADDR), then its global
    IPv6 ones (/proc/net/if_inet6; link-local ones need a scope id and are skipped)."""
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out.setdefault(name, []).append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]))
            except OSError:
                out.setdefault(name, [])
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and int(parts[3], 16) != 0x20:
                    addr = str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))
                    out.setdefault(parts[5], []).append(addr)
    except OSError:
        pass
    return out


def _route_address(family: socket.AddressFamily) -> str | None:
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((_ROUTE_PROBES[family], 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def _of_family(addrs: list[str], family: socket.AddressFamily) -> list[str]:
    return [a for a in addrs if family_of(a) == family]


def _from_interface(interface: str, family: socket.AddressFamily) -> str:
    table = interface_addresses()
    if interface not in table:
        raise AddressError(f"--advertise-interface {interface}: no such network interface "
                           f"(this host has {', '.join(sorted(table)) or 'none'})")
    addrs = _of_family(table[interface], family) or table[interface]  # a v6 socket takes v4 too
    if not addrs:
        raise AddressError(f"--advertise-interface {interface} has no address")
    return addrs[0]


def resolve_advertise_host(bind_host: str, advertise_host: str = "", interface: str = "") -> str:
    """The address this server tells its peers, from `--host`, `--advertise-host` and
    `--advertise-interface` (see the module docstring); raises AddressError naming the flag."""
    bind, adv = strip_brackets(bind_host), strip_brackets(advertise_host)
    if adv:
        if is_wildcard(adv):
            raise AddressError(f"--advertise-host {advertise_host!r} is a wildcard; give an address "
                               "peers can connect to")
        if interface:
            raise AddressError("give --advertise-host or --advertise-interface, not both")
        return adv
    family = family_of(bind)
    if interface:
        addr = _from_interface(interface, family)
        if not is_wildcard(bind) and addr != bind:
            raise AddressError(f"--advertise-interface {interface} ({addr}) is not --host {bind_host}: "
                               "a listener bound to one address cannot be reached at another")
        return addr
    if not is_wildcard(bind):
        return bind
    routed = _route_address(family)
    if routed:
        return routed
    candidates = sorted({a for name, addrs in interface_addresses().items()
                         for a in _of_family(addrs, family) if not is_loopback(a)})
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        return local_connect_host(bind)  # a host with loopback only: peers can only be local
    raise AddressError(f"--host {bind_host or '0.0.0.0'} with no default route and several addresses "
                       f"({', '.join(candidates)}): choose one with --advertise-host or "
                       "--advertise-interface")


def check_reachable(host: str, port: int, what: str, timeout: float = 2.0) -> None:
    """Connect to `host:port` once (then close) to prove what we advertise works; AddressError if not."""
    try:
        with socket.create_connection((strip_brackets(host), port), timeout=timeout):
            pass
    except OSError as e:
        raise AddressError(f"{what} advertises {host_port(host, port)}, which cannot be reached from this "
                           f"host ({e.strerror or e}); set --advertise-host to an address of this host that "
                           "--host covers") from None
