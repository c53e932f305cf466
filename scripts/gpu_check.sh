#!/usr/bin/env bash
# Everything the CUDA issue needs measured, for a session with a lent GPU (the `device` tool's `run`).
#
# Once, here (a machine with PyPI; from the repository root):
#     bash scripts/gpu_check.sh prepare
# downloads the timm wheel this package needs (the GPU image has an older timm), copies MNIST, and keeps both
# out of git (.git/info/exclude): .carry/wheels and .carry/mnist. Then, on the device, one call (10 minutes
# at most per call, so the stages run in order of priority and each is cut off at the time left):
#     run(command="bash scripts/gpu_check.sh", carry=[".carry"], timeout_s=600)
# or name the stages: prewarm host models throughput firstcall align compile profile check tests warmup table mnist
# (default: the first seven, in this order: the kernels compiled in parallel, the host's share of a call, the models'
# layers, the training steps, a new geometry's first call, the aligned variants, then the training steps under
# torch.compile last, since Inductor's builds of three models and their twins can take what is left of the call; the
# check compiles for longer). Results are written to $OUT, of which the device returns at most 8 files, 64 MiB in
# all: logs/<stage>.log as each stage runs (the benchmark stages' logs are their markdown tables; at the end they
# are packed into logs.tgz where the files would be more than 8), results.jsonl (every measurement of the benchmark
# stages, one JSON object per line, written as it is made), summary.txt with the versions, clocks and each stage's
# status and time, and triton_cache.tgz.part-aa, -ab, ...: the compiled kernels, a gzipped tar split into 15 MiB
# parts (the device returns files up to 16 MiB), left out where they would not fit. Copy the parts to .carry/ before
# the next call, which then starts from them (a machine given back loses its files): on a fresh H200 the check stage
# compiles for more than 530 s (its rows are printed as they are checked, so a cut-off log keeps what it reached).
#
# Stages:
#   check       python -m timm_sortconv.check --device cuda: every backend and auto against the reference path
#               (variants, orbit sortings, k 3, 5, 7, float32 and autocast), what auto decided, and SC against
#               F.conv2d and the models' twins (its log is the markdown report)
#   tests       the Triton backend's tests natively on the GPU (tests/test_triton_backend.py, in 8 pytest-xdist
#               workers so that kernels compile in parallel; the 9x9 cases, whose kernels take minutes to
#               compile, are left to the interpreter run on the CPU), the tuner's tests, and the CUDA test of
#               test_sort_conv.py (backend="auto" takes the Triton backend)
#   warmup      compiles every kernel the table needs, in parallel processes (Triton's compile takes tens
#               of seconds per 7x7 kernel; its cache then serves the timed runs)
#   table       five layer shapes x 4 variants x k 3, 5, 7, float32 and bf16/fp16 autocast: backend="auto"
#               (auto), each path (backend="triton-<path>": fused, columns, gemm), and the reference path
#   profile     torch.profiler's kernel times of forward+backward at the SCNN's layers, columns and gemm
#               paths, float32 and bf16: where the time goes (sorting kernels, cuBLAS, F.fold)
#   prewarm     compiles the kernels the models stage needs, in parallel processes (their output is not kept)
#   models      the SortConv2d layers of scnn_p_rs_7, ri_resnet18 and ri_densenet40: cuDNN, backend="auto",
#               each path, the reference path; what auto decided (every candidate's time and first call, which
#               compiles); every compiled kernel's registers and spills on the device
#   throughput  training steps of the three models (backend="auto") against their *_baseline twins
#   firstcall   the first call of new geometries with an empty Triton cache: scnn_p_rs_7's layers, float32,
#               forward and backward once on backend="auto"; the log's decision table gives each configuration's
#               parallel compile and checked calls (the goal: <= 30 s per geometry)
#   host        the host's share of an SC call (scripts/bench_host.py): the CPU time per call of every SortConv2d
#               layer of the three models on the GPU against nn.Conv2d (forward, forward+backward), the same on
#               meta tensors with the launches counted (the proxy measured without a GPU, on this host's CPU), and
#               a cProfile of one layer's eager calls (where the host's time goes)
#   compile     training steps of the three models against their twins under torch.compile, default and
#               reduce-overhead (CUDA graphs), float32
#   align       the aligned variants and the guided network (scnn_p_align_7_guided) on CUDA, where auto checks their
#               standard-operator form against the reference path and keeps the faster: training steps against
#               scnn_p_rs_7 and scnn_baseline_7, and each SC layer ring-sorted, aligned and guided
#               (scripts/bench_align.py; its log is the markdown tables)
#   mnist       the paper's MNIST protocol (scripts/configs/mnist_scnn.yaml, 100 epochs) on the Triton
#               backend, for $MNIST_MODEL (default scnn_p_rs_7; e.g. scnn_p_rs_7_canon); $OUT/mnist_run gets its last checkpoint, summary.csv and args.yaml. It takes more
#               than one call: copy $OUT/mnist_run to .carry/mnist_run and call again to resume from it
set -uo pipefail

WHEELS=.carry/wheels
PYTHON=${PYTHON:-python3}  # on the GPU image, python3 is the one with PyTorch
TIMM_VERSION=1.0.31
DEADLINE=${GPU_CHECK_SECONDS:-570}  # the device's per-call limit is 600 s
START=$(date +%s)

if [ "${1:-}" = "prepare" ]; then
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    grep -qx '/.carry/' "$exclude" 2>/dev/null || echo '/.carry/' >> "$exclude"
    mkdir -p "$WHEELS" .carry/mnist
    python3 -m pip download --no-deps --only-binary=:all: -d "$WHEELS" "timm==$TIMM_VERSION"
    cp /work/shared/data/mnist/* .carry/mnist/ 2>/dev/null || echo "no MNIST at /work/shared/data/mnist: the mnist stage will need --data-dir"
    du -sh .carry
    exit 0
fi

OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT/logs"
STAGES=${*:-prewarm host models throughput firstcall align compile}

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        || { echo "installing the carried wheels failed" | tee -a "$OUT/summary.txt"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TRITON_CACHE_DIR=/tmp/triton_cache
if ls .carry/triton_cache.tgz.part-* >/dev/null 2>&1; then
    cat .carry/triton_cache.tgz.part-* | tar xzf - -C /tmp
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv,noheader \
        2>/dev/null || echo "no nvidia-smi (dry run)"
    $PYTHON -c "import torch, triton, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__, 'cuda', torch.cuda.is_available())"
    git log -1 --format='commit %H %s' 2>/dev/null
} 2>&1 | tee "$OUT/summary.txt"

# DRY_RUN=1 runs the benchmark stages' code on tiny CPU tensors (Triton's interpreter) to check this script here.
WARM="$PYTHON scripts/bench_sortconv.py --device cuda${DRY_RUN:+ --dry-run}"  # runs whose output is not kept
BENCH="$WARM --json $OUT/results.jsonl"
[ -n "${DRY_RUN:-}" ] && export TRITON_INTERPRET=1
# The SC columns of the layer tables: backend="auto" as users get it, then each path of the Triton backend
PATHS=auto,fused,columns,gemm
VARIANTS=(polar-ring polar-global square-ring square-global)

left() { echo $(( DEADLINE - ($(date +%s) - START) )); }

stage() {  # stage NAME COMMAND...: runs it with the time left, output to $OUT/logs/NAME.log, status to summary.txt
    local name=$1; shift
    local budget; budget=$(left)
    if [ "$budget" -lt 20 ]; then
        echo "$name: not run (time left ${budget} s)" | tee -a "$OUT/summary.txt"
        return
    fi
    local begin; begin=$(date +%s)
    timeout "$budget" bash -c "$*" > "$OUT/logs/$name.log" 2>&1
    local rc=$?
    echo "$name: rc $rc ($([ $rc -eq 124 ] && echo 'cut off at the time limit' || echo done)), $(( $(date +%s) - begin )) s" \
        | tee -a "$OUT/summary.txt"
    tail -n 5 "$OUT/logs/$name.log"
}

for name in $STAGES; do
    case $name in
    check)
        stage check "$PYTHON -m timm_sortconv.check --device cuda --output /tmp/check.md" ;;
    tests)
        workers=$($PYTHON -c "import xdist" 2>/dev/null && echo "-n 8")
        stage tests "$PYTHON -m pytest -q -p no:cacheprovider $workers tests/test_triton_backend.py tests/test_autotune.py -k 'not 9-' && $PYTHON -m pytest -q -p no:cacheprovider tests/test_sort_conv.py -k cuda" ;;
    warmup)
        # One process per variant and kernel size, each running every call of the table once, untimed.
        jobs=()
        for variant in "${VARIANTS[@]}"; do
            for k in 3 5 7; do
                jobs+=("$WARM --shapes gpu --variants $variant --kernel-sizes $k --precisions fp32,bf16,fp16 --triton-paths $PATHS --repeats 0 --skip-reference > /dev/null")
            done
            jobs+=("$WARM --shapes scnn_p_rs_7,ri_resnet18,ri_densenet40 --variants $variant --precisions fp32,bf16 --triton-paths $PATHS --repeats 0 --skip-reference > /dev/null")
        done
        printf '%s\n' "${jobs[@]}" > /tmp/warmup_jobs.txt
        stage warmup "xargs -P 12 -I{} bash -c '{}' < /tmp/warmup_jobs.txt" ;;
    table)
        stage table "$BENCH --shapes gpu --kernel-sizes 3,5,7 --precisions fp32,bf16,fp16 --triton-paths $PATHS --repeats 20" ;;
    profile)
        stage profile "$BENCH --shapes scnn_p_rs_7 --precisions fp32,bf16 --triton-paths columns,gemm --repeats 3 --skip-reference --profile" ;;
    prewarm)
        # The models' layers run once, untimed, one process per model and precision: Triton compiles their kernels
        # (every candidate auto checks, and each path) in parallel, so that the models stage times warm kernels.
        jobs=()
        for model in scnn_p_rs_7 ri_resnet18 ri_densenet40; do
            for precision in fp32 bf16; do
                jobs+=("$WARM --shapes $model --precisions $precision --triton-paths $PATHS --repeats 0 --skip-reference > /dev/null")
            done
        done
        printf '%s\n' "${jobs[@]}" > /tmp/prewarm_jobs.txt
        stage prewarm "xargs -P 6 -I{} bash -c '{}' < /tmp/prewarm_jobs.txt" ;;
    models)
        stage models "$BENCH --shapes scnn_p_rs_7,ri_resnet18,ri_densenet40 --precisions fp32,bf16 --triton-paths $PATHS --repeats 20 --reference-repeats 1" ;;
    throughput)
        stage throughput "$BENCH --shapes none --throughput --precisions fp32,bf16 --steps 20" ;;
    host)
        if [ -n "${DRY_RUN:-}" ]; then
            stage host "$PYTHON scripts/bench_host.py gpu --dry-run --models scnn_p_rs_7 --batch 2 --json $OUT/results.jsonl --rounds 1 --calls 2 --profile && $PYTHON scripts/bench_host.py triton --models ri_densenet40 --json $OUT/results.jsonl --paths gemm --rounds 1 --calls 5"
        else
            stage host "$PYTHON scripts/bench_host.py gpu --json $OUT/results.jsonl --rounds 3 --calls 100 --profile && $PYTHON scripts/bench_host.py triton --json $OUT/results.jsonl --paths gemm --rounds 3 --calls 100"
        fi ;;
    compile)
        stage compile "$BENCH --shapes none --throughput --precisions fp32 --compile-modes default,reduce-overhead --steps 10" ;;
    align)
        if [ -n "${DRY_RUN:-}" ]; then
            stage align "$PYTHON scripts/bench_align.py --device cpu --batch-size 2 --rounds 1 --models scnn_p_rs_7,guided --layers"
        else
            stage align "$PYTHON scripts/bench_align.py --device cuda --rounds 5 --models scnn_baseline_7,scnn_p_rs_7,align,guided --layers"
        fi ;;
    firstcall)
        rm -rf /tmp/triton_cold
        stage firstcall "TRITON_CACHE_DIR=/tmp/triton_cold $BENCH --shapes scnn_p_rs_7 --precisions fp32 --triton-paths auto --repeats 0 --skip-reference" ;;
    mnist)
        resume=""
        [ -f .carry/mnist_run/last.pth.tar ] && resume="--resume .carry/mnist_run/last.pth.tar"
        stage mnist "$PYTHON scripts/train.py -c scripts/configs/mnist_scnn.yaml --model ${MNIST_MODEL:-scnn_p_rs_7} --data-dir .carry/mnist --output /tmp/train --experiment mnist_run $resume"
        mkdir -p "$OUT/mnist_run"
        cp /tmp/train/mnist_run/{last.pth.tar,summary.csv,args.yaml} "$OUT/mnist_run/" 2>/dev/null ;;
    *)
        echo "unknown stage $name; accepted: prepare prewarm host models throughput firstcall align compile profile check tests warmup table mnist" | tee -a "$OUT/summary.txt" ;;
    esac
done
# The device returns at most 8 files of at most 16 MiB, 64 MiB together: the logs as one file where they would be more.
files() { find "$OUT" -type f | wc -l; }
if [ "$(files)" -gt 8 ]; then
    tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$OUT/logs"
fi
if [ -d /tmp/triton_cache ]; then
    tar czf - -C /tmp triton_cache | split -b 15M - "$OUT/triton_cache.tgz.part-"
    parts=$(ls "$OUT"/triton_cache.tgz.part-* | wc -l)
    bytes=$(du -sb "$OUT" | cut -f1)
    if [ "$(files)" -gt 8 ] || [ "$bytes" -gt $(( 60 * 1024 * 1024 )) ]; then  # the results come first
        rm "$OUT"/triton_cache.tgz.part-*
        echo "triton_cache.tgz left out: $parts parts of at most 15 MiB beside $(files) result files" | tee -a "$OUT/summary.txt"
    fi
fi
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
