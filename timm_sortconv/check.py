"""Check and measure Sorting Convolution on this machine, in one command, for a bug report.

    python -m timm_sortconv.check [--device cuda] [--quick] [--output sortconv_check.md]

It prints a markdown report (and writes it to the file ``--output`` names, if any):

1. **Environment**: Python, PyTorch, Triton, timm and timm-sortconv versions; the GPU (name, compute
   capability, memory, CUDA) or the CPU (model, PyTorch's instruction-set level, the CPU kernel's); the
   backends available.
2. **Agreement** of every available backend, and of ``backend="auto"``, with the reference path (the
   specification) on the device: forward and the input, weight and bias gradients, for the paper's four
   variants (polar/square sampling, ring/global sorting), the orbit sortings (c4, c2) and the alignment
   (``align``, on the backends that run it), k = 3, 5, 7, a
   dense layer and a depthwise one, in float32 and under each autocast dtype of the device. The reference is
   computed in float64 on the same values (rounded to the autocast dtype under autocast); a case passes when
   the largest difference, relative to the reference's largest value, is within the tolerance ``auto`` checks
   its kernels with (:func:`timm_sortconv.ops.triton_backend.tuning.tolerance`). The Triton backend is checked
   through its own rule and on each of its paths, for the windows ``auto`` may give that path.
3. **What auto decided** for those calls on CUDA: per configuration, the kernel kept, the times of those
   that agreed and the ones left out with the reason.
4. **Speed** of SC (``backend="auto"``) against ``F.conv2d`` on the ``SortConv2d`` layers of the package's
   models at their input size (forward, and forward+backward), and training steps of the models against
   their ``nn.Conv2d`` twins (``*_baseline``). Each function is called once (which compiles kernels, and lets
   auto decide), then SC and what it is compared with take turns for a number of rounds, so that a change in
   the machine's load falls on both alike. On the CPU the time of a call is the CPU time of the process
   (``time.process_time``) on one PyTorch thread, and the least of the rounds is kept: time the process spent
   waiting for a core is not counted, and with one thread no thread of its own waits at a parallel region for
   another that lost its core (which, on a busy machine, makes a call of well under a millisecond take tens).
   On a GPU it is the median of CUDA-event times. The 1-minute load average before and after, the logical CPUs
   and the PyTorch threads are printed beside the times.

   **Too busy to measure.** A ratio is printed only where the times hold; elsewhere its cells say
   "not measured: the machine is busy (...); rerun on an idle machine". The machine counts as busy for a row
   when either
   - (CPU) the process ran for less than ``LEAST_CPU_SHARE`` (80%) of the wall-clock time of the row's timed
     calls: with one thread and a core to itself it runs for nearly all of it, so a lower share measures
     directly that other processes held the cores while the row was timed; or
   - the 1-minute load average, read before and after the row's rounds, is above ``MOST_LOAD_PER_CPU`` (1.5)
     per logical CPU. The check itself adds at most one per logical CPU (the agreement section runs on
     PyTorch's threads), so it trips only where other processes add at least half a unit per logical CPU; it
     catches a busy machine where a short row happened to run in a quiet moment, with caches and memory
     bandwidth still shared.
   Both are read during the measurement itself, not set as limits on the times, so the rule holds on a fast
   machine and a slow one alike.

``--quick`` stops after the agreement (and, on CUDA, what auto decided): the same cases, no timing (seconds on a
CPU); it is the run CI makes. The exit status is 1 when a case disagrees.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ops import available_backends, get_geometry, sort_conv2d
from .ops.backends import UnsupportedCall, fast_disabled
from .ops.geometry import ALIGNMENTS
from .ops.reference import sort_conv2d_reference

__all__ = ["Case", "agreement_cases", "main", "relative_error", "training_step"]

VARIANTS = (("polar", "ring"), ("polar", "global"), ("square", "ring"), ("square", "global"), ("polar", "c4"),
            ("polar", "c2"), ("polar", "align"))
KERNEL_SIZES = (3, 5, 7)
# (batch, channels, outputs, size, groups): a dense layer (the fused or columns path on a GPU) and a
# depthwise one (the direct path).
LAYERS = ((2, 16, 16, 9, 1), (2, 8, 8, 9, 8))
# Too busy to measure (the module's docstring): the least share of the wall-clock time of its timed calls that the
# process must have run for on the CPU, and the most 1-minute load average per logical CPU.
LEAST_CPU_SHARE = 0.8
MOST_LOAD_PER_CPU = 1.5
# The speed section's clocks (tests replace them).
wall_clock = time.perf_counter
cpu_clock = time.process_time
# Models timed, with their nn.Conv2d twins and batch sizes (the paper's).
MODELS = {"scnn_p_rs_7": ("scnn_baseline_7", 100), "ri_resnet18": ("ri_resnet18_baseline", 32),
          "ri_densenet40": ("ri_densenet40_baseline", 32)}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference of ``got`` from ``expected`` over the latter's largest magnitude (float64)."""
    got, expected = got.double(), expected.double()
    scale = expected.abs().max().item()
    return (got - expected).abs().max().item() / max(scale, 1e-300)


@dataclass(frozen=True)
class Case:
    """One agreement check: a backend (``path``: one path of the Triton backend, ``backend="triton-<path>"``,
    or None: the backend's own rule) on one call."""

    backend: str
    path: Optional[str]
    sampling: str
    sorting: str
    k: int
    layer: Tuple[int, int, int, int, int]
    dtype: str  # "float32" or the autocast dtype's name

    @property
    def label(self) -> str:
        return self.backend + (f"[{self.path}]" if self.path else "")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), else what ``platform`` says."""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        if names:
            return names[0]
    return platform.processor() or platform.machine()


def _environment(device: torch.device) -> List[Tuple[str, str]]:
    from .version import __version__
    from .ops import cpu_backend

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    import timm

    rows = [("Python", platform.python_version()), ("PyTorch", torch.__version__), ("Triton", triton_version),
            ("timm", timm.__version__), ("timm-sortconv", __version__), ("OS", platform.platform())]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        rows += [("GPU", f"{props.name}, compute capability {props.major}.{props.minor}, "
                         f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} multiprocessors"),
                 ("CUDA (PyTorch's)", str(torch.version.cuda))]
    rows += [("CPU", f"{cpu_model()}, {os.cpu_count()} logical cores, {torch.get_num_threads()} PyTorch threads"),
             ("CPU instruction set (PyTorch's level)", torch.backends.cpu.get_cpu_capability()),
             ("SC CPU kernel level", cpu_backend.cpu_isa()),
             ("Backends available", ", ".join(available_backends()))]
    return rows


def _autocast_dtypes(device: torch.device) -> List[torch.dtype]:
    if device.type == "cuda":
        return ([torch.bfloat16] if torch.cuda.is_bf16_supported() else []) + [torch.float16]
    return [torch.bfloat16]


def _backend_cases(device: torch.device) -> List[Tuple[str, Optional[str]]]:
    """(backend, Triton path) pairs to check: auto, each available fast backend by its own rule, and on the
    Triton backend each path."""
    from .ops.triton_backend import config

    cases = [("auto", None)]
    for name in available_backends():
        if name == "reference" or name.startswith("triton-"):  # the paths: below
            continue
        cases.append((name, None))
        if name == "triton" and device.type == "cuda":
            cases += [("triton", path) for path in config.PATHS]
    return cases


def agreement_cases(device: torch.device) -> List[Case]:
    """Every agreement check the command runs on ``device``."""
    from .ops.triton_backend import config

    dtypes = ["float32"] + [str(dtype).replace("torch.", "") for dtype in _autocast_dtypes(device)]
    # a forced Triton path only on windows auto may give its forward and backward (beyond, its kernels spill
    # or compile slowly); the direct forward on larger windows is checked through the backend's own rule
    largest = {None: 10 ** 9, "columns": 10 ** 9, "direct": config.window_limit("direct", backward=True),
               "fused": config.window_limit("fused"), "gemm": config.window_limit("gemm", backward=True)}
    return [Case(backend, path, sampling, sorting, k, layer, dtype)
            for backend, path in _backend_cases(device) for sampling, sorting in variants_of(backend)
            for k in KERNEL_SIZES for layer in LAYERS for dtype in dtypes if k * k <= largest[path]]


def variants_of(backend: str) -> List[Tuple[str, str]]:
    """The variants checked on ``backend``: all of them through ``auto`` and on the fused CPU kernel, which runs
    both kinds; the aligned ones on the harmonic backend, which runs only those, and the sorting ones on the
    others."""
    if backend in ("auto", "cpu"):
        return list(VARIANTS)
    return [(sampling, sorting) for sampling, sorting in VARIANTS if (sorting in ALIGNMENTS) == (backend == "harmonic")]


def _inputs(case: Case, device: torch.device) -> List[torch.Tensor]:
    """Input, weight and bias in float64: an input whose windows hold distinct values, exact in the half
    types (where values tie, a sort's gradient may go to either, and two right implementations differ),
    and random weights."""
    from .ops.triton_backend.tuning import tie_free_like

    batch, channels, outputs, size, groups = case.layer
    seed = case.k * 100 + groups
    generator = torch.Generator().manual_seed(seed)
    x = tie_free_like(torch.empty(batch, channels, size, size, dtype=torch.float64), (case.k, case.k), seed)
    weight = torch.randn(outputs, channels // groups, case.k, case.k, generator=generator, dtype=torch.float64)
    bias = torch.randn(outputs, generator=generator, dtype=torch.float64)
    return [t.to(device) for t in (x, weight, bias)]


def _run(fn: Callable, tensors: Sequence[torch.Tensor], grad_seed: int) -> List[torch.Tensor]:
    """Output and (input, weight, bias) gradients of ``fn`` for a fixed output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    generator = torch.Generator().manual_seed(grad_seed)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.device, out.dtype)
    return [out, *torch.autograd.grad(out, leaves, grad)]


def _values(case: Case, device: torch.device) -> List[torch.Tensor]:
    """The case's input, weight and bias: float64 values, rounded to the autocast dtype under autocast."""
    tensors = _inputs(case, device)
    if case.dtype != "float32":  # the values autocast's cast makes, in float64 for the reference
        tensors = [t.to(getattr(torch, case.dtype)).double() for t in tensors]
    return tensors


@functools.lru_cache(maxsize=None)
def _expected(sampling: str, sorting: str, k: int, layer: Tuple[int, ...], dtype: str, device: torch.device):
    """The float64 reference's output and gradients for a case (the same for every backend)."""
    case = Case("reference", None, sampling, sorting, k, layer, dtype)
    groups = layer[-1]

    def reference(x, weight, bias):
        return sort_conv2d_reference(F.pad(x, (k // 2,) * 4), weight, bias, get_geometry(k, sampling, sorting),
                                     (1, 1), (1, 1), groups)

    return _run(reference, _values(case, device), grad_seed=k)


def check_case(case: Case, device: torch.device) -> Tuple[float, float, str]:
    """(largest relative error over output and gradients, tolerance, note) of one case."""
    from .ops.triton_backend.tuning import tolerance

    groups = case.layer[-1]
    autocast = case.dtype != "float32"
    dtype = getattr(torch, case.dtype)

    def under_test(x, weight, bias):
        cast = torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext()
        with cast:
            return sort_conv2d(x, weight, bias, padding=case.k // 2, groups=groups, sampling=case.sampling,
                               sorting=case.sorting, backend=f"triton-{case.path}" if case.path else case.backend)

    expected = _expected(case.sampling, case.sorting, case.k, case.layer, case.dtype, device)
    try:
        got = _run(under_test, [t.float() for t in _values(case, device)], grad_seed=case.k)
    except UnsupportedCall:
        return 0.0, 0.0, "not supported"
    error = max(relative_error(a, b) for a, b in zip(got, expected))
    # Under autocast the output has the autocast dtype and the computation that precision.
    return error, tolerance(got[0].dtype if autocast else torch.float32), ""


def load_average() -> Optional[float]:
    """The 1-minute load average, or None where the system gives none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # AttributeError: not on this system (Windows)
        return None


@dataclass(frozen=True)
class Timing:
    """Seconds per call of functions timed taking turns, and what the machine did meanwhile."""

    seconds: Dict[str, float]
    cpu_share: Optional[float]  # the process's CPU time over the wall time of the timed calls (None on a GPU)
    load: Optional[float]  # the higher 1-minute load average read before and after the rounds (None: unknown)

    def busy(self) -> str:
        """The note that replaces a ratio of these times where the machine was too busy (the module's
        docstring gives the rule), or "" where the times hold."""
        cpus = os.cpu_count() or 1
        load = "load unknown" if self.load is None else f"load {self.load:.1f} on {cpus} logical CPUs"
        if self.cpu_share is not None and self.cpu_share < LEAST_CPU_SHARE:
            reason = f"this process ran {self.cpu_share:.0%} of the time it was timed, {load}"
        elif self.load is not None and self.load > MOST_LOAD_PER_CPU * cpus:
            reason = load
        else:
            return ""
        return f"not measured: the machine is busy ({reason}); rerun on an idle machine"

    def ratio(self, numerator: str, denominator: str) -> str:
        """``seconds[numerator] / seconds[denominator]``, or the note where the machine was too busy."""
        return self.busy() or f"{self.seconds[numerator] / self.seconds[denominator]:.2f}x"


def measure(fns: Dict[str, Callable[[], object]], rounds: int, device: torch.device) -> Timing:
    """Times each of ``fns`` after a warm-up call each: ``rounds`` rounds in which they take turns; on the CPU
    the least CPU time of the process per call, on a GPU the median of CUDA-event times."""
    from .ops.triton_backend.tuning import seconds

    for fn in fns.values():
        fn()
    loads = [load_average()]
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    wall = 0.0
    for _ in range(rounds):
        for name, fn in fns.items():
            if device.type == "cuda":
                samples[name].append(seconds(fn, device))
                continue
            wall_start, cpu_start = wall_clock(), cpu_clock()
            fn()
            samples[name].append(cpu_clock() - cpu_start)
            wall += wall_clock() - wall_start
    loads.append(load_average())
    load = None if None in loads else max(loads)
    if device.type == "cuda":
        return Timing({name: statistics.median(values) for name, values in samples.items()}, None, load)
    return Timing({name: min(values) for name, values in samples.items()}, sum(map(sum, samples.values())) / wall,
                  load)


def _model_layers(model: nn.Module, batch: int, device: torch.device) -> List[Tuple[nn.Module, torch.Size]]:
    """The model's distinct SortConv2d layers, each with its input shape at the model's input size."""
    from .layers import SortConv2d

    found: Dict[tuple, Tuple[nn.Module, torch.Size]] = {}

    def hook(module, inputs, output):
        shape = torch.Size((batch, *inputs[0].shape[1:]))
        key = (repr(module), tuple(shape))
        found.setdefault(key, (module, shape))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, SortConv2d)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, *model.pretrained_cfg["input_size"], device=device))
    for handle in handles:
        handle.remove()
    return list(found.values())


def _layer_rows(name: str, batch: int, rounds: int, device: torch.device) -> List[List[str]]:
    import timm

    model = timm.create_model(name).to(device)
    rows = []
    for module, shape in _model_layers(model, batch, device):
        x = torch.randn(shape, device=device, requires_grad=True)

        def sc():
            return module(x)

        def conv():
            return nn.Conv2d._conv_forward(module, x, module.weight, module.bias)

        fns = {}
        for label, fn in (("conv", conv), ("sc", sc)):
            def forward(fn=fn):
                with torch.no_grad():
                    fn()

            def forward_backward(fn=fn):
                out = fn()
                out.backward(torch.ones_like(out))

            fns[f"{label} fwd"], fns[f"{label} f+b"] = forward, forward_backward
        timing = measure(fns, rounds, device)
        layer = (f"{tuple(shape)} -> {module.out_channels}, k={module.kernel_size[0]}, stride {module.stride[0]}, "
                 f"groups {module.groups}, {module.sampling}-{module.sorting}")
        rows.append([name, layer, *(f"{timing.seconds[key] * 1e3:.3f}" for key in ("conv fwd", "conv f+b", "sc fwd",
                                                                                   "sc f+b")),
                     timing.ratio("sc fwd", "conv fwd"), timing.ratio("sc f+b", "conv f+b")])
    return rows


def _training_step(name: str, batch: int, device: torch.device) -> Callable[[], None]:
    """One Adam training step of the model ``name`` on a fixed random batch."""
    import timm

    model = timm.create_model(name)
    return training_step(model, model.pretrained_cfg["input_size"], batch, device)


def training_step(model: nn.Module, input_size: Sequence[int], batch: int, device: torch.device) -> Callable[[], None]:
    """One Adam training step of ``model`` (moved to ``device``) on a fixed random batch of ``input_size`` images."""
    model = model.to(device).train()
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, *input_size, generator=generator).to(device)
    labels = torch.randint(0, model.num_classes, (batch,), generator=generator).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    return step


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """PyTorch's intra-op threads set to ``count`` inside the block, and restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _load_line(when: str) -> str:
    load = load_average()
    return (f"Load average (1 minute) {when}: {'unknown' if load is None else f'{load:.2f}'}, on "
            f"{os.cpu_count()} logical CPUs.")


DECISION_HEADER = ["configuration", "chosen", "timed", "first call (parallel compile, then each check)", "left out"]


def _first_call(d) -> str:
    """The parallel compile's seconds (and its failures), then each candidate's checked call's seconds."""
    parts = []
    if d.compile_seconds:
        failed = "".join(f"; {name} failed to compile: {why}" for name, why in d.compile_failures.items())
        parts.append(f"parallel compile {d.compile_seconds:.2f} s{failed}")
    parts += [f"{name} {seconds:.2f} s" for name, seconds in d.checked_seconds.items()]
    return "; ".join(parts) or "-"


def decision_rows(decisions) -> List[List[str]]:
    """Rows of ``DECISION_HEADER`` for backend="auto"'s decisions (``TUNER.decisions()``): per configuration the
    kernel kept, the times of those timed, the candidates' parallel compile and each one's first (checked) call,
    and those left out with the reason."""
    return [[d.configuration, d.chosen.name,
             "; ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in d.seconds.items()) or "-",
             _first_call(d),
             "; ".join(f"{name}: {why}" for name, why in d.rejected.items()) or "-"] for d in decisions]


def _agreement_rows(cases: Sequence[Case], device: torch.device, failures: List[str]) -> Iterator[List[str]]:
    """The agreement table's rows, each yielded as soon as its case is checked (so that a long first run on a
    GPU, or one cut off, still shows every case checked so far); a failing case's label goes to ``failures``."""
    for case in cases:
        error, accepted, note = check_case(case, device)
        if note:
            status = note
        else:
            status = "pass" if error <= accepted else "FAIL"
            if status == "FAIL":
                failures.append(case.label)
        batch, channels, outputs, size, groups = case.layer
        yield [case.label, f"{case.sampling}-{case.sorting}", str(case.k),
               "depthwise" if groups > 1 else f"{channels} -> {outputs}", case.dtype,
               f"{error:.2e}" if not note else "-", f"{accepted:.0e}" if not note else "-", status]


class _Report:
    """Markdown printed as it is written, and kept for the file."""

    def __init__(self) -> None:
        self.lines: List[str] = []

    def __call__(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)

    def table(self, header: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
        """Prints the header at once and each row as ``rows`` gives it."""
        self("| " + " | ".join(header) + " |", "|" + "---|" * len(header))
        for row in rows:
            self("| " + " | ".join(row) + " |")
        self("")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m timm_sortconv.check", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to check and measure (default: cuda when there is a GPU)")
    parser.add_argument("--quick", action="store_true",
                        help="check only: no speed section (the CPU run CI makes)")
    parser.add_argument("--output", default=None, metavar="FILE",
                        help="also write the markdown report to FILE (default: print it only)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA device here (torch.cuda.is_available() is False)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    start = time.perf_counter()
    report = _Report()
    report("# Sorting Convolution check", "", f"`python -m timm_sortconv.check --device {args.device}"
           f"{' --quick' if args.quick else ''}`", "", "## Environment", "")
    report.table(["", ""], _environment(device))
    if fast_disabled():
        report("TIMM_SORTCONV_DISABLE_FAST is set: every call runs the reference path.", "")

    report("## Agreement with the reference path", "",
           "Largest difference of output and gradients from the float64 reference, relative to its largest value "
           "(under autocast: on the values rounded to the autocast dtype).", "")
    cases = agreement_cases(device)
    if device.type == "cuda":
        report(f"{len(cases)} cases. Each row is printed as it is checked; the first run on a machine compiles each "
               "Triton kernel it checks (Triton's disk cache keeps them for later runs), which takes minutes.", "")
    failures: List[str] = []
    report.table(["backend", "variant", "k", "layer", "dtype", "relative error", "accepted", "result"],
                 _agreement_rows(cases, device, failures))
    report(f"{len(cases) - len(failures)} of {len(cases)} cases agree." if not failures else
           f"**{len(failures)} of {len(cases)} cases disagree with the reference path.**", "")

    if device.type == "cuda":
        from .ops.triton_backend.tuning import TUNER

        report("## What auto decided", "")
        report.table(DECISION_HEADER, decision_rows(TUNER.decisions()))

    if args.quick:
        return _finish(report, args, start, failures)
    rounds = 20
    default_threads = torch.get_num_threads()
    report("## Speed", "")
    rule = f"the 1-minute load average stayed at most {MOST_LOAD_PER_CPU} per logical CPU"
    if device.type == "cuda":
        report(f"Milliseconds, CUDA events, on 1 PyTorch thread (of {default_threads} by default): the median of "
               f"{rounds} rounds in which SC (backend='auto') and what it is compared with take turns, after a warm-up "
               f"call each. A ratio is printed only where {rule}.", "")
    else:
        report(f"Milliseconds of the process's CPU time per call, on 1 PyTorch thread (of {default_threads} by "
               f"default): the least of {rounds} rounds in which SC (backend='auto') and what it is compared with "
               "take turns, after a warm-up call each. A ratio is printed only where the process ran for at least "
               f"{LEAST_CPU_SHARE:.0%} of the wall-clock time of its timed calls and {rule}.", "")
    report(_load_line("before"), "")
    with _torch_threads(1):
        # generators, so that each model's rows are printed as soon as they are measured
        layer_rows = (row for name, (_, batch) in MODELS.items() for row in _layer_rows(name, batch, rounds, device))
        report.table(["model", "layer (input -> outputs)", "conv fwd", "conv f+b", "SC fwd", "SC f+b", "SC/conv fwd",
                      "SC/conv f+b"], layer_rows)

        def step_row(name: str, twin: str, batch: int) -> List[str]:
            timing = measure({"sc": _training_step(name, batch, device), "twin": _training_step(twin, batch, device)},
                             rounds, device)
            return [name, twin, str(batch), f"{timing.seconds['sc'] * 1e3:.1f}", f"{timing.seconds['twin'] * 1e3:.1f}",
                    timing.ratio("sc", "twin")]

        step_rows = (step_row(name, twin, batch) for name, (twin, batch) in MODELS.items())
        report.table(["model", "nn.Conv2d twin", "batch", "SC step ms", "twin step ms", "SC / twin"], step_rows)
    report(_load_line("after"), "")
    return _finish(report, args, start, failures)


def _finish(report: _Report, args, start: float, failures: List[str]) -> int:
    """Ends the report (and writes it to ``--output``); the exit status: 1 when a case disagreed."""
    if args.quick:
        report("No speed section (`--quick`): run without `--quick` to time SC on this machine.", "")
    report(f"Done in {time.perf_counter() - start:.0f} s.")
    if args.output:
        with open(args.output, "w") as out:
            out.write("\n".join(report.lines) + "\n")
        print(f"\nReport written to {args.output}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
