"""Session-wide test ground: real S3 server, real Kubernetes control plane, node agent."""

import importlib.util

# The ground's fixtures live in tests/ground/; each module is a pytest plugin.
pytest_plugins = [
    m
    for m in ("tests.ground.s3", "tests.ground.kube", "tests.ground.tools", "tests.ground.refserver")
    if importlib.util.find_spec(m) is not None
]


# Where the time goes (issue 30): each test directory's time (setup, call and teardown of its tests),
# printed at the end of every session, so CI's log shows which part of the suite grew.
_SECONDS_BY_DIRECTORY: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:  # type: ignore[no-untyped-def]
    parts = report.nodeid.split("::")[0].split("/")
    where = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
    _SECONDS_BY_DIRECTORY[where] = _SECONDS_BY_DIRECTORY.get(where, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not _SECONDS_BY_DIRECTORY:
        return
    terminalreporter.section("seconds by test directory")
    for where, seconds in sorted(_SECONDS_BY_DIRECTORY.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {where}")
