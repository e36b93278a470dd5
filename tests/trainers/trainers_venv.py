"""Real EAGLE-3 trainers (SpecForge, speculators, NVIDIA Model-Optimizer) from PyPI, in one cached venv.

``tests/trainers/build_trainers.sh`` builds it once into
``${HSX_CACHE:-~/.cache/hsx}/trainers-<versions>/``. Each trainer's own pins cannot all hold in one
venv here (SpecForge 0.2.0 pins torch 2.11.0, transformers 5.8.1 and sglang 0.5.14, a GPU server it
needs only to capture states), so the trainers go in ``--no-deps`` and this module lists what their
offline data and EAGLE-3 training code import: one torch (the SGLang venv's, already in uv's cache),
one transformers that both SpecForge's and speculators' code accept. The tests run the trainers' code
in that venv as subprocesses; hsx itself never goes in it (exports are written by this checkout's
``hsx export`` in the project venv, as a user would).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SPECFORGE = "specforge==0.2.0"
SPECULATORS = "speculators==0.9.0"
HS_CONNECTORS = "hs-connectors==0.9.0"  # speculators' own package for reading hidden-state files
MODELOPT = "nvidia-modelopt==0.47.0"
TRAINERS = (SPECFORGE, SPECULATORS, HS_CONNECTORS, MODELOPT)

# What the trainers' data and training code import (read from their wheels), at versions inside
# every trainer's range that also hold together: torch 2.14.1 is speculators' ceiling and the
# SGLang CPU venv's torch; transformers 5.8.1 is SpecForge's pin, inside speculators' range (>=5.0, <=5.19)
# and under Model-Optimizer's (<5.15: 5.19's rotary embedding no longer takes the device its EAGLE module passes).
REQUIREMENTS = (
    "torch==2.14.1",
    "transformers==5.8.1",
    "datasets==5.1.0",
    "safetensors",
    "numpy<=2.5.4",
    "accelerate",
    "pydantic>=2",
    "pydantic-settings>=2",
    "pyyaml",
    "psutil",
    "tqdm<=4.70.1",
    "loguru<=0.7.3",
    "rich",
    "click",
    "typer>=0.12",
    "openai>=2",
    "httpx",
    "aiohttp",
    "protobuf",
    "omegaconf>=2.3",
    "packaging",
    "regex",
    "scipy",
    "pulp<4",
    "ninja",
    "nvidia-ml-py>=12",
    "requests",
    # hsx's in-place loaders in the trainer's environment (hsx[train]; hsx itself comes on PYTHONPATH).
    "boto3>=1.34",
    "zstandard>=0.22",
    "xxhash>=3.4",
    "isal>=1.6",
)
STAMP = ".complete"


def cache_root() -> Path:
    return Path(os.environ.get("HSX_CACHE") or Path.home() / ".cache" / "hsx")


def venv_dir() -> Path:
    name = "-".join(t.replace("==", "") for t in (SPECFORGE, SPECULATORS, MODELOPT))
    return cache_root() / f"trainers-{name}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def is_built() -> bool:
    return (venv_dir() / STAMP).is_file() and venv_python().exists()


def main(argv: list[str]) -> int:
    if argv == ["venv-dir"]:
        print(venv_dir())
        return 0
    if argv == ["requirements"]:
        print("\n".join(REQUIREMENTS))
        return 0
    if argv == ["trainers"]:
        print("\n".join(TRAINERS))
        return 0
    print("usage: python -m tests.trainers.trainers_venv venv-dir|requirements|trainers", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
