# Ferrum, CPU image.
#
#   docker build -t ferrum:cpu .
#   docker run --rm -p 8000:8000 -v ferrum-cache:/var/cache/ferrum \
#       -e FERRUM_MODEL=hf://HuggingFaceTB/SmolLM2-135M-Instruct ferrum:cpu
#
# The configuration is read from /etc/ferrum/config.yaml (mount your own over it); FERRUM_* variables
# and flags after the image name override it. Remote models are cached in the volume /var/cache/ferrum.
# Where the default base image or PyTorch's index cannot be reached, pass your own:
#   --build-arg BASE_IMAGE=... (a Debian-like image with python3 >= 3.11 and python3-venv)
#   --build-arg TORCH_INDEX_URL=... --build-arg TORCH_FIND_LINKS=/dir/with/wheels --build-arg PIP_INDEX_URL=...
#   --build-arg PIP_CERT=/path/to/ca-bundle.crt (with that file mounted into the build)

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=""
ARG PIP_INDEX_URL=https://pypi.org/simple
# a CA bundle for pip behind a TLS-inspecting proxy (mount it into the build with -v)
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# torch first, from its own index (the CPU build), so that nothing below pulls a CUDA build from PyPI
RUN python3 -m venv /opt/ferrum \
    && /opt/ferrum/bin/pip install --index-url "${TORCH_INDEX_URL}" --extra-index-url "${PIP_INDEX_URL}" \
           ${TORCH_FIND_LINKS:+--find-links "${TORCH_FIND_LINKS}"} "${TORCH_SPEC}"
COPY pyproject.toml README.md /src/
COPY ferrum /src/ferrum
# dumb-init (PyPI): PID 1 that forwards signals to the server and reaps its engine process
# (pip compiles the bytecode here: the image's root filesystem may be read-only)
RUN /opt/ferrum/bin/pip install "/src" "dumb-init==1.2.5.post1" \
    && /opt/ferrum/bin/pip uninstall -y pip

FROM ${BASE_IMAGE}
# g++ builds Ferrum's CPU kernels on the first start, for the CPU the container runs on (-march=native),
# into the cache volume (ferrum/kernels/cpu/build.py); without it plain PyTorch serves, several times slower
# hadolint ignore=DL3008
RUN command -v g++ >/dev/null || { apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*; }
COPY --from=build /opt/ferrum /opt/ferrum
COPY docker/config.yaml /etc/ferrum/config.yaml
RUN useradd --system --uid 10001 --user-group --home-dir /var/cache/ferrum --no-create-home --shell /usr/sbin/nologin ferrum \
    && mkdir -p /var/cache/ferrum \
    && chown 10001:10001 /var/cache/ferrum
ENV PATH=/opt/ferrum/bin:${PATH} \
    HOME=/var/cache/ferrum \
    FERRUM_CACHE=/var/cache/ferrum \
    HF_HOME=/var/cache/ferrum/huggingface \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
VOLUME ["/var/cache/ferrum"]
EXPOSE 8000
USER 10001:10001
WORKDIR /var/cache/ferrum
# healthy once the model is loaded and warmed (/ready); a long first download is covered by the start period
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('FERRUM_PORT', '8000'), timeout=4)"]
# SIGTERM starts the graceful drain (server.shutdown_timeout_s, default 30 s)
STOPSIGNAL SIGTERM
ENTRYPOINT ["dumb-init", "--single-child", "--", "ferrum", "serve", "--config", "/etc/ferrum/config.yaml"]
CMD []
