"""The test node's pod network: a host bridge and one network namespace + veth per pod.

Addresses come from POD_CIDR; the host end of the bridge is POD_GATEWAY. Everything made here carries the
`hsx` prefix so a crashed earlier run's leftovers can be found and removed.
"""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path

POD_CIDR = "10.244.0.0/24"
POD_GATEWAY = "10.244.0.1"
BRIDGE = "hsxbr0"
NETNS_PREFIX = "hsxpod-"
VETH_PREFIX = "hsxv"  # host end; interface names are at most 15 characters
_PREFIX_LEN = ipaddress.ip_network(POD_CIDR).prefixlen


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def pod_addresses() -> list[str]:
    """Every address a pod may get (the gateway excluded), in allocation order."""
    network = ipaddress.ip_network(POD_CIDR)
    return [str(a) for a in network.hosts() if str(a) != POD_GATEWAY]


def ensure_bridge() -> None:
    """Create the host bridge with the gateway address (idempotent)."""
    if _ip("link", "show", BRIDGE, check=False).returncode != 0:
        _ip("link", "add", BRIDGE, "type", "bridge")
    addresses = _ip("-o", "addr", "show", "dev", BRIDGE).stdout
    if f"{POD_GATEWAY}/" not in addresses:
        _ip("addr", "add", f"{POD_GATEWAY}/{_PREFIX_LEN}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")


def create_pod_network(netns: str, veth: str, address: str) -> None:
    """A named netns whose eth0 has `address`, reachable from the host through the bridge."""
    _ip("netns", "add", netns)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", veth, "master", BRIDGE)
        _ip("link", "set", veth, "up")
        inside = ("netns", "exec", netns, "ip")
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "addr", "add", f"{address}/{_PREFIX_LEN}", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "route", "add", "default", "via", POD_GATEWAY)
    except Exception:
        delete_pod_network(netns, veth)
        raise


def delete_pod_network(netns: str, veth: str) -> None:
    """Remove a pod's veth and netns (missing ones are fine)."""
    _ip("link", "del", veth, check=False)
    _ip("netns", "del", netns, check=False)


def remove_leftovers() -> None:
    """Delete every hsx pod netns, veth and the bridge (a crashed run's remains)."""
    netns_dir = Path("/run/netns")
    if netns_dir.is_dir():
        for entry in netns_dir.iterdir():
            if entry.name.startswith(NETNS_PREFIX):
                _ip("netns", "del", entry.name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(VETH_PREFIX):
            _ip("link", "del", name, check=False)
    _ip("link", "del", BRIDGE, check=False)
