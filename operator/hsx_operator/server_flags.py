"""server.extraArgs's guard in CEL: the launchers' checks of extra arguments (sglang_hook.launch.
refused_extra_arg, vllm_hook.launch.extra_args_problem), so the API server refuses what the
operator's renderer would refuse, at apply time."""

from __future__ import annotations

from hsx_extractor.sglang_hook.launch import MIN_ABBREV, OWNED_FLAGS, REFUSED_FLAGS
from hsx_extractor.vllm_hook.launch import OWNED_FLAGS as VLLM_OWNED_FLAGS

_GUARDED_FLAGS = sorted(OWNED_FLAGS | REFUSED_FLAGS)
_GUARDED_FLAGS_CEL = "[" + ", ".join(f"'{f}'" for f in _GUARDED_FLAGS) + "]"
# launch.refused_extra_arg in CEL: a flag name (before any '=') that is a guarded flag or an argparse
# abbreviation of one (a prefix of it).
_ARG_NAME_CEL = "(a.indexOf('=') >= 0 ? a.substring(0, a.indexOf('=')) : a)"
_SGLANG_ARGS_CEL = (
    "self.extraArgs.all(a, !a.startsWith('--') || "
    f"size({_ARG_NAME_CEL}) < {MIN_ABBREV} || !{_GUARDED_FLAGS_CEL}.exists(f, f.startsWith({_ARG_NAME_CEL})))"
)
# vllm_hook.launch.extra_args_problem in CEL: an owned flag itself, or a long flag's prefix.
_VLLM_ARGS_CEL = (
    "self.extraArgs.all(a, !a.startsWith('-') || !["
    + ", ".join(f"'{f}'" for f in sorted(VLLM_OWNED_FLAGS))
    + f"].exists(f, f == {_ARG_NAME_CEL} || ({_ARG_NAME_CEL}.startsWith('--') && size({_ARG_NAME_CEL}) >= "
    f"{MIN_ABBREV} && f.startsWith({_ARG_NAME_CEL}))))"
)
IS_VLLM = "(has(self.engine) && self.engine == 'vllm')"
EXTRA_ARGS_RULE = f"!has(self.extraArgs) || ({IS_VLLM} ? {_VLLM_ARGS_CEL} : {_SGLANG_ARGS_CEL})"
