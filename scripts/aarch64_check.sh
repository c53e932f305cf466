#!/usr/bin/env bash
# Builds the fused CPU extension on aarch64 and runs its agreement tests there, on an x86-64 Debian
# machine, through qemu-user emulation. For maintainers; CI cannot run it (it needs root and qemu).
#
#   sudo scripts/aarch64_check.sh [--rootfs DIR] [--reuse-cache] [CHECKOUT] [-- PYTEST_ARGS...]
#
# CHECKOUT (default: the repository this script is in) is copied into an arm64 Debian bookworm
# root file system (default /var/tmp/timm_sortconv-aarch64, or $AARCH64_ROOTFS), where the emulated
# aarch64 Python builds the extension from an empty extension cache (timed; --reuse-cache keeps the
# last build instead) and runs pytest on PYTEST_ARGS (default: the CPU backend's agreement tests,
# tests/test_cpu_backend.py and tests/test_backends.py). Exit status 0 only if the build succeeds
# and every test passes.
#
# The first run creates the root file system: Debian's debootstrap, qemu-user-static and
# binfmt-support on the host, an arm64 bookworm with python3, g++, ninja and git, and a venv with
# the aarch64 CPU wheels of torch 2.9.1 and torchvision 0.24.1 from PyPI, timm and the test tools:
# 1.6 GB (785 MB of it the venv), 12-22 minutes on a 2-core machine, most of it emulated. Later runs
# reuse it and install only what is missing. Under emulation the build then takes 10-14 minutes and
# the default tests 2-10 (measured on 2 shared cores; each run prints its own times).
#
# Compiler and tests run as aarch64 processes in a chroot: the kernel's binfmt_misc hands every
# aarch64 executable to qemu, so the build's child processes (ninja, g++, as, ld) are aarch64 too.
# Without binfmt_misc, `qemu-aarch64-static -L ROOTFS python3` would run the Python but execute the
# host's x86-64 compiler for the build, so the script requires it and says so if it is missing.
#
# Under emulation the kernel's speed means nothing: this checks that it builds and agrees with the
# reference path, not how fast it is.
set -euo pipefail

readonly TORCH_PINS=("torch==2.9.1" "torchvision==0.24.1")
readonly PIP_PACKAGES=("timm==1.0.31" pytest numpy pyyaml safetensors huggingface_hub ninja)
readonly DEBIAN_PACKAGES=(python3 python3-venv python3-dev g++ ninja-build git ca-certificates)
readonly DEFAULT_TESTS=(tests/test_cpu_backend.py tests/test_backends.py)
readonly VENV=/opt/venv
readonly CHECKOUT_IN_ROOT=/work/checkout
readonly CACHE_IN_ROOT=/tmp/timm_sortconv_extensions

usage() {
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit "$1"
}

die() {
    echo "aarch64_check: $*" >&2
    exit 2
}

rootfs=${AARCH64_ROOTFS:-/var/tmp/timm_sortconv-aarch64}
reuse_cache=0
checkout=""
while [ $# -gt 0 ]; do
    case "$1" in
        --rootfs) [ $# -ge 2 ] || die "--rootfs needs a folder"; rootfs=$2; shift 2 ;;
        --reuse-cache) reuse_cache=1; shift ;;
        -h|--help) usage 0 ;;
        --) shift; break ;;
        -*) die "unknown option '$1'; accepted: --rootfs DIR, --reuse-cache, -h, then CHECKOUT and -- PYTEST_ARGS" ;;
        *) [ -z "$checkout" ] || die "one CHECKOUT only (got '$checkout' and '$1')"; checkout=$1; shift ;;
    esac
done
pytest_args=("$@")
[ ${#pytest_args[@]} -gt 0 ] || pytest_args=("${DEFAULT_TESTS[@]}")
checkout=$(cd "${checkout:-$(dirname "$0")/..}" && pwd) || die "no such checkout folder"
[ -f "$checkout/timm_sortconv/ops/cpu_backend.py" ] || die "$checkout is not a timm-sortconv checkout (no timm_sortconv/ops/cpu_backend.py)"
[ "$(id -u)" = 0 ] || die "needs root (debootstrap, mount and chroot); run it with sudo"
command -v apt-get >/dev/null || die "needs a Debian or Ubuntu host (apt-get, debootstrap)"
rootfs=$(mkdir -p "$rootfs" && cd "$rootfs" && pwd)

step() { echo; echo "== $* ($(date +%T))"; }

in_root() {
    # A command inside the root file system, with a clean environment.
    chroot "$rootfs" /usr/bin/env -i PATH="$VENV/bin:/usr/sbin:/usr/bin:/sbin:/bin" HOME=/root LANG=C.UTF-8 \
        TORCH_EXTENSIONS_DIR="$CACHE_IN_ROOT" PYTHONPATH="$CHECKOUT_IN_ROOT" PYTHONDONTWRITEBYTECODE=1 "$@"
}

# One run at a time per root file system: they share its mounts and its copy of the checkout.
exec 9>"$rootfs.lock"
flock -n 9 || die "another aarch64_check.sh is using $rootfs"

step "host tools"
native=0
[ "$(uname -m)" = aarch64 ] && native=1
missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ $native = 0 ]; then
    command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
    command -v update-binfmts >/dev/null || missing+=(binfmt-support)
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ $native = 0 ]; then
    # Containers often start without binfmt_misc mounted; registering qemu needs it.
    if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
            || die "cannot mount binfmt_misc: aarch64 programs cannot be run here (the build needs them)"
    fi
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64 \
        || die "cannot register qemu-aarch64 with binfmt_misc (update-binfmts --enable qemu-aarch64 failed)"
    echo "binfmt_misc: qemu-aarch64 $(head -n 1 /proc/sys/fs/binfmt_misc/qemu-aarch64), $(qemu-aarch64-static --version | head -n 1)"
fi

step "arm64 root file system in $rootfs"
if [ ! -e "$rootfs/.debootstrap-done" ]; then
    echo "debootstrap (one time, several minutes)"
    include=$(IFS=,; echo "${DEBIAN_PACKAGES[*]}")
    debootstrap --arch=arm64 --variant=minbase --include="$include" bookworm "$rootfs" http://deb.debian.org/debian
    touch "$rootfs/.debootstrap-done"
fi
chroot "$rootfs" /bin/true || die "cannot run aarch64 programs in $rootfs (binfmt_misc and qemu-user-static?)"

mounted=()
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}" || true; done
}
trap cleanup EXIT
mount_once() {
    # mount_once TARGET MOUNT_ARGS...: mounts unless something already is there (then leaves it).
    local target=$rootfs$1
    shift
    mountpoint -q "$target" && return
    mount "$@" "$target"
    mounted+=("$target")
}
mount_once /proc -t proc proc
mount_once /sys --bind /sys
mount_once /dev --bind /dev

# Certificate authorities the host trusts locally (a TLS-inspecting proxy, say) are trusted inside too.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    in_root update-ca-certificates >/dev/null
fi
# shellcheck disable=SC2016 # $p expands inside the chroot's shell
absent=$(in_root sh -c 'for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done' - "${DEBIAN_PACKAGES[@]}")
if [ -n "$absent" ]; then
    echo "installing into the root file system: $absent"
    in_root apt-get update -qq
    # shellcheck disable=SC2086 # one package name per word
    in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o Dpkg::Use-Pty=0 $absent >/dev/null
fi

requirements="${TORCH_PINS[*]} ${PIP_PACKAGES[*]}"
if [ "$(cat "$rootfs$VENV/.requirements" 2>/dev/null)" != "$requirements" ]; then
    echo "venv: $requirements (one time: about 800 MB, several minutes)"
    [ -x "$rootfs$VENV/bin/python" ] || in_root python3 -m venv "$VENV"
    in_root python -m pip install -q --progress-bar off --disable-pip-version-check "${TORCH_PINS[@]}" "${PIP_PACKAGES[@]}"
    echo "$requirements" >"$rootfs$VENV/.requirements"
fi

step "copy of $checkout"
rm -rf "$rootfs$CHECKOUT_IN_ROOT"
mkdir -p "$rootfs$CHECKOUT_IN_ROOT"
if git -C "$checkout" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # The working tree as it is: tracked and untracked files, not what .gitignore leaves out.
    git -C "$checkout" ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' name; do [ -e "$checkout/$name" ] && printf '%s\0' "$name"; done \
        | tar -C "$checkout" --null -T - -cf - | tar --no-same-owner -xf - -C "$rootfs$CHECKOUT_IN_ROOT"
    source_id=$(git -C "$checkout" rev-parse --short HEAD)
    [ -z "$(git -C "$checkout" status --porcelain)" ] || source_id+=" + uncommitted changes"
else
    tar -C "$checkout" --exclude=.git --exclude=.venv --exclude=__pycache__ -cf - . \
        | tar --no-same-owner -xf - -C "$rootfs$CHECKOUT_IN_ROOT"
    source_id="not a git checkout"
fi
# The tests that read this repository's history (scripts/research/bench_kernel_ab.py) get one commit: the copy.
in_root git -C "$CHECKOUT_IN_ROOT" init -q
in_root git -C "$CHECKOUT_IN_ROOT" add -A
in_root git -C "$CHECKOUT_IN_ROOT" -c user.name=aarch64_check -c user.email=aarch64_check@localhost \
    commit -q -m "copy of $checkout ($source_id)"
echo "$source_id"

step "compiler"
in_root c++ --version | head -n 1
echo "-march=native here means: $(in_root c++ -march=native -Q --help=target | awk '$1 == "-march=" {print $2}')"
# GCC reads the CPU from /proc/cpuinfo, which qemu-user passes through from the host.
[ $native = 1 ] || echo "(under qemu /proc/cpuinfo is the host's x86 one, so GCC finds no aarch64 CPU there)"
echo "predefined: $(echo | in_root c++ -march=native -dM -E -x c++ - | awk '/__ARM_NEON |__ARM_FEATURE_SVE |__ARM_FEATURE_FMA / {printf "%s ", $2}')"

step "build of the fused CPU extension"
[ $reuse_cache = 1 ] || rm -rf "$rootfs$CACHE_IN_ROOT"
build_log=$rootfs/tmp/aarch64_check_build.log
set +e
in_root python - >"$build_log" 2>&1 <<'EOF'
import platform
import sys
import time
import warnings

import torch
from timm_sortconv.ops import cpu_backend

print(f"python {platform.python_version()} on {platform.machine()}, torch {torch.__version__}, "
      f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}")
start = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    extension = cpu_backend.load_extension(verbose=True)
for warning in caught:
    print(f"warning: {warning.message}")
print(f"build_seconds {time.perf_counter() - start:.0f}")
if extension is not None and hasattr(cpu_backend, "cpu_isa"):  # kernels built per instruction-set level
    print(f"instruction-set level: {cpu_backend.cpu_isa()}")
sys.exit(0 if extension is not None else 1)
EOF
build_status=$?
set -e
grep -E "^(python |warning: |instruction-set level: )" "$build_log" || true
build_seconds=$(awk '/^build_seconds/ {print $2}' "$build_log")
if [ $build_status != 0 ]; then
    echo "--- the build's output (also in $build_log):"
    tail -n 60 "$build_log"
    echo
    echo "RESULT: the fused CPU extension did NOT build on aarch64 (after ${build_seconds:-?} s)"
    exit 1
fi
echo "built in ${build_seconds} s (emulated; $([ $reuse_cache = 1 ] && echo 'cache reused' || echo 'from an empty cache'))"

step "tests: pytest ${pytest_args[*]}"
set +e
tests_start=$SECONDS
# shellcheck disable=SC2016 # $0 and $@ expand inside the chroot's shell
in_root sh -c 'cd "$0" && exec python -m pytest -q -p no:cacheprovider -rfEs "$@"' "$CHECKOUT_IN_ROOT" "${pytest_args[@]}"
tests_status=$?
tests_seconds=$((SECONDS - tests_start))
set -e

echo
echo "aarch64 check of $checkout ($source_id): build OK in ${build_seconds} s," \
     "tests $([ $tests_status = 0 ] && echo passed || echo FAILED) in ${tests_seconds} s (under qemu-user)"
if [ $tests_status != 0 ]; then
    echo "RESULT: FAIL"
    exit 1
fi
echo "RESULT: PASS"
