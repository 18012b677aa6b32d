"""The PROXY protocol header (HAProxy's spec, versions 1 and 2), without I/O.

A layer-4 proxy in front of wslb (HAProxy ``send-proxy``, AWS NLB, many ingress controllers)
opens each connection with one header naming the client it accepted, then relays bytes. wslb
reads it only on listeners with ``proxy_protocol: true`` and only from ``trusted_proxies``
(anyone else could claim any address). ``parse`` takes the first bytes of a connection and
returns the header and its length once it is complete, None while more bytes are needed, and
raises ``ProxyHeaderError`` for anything malformed.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

__all__ = ["MAX_HEADER", "ProxyHeader", "ProxyHeaderError", "parse"]

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V1_MAX = 107  # "PROXY TCP6 " + two full IPv6 addresses + two ports + CRLF
MAX_HEADER = 16 + 65535


class ProxyHeaderError(ValueError):
    """A malformed PROXY header: the connection is refused."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """The client the proxy accepted; ``source`` None for a LOCAL / UNKNOWN connection (the
    proxy's own, such as its health check: the TCP peer is the client)."""

    source: str | None
    source_port: int | None = None
    version: int = 1


def parse(data: bytes | bytearray) -> tuple[ProxyHeader, int] | None:
    """The header at the start of ``data`` and its length, or None if it is incomplete."""
    head = bytes(data[:16])
    if V2_SIGNATURE.startswith(head[:12]) and len(head) < 12:
        return None  # could still be either version
    if head.startswith(V2_SIGNATURE):
        return _v2(data)
    if b"PROXY ".startswith(head[:6]) and len(head) < 6:
        return None
    if head.startswith(b"PROXY "):
        return _v1(data)
    raise ProxyHeaderError("the connection does not start with a PROXY protocol header")


def _v1(data: bytes | bytearray) -> tuple[ProxyHeader, int] | None:
    end = data.find(b"\r\n", 0, V1_MAX + 1)
    if end < 0:
        if len(data) > V1_MAX:
            raise ProxyHeaderError("PROXY v1 header longer than 107 bytes")
        return None
    parts = bytes(data[:end]).decode("ascii", "replace").split(" ")
    if len(parts) >= 2 and parts[1] == "UNKNOWN":
        return ProxyHeader(None), end + 2
    if len(parts) != 6 or parts[1] not in ("TCP4", "TCP6"):
        raise ProxyHeaderError(f"malformed PROXY v1 header {bytes(data[:end])!r}")
    try:
        src = ipaddress.ip_address(parts[2])
        ipaddress.ip_address(parts[3])
        sport, dport = int(parts[4]), int(parts[5])
    except ValueError:
        raise ProxyHeaderError(f"malformed PROXY v1 addresses {bytes(data[:end])!r}") from None
    if src.version != (4 if parts[1] == "TCP4" else 6) or not (
        0 <= sport <= 65535 and 0 <= dport <= 65535
    ):
        raise ProxyHeaderError(f"malformed PROXY v1 addresses {bytes(data[:end])!r}")
    return ProxyHeader(str(src), sport, 1), end + 2


def _v2(data: bytes | bytearray) -> tuple[ProxyHeader, int] | None:
    if len(data) < 16:
        return None
    ver_cmd, fam, length = data[12], data[13], struct.unpack_from("!H", data, 14)[0]
    if ver_cmd >> 4 != 2:
        raise ProxyHeaderError(f"PROXY v2 header of unknown version {ver_cmd >> 4}")
    if len(data) < 16 + length:
        return None
    total = 16 + length
    command = ver_cmd & 0x0F
    if command == 0:  # LOCAL: the proxy's own connection
        return ProxyHeader(None, None, 2), total
    if command != 1:
        raise ProxyHeaderError(f"PROXY v2 header with unknown command {command}")
    family = fam >> 4
    body = bytes(data[16:total])
    if family == 1 and len(body) >= 12:  # AF_INET
        src = ipaddress.IPv4Address(body[0:4])
        port = struct.unpack_from("!H", body, 8)[0]
        return ProxyHeader(str(src), port, 2), total
    if family == 2 and len(body) >= 36:  # AF_INET6
        src6 = ipaddress.IPv6Address(body[0:16])
        port = struct.unpack_from("!H", body, 32)[0]
        return ProxyHeader(str(src6), port, 2), total
    if family in (0, 3):  # AF_UNSPEC, AF_UNIX: no address to use
        return ProxyHeader(None, None, 2), total
    raise ProxyHeaderError(f"PROXY v2 header too short for address family {family}")


Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def is_trusted(address: str, trusted: Networks) -> bool:
    """Whether ``address`` (a peer's IP) lies in one of the ``trusted_proxies`` blocks."""
    if not trusted:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
    return any(ip.version == net.version and ip in net for net in trusted)


def forwarded_client(x_forwarded_for: str, trusted: Networks) -> str | None:
    """The client an ``X-Forwarded-For`` from a trusted proxy names: the right-most address
    that is not itself a trusted proxy (each proxy appends the peer it saw, so the entries
    left of the first untrusted one could be anything the client wrote). None when the header
    names no valid address."""
    hops = [h.strip() for h in x_forwarded_for.split(",") if h.strip()]
    for hop in reversed(hops):
        try:
            ipaddress.ip_address(hop)
        except ValueError:
            return None  # a garbled entry: trust nothing left of it
        if not is_trusted(hop, trusted):
            return hop
    return hops[0] if hops else None
