"""The test node's pod network: a host bridge and one network namespace + veth per pod.

Several node agents may run at once on one machine (parallel test sessions), so each claims a slot: slot N
owns 10.244.N.0/24 (host end of its bridge 10.244.N.1), bridge `hsxbrN` and names with `hsxpodN-`/`hsxvN-`.
A slot is held by an flock for the agent's life; whoever claims a slot first removes what a crashed earlier
holder left in it, and never touches other slots.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

SLOTS = 32
LOCK_DIR = Path("/run/hsx-node-agent")


def gateway_of(slot: int) -> str:
    return f"10.244.{slot}.1"


def all_gateways() -> list[str]:
    """Every slot's host address (the API server's certificate names them all)."""
    return [gateway_of(slot) for slot in range(SLOTS)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


@dataclass(frozen=True)
class PodNetwork:
    """One slot's addresses and interface names."""

    slot: int

    @property
    def cidr(self) -> str:
        return f"10.244.{self.slot}.0/24"

    @property
    def gateway(self) -> str:
        return gateway_of(self.slot)

    @property
    def bridge(self) -> str:
        return f"hsxbr{self.slot}"

    @property
    def netns_prefix(self) -> str:
        return f"hsxpod{self.slot}-"

    @property
    def veth_prefix(self) -> str:
        return f"hsxv{self.slot}-"

    def names_for(self, pod_uid: str) -> tuple[str, str]:
        """(netns, host veth) for a pod; interface names stay within Linux's 15 characters."""
        short = pod_uid.replace("-", "")
        return f"{self.netns_prefix}{short[:12]}", f"{self.veth_prefix}{short[: 15 - len(self.veth_prefix)]}"

    def pod_addresses(self) -> list[str]:
        """Every address a pod may get (the gateway excluded), in allocation order."""
        return [str(a) for a in ipaddress.ip_network(self.cidr).hosts() if str(a) != self.gateway]

    def ensure_bridge(self) -> None:
        """Create the slot's bridge with the gateway address (idempotent)."""
        if _ip("link", "show", self.bridge, check=False).returncode != 0:
            _ip("link", "add", self.bridge, "type", "bridge")
        if f"{self.gateway}/" not in _ip("-o", "addr", "show", "dev", self.bridge).stdout:
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def create_pod_network(self, netns: str, veth: str, address: str) -> None:
        """A named netns whose eth0 has `address`, reachable from the host through the bridge."""
        _ip("netns", "add", netns)
        try:
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            inside = ("netns", "exec", netns, "ip")
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            # No default route on purpose: a pod reaches its /24 (the host end included) and nothing beyond.
        except Exception:
            delete_pod_network(netns, veth)
            raise

    def remove_leftovers(self) -> None:
        """Delete this slot's pod netns, veths and bridge (a crashed holder's remains)."""
        netns_dir = Path("/run/netns")
        if netns_dir.is_dir():
            for entry in netns_dir.iterdir():
                if entry.name.startswith(self.netns_prefix):
                    _ip("netns", "del", entry.name, check=False)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            parts = line.split(":", 2)
            name = parts[1].strip().split("@")[0] if len(parts) > 2 else ""
            if name.startswith(self.veth_prefix):
                _ip("link", "del", name, check=False)
        _ip("link", "del", self.bridge, check=False)


def delete_pod_network(netns: str, veth: str) -> None:
    """Remove a pod's veth and netns (missing ones are fine)."""
    _ip("link", "del", veth, check=False)
    _ip("netns", "del", netns, check=False)


class SlotClaim:
    """An exclusive hold on one slot (flock on /run/hsx-node-agent/slot-N.lock), released on close."""

    def __init__(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for slot in range(SLOTS):
            fd = os.open(LOCK_DIR / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.network = PodNetwork(slot)
            self._fd = fd
            return
        raise RuntimeError(f"all {SLOTS} pod-network slots are held by running node agents")

    def others_alive(self) -> bool:
        """Whether another agent holds a slot now (then shared host paths must stay)."""
        for slot in range(SLOTS):
            if slot == self.network.slot:
                continue
            path = LOCK_DIR / f"slot-{slot}.lock"
            if not path.exists():
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                return True
            finally:
                os.close(fd)
        return False

    def close(self) -> None:
        os.close(self._fd)
