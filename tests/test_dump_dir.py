"""The dump directory is shared by two users: the server (the image's root without capabilities) and
the extractor (uid 65532). Checked with the kernel's own permission rules: setpriv drops root's
capabilities or switches uid, as the pod's securityContext does."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsx_extractor import protocol

EXTRACTOR_UID = 65532
CAPLESS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
AS_EXTRACTOR = [
    *("setpriv", f"--reuid={EXTRACTOR_UID}", f"--regid={EXTRACTOR_UID}", "--clear-groups"),
    *("--bounding-set=-all", "--inh-caps=-all", "--"),
]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to switch users"
)


@pytest.fixture
def pod_tmpfs() -> Iterator[Path]:
    """Like the pod's /dev/shm emptyDir (mode 777, tmpfs); pytest's tmp_path is 0700."""
    root = Path(tempfile.mkdtemp(prefix="hsx-dumpdir-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    root.chmod(0o777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def sh(prefix: list[str], script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=30)


def test_either_user_creates_and_deletes_the_others_files(pod_tmpfs: Path) -> None:
    d = protocol.make_dump_dir(pod_tmpfs / "hsx")
    assert stat.S_IMODE(d.stat().st_mode) == 0o777
    server = sh(CAPLESS, f"echo dump > {d}/a.safetensors && echo marker > {d}/b.error.json")
    assert server.returncode == 0, server.stderr
    extractor = sh(AS_EXTRACTOR, f"cat {d}/a.safetensors && rm {d}/a.safetensors {d}/b.error.json && touch {d}/c")
    assert extractor.returncode == 0, extractor.stderr
    assert sh(CAPLESS, f"rm {d}/c").returncode == 0
    assert list(d.iterdir()) == []


def test_a_directory_made_the_default_way_locks_the_other_user_out(pod_tmpfs: Path) -> None:
    # Control: what round 1 did (mkdir under the usual umask) breaks the pod.
    made = sh(AS_EXTRACTOR, f"umask 022 && mkdir {pod_tmpfs}/hsx")
    assert made.returncode == 0, made.stderr
    denied = sh(CAPLESS, f"echo dump > {pod_tmpfs}/hsx/a.safetensors")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    # make_dump_dir in the server (not the owner, no CAP_FOWNER) cannot fix it and says so.
    code = f"from hsx_extractor import protocol; protocol.make_dump_dir({str(pod_tmpfs / 'hsx')!r}, wait_s=0.3)"
    run = subprocess.run([*CAPLESS, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "DumpDirError" in run.stderr and "make it mode 777" in run.stderr
    assert f"owned by uid {EXTRACTOR_UID}" in run.stderr


def test_the_owner_opens_a_directory_it_made_with_its_umask(pod_tmpfs: Path) -> None:
    (pod_tmpfs / "hsx").mkdir(mode=0o755)
    (pod_tmpfs / "hsx").chmod(0o1777)  # a sticky bit would stop each deleting the other's files
    d = protocol.make_dump_dir(pod_tmpfs / "hsx")
    assert stat.S_IMODE(d.stat().st_mode) == 0o777
