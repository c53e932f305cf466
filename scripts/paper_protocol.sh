#!/usr/bin/env bash
# The paper's MNIST protocol for one SCNN (Mo & Zhao, Table 1: 100 epochs, Adam 1e-4 times 0.8 every 10 epochs,
# batch 100, 50,000 / 10,000 split, the best validation epoch kept), trained in the background and measured:
# MNIST test and all of MNIST-rot for the best epoch, and a learning curve (MNIST, MNIST-rot mean and worst
# angle) at epochs 1, 2, 5, 10, 20, 40, 70 and 100 (2,000 images x 36 angles, all 360,000 at epoch 100).
#
#   bash scripts/paper_protocol.sh start  RUNS DATA [MODEL [OPTION...]]   # start, or resume from its checkpoint
#   bash scripts/paper_protocol.sh status RUNS [MODEL]        # running or not, the curve so far, the log's tail
#   bash scripts/paper_protocol.sh pause  RUNS [MODEL]        # stop the process (SIGSTOP) for a benchmark
#   bash scripts/paper_protocol.sh resume RUNS [MODEL]        # let it go on (SIGCONT)
#   bash scripts/paper_protocol.sh stop   RUNS [MODEL]        # end it; `start` resumes it later
#
# RUNS is a folder for the run (RUNS/<MODEL>-paper/: checkpoints, curve.json) and its log
# (RUNS/<MODEL>-paper.log, appended to by every session); its result is a row of the table RUNS/results.csv
# (scripts/mnist_results.py --results), its sweep's per-angle CSV and plot RUNS/<MODEL>-paper/mnist_rot.csv|png.
# Keep RUNS out of git's way: under the clone's output/ (ignored by git; the README uses
# output/paper) or outside the clone. A run that is killed, or ends with the session, loses at
# most the batches since its last recovery checkpoint (every 100 batches), and `start` resumes it with the
# result of an uninterrupted run. DATA is the folder of the MNIST IDX files. MODEL: scnn_p_rs_7 by default.
# THREADS (default 1) is the number of CPU threads it uses, so that the machine stays usable beside it.
# OPTIONs go to scripts/mnist_results.py after the protocol's own (a later option wins; the tests use them
# for a tiny run); a resumed run must be given the same ones.
set -euo pipefail
self=$(realpath "$0")
usage() { sed -n '7,11p' "$self" >&2; exit 2; }
[ $# -ge 2 ] || usage
# RUNS and DATA as the caller names them, before the repository becomes the working folder
action=$1 runs=$(realpath -m "$2")
if [ "$action" = start ]; then
    [ $# -ge 3 ] || usage
    data=$(realpath -m "$3") model=${4:-scnn_p_rs_7}
    shift $(($# < 4 ? $# : 4))
else
    model=${3:-scnn_p_rs_7}
fi
name=$model-paper
log=$runs/$name.log
pidfile=$runs/$name.pid
python=${PYTHON:-.venv/bin/python}
cd "$(dirname "$self")/.."

# The process recorded in the pid file, if it is still this run (a pid left by an earlier machine may be reused).
running() { [ -f "$pidfile" ] && { tr '\0' ' ' < "/proc/$(cat "$pidfile")/cmdline"; } 2>/dev/null | grep -q -- "--name $name "; }
signal() { running || { echo "$name: not running"; exit 1; }; kill "-$1" -- "-$(cat "$pidfile")"; }

case $action in
start)
    if running; then echo "$name: already running (process group $(cat "$pidfile")); log: $log"; exit 0; fi
    [ -d "$data" ] || { echo "error: no data folder $data (the folder of the MNIST IDX files)" >&2; exit 2; }
    mkdir -p "$runs"
    threads=${THREADS:-1}
    # the level the run's SC kernel takes (PyTorch's, or TIMM_SORTCONV_CPU_ISA's), not only what the CPU has
    isa=$("$python" -c 'from timm_sortconv.ops.cpu_backend import cpu_isa; print(cpu_isa())' 2>/dev/null || echo unknown)
    echo "$(date -u '+%F %T') start: $model, $threads thread(s), the SC kernel's $isa level on a CPU with$(grep -q \
        avx512f /proc/cpuinfo || echo out) AVX-512" >> "$log"
    # setsid: the run and its data-loading workers form one process group, which stop/pause/resume signal.
    OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads setsid nohup "$python" scripts/mnist_results.py \
        --model "$model" --name "$name" --config scripts/configs/mnist_scnn.yaml --data-dir "$data" \
        --runs "$runs" --results "$runs/results.csv" --curve 1 2 5 10 20 40 70 100 --curve-samples 2000 --log-interval 50 \
        "$@" >> "$log" 2>&1 < /dev/null &
    echo $! > "$pidfile"
    sleep 2
    if ! running; then echo "error: $name ended at once; the log's end:" >&2; tail -n 5 "$log" >&2; exit 1; fi
    echo "$name: started (process group $!); progress: tail -f $log"
    ;;
status)
    if running; then echo "$name: running (process group $(cat "$pidfile"))"; else echo "$name: not running"; fi
    if [ -f "$runs/$name/curve.json" ]; then cat "$runs/$name/curve.json"; echo; fi
    if [ -f "$log" ]; then tail -n 3 "$log"; fi
    ;;
pause) signal STOP; echo "$name: paused" ;;
resume) signal CONT; echo "$name: going on" ;;
stop) signal TERM; kill -CONT -- "-$(cat "$pidfile")" 2>/dev/null || true; echo "$name: stopped; 'start' resumes it from its last checkpoint" ;;
*) usage ;;
esac
