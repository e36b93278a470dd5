# syntax=docker/dockerfile:1
# (BuildKit: the RUN --mount lines below need it; Docker 23+ uses it by default.)
# hsx images, one target each (no Docker engine in CI: hadolint checks this file, nothing builds it):
#   docker build --target operator  -t ghcr.io/hsx-dev/hsx-operator:0.1.0  .
#   docker build --target extractor -t ghcr.io/hsx-dev/hsx-extractor:0.1.0 .
#   docker build --target sglang    -t ghcr.io/hsx-dev/hsx-sglang:0.1.0    .
#   docker build --target vllm      -t ghcr.io/hsx-dev/hsx-vllm:0.1.0      .
# Base tags are pinned; pin them by digest (name:tag@sha256:...) in a release pipeline.
# SGLANG_IMAGE must carry the release in hsx_extractor/sglang_hook/launch.py (SGLANG_VERSION);
# the sglang stage fails the build otherwise; likewise VLLM_IMAGE and vllm_hook/launch.py (VLLM_VERSION).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---- hsx as a wheel (the only stage that sees the source) -----------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY extractor ./extractor
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- the native bf16 kernels (storage/native.py): encoding's split and the Inf/NaN scan in C ---
# A library apart, so the wheel stays pure Python for the engine images; only the extractor loads it.
FROM ${PYTHON_IMAGE} AS native
# The compiler only: the library is plain C99 against libc and does not outlive this stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-deps /wheels/hsx-0.1.0-py3-none-any.whl \
    && CC=gcc python -m hsx_extractor.storage.native build /native

# ---- common runtime: slim Python, an unprivileged user --------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# 65532: the uid the chart and the extraction pods run as (runAsUser), so it has a passwd entry here.
RUN useradd --system --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin hsx

# ---- operator: kopf + kubernetes client, no torch -------------------------------------------
FROM runtime AS operator
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install "/wheels/hsx-0.1.0-py3-none-any.whl[operator]"
USER 65532:65532
ENTRYPOINT ["hsx-operator"]

# ---- extractor: reads dumps, writes shards, talks to S3; no torch ---------------------------
FROM runtime AS extractor
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install "/wheels/hsx-0.1.0-py3-none-any.whl[extractor]"
# Named, the library must load: an image without it fails here, a pod with a broken one at start.
COPY --from=native /native/_hsx_bf16.so /opt/hsx/_hsx_bf16.so
ENV HSX_NATIVE_LIB=/opt/hsx/_hsx_bf16.so
RUN python -m hsx_extractor.storage.native status
USER 65532:65532
ENTRYPOINT ["hsx"]

# ---- sglang: the official release plus hsx's dump hook ---------------------------------------
# Extraction mode is off unless SGLANG_HS_DUMP_DIR is set, so this image also serves normally.
FROM ${SGLANG_IMAGE} AS sglang
# --no-deps: the hook needs only numpy, which SGLang has; pip must never touch SGLang's torch.
# Then: put the activation .pth into site-packages, refuse a base image with another SGLang,
# and prove the .pth switches the hook on when the variable is set.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps /wheels/hsx-0.1.0-py3-none-any.whl \
    && python3 -m hsx_extractor.sglang_hook install-pth \
    && python3 -c "from hsx_extractor.sglang_hook.launch import SGLANG_VERSION as pin; from hsx_extractor.sglang_hook.bootstrap import installed_sglang_version as v; assert v() == pin, f'base image has sglang {v()}, hsx pins {pin}'" \
    && SGLANG_HS_DUMP_DIR=/tmp/hsx-check python3 -c "import sys; assert any(type(f).__name__ == 'HookFinder' for f in sys.meta_path), 'hook not active'"

# ---- vllm: the official release plus hsx's KV connector and launcher -------------------------
# Nothing is patched: vLLM loads the connector by module path when the operator's command
# (python3 -m hsx_extractor.vllm_hook serve ...) starts it, so this image also serves normally.
FROM ${VLLM_IMAGE} AS vllm
# --no-deps: the connector needs torch and vLLM, which the image has; pip must never touch them.
# Then: refuse a base image with another vLLM, and prove the connector imports against it.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps /wheels/hsx-0.1.0-py3-none-any.whl \
    && python3 -c "from importlib.metadata import version as v; from hsx_extractor.vllm_hook.launch import VLLM_VERSION as pin; assert v('vllm') == pin, f'base image has vllm {v(\"vllm\")}, hsx pins {pin}'" \
    && python3 -c "from hsx_extractor.vllm_hook.connector import HsxDumpConnector"
