#!/usr/bin/env bash
# The GPU checks of a session lent a GPU, as one prepared command per part: the device machine has torch and
# every package the suite needs, but no network and 15 minutes of device time per session, start included.
#
#   bash tools/gpu_session.sh tests   tests/cuda (OpInfo, training parity, integrations, fp8, demo)
#   bash tools/gpu_session.sh bench   benchmarks/fp8.py (the issue's goals: Llama-3-8B MLP block, ~1B Llama
#                                     step and its 200-step loss), fp8_profile.py (where the compiled block's
#                                     time goes, by kernel), eager_overhead.py (GPT-2 small with every op a
#                                     mixprec kernel), kernel_cost.py and `mixprec demo`
#   bash tools/gpu_session.sh all     both in one command of at most 9 minutes (shorter limits per step, no
#                                     JUnit file, fp8.py without the loss comparison and the small block, no
#                                     kernel_cost.py): for a session whose device time fits one machine start only
#   bash tools/gpu_session.sh tune    tools/fp8_tuning.py: ways of writing the compiled fp8 linear's
#                                     quantisation timed against bf16 (the 8B block with and without biases,
#                                     then the ~1B step under the fastest), with inductor's generated code
#
# The device image lacks `expecttest`, which torch's OpInfo database imports (tests/cuda/test_cuda_opinfo.py):
# download its wheel into .whl/ here (`pip download --no-deps --only-binary=:all: -d .whl expecttest`, with
# /.whl/ in .git/info/exclude) and name `.whl` in the device call's `carry`; this script installs what is
# there into /tmp/site. (On an H200 a machine started in about 30 s; `all` took 7 minutes, 2026-11-27.)
#
# Each step runs under its own time limit, so what finished comes back when a later step runs out of time
# (fp8.py writes its JSON after every case); a part takes at most 9 minutes. Logs and JSON go to $OUT (the device
# tool's folder: at most 8 files come back; `bench` writes 8 with the summary, `all` 8), else ./gpu-session.
# GPU_SESSION_DEVICE=cpu runs the same steps on a CPU, shortened, to check the wiring without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
device=${GPU_SESSION_DEVICE:-cuda}
out=${OUT:-gpu-session}
mkdir -p "$out"
python=${PYTHON:-python3}
site=
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (see above)
    site=${TMPDIR:-/tmp}/gpu-session-site
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
fi
export PYTHONPATH="$PWD/src${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
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
    "$python" -c "import expecttest" 2>/dev/null || echo "no expecttest: test_cuda_opinfo.py cannot import (carry .whl)"
} >"$out/summary.txt" 2>&1

tests() {  # tests LIMIT [JUNIT]
    export MIXPREC_CUDA_TESTS_DEVICE=$device
    local select
    if [ "$quick" = 1 ]; then
        select=(-n 2 -k "not opinfo")
    else
        select=(-n 15)  # (89 s on an H200's 16 host cores)
    fi
    # pytest-timeout, where installed (the device image has it): a hung test fails alone, with its stack
    "$python" -c "import pytest_timeout" 2>/dev/null && select+=(--timeout 150)
    [ -n "${2:-}" ] && select+=(--junitxml="$out/cuda-tests.xml")
    step cuda-tests "$1" "$python" -m pytest tests/cuda -q -p no:cacheprovider -rfE --durations=15 "${select[@]}"
}

bench() {  # bench FP8_LIMIT PROFILE_LIMIT OVERHEAD_LIMIT KERNEL_COST_LIMIT DEMO_LIMIT [FP8 CASES...]
    # (a limit of 0 skips the step)
    local fp8 profile overhead repeats steps
    local limits=("$1" "$2" "$3" "$4" "$5")
    shift 5
    if [ "$quick" = 1 ]; then
        fp8=(--cases mlp-gpt2-small llama loss --repeats 3 --warmup 1 --loss-steps 2)
        profile=(--steps 2)
        overhead=(--cases gpt2 --repeats 3)
        repeats=2
        steps=5
    else
        fp8=(--cases mlp-llama3-8b llama mlp-gpt2-small loss --repeats 5 --loss-steps 200)
        profile=(--steps 10)
        overhead=(--cases gpt2 gpt2_kernels --repeats 20)
        repeats=7
        steps=150
        [ $# -gt 0 ] && fp8=(--cases "$@" --repeats 5)
    fi
    step fp8 "${limits[0]}" "$python" benchmarks/fp8.py --device "$device" "${fp8[@]}" --json "$out/fp8.json"
    [ "${limits[1]}" = 0 ] || step fp8-profile "${limits[1]}" "$python" benchmarks/fp8_profile.py --device "$device" \
        "${profile[@]}"
    step eager-overhead "${limits[2]}" "$python" benchmarks/eager_overhead.py --device "$device" "${overhead[@]}" \
        --json "$out/eager-overhead.json"
    [ "${limits[3]}" = 0 ] || step kernel-cost "${limits[3]}" "$python" benchmarks/kernel_cost.py --device "$device" \
        --repeats "$repeats"
    step demo "${limits[4]}" "$python" -m mixprec demo --device "$device" --steps "$steps" --out "${TMPDIR:-/tmp}/gpu-session-demo"
}

tune() {  # tune LIMIT
    local extra=()
    [ "$quick" = 1 ] && extra=(--repeats 3 --no-llama)
    step fp8-tuning "$1" "$python" tools/fp8_tuning.py --device "$device" --out "$out" "${extra[@]}"
}

case "$part" in
tune)
    tune 500
    ;;
tests)
    tests 480 junit
    ;;
bench)
    bench 360 90 90 45 45
    ;;
all)
    # (measured 2026-11-27: tests 89 s; five fp8 cases within 250 s; the loss comparison 160 s alone, left to
    # `bench`; kernel_cost 18 s, left to `bench` (its goal met on an H200); the demo 20 s)
    tests 130
    bench 220 75 90 0 35 mlp-llama3-8b llama
    ;;
*)
    echo "usage: bash tools/gpu_session.sh tests|bench|tune|all" >&2
    exit 2
    ;;
esac
exit $failed
