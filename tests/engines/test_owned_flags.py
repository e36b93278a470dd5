"""The extraArgs guard (launch.refused_extra_arg) against the real SGLang release's own argument parser:
every spelling of a flag extraction mode owns is refused, abbreviations included, and no other real flag is."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hsx_extractor.sglang_hook.launch import (
    OWNED_FLAGS,
    REFUSED_FLAGS,
    extra_args_problem,
    refused_extra_arg,
)

# Builds SGLang's parser as `sglang serve` does and reports its flags by destination, and what argparse
# makes of a few abbreviations.
_PROBE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(prog="probe", exit_on_error=False)
ServerArgs.add_cli_args(p)
dests = {}
for a in p._actions:
    if a.option_strings:
        dests.setdefault(a.dest, []).extend(a.option_strings)
parsed = {}
for arg in sys.argv[1:]:
    try:
        ns, _ = p.parse_known_args(["--model-path", "/m", arg, "7"])
        parsed[arg] = {k: v for k, v in vars(ns).items() if v == "7" or v == 7}
    except (argparse.ArgumentError, SystemExit) as exc:
        parsed[arg] = str(exc)
print(json.dumps({"allow_abbrev": p.allow_abbrev, "dests": dests, "parsed": parsed}))
"""
ABBREVIATIONS = ["--tp-siz", "--tensor-parallel-s", "--por", "--hos", "--pipeline-parallel", "--confi"]


@pytest.fixture(scope="module")
def parser_facts(sglang_venv: Path) -> dict:
    done = subprocess.run(
        [str(sglang_venv / "bin" / "python"), "-c", _PROBE, *ABBREVIATIONS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_every_spelling_of_an_owned_flag_is_owned(parser_facts: dict) -> None:
    assert parser_facts["allow_abbrev"], "SGLang's parser takes abbreviations: the guard must refuse them"
    dests = parser_facts["dests"]
    owned = {d: flags for d, flags in dests.items() if set(flags) & OWNED_FLAGS}
    assert {"model_path", "tp_size", "dp_size", "port", "host", "pp_size"} <= set(owned)
    for dest, flags in owned.items():
        assert set(flags) <= OWNED_FLAGS, (dest, flags)
    every = {f for flags in dests.values() for f in flags}
    assert every >= REFUSED_FLAGS
    # No flag of the release is refused by accident: only owned ones and --config.
    assert sorted(f for f in every if refused_extra_arg(f) and f not in OWNED_FLAGS | REFUSED_FLAGS) == []


def test_abbreviations_argparse_would_expand_are_refused(parser_facts: dict) -> None:
    for arg, outcome in parser_facts["parsed"].items():
        # argparse takes each as an owned flag (or --config), or refuses it as ambiguous.
        assert refused_extra_arg(arg) is not None, (arg, outcome)
        assert refused_extra_arg(f"{arg}=7") is not None
    assert parser_facts["parsed"]["--tp-siz"] == {"tp_size": 7}
    problem = extra_args_problem(
        ["--mem-fraction-static", "0.8", "--tp-siz", "4", "--mod=/x", "--config", "c.yaml"]
    )
    assert (
        problem
        and "--tp-siz (--tp-size)" in problem
        and "--mod=/x (--model)" in problem
        and "--config" in problem
    )


_PARSE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(prog="probe")
ServerArgs.add_cli_args(p)
ns = p.parse_args(sys.argv[1:])
print(json.dumps({k: getattr(ns, k) for k in ("model_path", "tp_size", "nnodes", "node_rank", "dist_init_addr",
                                               "enable_return_aux_hidden_states", "disable_radix_cache",
                                               "served_model_name")}))
"""


def test_a_group_launch_parses_as_sglang_reads_it(sglang_venv: Path) -> None:
    """Issue 37: the command of each rank's pod in the operator's JobSet, expanded as the kubelet expands it for
    group 1, read by the release's own parser (SGLang's CPU path cannot run tensor parallelism here, so this and
    the pure tests are what proves the launch)."""
    from hsx_operator.desired import Owner
    from hsx_operator.group import desired_jobset
    from tests.ground.podspec import expand_refs
    from tests.operator.helpers import make_spec

    spec = make_spec(server={"nodes": 2, "gpus": 8, "extraArgs": ["--served-model-name", "a$(B)"]}, parallelism=2)
    jobset = desired_jobset(Owner("xj", "ns", "u"), spec)
    for rank, rjob in enumerate(jobset["spec"]["replicatedJobs"]):
        pod = rjob["template"]["spec"]["template"]["spec"]
        (server,) = [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == "sglang"]
        argv = [expand_refs(a, {"JOB_COMPLETION_INDEX": "1"}) for a in server["command"]]
        done = subprocess.run([str(sglang_venv / "bin" / "python"), "-c", _PARSE, *argv[3:]],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {
            "model_path": "/models/tiny", "tp_size": 16, "nnodes": 2, "node_rank": rank,
            "dist_init_addr": "xj-r1-leader-0-1.xj-r1:20000", "enable_return_aux_hidden_states": True,
            "disable_radix_cache": True, "served_model_name": "a$(B)",
        }  # fmt: skip
