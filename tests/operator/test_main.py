"""hsx-operator's start-up, as far as it does not need a cluster."""

from __future__ import annotations

import pwd
import socket

import pytest

from hsx_operator.main import peering_identity


def test_peering_identity_needs_no_passwd_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    # The chart runs the operator as uid 65532, which an image need not list: kopf's own fallback
    # (getpass.getuser) raised KeyError and the operator crashed at start.
    def no_user(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_user)
    monkeypatch.delenv("POD_ID", raising=False)
    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.delenv(name, raising=False)
    mine = peering_identity()
    assert mine.startswith(f"{socket.gethostname()}/") and mine != peering_identity()  # distinct per start
    monkeypatch.setenv("POD_ID", "hsx-7c9f-abcde")
    assert peering_identity() == "hsx-7c9f-abcde"
