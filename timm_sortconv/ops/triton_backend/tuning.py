"""A checked, timed choice among a call's kernels and the reference path: what ``backend="auto"`` runs.

The Triton backend's kernels cannot be measured where they are written, so ``auto`` does not trust them:
for each *configuration* of a call (the key its caller builds: geometry, dtype, shapes, strides, groups,
padding, device, and the settings that change a result or the choice: TF32 and deterministic mode), the
first call

1. runs the reference path, whose result the call returns;
2. compiles the candidates' kernels in parallel threads (each candidate's ``prepare``: Triton releases the
   GIL while it compiles, so a first call costs the slowest compile rather than the sum of all), then
   runs every candidate (a kernel path with one of its block sizes, :mod:`.config`) on the same inputs
   (or inputs of the same configuration that the caller's checker makes, below): a candidate that raises
   (it failed to compile or to launch) or whose result disagrees with the reference's
   (:func:`disagreement`) is left out for this configuration, with one warning naming it and the
   configuration;
3. keeps the fastest of the reference and the candidates that agreed, timed on this device (the median
   of :data:`REPEATS` runs each, with CUDA events on a GPU), for the rest of the process, as
   ``torch.backends.cudnn.benchmark`` does for convolutions.

Later calls of the configuration run the kept choice at once. ``auto`` is therefore never wrong where
the reference is right, and never slower than the reference by more than the time of one decision.

Exceptions to that rule, each for a reason:

* ``torch.use_deterministic_algorithms(True)``: candidates that add with atomics are left out, and the
  choice is the first candidate that agrees, in the backend's order of preference, not the fastest:
  timings vary between runs and processes, a fixed rule does not (every DDP process chooses alike).
* While a CUDA graph is being captured nothing is run twice or timed (it would be recorded into the
  graph): an undecided configuration runs the reference path, and nothing is kept. CUDA graphs are
  captured after warm-up calls, which decide.
* ``TIMM_SORTCONV_TUNE=0`` switches checking and timing off: an undecided configuration runs the
  backend's preferred candidate directly, unchecked (for users who checked their GPU already, e.g.
  with ``python -m timm_sortconv.check``).

What a candidate is compared with, on which arguments, is the caller's ``checker``. By default: the
reference's result on the call itself; where that is not finite (inputs with NaN or infinite values are
legitimate, but the reference and a kernel may differ in how far a NaN spreads before it reaches every
output of its window), on a copy of the arguments with those values replaced by zeros (:func:`zeroed`).
The call still returns the reference's result on its own arguments. Gradients are better checked on an
input whose windows hold distinct values (:func:`tie_free_like`): where values tie (ReLU's zeros,
half-precision data) a sort's gradient may go to either of them, and the reference path and a correct
kernel may pick differently. The checker runs with autocast off on the call's device: a backward runs
under the autocast of the code that called ``backward()`` (autograd's threads take on its state), and there
autocast would compute the float32 reference of a half-precision call (:func:`upcast`) with its products in
the autocast dtype. Its polar samples, interpolated and rounded to bfloat16, tie in more than half of the 7x7
windows of a tie-free input (float16: 6%; 3x3: none), and a tied pair's gradients may go either way, while
the kernels sort the float32 samples: every kernel would be left out. Decisions need no communication
between processes: under DDP each process decides for its own GPU (a collective here could wait forever on
a process whose batch differs).
Tests inject the clock (:attr:`Tuner.timer`) and failing or wrong candidates.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
import warnings
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

__all__ = ["COMPILE_THREADS", "REPEATS", "TUNE_ENV", "TUNER", "Candidate", "Decision", "Tuner", "all_finite",
           "capturing", "disagreement", "finite_check", "median_seconds", "prepare_all", "seconds", "tie_free_like",
           "tolerance", "tuning_enabled", "upcast", "zeroed"]

TUNE_ENV = "TIMM_SORTCONV_TUNE"
# Timed runs per candidate, after its checked run (which compiled it and warmed the caches).
REPEATS = 5
# At most this many threads compile a decision's candidates (each holds its candidate's buffers meanwhile).
COMPILE_THREADS = 8


@dataclass(frozen=True)
class Candidate:
    """One way to compute a call: ``run(*args)`` returns its result (a tensor, or a tuple of tensors and
    Nones); ``deterministic``: whether its result is the same on every run (no atomic additions);
    ``prepare(*args)``, where given: compiles the kernels ``run(*args)`` would launch, without running them
    (safe to call from another thread; an error there is left for ``run`` to raise)."""

    name: str
    run: Callable[..., Any]
    deterministic: bool = True
    prepare: Optional[Callable[..., Any]] = None


@dataclass
class Decision:
    """What a configuration runs, and why: the chosen candidate, the seconds each timed one took
    (empty where the choice was not timed), the candidates left out with the reason, and the wall seconds of
    each candidate's checked call (its first call in the process: the check, and compiling what the parallel
    compile left), and the wall seconds of that parallel compile (``compile_seconds``; with the timed runs,
    what the decision cost) and its failures by candidate (``compile_failures``: reported, not left out)."""

    configuration: str
    chosen: Candidate
    seconds: Dict[str, float] = field(default_factory=dict)
    rejected: Dict[str, str] = field(default_factory=dict)
    checked_seconds: Dict[str, float] = field(default_factory=dict)
    compile_seconds: float = 0.0
    compile_failures: Dict[str, str] = field(default_factory=dict)


def tuning_enabled() -> bool:
    """Whether ``TIMM_SORTCONV_TUNE`` leaves checking and timing on (anything but 0/false/no/off)."""
    return os.environ.get(TUNE_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``device``."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def tolerance(dtype: torch.dtype) -> float:
    """The largest accepted difference between a kernel's and the reference's result, relative to the
    reference result's largest magnitude: differences of rounding only (a wrong sort, tap or slot moves
    results by their own size). Products and sums round independently on each side, so their errors
    grow like those of the result itself, a few units of the precision: float32 allows TF32's (10-bit)
    rounding wherever PyTorch's settings let either side use it; half types are 8 units of their own."""
    if dtype == torch.float64:
        return 1e-9
    if dtype == torch.float32:
        tf32 = torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
        return 1e-2 if tf32 else 1e-4
    return 8 * torch.finfo(dtype).eps


def _autocast_off(device: torch.device):
    """A context in which autocast is off on ``device``'s type (nothing, where autocast has no such device):
    what a reference computes in float32 there is computed in float32, whatever the caller's autocast."""
    return torch.autocast(device.type, enabled=False) if torch.amp.is_autocast_available(device.type) else nullcontext()


def _tensors(result) -> List[Optional[torch.Tensor]]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def disagreement(got, expected) -> Optional[str]:
    """None if ``got`` agrees with ``expected`` (the reference's result: a tensor or a tuple of tensors
    and Nones): the same shapes, dtypes and missing entries, NaN where it has NaN, and elsewhere a largest
    difference within :func:`tolerance`; else what differs."""
    got, expected = _tensors(got), _tensors(expected)
    if len(got) != len(expected):
        return f"returned {len(got)} results instead of {len(expected)}"
    for index, (a, b) in enumerate(zip(got, expected)):
        what = f"result {index}" if len(expected) > 1 else "its result"
        if (a is None) != (b is None):
            return f"{what} is {'missing' if a is None else 'not asked for'}"
        if a is None:
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what} has shape {tuple(a.shape)} and {a.dtype}, expected {tuple(b.shape)} and {b.dtype}"
        a64, b64 = a.double(), b.double()
        if not torch.equal(torch.isnan(a64), torch.isnan(b64)):
            return f"{what} has NaN elsewhere than the reference path's"
        finite = torch.isfinite(b64)
        if not torch.equal(a64[~finite & ~torch.isnan(b64)], b64[~finite & ~torch.isnan(b64)]):
            return f"{what} has infinities elsewhere than the reference path's"
        scale = b64[finite].abs().max().item() if finite.any() else 0.0
        error = (a64[finite] - b64[finite]).abs().max().item() if finite.any() else 0.0
        if not error <= tolerance(b.dtype) * max(scale, torch.finfo(b.dtype).tiny):
            return (f"{what} differs from the reference path's by {error:.3g} (relative to its largest value "
                    f"{scale:.3g}: {error / max(scale, 1e-300):.3g}; accepted {tolerance(b.dtype):.3g})")
    return None


def all_finite(result) -> bool:
    """Whether every tensor of a result (a tensor, or a tuple of tensors and Nones) is finite."""
    return all(t is None or bool(torch.isfinite(t).all()) for t in _tensors(result))


def zeroed(args: tuple) -> tuple:
    """``args`` with NaN and infinite values of floating-point tensors replaced by zeros."""
    return tuple(torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
                 if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


HALF_TYPES = (torch.float16, torch.bfloat16)


def upcast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` computing in float32 where its arguments are float16/bfloat16 tensors, its tensor results
    rounded back to that type: a reference for half-precision kernels, which sample, sort and accumulate
    in float32 and round once."""
    def run(*args):
        half = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in HALF_TYPES), None)
        if half is None:
            return fn(*args)
        result = fn(*(a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF_TYPES else a for a in args))
        if isinstance(result, tuple):
            return tuple(r.to(half) if isinstance(r, torch.Tensor) else r for r in result)
        return result.to(half)
    return run


def tie_free_like(x: torch.Tensor, span: Sequence[int], seed: int = 0) -> torch.Tensor:
    """A tensor of ``x``'s shape, dtype, device and strides whose values differ within every window that
    spans at most ``span = (rows, columns)`` of its last two axes, and so do bilinear samples of them: a
    pattern of ``rows * columns`` values drawn at random, without repeats, from the positive numbers
    ``(1 + n / 128) * 2**e`` (exact in float16 and bfloat16; eight exponents at least, so that sums of a few
    of them do not coincide), repeated every ``rows`` rows and ``columns`` columns."""
    rows, columns = int(span[0]), int(span[1])
    count = rows * columns
    exponents = min(14, max(8, -(-2 * count // 128)))  # float16 holds 2**15
    pool = torch.arange(128 * exponents)
    pool = (1 + (pool % 128) / 128.0) * 2.0 ** (pool // 128).double()
    generator = torch.Generator().manual_seed(seed)
    values = pool[torch.randperm(len(pool), generator=generator)[:count]]
    if count > len(pool):  # windows of more than 1,792 pixels: some values repeat
        values = pool[torch.randint(len(pool), (count,), generator=generator)]
    height, width = x.shape[-2:]
    pattern = values[(torch.arange(height) % rows)[:, None] * columns + (torch.arange(width) % columns)[None, :]]
    return torch.empty_like(x).copy_(pattern.to(x.device).expand(x.shape))


def finite_check(reference: Candidate) -> Callable[[tuple, Any], tuple]:
    """The default checker: ``(arguments, expected result)`` to check candidates on, given the call's
    arguments and the reference's result on them: those, or zeroed copies where the result is not finite."""
    def check(args: tuple, result):
        if all_finite(result):
            return args, result
        args = zeroed(args)
        return args, reference.run(*args)
    return check


def seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes: CUDA events on a GPU (after the work queued before it), the wall
    clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median :func:`seconds` of ``repeats`` calls of ``fn`` (already warm)."""
    return statistics.median(seconds(fn, device) for _ in range(repeats))


def prepare_all(candidates: Sequence[Candidate], args: tuple, threads: int) -> Dict[str, str]:
    """Every candidate's ``prepare(*args)``, ``threads`` at a time; returns the failures by candidate name.
    A failure does not leave a candidate out: a kernel that failed to compile is not cached, so its checked
    run compiles it again and reports the error there."""
    def prepare(candidate: Candidate) -> Optional[str]:
        try:
            candidate.prepare(*args)
        except Exception as error:
            return _failure(error)
        return None
    if threads <= 1 or len(candidates) <= 1:
        problems = [prepare(candidate) for candidate in candidates]
    else:
        with ThreadPoolExecutor(min(threads, len(candidates)), thread_name_prefix="timm_sortconv-compile") as pool:
            problems = list(pool.map(prepare, candidates))
    return {c.name: problem for c, problem in zip(candidates, problems) if problem is not None}


def _time(candidate: Candidate, args: tuple, device: torch.device) -> float:
    return median_seconds(lambda: candidate.run(*args), REPEATS, device)


class Tuner:
    """The decisions of one process, by configuration key (thread-safe)."""

    def __init__(self) -> None:
        self._decisions: Dict[Hashable, Decision] = {}
        # (key, tuning enabled) -> the candidate of a configuration with nothing to decide
        self._fixed: Dict[Tuple[Hashable, bool], Candidate] = {}
        self._lock = threading.Lock()
        # Seconds one candidate takes on given arguments; tests replace it.
        self.timer: Callable[[Candidate, tuple, torch.device], float] = _time
        # Threads that compile the candidates of a decision (Triton's compiler runs outside the GIL).
        self.compile_threads = min(os.cpu_count() or 1, COMPILE_THREADS)

    def decisions(self) -> List[Decision]:
        """The decisions made so far, in order."""
        with self._lock:
            return list(self._decisions.values())

    def clear(self) -> None:
        """Forgets every decision (the next call of each configuration decides again)."""
        with self._lock:
            self._decisions.clear()
            self._fixed.clear()

    def run(self, key: Hashable, describe: Callable[[], str], reference: Candidate,
            candidates: Callable[[], Sequence[Candidate]], args: tuple, device: torch.device,
            checker: Optional[Callable[[tuple, Any], tuple]] = None):
        """The result of the call ``args`` for configuration ``key``: its decided choice's, or the
        reference's on the call that decides. ``candidates()`` lists the kernels to check and time, in
        order of preference, ``describe()`` names the configuration in warnings (both are called only for
        a configuration not yet decided), and ``checker(args, result)`` gives the arguments to check and
        time the candidates on and the result expected of them (default: :func:`finite_check`), with autocast off
        on ``device``."""
        decision = self._decisions.get(key)
        if decision is not None:
            return decision.chosen.run(*args)
        tune = tuning_enabled()
        fixed = self._fixed.get((key, tune))
        if fixed is not None:
            return fixed.run(*args)
        deterministic = torch.are_deterministic_algorithms_enabled()
        found = [c for c in candidates() if c.deterministic or not deterministic]
        if not found or not tune:  # nothing to decide: remembered, so later calls skip listing the candidates
            fixed = self._fixed[(key, tune)] = found[0] if found else reference
            return fixed.run(*args)
        if capturing(device):
            return reference.run(*args)
        with self._lock:
            decision = self._decisions.get(key)
            if decision is None:
                result = reference.run(*args)
                with _autocast_off(device):
                    check_args, expected = (checker or finite_check(reference))(args, result)
                self._decisions[key] = self._decide(describe(), reference, found, check_args, expected, device,
                                                    deterministic)
                return result
        return decision.chosen.run(*args)

    def _decide(self, configuration: str, reference: Candidate, candidates: Sequence[Candidate], args: tuple,
                expected, device: torch.device, deterministic: bool) -> Decision:
        decision = Decision(configuration, reference)
        preparing = [candidate for candidate in candidates if candidate.prepare is not None]
        if preparing:
            start = time.perf_counter()
            decision.compile_failures = prepare_all(preparing, args, self.compile_threads)
            decision.compile_seconds = time.perf_counter() - start
        agreed = []
        for candidate in candidates:
            start = time.perf_counter()
            try:
                problem = disagreement(candidate.run(*args), expected)  # reads the result: waits for the GPU
            except Exception as error:  # a compile or launch failure leaves the kernel out, not the call
                problem = _failure(error)
            decision.checked_seconds[candidate.name] = time.perf_counter() - start
            if problem is None:
                agreed.append(candidate)
            else:
                _reject(decision, candidate, problem)
        if deterministic:
            decision.chosen = agreed[0] if agreed else reference
            return decision
        for candidate in [reference, *agreed]:
            try:
                decision.seconds[candidate.name] = self.timer(candidate, args, device)
            except Exception as error:
                if candidate is reference:
                    raise
                _reject(decision, candidate, _failure(error))
        fastest = min(decision.seconds.values())
        decision.chosen = next(c for c in [reference, *agreed] if decision.seconds.get(c.name) == fastest)
        return decision


def _failure(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"failed: {type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _reject(decision: Decision, candidate: Candidate, problem: str) -> None:
    """Leaves ``candidate`` out of ``decision``, with the one warning that names it and the configuration."""
    decision.rejected[candidate.name] = problem
    warnings.warn(f"timm_sortconv: {candidate.name} is left out for {decision.configuration}: {problem}. "
                  "backend='auto' runs another kernel that agreed with the reference path, or the reference path.",
                  RuntimeWarning, stacklevel=4)


TUNER = Tuner()
