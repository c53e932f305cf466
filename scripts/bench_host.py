"""The host's share of a Sorting Convolution call: what the CPU spends per call, with and without a GPU.

A layer's call costs the GPU its kernels and the host the Python and dispatcher work that launches them; where
the host's part is the larger, the GPU waits. This script measures that part, three ways:

* ``cpu``: the fused CPU backend's whole cost per call at a small layer (default ``1x8x6x6 -> 8``, k = 3),
  where the kernel itself is a few microseconds and the rest is the host: ``SortConv2d`` against
  ``nn.Conv2d``, forward without gradient, forward with an input that needs one, forward+backward.
* ``triton``: the Triton backend's host work per call, without a GPU: every ``SortConv2d`` layer of the
  models (``--models``, at their input size and ``--batch``) runs on *meta* tensors (every torch operation
  computes only shapes, as an asynchronous GPU launch costs the host its dispatch only) with the Triton
  launches (and ``F.fold``, whose meta form is a Python decomposition) replaced by a counter, against
  ``nn.Conv2d`` on meta tensors. Besides the microseconds it counts,
  per call, the kernel launches and the torch calls the host makes (calls of torch's C functions and tensor
  methods from Python, each a dispatcher entry), forward and backward. Triton's own launcher (argument
  specialisation, its cache lookup, the driver call) is not included: add the launches times its cost
  on the GPU's host. ``auto``'s decision is skipped (``TIMM_SORTCONV_TUNE=0``: the first candidate), and each
  path can be forced with ``--paths``; ``--scatter`` makes the forced paths' backward, where it is the columns
  or gemm path's, add the input gradient into place with atomics (the candidates ``auto`` times beside their fold).
* ``gpu``: on a CUDA device, the CPU time per call of every ``SortConv2d`` layer of the models with
  ``backend="auto"`` after its decision, against ``nn.Conv2d`` (no synchronisation inside the timed calls, so
  where the host is slower than the GPU, CPU time and wall time agree), forward and forward+backward. This is
  the figure the other two stand in for.

Times are CPU time of the process (``time.process_time``) per call on one PyTorch thread, the least of
``--rounds`` rounds in which SC and the convolution take turns; the 1-minute load average is printed beside them.
``--json`` appends one JSON line per measurement.

Examples::

    python scripts/bench_host.py cpu
    python scripts/bench_host.py triton --models ri_densenet40 --json output/host.jsonl
    python scripts/bench_host.py gpu        # on a GPU machine (scripts/gpu_check.sh host)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

os.environ.setdefault("TIMM_SORTCONV_TUNE", "0")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import timm  # noqa: E402
import timm_sortconv  # noqa: E402,F401
from timm_sortconv import SortConv2d  # noqa: E402
from timm_sortconv.cli import CommandError, run  # noqa: E402

MODEL_BATCH = {"scnn_p_rs_7": 100, "ri_resnet18": 32, "ri_densenet40": 32}


def per_call(fn: Callable[[], object], calls: int) -> float:
    """CPU microseconds per call of ``fn`` over ``calls`` calls."""
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def alternate(functions: Dict[str, Callable[[], object]], calls: int, rounds: int) -> Dict[str, float]:
    """The least per-call CPU time of each function over ``rounds`` rounds, taking turns (after a warm-up)."""
    for fn in functions.values():
        for _ in range(3):
            fn()
    best = {name: float("inf") for name in functions}
    for _ in range(rounds):
        for name, fn in functions.items():
            best[name] = min(best[name], per_call(fn, calls))
    return best


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            text = info.read()
        cpu = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        cpu += " (avx512f)" if " avx512f" in text else ""
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def emit(args, record: dict) -> None:
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "a") as out:
            out.write(json.dumps(record) + "\n")


def _steps(layer: nn.Module, x: torch.Tensor) -> Dict[str, Callable[[], object]]:
    """Forward without gradient, forward with an input that needs one, forward+backward of ``layer``."""
    leaf = x.detach().requires_grad_(True)

    def forward():
        with torch.no_grad():
            return layer(x)

    def backward():
        layer(leaf).sum().backward()

    return {"forward": forward, "forward (grad)": lambda: layer(leaf), "forward+backward": backward}


def bench_cpu(args) -> None:
    torch.set_num_threads(1)
    batch, channels, size, outputs, k = args.layer
    x = torch.randn(batch, channels, size, size)
    sc = SortConv2d(channels, outputs, k, padding=k // 2)
    conv = nn.Conv2d(channels, outputs, k, padding=k // 2)
    conv.load_state_dict(sc.state_dict())
    print(f"CPU backend, layer {batch}x{channels}x{size}x{size} -> {outputs}, k {k}: {machine()}")
    print("| call | nn.Conv2d (us) | SortConv2d (us) | ratio |\n|---|---|---|---|")
    sc_steps, conv_steps = _steps(sc, x), _steps(conv, x)
    for step in sc_steps:
        times = alternate({"sc": sc_steps[step], "conv": conv_steps[step]}, args.calls, args.rounds)
        print(f"| {step} | {times['conv']:.1f} | {times['sc']:.1f} | {times['sc'] / times['conv']:.2f} |")
        emit(args, {"kind": "cpu", "layer": args.layer, "step": step, "conv_us": times["conv"], "sc_us": times["sc"],
                    **machine()})


def model_layers(name: str, batch: int, device) -> List[Tuple[str, SortConv2d, Tuple[int, ...]]]:
    """``(name, layer, input shape)`` of every ``SortConv2d`` of ``name`` at its input size and ``batch``
    (found with forward hooks on a CPU copy, batch 1)."""
    model = timm.create_model(name).eval()
    shapes: Dict[str, Tuple[int, ...]] = {}
    def record(where):
        def hook(module, inputs, output):
            shapes.setdefault(where, tuple(inputs[0].shape))
        return hook

    hooks = [module.register_forward_hook(record(where)) for where, module in model.named_modules()
             if isinstance(module, SortConv2d)]
    with torch.no_grad():
        model(torch.randn(1, *model.pretrained_cfg["input_size"]))
    for hook in hooks:
        hook.remove()
    found, seen = [], set()
    for where, module in model.named_modules():
        if where not in shapes:
            continue
        key = (module.in_channels, module.out_channels, module.kernel_size, module.stride, module.groups,
               shapes[where][1:])
        if key in seen:  # the same layer at the same size: measured once
            continue
        seen.add(key)
        found.append((where, module.to(device), (batch, *shapes[where][1:])))
    return found


def twin(layer: SortConv2d, device) -> nn.Conv2d:
    """The ``nn.Conv2d`` a layer is compared with: its arguments, on ``device``."""
    return nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, layer.padding,
                     layer.dilation, layer.groups, layer.bias is not None, device=device)


class LaunchCounter:
    """Stands in for ``triton_backend._launch`` (counts launches, runs nothing) and for its ``_fold`` (``F.fold``,
    one kernel on a GPU, whose meta implementation is a Python decomposition a GPU's host never runs: counted
    as a launch, answered with an empty tensor of its shape)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, kernel, grid):
        self.count += 1
        return self._nothing

    @staticmethod
    def _nothing(*args, **kwargs):
        return None

    def fold(self, windows: torch.Tensor, call) -> torch.Tensor:
        self.count += 1
        return windows.new_empty(windows.shape[0], call.channels, call.height, call.width)


class TorchCalls:
    """Counts the calls of torch's C functions and tensor methods made from Python while it is active."""

    def __init__(self) -> None:
        self.count = 0

    def _profile(self, frame, event, arg):
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None) or ""
            if isinstance(owner, torch.Tensor) or module.startswith("torch") or type(owner).__module__.startswith("torch"):
                self.count += 1

    def __enter__(self):
        self.count = 0
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def bench_triton(args) -> None:
    from timm_sortconv.ops import backends, triton_backend
    from timm_sortconv.ops.triton_backend import config
    if triton_backend.triton is None:
        raise CommandError("triton is not installed; the Triton backend's host work cannot be measured here")
    torch.set_num_threads(1)
    counter = LaunchCounter()
    triton_backend._launch, triton_backend._fold = counter, counter.fold
    if args.scatter:
        for name in triton_backend.SCATTER_PATHS:
            triton_backend._BACKWARD_PATHS[name] = functools.partial(triton_backend._BACKWARD_PATHS[name], scatter=True)

    def meta_supports(x, weight, bias, geometry, *rest):  # the backend's own rule, with meta tensors as CUDA's
        return geometry.kernel_size <= triton_backend.MAX_KERNEL_SIZE and geometry.kernel_size % 2 == 1 \
            and x.dtype in triton_backend.SUPPORTED_DTYPES and not triton_backend.is_aligned(geometry)

    for name in [n for n in backends._BACKENDS if n == "triton" or n.startswith("triton-")]:
        backends._BACKENDS[name] = dataclasses.replace(backends._BACKENDS[name], supports=meta_supports,
                                                       available=lambda: True)
    print(f"Triton backend's host work on meta tensors, launches counted, not run: {machine()}")
    print("| model | layer | input | path | conv fwd | SC fwd | ratio | conv fwd+bwd | SC fwd+bwd | ratio | "
          "launches fwd/bwd | torch calls fwd/bwd |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    meta = torch.device("meta")
    for model_name in args.models:
        batch = args.batch or MODEL_BATCH.get(model_name, 32)
        for where, layer, shape in model_layers(model_name, batch, meta):
            conv = twin(layer, meta)
            x = torch.empty(shape, device=meta)
            for path in args.paths:
                layer.backend = path if path == "auto" else f"triton-{path}"
                try:
                    steps = _steps(layer, x)
                    times = alternate({"sc": steps["forward (grad)"], "conv": _steps(conv, x)["forward (grad)"]},
                                      args.calls, args.rounds)
                    both = alternate({"sc": steps["forward+backward"], "conv": _steps(conv, x)["forward+backward"]},
                                     args.calls, args.rounds)
                except backends.UnsupportedCall:
                    continue
                counts = []
                leaf = x.detach().requires_grad_(True)
                for phase in ("forward", "backward"):
                    counter.count = 0
                    with TorchCalls() as calls:
                        if phase == "forward":
                            out = layer(leaf)
                        else:
                            out.sum().backward()
                    counts.append((counter.count, calls.count))
                scattered = args.scatter and config.backward_path_of(path) in triton_backend.SCATTER_PATHS
                shown = f"{path} scatter" if scattered else path
                print(f"| {model_name} | {where} | {tuple(shape)} | {shown} | {times['conv']:.0f} | {times['sc']:.0f} | "
                      f"{times['sc'] / times['conv']:.1f} | {both['conv']:.0f} | {both['sc']:.0f} | "
                      f"{both['sc'] / both['conv']:.1f} | {counts[0][0]}/{counts[1][0]} | {counts[0][1]}/{counts[1][1]} |")
                emit(args, {"kind": "triton-host", "model": model_name, "layer": where, "input": list(shape),
                            "path": shown, "conv_fwd_us": times["conv"], "sc_fwd_us": times["sc"],
                            "conv_fwd_bwd_us": both["conv"], "sc_fwd_bwd_us": both["sc"],
                            "launches": [counts[0][0], counts[1][0]], "torch_calls": [counts[0][1], counts[1][1]],
                            **machine()})
                last = (f"{where} ({path})", steps["forward+backward"])
    if args.profile:
        profile_calls(*last, args.calls)


def bench_gpu(args) -> None:
    if args.dry_run:  # this mode's code on CPU tensors, to check it without a GPU (the times mean nothing)
        device, gpu_name, synchronize = torch.device("cpu"), "CPU (dry run)", lambda: None
    elif not torch.cuda.is_available():
        raise CommandError("no CUDA device: the gpu mode measures a GPU's host; use 'cpu' or 'triton' here, or "
                           "--dry-run to check this mode's code")
    else:
        device, gpu_name, synchronize = torch.device("cuda"), torch.cuda.get_device_name(), torch.cuda.synchronize
    torch.set_num_threads(1)
    print(f"CPU time per call on the GPU's host, backend='auto' after its decision: {machine()}, {gpu_name}")
    print("| model | layer | input | conv fwd | SC fwd | ratio | conv fwd+bwd | SC fwd+bwd | ratio |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models:
        batch = args.batch or MODEL_BATCH.get(model_name, 32)
        for where, layer, shape in model_layers(model_name, batch, device):
            conv = twin(layer, device)
            x = torch.randn(shape, device=device)
            sc_steps, conv_steps = _steps(layer, x), _steps(conv, x)
            for step in (sc_steps["forward+backward"], conv_steps["forward+backward"]):  # auto decides here
                step()
            synchronize()
            times = alternate({"sc": sc_steps["forward (grad)"], "conv": conv_steps["forward (grad)"]}, args.calls,
                              args.rounds)
            both = alternate({"sc": sc_steps["forward+backward"], "conv": conv_steps["forward+backward"]}, args.calls,
                             args.rounds)
            synchronize()
            print(f"| {model_name} | {where} | {tuple(shape)} | {times['conv']:.0f} | {times['sc']:.0f} | "
                  f"{times['sc'] / times['conv']:.1f} | {both['conv']:.0f} | {both['sc']:.0f} | "
                  f"{both['sc'] / both['conv']:.1f} |")
            emit(args, {"kind": "gpu-host", "model": model_name, "layer": where, "input": list(shape),
                        "conv_fwd_us": times["conv"], "sc_fwd_us": times["sc"], "conv_fwd_bwd_us": both["conv"],
                        "sc_fwd_bwd_us": both["sc"], "gpu": gpu_name, **machine()})
            last = (where, sc_steps["forward+backward"])
    if args.profile:
        profile_calls(*last, args.calls)


def profile_calls(where: str, step: Callable[[], object], calls: int) -> None:
    """cProfile of ``calls`` calls of ``step`` (one layer's forward+backward): where the host's time goes, by own
    time and by cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(25)
        print(f"\n### cProfile of {calls} forward+backward calls of {where}, by {order}\n\n```\n"
              f"{text.getvalue().strip()}\n```")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("cpu", "triton", "gpu"))
    parser.add_argument("--layer", type=int, nargs=5, default=[1, 8, 6, 8, 3],
                        metavar=("BATCH", "CHANNELS", "SIZE", "OUTPUTS", "K"), help="cpu: the layer")
    parser.add_argument("--models", nargs="+", default=list(MODEL_BATCH))
    parser.add_argument("--batch", type=int, help="triton, gpu: batch (default: scnn_p_rs_7 100, the others 32)")
    parser.add_argument("--paths", nargs="+", default=["auto"], choices=("auto", "direct", "fused", "gemm", "columns"),
                        help="triton: the backend's rule (auto's first candidate) and/or forced paths")
    parser.add_argument("--scatter", action="store_true",
                        help="triton: the forced paths' columns or gemm backward adds the input gradient with atomics")
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="append one JSON line per measurement to this file")
    parser.add_argument("--dry-run", action="store_true", help="gpu: run the mode's code on CPU tensors (no GPU)")
    parser.add_argument("--profile", action="store_true",
                        help="triton, gpu: after the table, a cProfile of the last layer's forward+backward calls")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in timm.list_models("*")]
    if unknown:
        raise CommandError(f"--models: unknown model(s) {', '.join(unknown)}; e.g. {', '.join(MODEL_BATCH)}")
    if args.scatter and "auto" in args.paths:
        raise CommandError("--scatter applies to forced paths only: use --paths with direct, fused, gemm or columns, "
                           "not auto (whose candidates include the scatters)")
    {"cpu": bench_cpu, "triton": bench_triton, "gpu": bench_gpu}[args.mode](args)


if __name__ == "__main__":
    run(main)
