"""The engine's compiled CPU kernels (`csrc/`), built at first use.

- `paged_decode`: decode attention read in place from the paged KV pool.
- `moe_block`: a whole sparse layer (router, top-k, experts, combine) in one op.
- `rms_norm`, `add_rms_norm_`, `rope_and_cache_`, `silu_mul`: a decoder
  layer's float32 elementwise steps, one op each instead of 2-14 torch ops.
- `decode_layers`: every decoder layer of a pure-decode step in one op,
  calling the kernels above and oneDNN's GEMMs from C++ in the order the
  Python loop of `rollout.model` would.
- `sample_rows`: sampling and logprobs, three passes over each row of logits
  instead of about a dozen ops; with top-k, top-p or min-p, a sort of the
  candidates that can be kept instead of the whole vocabulary;
  `counter_uniform` draws its per-row uniforms, as `rollout.engine.sampler` defines them.
- `delta_compare`, `delta_scatter`: a delta push's compare against the
  trainer's copy in one pass, and the scatter of changed elements
  (`rollout.engine.weight_delta`).
- `lora_merge`: an adapter push's `base + scaling * B @ A`, accumulated in
  float32 registers and rounded once, written straight into the target
  (`rollout.engine.weight_lora`).
- `score_block`: teacher-forced logprobs (and top k) folded one vocabulary
  block of logits at a time, an online logsumexp (`rollout.engine.scoring`).

The sources are compiled with the machine's C++ compiler (`$CXX`, else `c++`)
against the installed torch into one shared library named by a hash of the
sources, the flags and the torch version, so a changed source or torch builds
anew and an unchanged one loads without compiling. Libraries live in
`$ROLLOUT_KERNEL_DIR`, else `$XDG_CACHE_HOME/rollout-engine/kernels` (default
`~/.cache/...`). A file lock lets several processes (the actors of one node)
ask at once: one compiles, the others wait and load its library.

Vector flags follow torch's own CPU capability (AVX512, AVX2 or none), so a
library is only built for, and loaded on, a machine that runs it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "paged_attention.cpp",
        "fused_ops.cpp",
        "sampler.cpp",
        "decode_layers.cpp",
        "skinny_linear.cpp",
        "moe_block.cpp",
        "score_block.cpp",
        "delta_encode.cpp",
        "lora_merge.cpp",
    )
)
HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("vec_math.h", "kernels.h"))
_VECTOR_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "AVX2": ["-mavx2", "-mfma"],
}
_BUILD_TIMEOUT_S = 600
_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "ops" -> the loaded namespace, or "error" -> why it is unavailable


class KernelUnavailable(RuntimeError):
    """The CPU kernels could not be built or loaded (no compiler, a compile error)."""


def cpu_ops():
    """The `torch.ops.rollout` namespace, compiling the kernels on first use.

    `paged_decode(q [R, Hq, D], k_cache [pages, page_size, Hkv, D], v_cache,
    block_tables [R, P] int64, context_lens [R] int64, out [R, Hq, D], scale,
    window)`, `window` 0 meaning none; the fused ops and `sample_rows` are
    documented in `csrc/fused_ops.cpp` and `csrc/sampler.cpp`. Raises
    `KernelUnavailable` with the reason (remembered for the process) when
    they cannot be built.
    """
    with _lock:
        if "ops" not in _loaded and "error" not in _loaded:
            try:
                torch.ops.load_library(str(_build()))
                _loaded["ops"] = torch.ops.rollout
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _loaded["error"] = f"{type(exc).__name__}: {exc}"
        if "error" in _loaded:
            raise KernelUnavailable(f"the compiled CPU kernels are unavailable: {_loaded['error']}")
        return _loaded["ops"]


def kernel_dir() -> Path:
    if os.environ.get("ROLLOUT_KERNEL_DIR"):
        return Path(os.environ["ROLLOUT_KERNEL_DIR"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "rollout-engine" / "kernels"


def _flags() -> list[str]:
    """Compile flags, paths aside; part of the library's content hash, as are the
    compiler and `_LINK_FLAGS`."""
    return [
        "-O3",
        "-std=c++20",
        "-ffp-contract=off",  # no FMA contraction: fused_ops.cpp keeps the reference rounding
        "-fno-trapping-math",  # no FP traps are used; lets clamps and floor in vec_math.h vectorize
        "-fPIC",
        "-fopenmp",  # at::parallel_for runs on torch's own OpenMP pool (same libgomp soname)
        *_VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), []),
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]


def _compiler() -> list[str]:
    """`$CXX` split like a shell would (`ccache g++` works), else `c++`."""
    return shlex.split(os.environ.get("CXX") or "c++")


_LINK_FLAGS = ["-shared", "-fopenmp", "-lc10", "-ltorch_cpu"]  # after the objects: libraries resolve in order


def _compile_command(source: Path, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths  # imports setuptools: only when building

    return [*_compiler(), *_flags(), *(f"-I{p}" for p in include_paths()), "-c", str(source), "-o", str(output)]


def _link_command(objects: list[Path], output: Path) -> list[str]:
    torch_lib = Path(torch.__file__).parent / "lib"
    objects_out = [*(str(o) for o in objects), "-o", str(output)]
    return [*_compiler(), *objects_out, f"-L{torch_lib}", *_LINK_FLAGS, f"-Wl,-rpath,{torch_lib}"]


def _run(commands: dict[str, list[str]]) -> None:
    """Runs the commands (by label) side by side; raises with the compiler's output if any fails."""
    procs = {
        label: subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for label, c in commands.items()
    }
    failures = []
    try:
        for label, proc in procs.items():
            _, err = proc.communicate(timeout=_BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                failures.append(f"{label}:\n{err[-4000:]}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    if failures:
        raise RuntimeError("building the CPU kernels failed: " + "\n".join(failures))


def _build() -> Path:
    """The library's path, compiled now unless an identical build exists."""
    key = hashlib.sha256()
    for path in SOURCES + HEADERS:
        key.update(path.read_bytes())
    key.update(" ".join([torch.__version__, *_compiler(), *_flags(), *_LINK_FLAGS]).encode())
    directory = kernel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"rollout_cpu_{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    with open(directory / (library.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same library
        if library.exists():
            return library
        with tempfile.TemporaryDirectory(dir=directory, prefix="build-") as work:
            objects = [Path(work) / f"{source.stem}.o" for source in SOURCES]
            _run({s.name: _compile_command(s, o) for s, o in zip(SOURCES, objects, strict=True)})  # in parallel
            partial = Path(work) / library.name
            _run({"linking": _link_command(objects, partial)})
            os.replace(partial, library)  # atomic: readers see no library or a whole one
    return library
