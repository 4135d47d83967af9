"""Compile the engine's CPU kernels (engine/runner/csrc/*.cpp) into one library against the installed torch.

The library lands beside its sources (engine/runner/csrc/prefix_console_ops.so) and registers the ops
`torch.ops.prefix_console.*` when engine/runner/native_kernels.py, which owns it (its paths, the
manifest, loading, the probes), loads it: the paged decode attention
(paged_decode.cpp), the tiled attention of prefills and shared prefixes (tiled_attention.cpp), the
merge of partial attention results (merge_partials.cpp), the linears of few rows (panel_linear.cpp) and
a decoder layer's fused elementwise steps (decoder_ops.cpp). It is built for the
vector instructions of the machine that builds it (AVX-512, else AVX2 with FMA, else none: ATen's
`Vectorized` then falls back to plain loops), which is the machine that runs it: `make install` builds
it in place, with a manifest of the sources it was built from beside it. A library older than any of
its sources, or built from another set of them (one added or deleted since), is stale: loading it raises
an error that names `make native` (engine/native_guard.py states the policy). `-ffp-contract=off`: no product and sum are fused into one rounding
that torch's eager ops do not have.

OpenMP: the kernel's `at::parallel_for` compiles to OpenMP regions, linked against `libgomp.so.1` by
soname, the same name torch's own copy carries, so at run time the process's one OpenMP runtime (torch's,
loaded first) serves both and the kernel uses the engine's thread settings.

Run: `.venv/bin/python build_kernels.py` (g++ and the installed torch's headers).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine.runner.native_kernels import LIBRARY, MANIFEST, SOURCES

# (cpuinfo flags required, compiler flags, ATen's name for the instruction set), best first.
INSTRUCTION_SETS = (
    ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"], "AVX512"),
    # torch's AVX2 headers convert halves with F16C (vec_half.h): without -mf16c they do not compile.
    ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"], "AVX2"),
)


def instruction_set(cpu_flags: set[str]) -> tuple[list[str], str]:
    """Compiler flags and ATen's capability name for the best instruction set these CPU flags allow.

    With AVX-512 and the CPU's bf16 dot products (avx512_bf16), BF16_DOT_PRODUCTS lets the bf16 paths of
    panel_linear.cpp and tiled_attention.cpp use them (in their own functions only: the rest of the
    library keeps AVX-512)."""
    for required, flags, name in INSTRUCTION_SETS:
        if required <= cpu_flags:
            extra = ["-DBF16_DOT_PRODUCTS"] if name == "AVX512" and "avx512_bf16" in cpu_flags else []
            return flags + extra + [f"-DCPU_CAPABILITY={name}", f"-DCPU_CAPABILITY_{name}"], name
    return ["-DCPU_CAPABILITY=DEFAULT"], "DEFAULT"


def cpu_flags() -> set[str]:
    """This machine's CPU flags (from /proc/cpuinfo's first `flags` line; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def compile_command(isa_flags: list[str]) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    return [
        "g++", "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", *isa_flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        *map(str, SOURCES), "-o", str(LIBRARY),
        f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-ltorch_cpu", "-lc10",
    ]  # fmt: skip


def main() -> None:
    flags, name = instruction_set(cpu_flags())
    command = compile_command(flags)
    LIBRARY.unlink(missing_ok=True)  # unlinked, not overwritten: a running console keeps its mapped copy
    # Written first: the library is then the folder's last new entry, so make finds it newer than the folder.
    MANIFEST.write_text("".join(f"{source.name}\n" for source in SOURCES))
    print(" ".join(command), flush=True)
    if subprocess.run(command).returncode != 0:
        sys.exit(f"building {LIBRARY} failed (see the compiler's output above)")
    print(f"built {LIBRARY} for {name}")


if __name__ == "__main__":
    main()
