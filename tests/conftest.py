"""Session-wide test ground: real S3 server, real Kubernetes control plane, node agent."""

import importlib.util

# The ground's fixtures live in tests/ground/; each module is a pytest plugin.
pytest_plugins = [
    m
    for m in ("tests.ground.s3", "tests.ground.kube", "tests.ground.tools", "tests.ground.refserver")
    if importlib.util.find_spec(m) is not None
]
