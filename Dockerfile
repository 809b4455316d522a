# batchinfer: one image for the scheduler, the workers and the exporter (docker-compose.yml).
# On linux/amd64, pip's default torch wheel is the CUDA build, so the same image serves GPUs
# (through the NVIDIA container toolkit) and runs on CPU.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOKENIZERS_PARALLELISM=false \
    BATCHINFER_RESULTS_ROOT=/results

WORKDIR /app
# g++ and ninja: the CPU decode-attention kernel (kernels/cpu_ext) is compiled on first use; without
# them the workers answer on the slower torch path.
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/*
# Dependencies first, so code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p batchinfer workers/models kernels jobs \
    && touch batchinfer/__init__.py workers/__init__.py workers/models/__init__.py kernels/__init__.py jobs/__init__.py \
    && pip install . && pip uninstall -y batchinfer
COPY batchinfer batchinfer
COPY workers workers
COPY kernels kernels
COPY jobs jobs
RUN pip install --no-deps . && useradd --create-home --uid 1000 batchinfer \
    && mkdir -p /results /models && chown batchinfer /results
USER batchinfer
# Build the CPU decode kernel into the user's torch extensions cache now, not in a worker's first step.
RUN python -P -c "from batchinfer.kernels.cpu_ext import decode; print('cpu decode kernel:', decode.available())"

ENTRYPOINT ["batchinfer"]
CMD ["--help"]
