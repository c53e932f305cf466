#!/usr/bin/env python
"""First-use build time of the fused CPU kernel, per instruction-set level, from an empty extension cache.

For each level given (default: every level this CPU runs) it builds the package's kernel into a new
temporary ``TORCH_EXTENSIONS_DIR`` with ``cpu_backend.load_kernel`` and prints the wall-clock time and the
CPU time of the compiler processes (ninja runs the translation units in parallel, so wall clock is less
than CPU time on an idle machine with several cores).

    python scripts/research/probes/build_time.py avx512 avx2 generic
"""
import argparse
import os
import resource
import shutil
import tempfile
import time

from timm_sortconv.ops import cpu_backend


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("levels", nargs="*", help=f"instruction-set levels ({', '.join(cpu_backend.ISA_LEVELS)}; "
                                                  "default: those this CPU runs)")
    levels = parser.parse_args(argv).levels or list(cpu_backend.runnable_isa_levels())
    for level in levels:
        if level not in cpu_backend.ISA_LEVELS:
            parser.error(f"unknown level {level!r}; accepted: {', '.join(cpu_backend.ISA_LEVELS)}")
    for level in levels:
        cache = tempfile.mkdtemp(prefix=f"timm_sortconv_build_{level}_")
        os.environ["TORCH_EXTENSIONS_DIR"] = cache
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        try:
            cpu_backend.load_kernel(None, level)
        finally:
            wall = time.perf_counter() - start
            shutil.rmtree(cache, ignore_errors=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        print(f"{level}: {wall:.1f} s wall clock, {cpu:.1f} s CPU time of the compilers, "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
