#!/usr/bin/env python3
"""Two builds of the package's onnxruntime library against each other on the same fused file, in one process, taking
turns: what a change to the kernels gains where the model is deployed.

Each model (random weights, evaluation mode) is exported once per batch size with ``timm_sortconv.onnx.export(...,
fused=True)``; one onnxruntime session per library (``--before``, ``--after``: paths of built libraries, e.g. two
files of ``.cache/native/build/`` from two checkouts or commits; ``--after`` defaults to this checkout's
``library_path()``) runs it with each ``--threads`` setting. After a warm-up call the sessions take turns for
``--rounds`` rounds of ``--repeats`` calls; printed: the median milliseconds of a call of each, their ratio, and the
largest difference of their outputs over the largest output.

With two threads or more, two sessions in one process have each other's idle pool threads spinning on the same
cores: ``--processes`` times each library's calls of a round in a process of its own (the file and the input in a
temporary folder), the libraries still taking turns.

Example::

    python scripts/bench_onnx_library_ab.py --before OLD.so --models scnn_p_align_7_guided --batches 1 32
    python scripts/bench_onnx_library_ab.py --before OLD.so --models scnn_p_rs_7 --batches 1 --threads 2 --processes
    python scripts/bench_onnx_library_ab.py --before OLD.so --models sortify:resnet18@224 --sorting align --batches 1
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import timm
import torch

import timm_sortconv
from timm_sortconv import onnx as sc_onnx
from timm_sortconv.cli import CommandError, run


def _session(data: bytes, library: str, threads: int):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry(sc_onnx.THREADS_KEY, str(threads))
    options.register_custom_ops_library(library)
    return onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _mean_ms(session, feed: dict, repeats: int) -> float:
    """Milliseconds of one call of ``session`` on ``feed``: the mean of ``repeats`` calls."""
    start = time.perf_counter()
    for _ in range(repeats):
        session.run(None, feed)
    return (time.perf_counter() - start) / repeats * 1e3


def _time_calls(data: bytes, library: str, threads: int, x: np.ndarray, repeats: int) -> float:
    """_mean_ms of a new session of ``data`` on ``x``, after a warm-up call."""
    session = _session(data, library, threads)
    feed = {session.get_inputs()[0].name: x}
    session.run(None, feed)
    return _mean_ms(session, feed, repeats)


def _time_in_process(folder: str, library: str, threads: int, repeats: int) -> float:
    """_time_calls on the file and input saved in ``folder``, in a new Python process."""
    result = subprocess.run([sys.executable, __file__, "--time-saved", folder, library, str(threads), str(repeats)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise CommandError(f"timing {library} in a new process failed: {result.stderr.strip()[-2000:]}")
    return float(result.stdout.split()[-1])


def _time_saved(folder: str, library: str, threads: str, repeats: str) -> None:
    with open(os.path.join(folder, "model.onnx"), "rb") as f:
        data = f.read()
    x = np.load(os.path.join(folder, "input.npy"))
    print(_time_calls(data, library, int(threads), x, int(repeats)))


def _model(name: str, sorting):
    """``(model in evaluation mode, its input's (C, H, W))`` for a name of ``--models``."""
    if name.startswith("sortify:"):
        base, _, size = name[len("sortify:"):].partition("@")
        if not size.isdigit():
            raise CommandError(f"{name!r}: a sortify model is written sortify:NAME@SIZE, e.g. sortify:resnet18@224")
        kwargs = {} if sorting is None else {"sorting": sorting}
        return timm_sortconv.sortify(timm.create_model(base, num_classes=10), **kwargs).eval(), (3, int(size), int(size))
    model = timm.create_model(name, num_classes=10).eval()
    return model, model.pretrained_cfg.get("input_size", (1, 28, 28))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--time-saved"]:
        return _time_saved(*argv[1:])
    parser = argparse.ArgumentParser(prog="python scripts/bench_onnx_library_ab.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the library to compare against (a built .so)")
    parser.add_argument("--after", default=None,
                        help="the library compared (default: this checkout's, built if needed)")
    parser.add_argument("--models", default="scnn_p_align_7_guided",
                        help="comma-separated registered models (each at its pretrained_cfg's input size) or "
                             "sortify:NAME@SIZE (a timm model converted by sortify, at SIZE x SIZE)")
    parser.add_argument("--sorting", default=None,
                        help="the sorting of the sortify:NAME@SIZE models (default: sortify's)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=None, help="calls per round (default: 40 at batch 1, else 3)")
    parser.add_argument("--processes", action="store_true",
                        help="time each library's calls of a round in a process of its own (for two threads or more)")
    args = parser.parse_args(argv)
    after = args.after or sc_onnx.library_path()
    for path in (args.before, after):
        if not os.path.isfile(path):
            raise CommandError(f"no library at {path}: give the path of a built timm_sortconv_onnxruntime_*.so")
    if min(args.batches) < 1 or min(args.threads) < 1 or args.rounds < 1:
        raise CommandError("--batches, --threads and --rounds take values >= 1")
    torch.manual_seed(0)
    for name in args.models.split(","):
        model, shape = _model(name, args.sorting)
        for batch in args.batches:
            x = torch.randn(batch, *shape)
            buffer = io.BytesIO()
            sc_onnx.export(model, x, buffer, fused=True)
            for threads in args.threads:
                libraries = {"before": args.before, "after": after}
                sessions = {tag: _session(buffer.getvalue(), library, threads) for tag, library in libraries.items()}
                feed = {sessions["before"].get_inputs()[0].name: x.numpy()}
                outputs = {tag: s.run(None, feed)[0] for tag, s in sessions.items()}
                error = float(np.abs(outputs["before"] - outputs["after"]).max() / np.abs(outputs["before"]).max())
                repeats = args.repeats or (40 if batch == 1 else 3)
                times = {tag: [] for tag in sessions}
                if args.processes:
                    del sessions
                    with tempfile.TemporaryDirectory() as folder:
                        with open(os.path.join(folder, "model.onnx"), "wb") as f:
                            f.write(buffer.getvalue())
                        np.save(os.path.join(folder, "input.npy"), x.numpy())
                        for _ in range(args.rounds):
                            for tag, library in libraries.items():
                                times[tag].append(_time_in_process(folder, library, threads, repeats))
                else:
                    for _ in range(args.rounds):
                        for tag, session in sessions.items():
                            times[tag].append(_mean_ms(session, feed, repeats))
                before, after_ms = statistics.median(times["before"]), statistics.median(times["after"])
                print(f"{name} batch {batch}, threads {threads}: before {before:.2f} ms, after {after_ms:.2f} ms "
                      f"(x{after_ms / before:.3f}); outputs differ by {error:.1e} of the largest", flush=True)


if __name__ == "__main__":
    run(main)
