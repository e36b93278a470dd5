"""hsx's dump producer for vLLM 0.32 (see docs/vllm.md).

Importing this package is light (no torch, no vLLM): the operator uses :mod:`.launch` to build the
server's command. The KV connector that writes dumps lives in :mod:`.connector`; vLLM loads it by
module path (``--kv-transfer-config``'s ``kv_connector_module_path``).
"""
