#!/usr/bin/env python3
"""Where a training step's CPU time goes: Linux ``perf`` samples of training steps, grouped by what the code does.

The steps (forward, cross-entropy, backward and an Adam update on random images) run in a child process under
``perf record``, which is switched on only around the timed steps (``--control`` FIFO), so that start-up,
imports and the warm-up step are not counted. Samples are grouped by symbol into the phases of the fused
CPU kernel (``timm_sortconv/csrc/sort_conv_kernel.h``):

* forward GEMM, backward input-gradient GEMM, weight-gradient GEMM (the register-tiled micro-GEMMs);
* sampling: the windows staged from the input and the bilinear taps (backward: the samples taken again);
* sampling + sorting fused: the forward pass's direct path (reads, interpolates and sorts in registers);
* sorting (recording the swaps in backward) and unsorting (the gradients sent back through the swaps);
* scatter: sample gradients added to the input gradient through the taps;
* kernel, rest: the kernel's own loops (blocks, lane copies, transposes, image copies, sums of parts);
* convolution (oneDNN): ``F.conv2d``'s JIT code, which the plain twins run;
* other PyTorch operators (batch norm, pooling, Adam, autograd), Python and dispatch, the OS.

A function the compiler inlined counts in its caller: the phases are as fine as the symbols. ``perf`` must be
installed (Debian: ``linux-perf``) and allowed to sample this process (``/proc/sys/kernel/perf_event_paranoid``
<= 2 for one's own processes).

Examples::

    python scripts/profile_training.py --model scnn_p_rs_7 --model scnn_baseline_7 --threads 1
    python scripts/profile_training.py --model ri_resnet18 --size 128 --batch 16 --steps 5
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# (phase, pattern of the symbol); the first match wins. Kernel symbols are C++ names in an anonymous namespace.
PHASES = [
    ("forward GEMM", r"micro_gemm<.*\bforward_kernel|forward_kernel.*micro_gemm<"),
    ("weight-gradient GEMM", r"micro_gemm_reduce|gemm_reduce"),
    ("input-gradient GEMM", r"micro_gemm<"),
    ("sampling + sorting (forward, fused)", r"sort_direct|sort_polar_fixed|sort_polar_segment"),
    ("sampling", r"stage_windows|apply_tap|gather_samples"),
    ("unsorting (backward)", r"unsort_|replay_reversed"),
    ("sorting", r"sort_fixed|sort_segment|sort_samples|run_network|load_and_sort"),
    ("scatter (backward)", r"scatter_"),
    ("kernel, rest", r"timm_sortconv_cpu|forward_kernel|backward_kernel|forward_impl|backward_impl|ImageRing|"
                     r"make_block|load_lanes|store_lanes|make_plan"),
    ("convolution (oneDNN)", r"^\[JIT\]|dnnl|mkldnn|brgemm"),
    ("Python and dispatch", r"^libpython|^python|^libtorch_python|c10::Dispatcher|^libc10"),
    ("other PyTorch operators", r"^libtorch_cpu|^libgomp|^libomp"),
    ("OS and C library", r"^\[kernel|^libc\.|^libm\.|^ld-linux"),
]


def worker(args) -> None:
    """The child: build the model, warm up, then time ``--steps`` steps with perf switched on around them."""
    import torch
    import timm

    import timm_sortconv  # noqa: F401  (registers the models)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = timm.create_model(args.model[0], num_classes=10)
    chans = model.pretrained_cfg["input_size"][0]
    size = args.size or model.pretrained_cfg["input_size"][-1]
    x, y = torch.randn(args.batch, chans, size, size), torch.randint(0, 10, (args.batch,))
    optimizer = torch.optim.Adam(model.parameters(), 1e-4)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()
    with open(args.control, "w") as ctl, open(args.ack) as ack:
        ctl.write("enable\n"), ctl.flush(), ack.readline()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        ctl.write("disable\n"), ctl.flush(), ack.readline()
    print(f"{args.batch * args.steps / wall:.1f} {args.batch * args.steps / cpu:.1f}")


def classify(dso: str, symbol: str) -> str:
    for phase, pattern in PHASES:
        if re.search(pattern, symbol) or re.search(pattern, dso):
            return phase
    return "other"


def profile(args, model: str, folder: str):
    """Runs the worker under perf for one model; returns (images/s wall, images/s CPU, {phase: share})."""
    control, ack, data = (os.path.join(folder, name) for name in ("ctl", "ack", f"{model}.data"))
    for fifo in (control, ack):
        if os.path.exists(fifo):
            os.remove(fifo)
        os.mkfifo(fifo)
    child = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--batch", str(args.batch),
             "--steps", str(args.steps), "--threads", str(args.threads), "--control", control, "--ack", ack]
    if args.size:
        child += ["--size", str(args.size)]
    # -g: call chains, so that a micro-GEMM is told apart by its caller (forward or backward kernel).
    record = ["perf", "record", "-q", "-g", "-D", "-1", f"--control=fifo:{control},{ack}", "-o", data, "--", *child]
    done = subprocess.run(record, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: perf record failed ({done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1]}")
    wall_rate, cpu_rate = map(float, done.stdout.split()[-2:])
    report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--stdio", "-g", "caller,0.5,callee",
                             "--sort", "dso,symbol", "--percent-limit", "0"], capture_output=True, text=True)
    shares: dict = {}
    for dso, symbol, share in parse_report(report.stdout):
        phase = classify(dso, symbol)
        shares[phase] = shares.get(phase, 0.0) + share
    return wall_rate, cpu_rate, shares


def parse_report(text: str):
    """(dso, symbol, percent) of every top-level line of ``perf report --stdio``; a micro-GEMM's forward
    share is split from its backward one by the call chains below its line."""
    top = re.compile(r"^\s+([\d.]+)%\s+(.+?)\s+\[[.k]\]\s+(.*?)\s*$")
    chain = re.compile(r"^\s*[|-]*\s*--([\d.]+)%--(.*)$")
    only_chain = re.compile(r"^\s*\|*\s*---(\S.*)$")  # a symbol with one caller: its whole share
    current = None
    for line in text.splitlines():
        match = top.match(line)
        if match:
            if current:
                yield from split_by_caller(*current)
            current = [match.group(2), match.group(3), float(match.group(1)), []]
            continue
        match = chain.match(line)
        if current and match:
            current[3].append((float(match.group(1)), match.group(2)))
        elif current and not current[3] and only_chain.match(line):
            current[3].append((current[2], only_chain.match(line).group(1)))
    if current:
        yield from split_by_caller(*current)


def split_by_caller(dso: str, symbol: str, share: float, callers):
    if not symbol.startswith("(anonymous namespace)::micro_gemm<") or not callers:
        yield dso, symbol, share
        return
    forward = sum(p for p, caller in callers if "forward_kernel" in caller)
    yield dso, "forward_kernel " + symbol, forward
    yield dso, symbol, share - forward


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="registered model (repeat for several)")
    parser.add_argument("--batch", type=int, default=100, help="images per step (default: 100)")
    parser.add_argument("--size", type=int, default=None, help="input side (default: the model's)")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps after one warm-up step (default: 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--ack", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if shutil.which("perf") is None:
        sys.exit("error: perf is not installed (Debian: apt-get install linux-perf); it samples the steps")
    results = {}
    with tempfile.TemporaryDirectory(prefix="profile_training_") as folder:
        for model in args.model:
            results[model] = profile(args, model, folder)
    phases = [phase for phase, _ in PHASES] + ["other"]
    print("| phase | " + " | ".join(f"`{m}`" for m in args.model) + " |")
    print("|---|" + "---|" * len(args.model))
    for phase in phases:
        if any(results[m][2].get(phase, 0) >= 0.05 for m in args.model):
            cells = []
            for m in args.model:
                wall_rate, cpu_rate, shares = results[m]
                ms = shares.get(phase, 0.0) / 100 * 1000 / cpu_rate  # CPU ms per image
                cells.append(f"{shares.get(phase, 0.0):.1f}% ({ms:.2f} ms)")
            print(f"| {phase} | " + " | ".join(cells) + " |")
    print("| **step, images/s (CPU time; wall)** | " + " | ".join(
        f"**{results[m][1]:.1f}**; {results[m][0]:.1f}" for m in args.model) + " |")


if __name__ == "__main__":
    main()
