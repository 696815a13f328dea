#!/usr/bin/env bash
# One prepared check for a CUDA or ROCm machine (device "cuda"), about 7-9 minutes (each part
# has its own time limit):
#
#   1. the environment: GPU, driver, torch build, bf16 support            (env.txt)
#   2. every demo in demos/ that follows the script contract (a setup() for amp-tui train) for 30
#      steps, headless, on cuda, in fp16 and in bf16 (two at a time)     (demo-*.log, runs/)
#   3. the test suite's CUDA-marked tests: pytest -m cuda                  (pytest-cuda.log)
#      They include tests/integrations/test_integration_cuda.py: the Hugging Face Trainer with fp16=True
#      and Lightning with precision="16-mixed", which get a GradScaler only on a GPU (on the CPU
#      the test suite hands them one by hand); run on their own too     (frameworks-fp16.log)
#   4. the overhead benchmark on a GPT-2-small-sized model (12 blocks, d_model 768, vocab 50257,
#      seq 512, batch 8) in fp16 and bf16: python bench/run.py --gpu --only overhead; its run/1,
#      run/10 and run/auto lines (run/auto: the adaptive schedule, the default)
#                                                                          (overhead.txt, *-gpu.json)
#   5. the whole-process line on the same model in fp16 and bf16: `amp-tui train --headless
#      --steps 50 --probe-every 1`, and `amp-tui train --headless --steps 50` with its defaults (the
#      adaptive schedule, "amp-tui auto"), against the bare-loop script, 5 pairs of three processes each:
#      python bench/run.py --gpu --only process                           (process.txt, *-gpu.json)
#      The adaptive schedule's target rows (run/auto, "amp-tui train (defaults)") are copied to
#      summary.txt after parts 4 and 5 (auto-targets.txt).
#   6. with 2 GPUs or more: amp-tui's coordination of 2 ranks over plain DDP, NCCL, one rank per
#      GPU: python bench/ddp_overhead.py --backend nccl --quick             (ddp-nccl.log, *-ddp-nccl.json)
#      and the same over a bare FSDP2 (fully_shard) loop:
#      python bench/fsdp_overhead.py --backend nccl --quick                (fsdp-nccl.log, *-fsdp-nccl.json)
#   7. fp8: the what-if's emulated casts against torch._scaled_mm (bench/fp8_native.py), and
#      `amp-tui train demos/fp8_outliers.py --dtype fp8` there and back to bf16  (fp8.log, fp8-train.log)
#
# Results go to $OUT if set, else bench/results/gpu-<date>/; summary.txt lists each part's exit
# status and time. Every part has its own time limit and a failing part doesn't stop the others;
# the script exits 0 when every part passed, 1 otherwise, 2 when there is no usable GPU.
#
#   bash bench/gpu_check.sh
#   PYTHON=/path/to/venv/bin/python OUT=/tmp/gpu bash bench/gpu_check.sh
#
# The Python used: $PYTHON, else ./.venv/bin/python, else python3, the first that imports torch.
# It needs torch with CUDA/ROCm, rich and textual (and pytest for part 3; transformers, accelerate
# and lightning for the framework tests, pip install -e '.[test]'; transformers also adds the
# DebugUnderflowOverflow contender). amp_tui is imported from this checkout (PYTHONPATH),
# so nothing needs installing if those are present.
#
# GPU_CHECK_DEVICE=cpu runs the same parts on the CPU (the overhead and process parts on
# bench/run.py --quick's small models instead of GPT-2 small): a dry run of this script on a
# machine without a GPU.

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-$ROOT/bench/results/gpu-$STAMP}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONWARNINGS="ignore::UserWarning"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
FAILED=0
START=$(date +%s)

say() { echo "$*" | tee -a "$SUMMARY"; }

# part NAME LIMIT_S COMMAND...: run with a time limit, output to $OUT/NAME.log, status to
# $OUT/NAME.status ("rc seconds"); safe to run in the background.
part() {
    local name=$1 limit=$2
    shift 2
    local t0
    t0=$(date +%s)
    echo "+ $*" > "$OUT/$name.log"
    timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$rc $(( $(date +%s) - t0 )) $limit" > "$OUT/$name.status"
}

# verdict NAME: one summary line from NAME.status; a failure marks the whole check failed.
verdict() {
    local name=$1 rc took limit
    read -r rc took limit < "$OUT/$name.status" || { say "FAIL  $name: no status"; FAILED=1; return; }
    if [ "$rc" -eq 0 ]; then
        say "PASS  $name (${took}s)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "FAIL  $name: over its ${limit}s limit, see $name.log"
        FAILED=1
    else
        say "FAIL  $name: exit $rc (${took}s), see $name.log"
        FAILED=1
    fi
}

# ---- 0. a Python with torch --------------------------------------------------------------------
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for candidate in "$ROOT/.venv/bin/python" python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
            PY="$candidate"
            break
        fi
    done
fi
if [ -z "$PY" ]; then
    say "no Python that imports torch (set PYTHON=...)"
    exit 2
fi

# ---- 1. environment ------------------------------------------------------------------------------
{
    echo "date: $(date -Iseconds)"
    echo "host: $(hostname)"
    echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    echo "checkout: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l | tr -d ' ') changed files"
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
    command -v rocm-smi >/dev/null 2>&1 && rocm-smi --showproductname
    "$PY" - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    print("bf16 supported", torch.cuda.is_bf16_supported())
for name in ("rich", "textual", "textual_plotext", "safetensors", "pytest", "transformers", "accelerate",
             "lightning"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "present"))
    except Exception as exc:  # noqa: BLE001
        print(name, "MISSING", type(exc).__name__)
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "$DEVICE" = "cpu" ]; then
    say "dry run on the CPU (GPU_CHECK_DEVICE=cpu)"
elif ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    say "torch.cuda.is_available() is False: no CUDA/ROCm device here (see env.txt)"
    exit 2
fi
if ! "$PY" -c "import rich" >/dev/null 2>&1; then
    say "note: rich is missing: the headless demos need it (pip install -e . where the network allows)"
fi

# ---- 2. demos in fp16 and bf16 (two at a time: each is mostly start-up) -------------------------
names=()
for demo in "$ROOT"/demos/*.py; do
    [ -f "$demo" ] || continue
    stem="$(basename "$demo" .py)"
    # own_loop.py, hf_trainer.py, lightning_module.py run under amp-tui run, not amp-tui train
    grep -q "^def setup(" "$demo" || continue
    for dtype in fp16 bf16; do
        part "demo-$stem-$dtype" 60 "$PY" -m amp_tui train "$demo" --headless --device "$DEVICE" \
            --dtype "$dtype" --steps 30 --run-dir "$OUT/runs/$stem-$dtype" &
        names+=("demo-$stem-$dtype")
        [ "$dtype" = bf16 ] && wait
    done
done
wait
for name in "${names[@]}"; do
    verdict "$name"
done

# ---- 3. CUDA-marked tests ------------------------------------------------------------------------
if "$PY" -c "import pytest" >/dev/null 2>&1; then
    part pytest-cuda 100 "$PY" -m pytest -m cuda -q -p no:cacheprovider -o addopts="" tests
    verdict pytest-cuda
    if grep -q -E "errors? (during|while) collect|ERROR collecting|no tests ran" "$OUT/pytest-cuda.log"; then
        # A test module that can't be imported here (a missing plugin) must not hide the CUDA tests.
        files=$(grep -l -E "mark\.cuda|pytest\.mark\.cuda" "$ROOT"/tests/*/test_*.py 2>/dev/null | tr '\n' ' ')
        if [ -n "$files" ]; then
            say "      (collection trouble: the CUDA-marked files alone follow)"
            # shellcheck disable=SC2086
            part pytest-cuda-files 80 "$PY" -m pytest -m cuda -q -p no:cacheprovider -o addopts="" $files
            verdict pytest-cuda-files
        fi
    fi
else
    say "FAIL  pytest-cuda: pytest is not installed for $PY"
    FAILED=1
fi

# ---- 3b. the frameworks' own fp16 (their GradScaler exists only on a GPU) -------------------------
if [ "$DEVICE" = "cpu" ]; then
    say "skip  frameworks-fp16: the CPU gives the frameworks no fp16 GradScaler"
elif "$PY" -c "import pytest, transformers, accelerate, lightning" >/dev/null 2>&1; then
    part frameworks-fp16 120 "$PY" -m pytest -m cuda -q -p no:cacheprovider -o addopts="" \
        "$ROOT/tests/integrations/test_integration_cuda.py"
    verdict frameworks-fp16
else
    say "FAIL  frameworks-fp16: transformers, accelerate or lightning is missing for $PY (pip install -e '.[test]')"
    FAILED=1
fi

# ---- 4. overhead benchmark on GPT-2-small size ---------------------------------------------------
if [ "$DEVICE" = "cpu" ]; then
    part overhead 150 "$PY" "$ROOT/bench/run.py" --quick --only overhead --device cpu --out "$OUT"
else
    part overhead 150 "$PY" "$ROOT/bench/run.py" --gpu --only overhead --device "$DEVICE" --out "$OUT"
fi
verdict overhead
# the table is at the end of the log; keep it on its own too
sed -n '/^amp-tui benchmarks/,$p' "$OUT/overhead.log" > "$OUT/overhead.txt"

# ---- 5. whole process on GPT-2-small size: amp-tui train against the bare loop ------------------
if [ "$DEVICE" = "cpu" ]; then
    part process 240 "$PY" "$ROOT/bench/run.py" --quick --only process --device cpu --out "$OUT"
else
    # three processes a pair now (--probe-every 1, the defaults, the bare loop): 300 s became 420 s
    part process 420 "$PY" "$ROOT/bench/run.py" --gpu --only process --device "$DEVICE" --out "$OUT"
fi
verdict process
sed -n '/^amp-tui benchmarks/,$p' "$OUT/process.log" > "$OUT/process.txt"
# the adaptive schedule (the default) side by side with probe_every 1: its target rows, in the summary
grep -h -E "^ *(PASS|MISS|UNSURE) .*(run/auto|\(defaults\))" "$OUT/overhead.txt" "$OUT/process.txt" > "$OUT/auto-targets.txt" 2>/dev/null
if [ -s "$OUT/auto-targets.txt" ]; then
    say "      the adaptive schedule (default):"
    sed 's/^/      /' "$OUT/auto-targets.txt" | tee -a "$SUMMARY"
else
    say "      the adaptive schedule (default): no target rows in overhead.txt or process.txt"
fi
# ---- 6. several ranks: amp-tui's coordination over plain DDP, one rank per GPU with NCCL --------
if [ "$DEVICE" = "cpu" ]; then
    part ddp 150 "$PY" "$ROOT/bench/ddp_overhead.py" --backend gloo --nproc 2 --quick --out "$OUT"
    verdict ddp
    part fsdp 240 "$PY" "$ROOT/bench/fsdp_overhead.py" --backend gloo --nproc 2 --quick --out "$OUT"
    verdict fsdp
else
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    if [ "${GPUS:-0}" -ge 2 ]; then
        part ddp-nccl 90 "$PY" "$ROOT/bench/ddp_overhead.py" --backend nccl --nproc 2 --quick --out "$OUT"
        verdict ddp-nccl
        part fsdp-nccl 90 "$PY" "$ROOT/bench/fsdp_overhead.py" --backend nccl --nproc 2 --quick --out "$OUT"
        verdict fsdp-nccl
    else
        say "skip  ddp-nccl, fsdp-nccl: ${GPUS:-0} GPU(s), they need 2 or more"
    fi
fi

# ---- 7. fp8: the what-if's emulated casts against the native fp8 GEMMs, and torchao natively -----
part fp8 120 "$PY" "$ROOT/bench/fp8_native.py" --device "$DEVICE"
verdict fp8
sed 's/^/      /' "$OUT/fp8.log" | grep -E "PASS|FAIL|skip" | tee -a "$SUMMARY"
# --dtype fp8 under amp-tui train: native fp8 GEMMs from compute capability 8.9 (emulated below it,
# and on the CPU), back to bf16 and into fp8 again.
part fp8-train 120 "$PY" -m amp_tui train "$ROOT/demos/fp8_outliers.py" --headless --device "$DEVICE" \
    --dtype fp8 --steps 60 --at 30:dtype=bf16 --at 45:dtype=fp8 --run-dir "$OUT/runs/fp8-train"
verdict fp8-train

say "total $(( $(date +%s) - START ))s; results in $OUT"
exit "$FAILED"
