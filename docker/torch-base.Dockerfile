# A Debian Python image with torch and torchvision from a package index, pinned in
# /etc/pip/constraint.txt as NGC's PyTorch images pin theirs: the base of mmlight's image on machines
# without NGC (docker/Dockerfile with --build-arg BASE_IMAGE=...), and the stand-in for NGC that
# tests/test_docker_image.py builds (see docs/docker.md).
#
#   docker build -f docker/torch-base.Dockerfile -t mmlight-base .
#   docker build -f docker/Dockerfile --build-arg BASE_IMAGE=mmlight-base -t mmlight:debian .
#
# --build-arg TORCH_REQUIREMENTS="torch==2.9.1 torchvision==0.24.1" installs a given pair instead of the
# newest (the tests build the oldest supported one, .ci/oldest-pair.txt).
#
# PyPI's torch for Linux x86-64 bundles CUDA (about 6 GB with its libraries) and runs on the CPU as
# well; --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu installs the CPU-only wheels.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# A virtual environment first on PATH, so that `python` and `pip` are its own whichever Python the
# image has (Debian's python3 refuses system-wide pip installs, PEP 668; the official python images
# have no such rule).
ENV VIRTUAL_ENV=/opt/venv
ENV PATH="${VIRTUAL_ENV}/bin:${PATH}"
RUN python3 -m venv "${VIRTUAL_ENV}"

# torch and torchvision, then the constraint file that keeps later installs from replacing them
# (NGC >= 25.03 ships /etc/pip/constraint.txt; pip reads it through PIP_CONSTRAINT). Unpinned by
# default: the index's newest matched pair, as an NGC release holds its month's torch.
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG TORCH_REQUIREMENTS="torch torchvision"
# TORCH_REQUIREMENTS is split into words on purpose (one requirement each).
# hadolint ignore=DL3013,SC2086
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" ${TORCH_REQUIREMENTS} \
    && mkdir -p /etc/pip \
    && pip list --format=freeze | grep -iE '^(torch|torchvision|triton)==' | sort > /etc/pip/constraint.txt \
    && cat /etc/pip/constraint.txt
ENV PIP_CONSTRAINT=/etc/pip/constraint.txt

CMD ["python"]
