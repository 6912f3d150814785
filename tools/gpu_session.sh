#!/usr/bin/env bash
# The GPU checks of a session lent a GPU, as one prepared command per part: the device machine has torch and
# every package the suite needs, but no network and 15 minutes of device time per session, start included.
#
#   bash tools/gpu_session.sh tests   tests/cuda (OpInfo, training parity, integrations, fp8, demo)
#   bash tools/gpu_session.sh bench   benchmarks/fp8.py (the issue's goals: Llama-3-8B MLP block, ~1B Llama
#                                     step and its 200-step loss), eager_overhead.py (GPT-2 small with every op
#                                     a mixprec kernel), kernel_cost.py and `mixprec demo`
#
# Each step runs under its own time limit, so what finished comes back when a later step runs out of time;
# a part takes at most 9 minutes. Logs and JSON go to $OUT (the device tool's folder: at most 8 files come back,
# and each part writes at most 7), else ./gpu-session.
# GPU_SESSION_DEVICE=cpu runs the same steps on a CPU, shortened, to check the wiring without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
device=${GPU_SESSION_DEVICE:-cuda}
out=${OUT:-gpu-session}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
quick=$([ "$device" = cpu ] && echo 1 || echo 0)
failed=0

step() {  # step NAME SECONDS COMMAND...: run COMMAND with output to $out/NAME.log, under a time limit
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s$([ $rc = 124 ] && echo " (time limit $limit s)")" | tee -a "$out/summary.txt"
    [ $rc = 0 ] || failed=1
}

{
    echo "part $part on $device, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    [ "$device" = cuda ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} >"$out/summary.txt" 2>&1

case "$part" in
tests)
    export MIXPREC_CUDA_TESTS_DEVICE=$device
    if [ "$quick" = 1 ]; then
        select=(-n 2 -k "not opinfo")
    else
        select=(-n 4)
    fi
    step cuda-tests 480 "$python" -m pytest tests/cuda -q -p no:cacheprovider "${select[@]}" \
        --junitxml="$out/cuda-tests.xml"
    ;;
bench)
    if [ "$quick" = 1 ]; then
        fp8=(--cases mlp-gpt2-small llama --repeats 3 --warmup 1 --loss-steps 2)
        overhead=(--cases gpt2 --repeats 3)
        repeats=2
        steps=5
    else
        fp8=(--cases mlp-llama3-8b mlp-gpt2-small llama --repeats 5 --loss-steps 200)
        overhead=(--cases gpt2 gpt2_kernels --repeats 20)
        repeats=7
        steps=150
    fi
    step fp8 360 "$python" benchmarks/fp8.py --device "$device" "${fp8[@]}" --json "$out/fp8.json"
    step eager-overhead 90 "$python" benchmarks/eager_overhead.py --device "$device" "${overhead[@]}" \
        --json "$out/eager-overhead.json"
    step kernel-cost 45 "$python" benchmarks/kernel_cost.py --device "$device" --repeats "$repeats"
    step demo 45 "$python" -m mixprec demo --device "$device" --steps "$steps" --out "${TMPDIR:-/tmp}/gpu-session-demo"
    ;;
*)
    echo "usage: bash tools/gpu_session.sh tests|bench" >&2
    exit 2
    ;;
esac
exit $failed
