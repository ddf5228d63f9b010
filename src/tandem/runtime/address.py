"""Which address a process binds and which it advertises for others to dial.

Every process that others reach (a worker's request plane and transfer agent, a ZMQ event
publisher, the frontend's runtime address) registers an address in discovery. The one it
advertises must be routable from the other hosts of the deployment:

- `--advertise-host` (`TANDEM_ADVERTISE_HOST`) given: advertise it.
- bound to one address that is not loopback (`--host 10.0.0.5`): advertise that address.
- discovery or events on another host (an etcd or NATS URL whose host is not loopback): the
  address of this host's interface that routes to that server (a UDP socket `connect`ed to it,
  its `getsockname`; no packet is sent). A default loopback bind then binds that address too,
  so a worker started with only `--etcd-url`/`--nats-url` is reachable from the other hosts.
- bound to every address (`0.0.0.0` or `::`) on one host: the address of the interface that
  holds the default route, else loopback — never `0.0.0.0`.
- otherwise (one host, loopback): loopback, as before.

Advertising loopback while discovery or events span hosts is refused at start (`AddressError`):
the other hosts would exclude the process and every request would be 503.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
from urllib.parse import urlsplit

from tandem.runtime.config import RuntimeConfig

logger = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::", "")
# a documentation address (RFC 5737): connecting a UDP socket to it picks the default route's
# interface without sending anything
_DEFAULT_ROUTE_PROBE = "192.0.2.1"


class AddressError(ValueError):
    """A process would advertise an address the other hosts of its deployment cannot reach."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def remote_servers(config: RuntimeConfig) -> list[str]:
    """The hosts of the discovery and event servers this process uses that are not loopback
    (an empty list: the deployment lives on this host)."""
    urls = []
    if config.discovery == "etcd":
        urls.append(config.etcd_url)
    if config.events == "nats":
        urls.extend(config.nats_url.split(","))
    hosts = []
    for url in urls:
        host = urlsplit(url.strip()).hostname
        if host and not is_loopback(host):
            hosts.append(host)
    return hosts


def _udp_socket_name(host: str, port: int, *, connect: bool) -> str | None:
    """The local address of a UDP socket that could connect to (or else bind) `host`:`port`
    (no packet is sent); None when no address of `host` allows it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                if connect:
                    sock.connect(sockaddr)
                else:
                    sock.bind(sockaddr)
            except OSError:
                continue
            name = sock.getsockname()[0]
            return name if isinstance(name, str) else None
    return None


def route_source(target: str) -> str | None:
    """This host's address on the interface that routes to `target` (None: no route)."""
    host = _udp_socket_name(target, 9, connect=True)
    return None if host is None or is_wildcard(host) else host


def is_local_address(host: str) -> bool:
    """True when a socket can bind `host` on this machine."""
    return _udp_socket_name(host, 0, connect=False) is not None


def resolve_addresses(config: RuntimeConfig) -> RuntimeConfig:
    """`config` with `host` (what to bind) and `advertise_host` (what others dial) decided, by
    the rules in this module's docstring. Raises AddressError for a loopback advertise address
    while discovery or events span hosts."""
    bind, advertise = config.host, config.advertise_host
    remotes = remote_servers(config)
    if not advertise:
        if not is_wildcard(bind) and not is_loopback(bind):
            advertise = bind
        elif remotes:
            advertise = route_source(remotes[0]) or ""
        elif is_wildcard(bind):
            advertise = route_source(_DEFAULT_ROUTE_PROBE) or "127.0.0.1"
        else:
            advertise = bind
        if is_loopback(bind) and advertise and not is_loopback(advertise):
            bind = advertise  # the default loopback bind would be unreachable from other hosts
    elif is_loopback(bind) and not is_loopback(advertise):
        bind = advertise if is_local_address(advertise) else "0.0.0.0"
    if remotes and (not advertise or is_loopback(advertise)):
        raise AddressError(
            f"this process would advertise {advertise or 'no address'!r} while discovery/events "
            f"run on another host ({', '.join(remotes)}): the other hosts could not reach it; "
            "start it with --advertise-host <an address of this host they can reach> "
            "(or TANDEM_ADVERTISE_HOST), or bind a routable one with --host"
        )
    if not is_loopback(advertise) and not is_local_address(advertise):
        logger.warning(
            "advertise host %s is not an address of this machine: peers must reach it through "
            "NAT or port forwarding to this process's ports",
            advertise,
        )
    return dataclasses.replace(config, host=bind, advertise_host=advertise)
