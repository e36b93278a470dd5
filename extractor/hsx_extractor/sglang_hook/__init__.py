"""hsx's dump hook for SGLang 0.5.23 extraction mode (see docs/sglang.md).

Importing this package is light (no torch, no SGLang): the operator uses :func:`server_args`
and :func:`server_env` to build the sidecar. The hook itself lives in :mod:`.hook` and
:mod:`.writer`; :mod:`.bootstrap` installs it, from ``hsx_sglang_hook.pth``, in every Python
process that has ``SGLANG_HS_DUMP_DIR`` set.
"""

from hsx_extractor.sglang_hook.launch import (
    SGLANG_BASE_IMAGE,
    SGLANG_VERSION,
    is_extraction_env,
    server_args,
    server_env,
)

__all__ = ["SGLANG_BASE_IMAGE", "SGLANG_VERSION", "is_extraction_env", "server_args", "server_env"]
