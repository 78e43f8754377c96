#!/usr/bin/env bash
# A change to kernel sources measured against a commit's version of the same files,
# alternated in one sitting: each round runs COMMAND with REV's files in place (A), then
# with the working tree's (B). The C++ kernels are built per source hash and cached
# (~/.cache/cadence/kernels), so each version builds once; a drift of the machine over
# the sitting weighs on both alike. The working tree's files are put back at the end,
# interrupted or not.
#
#   benchmarks/kernels/ab_source.sh REV ROUNDS FILE... -- COMMAND...
#
# e.g. the prompt's attention on one thread against the last commit's:
#   benchmarks/kernels/ab_source.sh HEAD 3 server/cadence/kernels/cpu/attention_avx2.h -- \
#       python benchmarks/kernels/cpu_attention_bench.py --prefill --batch 3 --context 320 \
#       --dtype float32 --kv-dtype bfloat16 --threads 1 --steps 15
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 REV ROUNDS FILE... -- COMMAND..." >&2
    exit 2
fi
rev=$1 rounds=$2
shift 2
files=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    files+=("$1")
    shift
done
if [ $# -lt 2 ] || [ ${#files[@]} -eq 0 ]; then
    echo "usage: $0 REV ROUNDS FILE... -- COMMAND..." >&2
    exit 2
fi
shift  # the --
root=$(git rev-parse --show-toplevel)
cd "$root"
for f in "${files[@]}"; do
    git cat-file -e "$rev:$f"  # a file REV lacks: stop before touching anything
done
saved=$(mktemp -d)
for f in "${files[@]}"; do
    mkdir -p "$saved/$(dirname "$f")"
    cp "$f" "$saved/$f"
done
restore() {
    for f in "${files[@]}"; do cp "$saved/$f" "$f"; done
    rm -rf "$saved"
}
trap restore EXIT
export PYTHONPATH="$root/server${PYTHONPATH:+:$PYTHONPATH}"
for ((r = 1; r <= rounds; r++)); do
    for side in A B; do
        for f in "${files[@]}"; do
            if [ "$side" = A ]; then git show "$rev:$f" > "$f"; else cp "$saved/$f" "$f"; fi
        done
        label="working tree"
        [ "$side" = A ] && label=$rev
        echo "round $r, $side ($label):"
        "$@"
    done
done
