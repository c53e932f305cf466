#!/usr/bin/env python3
"""What an exported SC model costs where it is deployed: each model and its plain twin exported to ONNX and run by
onnxruntime or OpenVINO, taking turns.

For every model (``--models``; ``sortify:NAME@SIZE`` is a timm model converted by ``sortify``, its twin the original)
both networks are built with random weights in evaluation mode, exported by ``torch.onnx.export`` (``--exporter``:
the TorchScript-based one, ``dynamo=False``, or ``dynamo``) at each batch size, and run by a stock onnxruntime
``InferenceSession`` (CPUExecutionProvider, default graph optimisations) with each ``--threads`` setting (0: all
cores, onnxruntime's default). After a warm-up call each, the two sessions take turns for ``--rounds`` rounds of
``--repeats`` calls, and the least time of a call is kept. With ``--processes N`` each file is instead timed in
processes of its own, one session each (SC, twin, SC, ... N of each; in each, calls for half a second to warm up,
then ``--rounds`` x ``--repeats`` calls), the least time of a call over them kept: what a program holding one session
sees. (In some processes holding both sessions, onnxruntime runs a standard-operator file at all threads about twice
as slow as in a process of its own: results/benchmarks/README.md, "Measuring".) Printed per row: the milliseconds of
SC and twin and their ratio, the agreement with PyTorch (the largest difference of an output over the largest
output), the export's seconds, the file's megabytes and nodes, and the nodes per SC layer (the graph's nodes beyond
the twin's, per SC layer, plus the one convolution it replaces: 0 where each fused node also takes the ReLU after it,
which is a node of its own in the twin's file).

SC layers export in standard operators (``timm_sortconv.onnx.portable``), as ``--decomposition`` writes them (default:
the runtime's own, ``network`` for onnxruntime, ``topk`` for OpenVINO), or with ``--fused`` as one custom node each,
run by the package's onnxruntime library (``timm_sortconv.onnx``: ``session`` registers it and tells it the threads).
``--runtime openvino`` runs the files in OpenVINO (CPU, float32 inference precision, ``INFERENCE_NUM_THREADS``; 0:
its default) instead, with ``--fused`` the package's OpenVINO extension loaded (``timm_sortconv.onnx.openvino``);
``--profile PATH`` then appends OpenVINO's per-node profile (``PERF_COUNT``) by node type.
``--layers`` (with ``--fused``, onnxruntime) also times each SC layer on its own: its node cut out of the SC file
(``onnx.utils.extract_model``, from the tensors it reads to its output) and the twin's convolution at the same place
with what follows it up to the same tensor (its ReLU), each fed the activations the whole networks compute there and
timed as the networks are (taking turns, or with ``--processes``); printed per layer with the cut's agreement with the
whole network, then what the networks spend outside those layers (the whole network's time less the layers').
The files go to a temporary folder, removed at the end. ``--csv PATH`` appends the rows, with the machine and the
command, to a CSV (``results/benchmarks/onnx.csv``, which ``scripts/docs.py`` turns into BENCHMARKS.md's table).

Examples::

    python scripts/bench_onnx.py --models ri_resnet18 --batches 1 --threads 1
    python scripts/bench_onnx.py --decomposition chunked --csv results/benchmarks/onnx.csv
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from typing import Dict, List, Tuple

import numpy as np
import timm
import torch
import torch.nn as nn

import timm_sortconv
from timm_sortconv import SortConv2d
from timm_sortconv import onnx as sc_onnx
from timm_sortconv.check import cpu_model
from timm_sortconv.cli import CommandError
from timm_sortconv.ops.cpu_backend import cpu_isa
from timm_sortconv.onnx import DECOMPOSITIONS, ONNXRUNTIME, OPENVINO, decomposition

MODELS = ("scnn_p_rs_7", "scnn_p_align_7_guided", "scnn_p_align_7_guided_canon", "ri_vgg16", "ri_resnet18",
          "ri_densenet40", "sortify:resnet18@224")
TWINS = {"scnn_p_rs_7": "scnn_baseline_7", "scnn_p_align_7_guided": "scnn_baseline_7",
         "scnn_p_align_7_guided_canon": "scnn_baseline_7"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Exported SC models against their plain twins in onnxruntime")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="batch sizes (default: 1 32)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0],
                        help="onnxruntime intra-op threads, 0: all cores (default: 1 0)")
    parser.add_argument("--runtime", default="onnxruntime", choices=("onnxruntime", "openvino"),
                        help="the runtime that runs the files (default: onnxruntime)")
    parser.add_argument("--decomposition", default=None, choices=DECOMPOSITIONS,
                        help=f"how SC layers are written in standard operators (default: the runtime's, "
                             f"{ONNXRUNTIME} for onnxruntime, {OPENVINO} for OpenVINO)")
    parser.add_argument("--fused", action="store_true",
                        help="export sorting layers as one timm_sortconv::SortConv2d node each and run them with the "
                             "package's onnxruntime library (timm_sortconv.onnx; built on first use)")
    parser.add_argument("--exporter", default="torchscript", choices=("torchscript", "dynamo"),
                        help="torch.onnx.export's dynamo=False or dynamo=True (default: torchscript)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, SC and twin taking turns (default: 3)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="calls per round (default: 5 at batch 1, 2 at larger batches)")
    parser.add_argument("--processes", type=int, default=0, metavar="N",
                        help="time each file in N processes of its own, SC and twin taking turns (default: 0, both "
                             "sessions in this process)")
    parser.add_argument("--no-spinning", action="store_true",
                        help="onnxruntime's pool threads wait without spinning (session.intra_op.allow_spinning = 0)")
    parser.add_argument("--csv", default=None, metavar="PATH", help="append the rows to this CSV")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="also profile the SC session (onnxruntime's profiler, 3 calls) and append its time per "
                             "operator type to this CSV")
    parser.add_argument("--layers", action="store_true",
                        help="with --fused: also time each SC layer and the twin's convolution there on their own")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS,
                        metavar=("FILE", "INPUT", "OUTPUT"))  # (a process of --processes: times one file)
    args = parser.parse_args(argv)
    if args.processes < 0:
        parser.error(f"--processes must be 0 or more, got {args.processes}")
    if args.no_spinning and (args.csv or args.runtime == "openvino"):
        parser.error("--no-spinning is an onnxruntime setting that BENCHMARKS.md's table does not show: run it "
                     "without --csv, with --runtime onnxruntime")

    if args.layers and (not args.fused or args.runtime != "onnxruntime"):
        parser.error("--layers cuts each fused SortConv2d node out of the file: add --fused (runtime onnxruntime)")
    if args.decomposition is None:
        args.decomposition = OPENVINO if args.runtime == "openvino" else ONNXRUNTIME
    for name in args.models.split(","):
        if name not in MODELS and not name.startswith("sortify:") and name not in timm.list_models():
            parser.error(f"unknown model {name!r}; accepted: a registered model or sortify:NAME@SIZE")
    return args


def trained_like(model: nn.Module) -> nn.Module:
    """Random BatchNorm statistics and affine weights, as a trained model has (a fresh model's last BatchNorm of a
    residual block has zero weights, which would make the folded convolutions of its export all zero, and an exporter
    store equal weights once)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                for tensor, low in ((m.weight, 0.5), (m.bias, -0.5), (m.running_mean, -0.5), (m.running_var, 0.5)):
                    if tensor is not None:
                        tensor.copy_(torch.rand(tensor.shape, generator=generator) + low)
    return model


def build(name: str) -> Tuple[nn.Module, nn.Module, Tuple[int, int, int], str]:
    """``(SC model, twin, input shape, twin's name)``: the same random weights (:func:`trained_like`)."""
    torch.manual_seed(0)
    if name.startswith("sortify:"):
        base, size = name[len("sortify:"):].split("@")
        twin = trained_like(timm.create_model(base)).eval()
        model = timm_sortconv.sortify(timm.create_model(base)).eval()
        model.load_state_dict(twin.state_dict())
        return model, twin, (3, int(size), int(size)), base
    model = trained_like(timm.create_model(name)).eval()
    twin_name = TWINS.get(name, f"{name}_baseline")
    if name.startswith("scnn_") and name not in TWINS:  # an SCNN's twin: the plain SCNN of its kernel size
        twin_name = f"scnn_baseline_{re.search(r'_([0-9]+)', name).group(1)}"
    twin = timm.create_model(twin_name).eval()
    twin.load_state_dict(model.state_dict())
    cfg = model.pretrained_cfg
    return model, twin, tuple(cfg["input_size"]), twin_name


def export(model: nn.Module, x: torch.Tensor, path: str, exporter: str, fused: bool = False) -> float:
    """Exports ``model`` at ``x``'s shape (batch dynamic) to ``path``; returns the seconds it took."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc_onnx.export(model, x, path, dynamo=exporter == "dynamo", fused=fused)
    return time.perf_counter() - start


def openvino_model(path: str, threads: int, profile: bool = False, extension: bool = False):
    """``path`` compiled by OpenVINO for the CPU (float32, ``threads`` inference threads, 0: its default), with the
    package's extension loaded where ``extension``."""
    import openvino

    from timm_sortconv.onnx.openvino import extension_path

    config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    if profile:
        config["PERF_COUNT"] = True
    core = openvino.Core()
    if extension:
        core.add_extension(str(extension_path()))
    return core.compile_model(path, "CPU", config)


def session(path: str, threads: int, fused: bool = False, runtime: str = "onnxruntime", spinning: bool = True):
    """A CPU session of ``path`` with ``threads`` intra-op threads (0: all) whose ``run(None, feed)`` returns the
    outputs; with ``fused`` the package's library registered (:func:`timm_sortconv.onnx.session`), or in OpenVINO its
    extension (:mod:`timm_sortconv.onnx.openvino`); ``spinning``: onnxruntime's ``session.intra_op.allow_spinning``."""
    import onnxruntime as ort

    if runtime == "openvino":
        request = openvino_model(path, threads, extension=fused).create_infer_request()
        return type("OpenVINOSession", (), {"run": staticmethod(
            lambda names, feed: list(request.infer([feed["x"]]).values()))})
    options = ort.SessionOptions()
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if fused:
        return sc_onnx.session(path, threads, options=options)
    options.intra_op_num_threads = threads
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def best_of(runs: List, feed: Dict, rounds: int, repeats: int) -> List[float]:
    """The least seconds of a call of each session, the sessions taking turns."""
    for run in runs:
        run(None, feed)
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for i, run in enumerate(runs):
            for _ in range(repeats):
                start = time.perf_counter()
                run(None, feed)
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def time_alone(path: str, threads: int, fused: bool, runtime: str, inputs: str, calls: int,
               spinning: bool = True) -> Tuple[float, np.ndarray]:
    """The least seconds of a call of ``path`` on the input saved in ``inputs`` (a ``.npy``), in a process of its own
    (this script's hidden ``--child``: half a second of warm-up, then ``calls`` calls), and its output."""
    import subprocess

    outputs = os.path.join(os.path.dirname(inputs), "out.npy")
    command = [sys.executable, os.path.abspath(__file__), "--child", path, inputs, outputs, "--threads", str(threads),
               "--runtime", runtime, "--rounds", "1", "--repeats", str(calls)] + (["--fused"] if fused else []) + (
        [] if spinning else ["--no-spinning"])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise CommandError(f"timing {path} in a process of its own failed: {done.stderr.strip()[-2000:]}")
    return float(done.stdout.split()[-1]), np.load(outputs)


def load_feed(inputs: str) -> Dict[str, np.ndarray]:
    """A file's inputs by name from ``inputs``: a ``.npy`` of ``x``, or an ``.npz`` of the inputs by name."""
    return dict(np.load(inputs)) if inputs.endswith(".npz") else {"x": np.load(inputs)}


def time_files(paths: List[str], inputs: List[str], threads: int, fused: bool, runtime: str, processes: int,
               rounds: int, repeats: int, spinning: bool) -> Tuple[List[float], np.ndarray]:
    """The least seconds of a call of each file of ``paths`` (the first with the package's library or extension where
    ``fused``), each on its ``inputs`` file (:func:`load_feed`): the sessions taking turns in this process for
    ``rounds`` of ``repeats`` calls, or with ``processes`` each file in that many processes of its own; and the first
    file's output."""
    if processes:
        best = [float("inf")] * len(paths)
        for _ in range(processes):
            for i, (path, given) in enumerate(zip(paths, inputs)):
                took, output = time_alone(path, threads, fused and i == 0, runtime, given, rounds * repeats, spinning)
                best[i] = min(best[i], took)
                if i == 0:
                    out = output
        return best, out
    runs = []
    for i, (path, given) in enumerate(zip(paths, inputs)):
        run, feed = session(path, threads, fused and i == 0, runtime, spinning).run, load_feed(given)
        runs.append(lambda names, _, run=run, feed=feed: run(names, feed))
    (out,) = runs[0](None, None)
    return best_of(runs, {}, rounds, repeats), out


def child(args: argparse.Namespace) -> int:
    """``--child FILE INPUT OUTPUT``: one session of FILE, called on INPUT (a ``.npy`` of ``x``, or an ``.npz`` of
    the file's inputs by name; its first output saved to OUTPUT) for half a
    second to warm up (the caches, onnxruntime's threads: a fresh process's first calls of a small model are slower),
    then ``--repeats`` calls; prints the least seconds of a call."""
    path, inputs, outputs = args.child
    feed = load_feed(inputs)
    run = session(path, args.threads[0], args.fused, args.runtime, not args.no_spinning).run
    np.save(outputs, run(None, feed)[0])
    start = time.perf_counter()
    while time.perf_counter() - start < 0.5:
        run(None, feed)
    (best,) = best_of([run], feed, 1, args.repeats)
    print(best)
    return 0


def profile(path: str, threads: int, feed: Dict, fused: bool = False, calls: int = 3) -> Dict[str, Tuple[float, int]]:
    """Milliseconds per call and nodes of each operator type in onnxruntime's profile of ``calls`` calls (after a
    warm-up call, left out)."""
    import json

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as folder:
        options.profile_file_prefix = os.path.join(folder, "profile")
        session_ = sc_onnx.session(path, threads, options=options) if fused else ort.InferenceSession(
            path, options, providers=["CPUExecutionProvider"])
        for _ in range(calls + 1):
            session_.run(None, feed)
        with open(session_.end_profiling()) as f:
            events = json.load(f)
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    start = runs[-calls] if len(runs) >= calls else 0
    totals: Dict[str, List[float]] = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= start:
            entry = totals.setdefault(event["args"]["op_name"], [0.0, 0])
            entry[0] += event["dur"] / 1e3 / calls
            entry[1] += 1
    return {op: (ms, count // calls) for op, (ms, count) in totals.items()}


def openvino_profile(path: str, threads: int, feed: Dict, calls: int = 3,
                     extension: bool = False) -> Dict[str, Tuple[float, int]]:
    """Milliseconds per call and nodes of each node type (with its implementation) in OpenVINO's profile
    (``PERF_COUNT``) of the last of ``calls`` calls."""
    request = openvino_model(path, threads, profile=True, extension=extension).create_infer_request()
    for _ in range(calls):
        request.infer([feed["x"]])
    totals: Dict[str, List[float]] = {}
    for info in request.profiling_info:
        entry = totals.setdefault(f"{info.node_type} ({info.exec_type})", [0.0, 0])
        entry[0] += info.real_time.total_seconds() * 1e3
        entry[1] += 1
    return {op: (ms, count) for op, (ms, count) in totals.items() if ms > 0}


def activations(path: str, names: List[str], feed: Dict, fused: bool) -> Dict[str, np.ndarray]:
    """The tensors ``names`` of the network at ``path`` on ``feed`` (the file run once with them as outputs too)."""
    import onnx

    model = onnx.load(path)
    model.graph.output.extend([onnx.ValueInfoProto(name=name) for name in names])
    with tempfile.TemporaryDirectory() as folder:
        probe = os.path.join(folder, "probe.onnx")
        onnx.save(model, probe)
        values = session(probe, 1, fused).run(None, feed)
    return dict(zip(names, values[-len(names):]))


def layer_cuts(sc_path: str, twin_path: str, feed: Dict, folder: str) -> List[Dict[str, object]]:
    """Each fused SC node of ``sc_path`` and the twin's convolution at the same place, cut into files of their own in
    ``folder`` with the activations they read: per layer ``name``, ``shape`` (its input's), and per side (``sc``,
    ``twin``) the cut's ``file``, ``inputs`` (an ``.npz`` of its inputs) and ``expected`` (the whole network's value of
    its output). The twin's cut ends at the SC node's output where the twin's graph has that tensor (the ReLU after
    its convolution), else at the convolution's output; a twin without a convolution there has no cut (None)."""
    import onnx
    import onnx.utils

    graphs = [onnx.load(p, load_external_data=False).graph for p in (sc_path, twin_path)]
    constants = [{i.name for i in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
                 for g in graphs]
    tensors = {o for n in graphs[1].node for o in n.output} | {i.name for i in graphs[1].input}
    plans = []
    for node in graphs[0].node:
        if node.op_type != "SortConv2d":
            continue
        reads = [i for i in node.input if i and i not in constants[0]]
        prefix = node.name.rsplit("/", 1)[0] + "/"
        conv = next((n for n in graphs[1].node if n.op_type == "Conv" and n.name.startswith(prefix)), None)
        twin = None
        if conv is not None:
            end = node.output[0] if node.output[0] in tensors else conv.output[0]
            # a residual the fused node adds (its input S) is read by the twin's Add on the way to that tensor
            extra = [i for i in reads[1:] if i in tensors] if end == node.output[0] else []
            twin = ([conv.input[0]] + extra, [end])
        plans.append((prefix.rstrip("/"), (reads, [node.output[0]]), twin))
    wanted = [sorted({t for _, sc, _ in plans for t in sc[0] + sc[1]}),
              sorted({t for _, _, twin in plans if twin for t in twin[0] + twin[1]})]
    values = [activations(sc_path, wanted[0], feed, True), activations(twin_path, wanted[1], feed, False)]
    cuts = []
    for index, (name, *ends) in enumerate(plans):
        cut: Dict[str, object] = dict(name=name, shape="x".join(map(str, values[0][ends[0][0][0]].shape)))
        for tag, path, found, end in zip(("sc", "twin"), (sc_path, twin_path), values, ends):
            if end is None:
                cut[tag] = None
                continue
            file = os.path.join(folder, f"{tag}_layer{index}.onnx")
            onnx.utils.extract_model(path, file, end[0], end[1])
            inputs = os.path.join(folder, f"{tag}_layer{index}.npz")
            np.savez(inputs, **{i: found[i] for i in end[0]})
            cut[tag] = dict(file=file, inputs=inputs, expected=found[end[1][0]])
        cuts.append(cut)
    return cuts


def time_layers(cuts: List[Dict[str, object]], threads: int, processes: int, rounds: int, repeats: int,
                spinning: bool) -> List[Dict[str, object]]:
    """Each cut of :func:`layer_cuts` timed as the networks are (:func:`time_files`, the SC cut first). Per layer the
    least seconds of a call (``sc``, ``twin``; None where there is no cut) and the largest difference of the SC cut's
    output from the whole network's, over the largest (``error``)."""
    rows = []
    for cut in cuts:
        sides = [cut[tag] for tag in ("sc", "twin") if cut[tag] is not None]
        best, out = time_files([side["file"] for side in sides], [side["inputs"] for side in sides], threads, True,
                               "onnxruntime", processes, rounds, repeats, spinning)
        expected = cut["sc"]["expected"]
        rows.append(dict(name=cut["name"], shape=cut["shape"], sc=best[0], twin=best[1] if len(best) > 1 else None,
                         error=float(np.abs(out - expected).max() / max(np.abs(expected).max(), 1e-30))))
    return rows


def print_layers(rows: List[Dict[str, object]], sc_s: float, twin_s: float) -> None:
    """One line per layer (milliseconds and ratio), then the networks' time outside the layers timed."""
    for row in rows:
        twin = f"twin {row['twin'] * 1e3:.3f} ms, ratio {row['sc'] / row['twin']:.2f}" if row["twin"] else "no twin cut"
        print(f"  layer {row['name']} ({row['shape']}): SC {row['sc'] * 1e3:.3f} ms, {twin}; error "
              f"{row['error']:.1e}", flush=True)
    paired = [r for r in rows if r["twin"]]
    sc_layers = sum(r["sc"] for r in paired)
    twin_layers = sum(r["twin"] for r in paired)
    print(f"  the {len(paired)} layers: SC {sc_layers * 1e3:.3f} ms, twin {twin_layers * 1e3:.3f} ms, ratio "
          f"{sc_layers / twin_layers:.2f}; outside them (the network less its layers): SC "
          f"{(sc_s - sc_layers) * 1e3:.3f} ms, twin {(twin_s - twin_layers) * 1e3:.3f} ms", flush=True)


def graph_nodes(path: str) -> int:
    import onnx

    return len(onnx.load(path, load_external_data=False).graph.node)


def git_commit() -> str:
    """The repository's commit, ``+`` if the work tree differs from it outside ``results/`` (where the rows of an
    earlier run of the same series may just have been written); ``unknown`` outside a checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)results"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+" if dirty else "")


def machine(runtime: str = "onnxruntime") -> str:
    if runtime == "openvino":
        import openvino

        version = f"openvino {openvino.__version__.split('-')[0]}"
    else:
        import onnxruntime as ort

        version = f"onnxruntime {ort.__version__}"
    return f"{cpu_model()}, {os.cpu_count()} logical CPUs; torch {torch.__version__.split('+')[0]}, {version}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    command = "python scripts/bench_onnx.py " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(f"CPU: {machine(args.runtime)}; SC kernel {cpu_isa()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    header = ["model", "twin", "input", "batch", "threads", "runtime", "decomposition", "exporter", "sc_ms", "twin_ms",
              "ratio",
              "error", "sc_export_s", "twin_export_s", "sc_mb", "twin_mb", "sc_nodes", "twin_nodes",
              "nodes_per_sc_layer", "date", "commit", "machine", "isa", "load", "command"]
    rows, profiles = [], []
    mode = ("extension" if args.runtime == "openvino" else "fused") if args.fused else args.decomposition
    with tempfile.TemporaryDirectory() as folder, decomposition(args.decomposition):
        for name in args.models.split(","):
            model, twin, shape, twin_name = build(name)
            sc_layers = sum(isinstance(m, SortConv2d) for m in model.modules())
            for batch in args.batches:
                x = torch.randn(batch, *shape)
                paths = [os.path.join(folder, f"{tag}.onnx") for tag in ("sc", "twin")]
                seconds = [export(model, x, paths[0], args.exporter, args.fused),
                           export(twin, x, paths[1], args.exporter)]
                sizes = [os.path.getsize(p) / 1e6 for p in paths]
                nodes = [graph_nodes(p) for p in paths]
                with torch.no_grad():
                    expected = model(x)
                inputs = os.path.join(folder, "x.npy")  # (what the sessions, or the processes of --processes, read)
                np.save(inputs, x.numpy())
                cuts = layer_cuts(paths[0], paths[1], {"x": x.numpy()}, folder) if args.layers else []
                for threads in args.threads:
                    feed = {"x": x.numpy()}
                    repeats = args.repeats or (5 if batch == 1 else 2)
                    (sc_s, twin_s), out = time_files(paths, [inputs, inputs], threads, args.fused, args.runtime,
                                                     args.processes, args.rounds, repeats, not args.no_spinning)
                    error = float((torch.from_numpy(out) - expected).abs().max() / expected.abs().max())
                    row = dict(model=name, twin=twin_name, input="x".join(map(str, shape)), batch=batch,
                               threads=threads or "all", runtime=args.runtime, decomposition=mode,
                               exporter=args.exporter,
                               sc_ms=f"{sc_s * 1e3:.2f}", twin_ms=f"{twin_s * 1e3:.2f}", ratio=f"{sc_s / twin_s:.2f}",
                               error=f"{error:.1e}", sc_export_s=f"{seconds[0]:.1f}", twin_export_s=f"{seconds[1]:.1f}",
                               sc_mb=f"{sizes[0]:.2f}", twin_mb=f"{sizes[1]:.2f}", sc_nodes=nodes[0],
                               twin_nodes=nodes[1],
                               # (at least one: a fused node that takes the residual Adds and ReLUs in leaves the
                               # file fewer nodes than the twin's)
                               nodes_per_sc_layer=f"{max(1.0, (nodes[0] - nodes[1]) / sc_layers + 1):.0f}",
                               date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), commit=git_commit(),
                               machine=machine(args.runtime), isa=cpu_isa(), load=f"{os.getloadavg()[0]:.2f}",
                               command=command)
                    rows.append(row)
                    if args.profile:
                        found = (openvino_profile(paths[0], threads, feed, extension=args.fused)
                                 if args.runtime == "openvino" else
                                 profile(paths[0], threads, feed, args.fused))
                        for op, (ms, count) in sorted(found.items(), key=lambda i: -i[1][0]):
                            profiles.append(dict(model=name, batch=batch, threads=row["threads"],
                                                 runtime=args.runtime, decomposition=mode,
                                                 op_type=op, ms=f"{ms:.2f}", nodes=count, sc_ms=row["sc_ms"],
                                                 date=row["date"], commit=row["commit"], machine=row["machine"],
                                                 command=command))
                    print(f"{name} batch {batch}, threads {row['threads']}: SC {row['sc_ms']} ms, {twin_name} "
                          f"{row['twin_ms']} ms, ratio {row['ratio']}; error {row['error']}; export {row['sc_export_s']} "
                          f"/ {row['twin_export_s']} s; {row['sc_mb']} / {row['twin_mb']} MB; nodes {nodes[0]} / "
                          f"{nodes[1]} ({row['nodes_per_sc_layer']} per SC layer)", flush=True)
                    if cuts:
                        print_layers(time_layers(cuts, threads, args.processes, args.rounds, repeats,
                                                 not args.no_spinning), sc_s, twin_s)
    for path, fields, table in ((args.csv, header, rows), (args.profile, list(profiles[0]) if profiles else [],
                                                             profiles)):
        if path and table:
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                if new:
                    writer.writeheader()
                writer.writerows(table)
    return 0


if __name__ == "__main__":
    from timm_sortconv.cli import run

    run(main)
