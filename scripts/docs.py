#!/usr/bin/env python3
"""The numbers of README.md, RESULTS.md and BENCHMARKS.md, written from the stored results they come from.

A figure that a reader meets in more than one document has one home: a stored result (JSON or CSV, each with the
command, date and machine that measured it), from which every document's copy is written. In a document, a
generated block is the text between ``<!-- docs: NAME -->`` and ``<!-- /docs -->``; NAME is one of :data:`BLOCKS`,
and the same NAME may appear in several documents (it is the same text in each). Everything outside the blocks is
written by hand and holds no figure that another document holds.

    python scripts/docs.py            # rewrite the blocks from the stored results
    python scripts/docs.py --check    # exit 1 naming every block that differs (tests/test_docs.py runs it)
    python scripts/docs.py --record-demo output/demo              # store a demo run (its time and load), then rewrite
    python scripts/docs.py --record-demo DIR --other-cpu "how it ran"    # ... as another CPU's run

Stored results read here:

* ``results/benchmarks/*.csv``: CPU layer, training and twin benchmarks; the GPU's training steps and layers.
* ``results/demo/``: the demo's rotation sweep (``scripts/demo.py`` as the README runs it) and how it was run.
* ``model_cards/results/full.csv``: the bundled MNIST models (``scripts/mnist_results.py``).
* ``scripts/research/results/decision.csv``: the decision table (``scripts/research/decision_table.py``).
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "RESULTS.md", "BENCHMARKS.md")
BENCH = REPO / "results" / "benchmarks"
MARK = re.compile(r"(<!-- docs: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /docs -->)", re.S)
ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2"}


def read_csv(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def span(values: Iterable[float], digits: int = 2, suffix: str = "x") -> str:
    values = sorted(values)
    low, high = f"{values[0]:.{digits}f}", f"{values[-1]:.{digits}f}"
    return f"{low}{suffix}" if low == high else f"{low}-{high}{suffix}"


def threads_label(row: Dict[str, str]) -> str:
    return f"{row['threads']}, {'CPU time' if row['clock'] == 'cpu' else 'wall clock'}"


# ---------------------------------------------------------------------------------------------------- speed

def cpu_groups() -> Dict[Tuple[str, str, str], List[Dict[str, str]]]:
    groups: Dict[Tuple[str, str, str], List[Dict[str, str]]] = {}
    for row in read_csv(BENCH / "cpu_layers.csv"):
        groups.setdefault((row["isa"], row["threads"], row["clock"]), []).append(row)
    return groups


def speed() -> str:
    """CPU layers per instruction set and threads, the SCNN's training step against its twin's, and the GPU's
    training steps against the twins': the speed headlines of README.md and BENCHMARKS.md."""
    training = {(r["isa"], r["threads"]): float(r["images_s"]) / float(r["baseline_images_s"])
                for r in read_csv(BENCH / "cpu_training.csv") if r["precision"] == "float32"}
    lines = ["| CPU (fused kernel) | threads, clock | layer rows | SC/conv forward | SC/conv forward+backward | "
             "`scnn_p_rs_7` training images/s / twin's |", "|---|---|---|---|---|---|"]
    machine = ""
    for (isa, threads, clock), rows in cpu_groups().items():
        machine = rows[0]["machine"]
        fwd = [float(r["sc_fwd_ms"]) / float(r["conv_fwd_ms"]) for r in rows]
        fb = [float(r["sc_fb_ms"]) / float(r["conv_fb_ms"]) for r in rows]
        lines.append(f"| {ISA_NAMES[isa]} | {threads_label(rows[0])} | {len(rows)} | {span(fwd)} | {span(fb)} | "
                     f"{training[(isa, threads)]:.2f} |")
    gpu_rows = read_csv(BENCH / "gpu_training.csv")
    lines += ["", f"Measured on {machine}, 2026-11-25/26 (the tables below give the commands).", "",
              "| GPU training step (`backend=\"auto\"`) | float32 images/s / twin's | bfloat16 autocast |",
              "|---|---|---|"]
    by_model: Dict[str, Dict[str, float]] = {}
    for r in gpu_rows:
        by_model.setdefault(r["model"], {})[r["precision"]] = float(r["images_s"]) / float(r["twin_images_s"])
    for model, ratios in by_model.items():
        lines.append(f"| `{model}` | {ratios['fp32']:.2f} | {ratios['bf16']:.2f} |")
    layers = [r for r in read_csv(BENCH / "gpu_layers.csv") if r["k"] == "7"]
    def extent(part: str) -> str:
        return (f"{min(float(r[part + '_min']) for r in layers):.1f}-"
                f"{max(float(r[part + '_max']) for r in layers):.1f}x")

    lines += ["", f"On the GPU ({gpu_rows[0]['gpu'].split(',')[0]}, {gpu_rows[0]['date'][:10]}, commit "
              f"{gpu_rows[0]['commit']}) the 7x7 layers took {extent('fwd_fp32')} the convolution's time forward and "
              f"{extent('fb_fp32')} forward+backward (float32), on {layers[0]['backend']}."]
    return "\n".join(lines)


def speed_brief() -> str:
    """The speed headline in two sentences (README.md), from the same rows as :func:`speed`."""
    fb = [float(r["sc_fb_ms"]) / float(r["conv_fb_ms"]) for rows in cpu_groups().values() for r in rows]
    training = [float(r["images_s"]) / float(r["baseline_images_s"]) for r in read_csv(BENCH / "cpu_training.csv")
                if r["precision"] == "float32"]
    layers = read_csv(BENCH / "cpu_layers.csv")
    gpu_rows = read_csv(BENCH / "gpu_training.csv")
    gpu = [float(r["images_s"]) / float(r["twin_images_s"]) for r in gpu_rows]
    return (f"On a CPU ({layers[0]['machine'].split(' (')[0]}; AVX-512 and AVX2, 1 and 2 threads) a layer's forward and "
            f"backward take {span(fb)} the time of `F.conv2d`'s ({len(layers) // 4} layer shapes) and `scnn_p_rs_7` "
            f"trains at {span(training, suffix='')} of its plain twin's images/s; on an "
            f"{gpu_rows[0]['gpu'].split(',')[0]} ({gpu_rows[0]['date'][:10]}) the SC models train at "
            f"{span(gpu, suffix='')} of their twins' speed (`BENCHMARKS.md`).")


def cpu_layers() -> str:
    """Per layer shape, the SC/conv time ratios (forward / forward+backward, the range over the four variants) at
    each instruction set and thread count; every row's milliseconds are in ``cpu_layers.csv``."""
    groups = cpu_groups()
    shapes = list(dict.fromkeys(r["shape"] for rows in groups.values() for r in rows))
    prefix = "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 "
    commands = list(dict.fromkeys(rows[0]["command"].removeprefix(prefix) for rows in groups.values()))
    dates = sorted(r["date"][:10] for rows in groups.values() for r in rows)
    first = next(iter(groups.values()))[0]
    when = dates[0] + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
    lines = [" and ".join(f"`{c}`" for c in commands) + f" (AVX2 columns: `{prefix.strip()}` before it), {when}, "
             f"package at {first['commit']}; SC time / `F.conv2d` time, forward / forward+backward, the range over "
             "polar and square sampling and ring and global sorting:", "",
             "| shape (batch, channels, map, k) | " + " | ".join(f"{ISA_NAMES[isa]}, {threads_label(rows[0])}"
                                                              for (isa, _, _), rows in groups.items()) + " |",
             "|---|" + "---|" * len(groups)]
    for shape in shapes:
        cells = []
        for rows in groups.values():
            mine = [r for r in rows if r["shape"] == shape]
            cells.append(f"{span(float(r['sc_fwd_ms']) / float(r['conv_fwd_ms']) for r in mine)} / "
                         f"{span(float(r['sc_fb_ms']) / float(r['conv_fb_ms']) for r in mine)}")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_training() -> str:
    rows = read_csv(BENCH / "cpu_training.csv")
    lines = [f"`{rows[0]['command'].replace(' --threads 1 --clock cpu', ' [--threads 1 --clock cpu]')}` (AVX2 rows: "
             "`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` before it), "
             f"{rows[0]['date']}, package at {rows[0]['commit']}. A step: forward, cross-entropy, backward and Adam "
             "on 100 images of 1x28x28.", "",
             "| instruction set | threads, clock | precision | `scnn_baseline_7` images/s | `scnn_p_rs_7` images/s | "
             "ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {ISA_NAMES[r['isa']]} | {threads_label(r)} | {r['precision']} | {r['baseline_images_s']} | "
                     f"{r['images_s']} | {float(r['images_s']) / float(r['baseline_images_s']):.2f} |")
    return "\n".join(lines)


def cpu_twins() -> str:
    rows = read_csv(BENCH / "cpu_twins.csv")
    columns = [("avx512", "1"), ("avx512", "2"), ("avx2", "1"), ("avx2", "2")]
    titles = [f"{ISA_NAMES[isa]}, {t} thread{'s' if t == '2' else ''}" for isa, t in columns]
    models = list(dict.fromkeys((r["model"], r["twin"]) for r in rows))
    cell = {(r["model"], r["isa"], r["threads"]): r for r in rows}
    lines = [f"`{rows[0]['command'].replace(' --threads 1 --clock cpu', ' [--threads 1 --clock cpu]')}` "
             f"(AVX2: with `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`), {rows[0]['date']}, package at "
             f"{rows[0]['commit']}; 1 thread on CPU time. Training images/s, SC / twin (ratio):", "",
             "| SC model (input, batch) | twin | " + " | ".join(titles) + " |", "|---|---|" + "---|" * 4]
    def pair(r: Dict[str, str], sc: str, twin: str, suffix: str) -> str:
        return f"{r[sc]} / {r[twin]} (**{float(r[sc]) / float(r[twin]):.2f}{suffix}**)"

    for model, twin in models:
        first = cell[(model, "avx512", "1")]
        lines.append(f"| `{model}` ({first['train_size']}x{first['train_size']}, {first['batch']}) | `{twin}` | "
                     + " | ".join(pair(cell[(model, isa, t)], "train_images_s", "twin_train_images_s", "")
                                  for isa, t in columns) + " |")
    lines += ["", "Inference of one image, milliseconds, SC / twin (ratio):", "",
              "| SC model (input) | twin | " + " | ".join(titles) + " |", "|---|---|" + "---|" * 4]
    for model, twin in models:
        first = cell[(model, "avx512", "1")]
        lines.append(f"| `{model}` ({first['latency_size']}x{first['latency_size']}) | `{twin}` | "
                     + " | ".join(pair(cell[(model, isa, t)], "latency_ms", "twin_latency_ms", "x")
                                  for isa, t in columns) + " |")
    return "\n".join(lines)


def gpu() -> str:
    rows = read_csv(BENCH / "gpu_training.csv")
    layers = read_csv(BENCH / "gpu_layers.csv")
    lines = [f"{rows[0]['gpu']}; commit {rows[0]['commit']}, {rows[0]['date']} UTC. Training steps (Adam, median of "
             f"20 after a warm-up step; SC on `backend=\"auto\"`): `{rows[0]['command']}`", "",
             "| model | precision | batch | images/s | twin | its images/s | SC / twin |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['model']}` | {r['precision']} | {r['batch']} | {r['images_s']} | `{r['twin']}` | "
                     f"{r['twin_images_s']} | {float(r['images_s']) / float(r['twin_images_s']):.2f} |")
    lines += ["", f"The models' SortConv2d layers at their input size, SC on {layers[0]['backend']} against "
              f"`F.conv2d` (median of 20, CUDA events; ranges over each model's layers): `{layers[0]['command']}`", "",
              "| model | layers | k | forward fp32 | forward+backward fp32 | forward bf16 | forward+backward bf16 |",
              "|---|---|---|---|---|---|---|"]
    for r in layers:
        cells = [f"{r[f'{part}_min']}-{r[f'{part}_max']}x" for part in ("fwd_fp32", "fb_fp32", "fwd_bf16", "fb_bf16")]
        lines.append(f"| `{r['model']}` | {r['layers']} | {r['k']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- accuracy

# The bundled models and the row each one's weights come from; the control is a RESULTS row without weights.
# (model, its training stages' rows, the last holding the weights' figures, what it is)
MNIST_ROWS = (
    ("scnn_baseline_7", ("scnn_baseline_7",), "plain CNN, the paper's baseline (bundled)"),
    ("scnn_p_rs_7", ("scnn_p_rs_7-paper",), "the paper's P-RS-7 on its 100-epoch schedule (bundled)"),
    ("scnn_p_rs_7_blur", ("scnn_p_rs_7_blur",), "P-RS-7 with a blur (bundled)"),
    ("scnn_p_rs_7_canon", ("scnn_p_rs_7_canon",), "P-RS-7 turned to the principal axis first (bundled)"),
    ("scnn_p_c2_7_canon", ("scnn_p_c2_7_canon", "scnn_p_c2_7_canon-ft4"),
     "half-turn orbit sorting + the turn (bundled)"),
    ("scnn_p_rs_7_early_canon", ("scnn_p_rs_7_early_canon",),
     "sorting in the first two layers only + the first moment's turn (bundled)"),
    ("scnn_p_align_7_guided", ("scnn_p_align_7_guided",),
     "aligned windows turned by the blurred input's orientation (bundled)"),
    ("scnn_p_align_7_guided_canon", ("scnn_p_align_7_guided_canon",),
     "the same + the first moment's turn, its orientation in the guide (bundled)"),
    ("scnn_baseline_7", ("scnn_baseline_7-canon1-e5",), "control: plain CNN + the canonical turn (not shipped)"),
)


def mnist_entries() -> List[Tuple[str, str, List[Dict], Tuple]]:
    """(model, what it is, its training stages' rows as stored, the paper's (MNIST, MNIST-rot) or (None, None))
    for :data:`MNIST_ROWS`: the paper's figures only where the row is the paper's network and schedule."""
    sys.path.insert(0, str(REPO))
    from timm_sortconv.cli.mnist_results import PAPER, records

    table = records(REPO / "model_cards" / "results" / "full.csv")
    entries = []
    for model, rows, what in MNIST_ROWS:
        stages = [table.find(name=row) for row in rows]
        paper = PAPER.get(model, (None, None)) if rows[-1] in (model, f"{model}-paper") else (None, None)
        entries.append((model, what, stages, paper))
    return entries


def mnist() -> str:
    lines = ["| model | what | MNIST | paper | MNIST-rot | paper | training |", "|---|---|---|---|---|---|---|"]
    for model, what, stages, paper in mnist_entries():
        result = stages[-1]
        cells = [f"{result['mnist_test_top1']:.2f}%", f"{paper[0]:.2f}%" if paper[0] else "-",
                 f"{result['mnist_rot_top1']:.2f}%", f"{paper[1]:.2f}%" if paper[1] else "-",
                 " + ".join(str(stage["epochs"]) for stage in stages) + " epoch" + "s" * (sum(
                     stage["epochs"] for stage in stages) > 1)]
        lines.append(f"| `{model}` | {what} | " + " | ".join(cells) + " |")
    lines += ["", "MNIST: all 10,000 test images; MNIST-rot: all 360,000 (the test set turned by 0, 10, ..., 350 "
              "degrees). Rows, commands and per-angle accuracies: `model_cards/results/full.csv`."]
    return "\n".join(lines)


def mnist_brief() -> str:
    """The bundled models' MNIST / MNIST-rot in two sentences (README.md), from the rows of :func:`mnist`."""
    parts = []
    for model, _, stages, paper in mnist_entries():
        result = stages[-1]
        name = f"`{model}`" + (" + `canonicalize=moment1` (not shipped)" if result["name"].endswith("canon1-e5") else "")
        parts.append(f"{name} {result['mnist_test_top1']:.2f} / {result['mnist_rot_top1']:.2f}"
                     + (f" (paper {paper[0]:.2f} / {paper[1]:.2f})" if paper[0] else ""))
    return ("MNIST / MNIST-rot top-1 % (all 10,000 test images; all 360,000 turned ones): " + "; ".join(parts)
            + " (RESULTS.md: every row, its command and the peers).")


DEMO = REPO / "results" / "demo"
DEMO_ANGLES = (0, 30, 60, 90, 130, 180, 270, 310)


def demo() -> str:
    """The demo's table, and one line: how it ran, how far other CPUs move it (every stored run's mean of 36,
    ``meta["other_cpus"]``) and what the demo checks at its end (:mod:`timm_sortconv.cli.demo`'s constants)."""
    sys.path.insert(0, str(REPO))
    from timm_sortconv.cli import demo as demo_tool

    meta = json.loads((DEMO / "demo.json").read_text())
    rows = read_csv(DEMO / "rotation_sweep.csv")
    models = [name for name in rows[0] if name != "angle"]
    by_angle = {int(float(r["angle"])): r for r in rows}
    others = [run for run in meta.get("other_cpus", []) if "minutes" in run]
    lines = ["| angle | " + " | ".join(str(a) for a in DEMO_ANGLES) + " | mean of 36 |",
             "|---|" + "---|" * (len(DEMO_ANGLES) + 1)]
    means = {}
    for name in models:
        label = meta["labels"].get(name, name)
        values = [float(by_angle[a][name]) for a in DEMO_ANGLES]
        means[name] = [sum(float(r[name]) for r in rows) / len(rows)]
        means[name] += [run["mean"][name] for run in others]
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + f" | **{means[name][0]:.2f}** |")
    sc = next(m for m in models if "baseline" not in m)
    plain = next(m for m in models if "baseline" in m)
    low, high = demo_tool.EXPECTED_SC_MEAN
    lines += ["", f"Top-1 % on the sample's {meta['test_images']} test images after one epoch on "
              f"{meta['train_images']:,}; `{meta['command']}`: {meta['minutes']:.1f} min on {meta['machine']} "
              f"({meta['date']}, the kernel's {meta['isa']} build, {meta['load']})"
              + (f"; {span([run['minutes'] for run in others], digits=1, suffix=' min')} on the other CPUs stored"
                 if others else "") + ". Other CPUs end the epoch at other "
              f"weights (PyTorch picks its kernels by CPU): mean of 36 over the {len(means[sc])} "
              f"stored runs (`results/demo/demo.json`) SC {span(means[sc], suffix='')}, plain "
              f"{span(means[plain], suffix='')}. The demo exits with status 1 unless SC scores the same images at "
              f"the four quarter turns and its mean lies {demo_tool.MIN_MARGIN:g} points or more above the plain "
              f"network's; it warns outside {low:g}-{high:g}."]
    return "\n".join(lines)


def record_demo(folder: Path, minutes: Optional[float] = None, load: Optional[str] = None, where: str = "") -> None:
    """Stores the demo's sweep (``rotation_sweep.csv`` of its ``--output`` folder) with how it ran, for :func:`demo`:
    its command, the images it trained on and swept, the machine it ran on (the CPU, the kernel's level, the threads),
    its minutes and the load it ran under, all from the folder's ``run.json``, which the demo writes (``minutes`` and
    ``load``, in words, replace what it measured). The runs on other CPUs (``other_cpus``) are kept. With ``where`` (how it ran, in words:
    the clone, a forced instruction-set level) the run is stored as one of the other CPUs instead (its upright and
    mean figures, minutes, and ``where`` with the load), beside the stored sweep, replacing an earlier one of the same
    machine and level."""
    import shlex
    import shutil
    import time

    run = json.loads((folder / "run.json").read_text())
    if "machine" not in run:
        raise SystemExit(f"{folder / 'run.json'} does not say what the demo ran on (written by an older demo): run "
                         "the demo again")
    machine = f"{run['machine']['cpu']}, {run['machine']['threads']} threads"
    if minutes is None:
        if "seconds" not in run:
            raise SystemExit(f"{folder / 'run.json'} does not say how long the demo took: give --minutes")
        minutes = round(run["seconds"] / 60, 1)
    if load is None:
        measured = [value for value in run.get("load_average", []) if value is not None]
        load = (f"load average {span(measured, digits=1, suffix='')} on {run['machine']['logical_cpus']} logical CPUs"
                if measured else "")
    isa = run["machine"]["kernel_isa"] or "reference path (no kernel)"
    date = time.strftime("%Y-%m-%d", time.gmtime())
    stored = json.loads((DEMO / "demo.json").read_text()) if (DEMO / "demo.json").is_file() else {}
    kept = stored.get("other_cpus", [])
    if where:
        rows = read_csv(folder / "rotation_sweep.csv")
        labels = [name for name in rows[0] if name != "angle"]
        entry = {"machine": machine, "isa": isa, "date": date, "where": where + (f", {load}" if load else ""),
                 "minutes": minutes,
                 "upright": {m: float(rows[0][m]) for m in labels},
                 "mean": {m: round(sum(float(r[m]) for r in rows) / len(rows), 2) for m in labels}}
        stored["other_cpus"] = [o for o in kept if (o["machine"], o["isa"]) != (machine, isa)] + [entry]
        (DEMO / "demo.json").write_text(json.dumps(stored, indent=1) + "\n")
        return
    DEMO.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "rotation_sweep.csv", DEMO / "rotation_sweep.csv")
    meta = {"command": shlex.join([".venv/bin/python", "scripts/demo.py", *run["arguments"]]), "minutes": minutes,
            "load": load, "machine": machine, "isa": isa, "date": date, "train_images": run["train_images"],
            "test_images": run["test_images"],
            "labels": {"scnn_p_rs_3": "`scnn_p_rs_3` (SC)", "scnn_baseline_3": "`scnn_baseline_3` (same parameters)"},
            "other_cpus": kept}
    (DEMO / "demo.json").write_text(json.dumps(meta, indent=1) + "\n")


#: BENCHMARKS.md's deployment table: (runtime, path in onnx.csv's decomposition column) -> its column.
ONNX_COLUMNS = {("onnxruntime", "network"): "onnxruntime, standard operators",
                ("onnxruntime", "fused"): "onnxruntime, fused node",
                ("openvino", "topk"): "OpenVINO, standard operators (`topk`)",
                ("openvino", "extension"): "OpenVINO, extension"}


def _onnx_rows() -> List[dict]:
    """The latest row of each cell (model, batch, threads, runtime, path) of ``onnx.csv``, in the file's order."""
    every = read_csv(BENCH / "onnx.csv")
    for row in every:
        row.setdefault("runtime", "onnxruntime")
    latest = {(r["model"], r["batch"], r["threads"], r["runtime"], r["decomposition"]): r for r in every}
    return [r for r in every if latest[(r["model"], r["batch"], r["threads"], r["runtime"], r["decomposition"])] is r]


def _processes(row: dict) -> int:
    """The ``--processes N`` of the command that measured ``row`` (0: both sessions in one process)."""
    words = row["command"].split()
    return int(words[words.index("--processes") + 1]) if "--processes" in words else 0


def onnx() -> str:
    """Exported SC models against their twins (``scripts/bench_onnx.py``): one table, runtime x path x model, and
    where OpenVINO's time goes (its per-node profile)."""
    rows = _onnx_rows()  # (the header and the commands are those of the rows shown)
    cell = {(r["model"], r["batch"], r["threads"], r["runtime"], r["decomposition"]): r for r in rows}
    found = [key for key in ONNX_COLUMNS if any((r["runtime"], r["decomposition"]) == key for r in rows)]
    machines = sorted({r["machine"].split(";")[0] for r in rows})
    versions = sorted({part.strip() for r in rows for part in r["machine"].split(";")[1].split(",")})
    isas = sorted({r.get("isa", "") for r in rows} - {""})
    # the package's commit of each kind of column (the standard-operator files and the package's kernels)
    kinds = {"fused": "fused node", "extension": "extension"}
    models: Dict[Tuple[str, str], List[str]] = {}  # (commit, kind) -> its models
    for r in rows:
        models.setdefault((r["commit"], kinds.get(r["decomposition"], "standard operators")), []).append(r["model"])
    commits: Dict[str, List[str]] = {}
    for (commit, kind), names in models.items():
        # a kind measured at several commits: the models of each but its largest share are named
        largest = max((len(set(n)) for (c, k), n in models.items() if k == kind))
        if len(set(names)) < largest:
            kind += " of " + ", ".join(f"`{name}`" for name in dict.fromkeys(names))
        commits.setdefault(commit, []).append(kind)
    at = "; ".join(f"{' and '.join(kinds_)} at {commit}" if len(commits) > 1 else commit
                   for commit, kinds_ in commits.items())
    dates = sorted({r["date"][:10] for r in rows})
    alone = sorted({_processes(r) for r in rows} - {0})
    method = "SC and twin taking turns in one process"
    if alone:
        method += (", or where marked *, each file in processes of its own, one session each, taking turns "
                   f"(`--processes {' / '.join(map(str, alone))}`)")
    lines = [f"SC time / twin time, the least time of a call, {method} "
             f"({', '.join(dates)}, the package: {at}; {'; '.join(machines)}, the kernels' "
             f"{' and '.join(isas)} build; {', '.join(versions)}; `all` threads: the runtime's default):", "",
             "| model (input) | batch | threads | " + " | ".join(ONNX_COLUMNS[key] for key in found) + " |",
             "|---|---|---|" + "---|" * len(found)]
    # model by model as the file first names them, then by batch and threads (rows measured later come last in it)
    first = {model: i for i, model in reversed(list(enumerate(r["model"] for r in rows)))}
    keys = sorted(dict.fromkeys((r["model"], r["input"], r["batch"], r["threads"]) for r in rows),
                  key=lambda k: (first[k[0]], int(k[2]), k[3] != "1", k[3]))
    for model, size, batch, threads in keys:
        cells = []
        for runtime, path in found:
            r = cell.get((model, batch, threads, runtime, path))
            mark = "*" if r and _processes(r) else ""
            cells.append(f"{r['ratio']}x{mark} ({r['sc_ms']} / {r['twin_ms']} ms)" if r else "-")
        lines.append(f"| `{model}` ({size}) | {batch} | {threads} | " + " | ".join(cells) + " |")
    commands = list(dict.fromkeys(r["command"] for r in rows))
    lines += ["", "Commands: " + "; ".join(f"`{c}`" for c in commands) + "."]
    profile_path = BENCH / "onnx_profile.csv"
    if profile_path.is_file():
        profile = [p for p in read_csv(profile_path) if p.get("runtime") == "openvino"]
        if profile:
            commands = "; ".join(f"`{c}`" for c in dict.fromkeys(p["command"] for p in profile))
            lines += ["", f"Where OpenVINO's time goes (its per-node profile, `PERF_COUNT`, the last of 3 calls, batch 1, "
                      f"one thread; {commands}): milliseconds by node type and implementation (`Reference`: the "
                      "extension's operation), and its share:", "",
                      "| model | path | " + " | ".join(f"{i}." for i in range(1, 5)) + " |", "|---|---|" + "---|" * 4]
            for key in dict.fromkeys((p["model"], p["decomposition"]) for p in profile):
                ops = [p for p in profile if (p["model"], p["decomposition"]) == key]
                latest = max((p["date"], p["commit"]) for p in ops)  # the last profile of the model and path
                ops = [p for p in ops if (p["date"], p["commit"]) == latest]
                total = sum(float(p["ms"]) for p in ops)
                top = sorted(ops, key=lambda p: -float(p["ms"]))[:4]
                lines.append(f"| `{key[0]}` | {key[1]} | " + " | ".join(
                    f"{p['op_type']} x{p['nodes']} {float(p['ms']):.1f} ms ({100 * float(p['ms']) / total:.0f}%)"
                    for p in top) + " |")
    return "\n".join(lines)


def onnx_brief() -> str:
    """The exported models' cost per runtime in one sentence (README.md), from :func:`onnx`'s rows."""
    rows = _onnx_rows()

    def extent(runtime: str, path: str, models: Sequence[str]) -> str:
        return span(float(r["ratio"]) for r in rows
                    if (r["runtime"], r["decomposition"]) == (runtime, path) and r["model"] in models)

    sevens = ("scnn_p_rs_7",)
    threes = ("ri_vgg16", "ri_resnet18", "ri_densenet40", "sortify:resnet18@224")
    guided = ("scnn_p_align_7_guided", "scnn_p_align_7_guided_canon")
    first = rows[0]

    def runtime(runtime_: str, path: str) -> str:
        return (f"{extent(runtime_, path, sevens + threes)} (`scnn_p_rs_7`, 3x3), "
                f"{extent(runtime_, path, guided)} (guided)")

    return (f"SC time over its twin's, batch 1 and 32, one and all threads ({first['machine'].split(',')[0]}): "
            f"onnxruntime with the library {runtime('onnxruntime', 'fused')}, OpenVINO with the extension "
            f"{runtime('openvino', 'extension')}; in standard operators alone "
            f"{extent('onnxruntime', 'network', sevens + threes + guided)} and "
            f"{extent('openvino', 'topk', sevens + threes + guided)} (`BENCHMARKS.md`).")


def wide_pair() -> str:
    """``scripts/research/wide_pair.py``'s table over its stored results."""
    sys.path.insert(0, str(REPO / "scripts" / "research"))
    import wide_pair as study

    return study.table(study.RESULTS)


def decision(table: str) -> Callable[[], str]:
    """The block of ``scripts/research/decision_table.py``'s function ``table`` over its stored results."""
    def block() -> str:
        sys.path.insert(0, str(REPO / "scripts" / "research"))
        import decision_table

        return getattr(decision_table, table)(decision_table.RESULTS)

    return block


BLOCKS: Dict[str, Callable[[], str]] = {
    "speed": speed, "speed-brief": speed_brief, "mnist-brief": mnist_brief, "cpu-layers": cpu_layers,
    "cpu-training": cpu_training, "cpu-twins": cpu_twins, "gpu": gpu, "mnist": mnist, "demo": demo,
    "decision": decision("table"), "decision-attempts": decision("attempts_table"),
    "decision-aligned": decision("aligned_table"), "onnx": onnx, "onnx-brief": onnx_brief, "wide-pair": wide_pair,
}


def render(text: str, cache: Dict[str, str]) -> str:
    """``text`` with every generated block's body written afresh (``cache``: bodies made so far)."""
    def body(match: re.Match) -> str:
        name = match.group("name")
        if name not in BLOCKS:
            raise KeyError(f"unknown block {name!r}; accepted: {', '.join(BLOCKS)}")
        if name not in cache:
            cache[name] = BLOCKS[name]().rstrip("\n") + "\n"
        return match.group(1) + cache[name] + match.group(4)
    return MARK.sub(body, text)


def differences(documents: Sequence[str] = DOCUMENTS) -> List[str]:
    """``document: block`` for every block whose text is not what the stored results give."""
    cache: Dict[str, str] = {}
    found = []
    for name in documents:
        text = (REPO / name).read_text()
        fresh = render(text, cache)
        for old, new in zip(MARK.finditer(text), MARK.finditer(fresh)):
            if old.group("body") != new.group("body"):
                found.append(f"{name}: {old.group('name')}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which blocks differ (exit 1 if any)")
    parser.add_argument("--record-demo", metavar="DIR", help="store the demo run in DIR (its --output) as the demo's "
                        "result (the time and load its run.json records), then rewrite the blocks")
    parser.add_argument("--minutes", type=float, help="with --record-demo: the demo's time, in place of run.json's")
    parser.add_argument("--load", help="with --record-demo: the load it ran under, in words, in place of run.json's")
    parser.add_argument("--other-cpu", metavar="WHERE", default="",
                        help="with --record-demo: store the run as another CPU's, beside the stored sweep; WHERE says "
                             "how it ran, in words (the clone, the load, a forced instruction-set level)")
    args = parser.parse_args(argv)
    if args.other_cpu and not args.record_demo:
        parser.error("--other-cpu needs --record-demo DIR (the demo's --output folder)")
    if args.record_demo:
        record_demo(Path(args.record_demo), args.minutes, args.load, args.other_cpu)
    if args.check:
        found = differences()
        for entry in found:
            print(f"differs from its stored results: {entry} (run python scripts/docs.py)")
        return 1 if found else 0
    cache: Dict[str, str] = {}
    for name in DOCUMENTS:
        path = REPO / name
        text = path.read_text()
        fresh = render(text, cache)
        if fresh != text:
            path.write_text(fresh)
            print(f"{name}: rewrote {', '.join(m.group('name') for m in MARK.finditer(fresh))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
