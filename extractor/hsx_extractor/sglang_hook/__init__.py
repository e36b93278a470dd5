"""hsx's dump hook for SGLang 0.5.23 extraction mode (see docs/sglang.md).

Importing this package is light (no torch, no SGLang): the operator uses
:mod:`.launch` to build the sidecar's command. The hook itself lives in :mod:`.hook` and
:mod:`.writer`; :mod:`.bootstrap` installs it, from ``hsx_sglang_hook.pth``, in every Python
process that has ``SGLANG_HS_DUMP_DIR`` set.
"""
