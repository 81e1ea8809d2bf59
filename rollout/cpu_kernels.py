"""The engine's compiled CPU kernel (`csrc/paged_attention.cpp`), built at first use.

The source is compiled with the machine's C++ compiler (`$CXX`, else `c++`)
against the installed torch into a shared library named by a hash of the
source, the flags and the torch version, so a changed source or torch builds
anew and an unchanged one loads in milliseconds. Libraries live in
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
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_VECTOR_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "AVX2": ["-mavx2", "-mfma"],
}
_BUILD_TIMEOUT_S = 600
_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "op" -> the loaded op, or "error" -> why it is unavailable


class KernelUnavailable(RuntimeError):
    """The CPU kernel could not be built or loaded (no compiler, a compile error)."""


def paged_decode_op() -> Callable[..., None]:
    """`torch.ops.rollout.paged_decode`, compiling it on first use.

    Signature: `(q [R, Hq, D], k_cache [pages, page_size, Hkv, D], v_cache,
    block_tables [R, P] int64, context_lens [R] int64, out [R, Hq, D], scale,
    window)`; `window` 0 means no sliding window. Raises `KernelUnavailable`
    with the reason (remembered for the process) when it cannot be built.
    """
    with _lock:
        if "op" not in _loaded and "error" not in _loaded:
            try:
                torch.ops.load_library(str(_build()))
                _loaded["op"] = torch.ops.rollout.paged_decode
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _loaded["error"] = f"{type(exc).__name__}: {exc}"
        if "error" in _loaded:
            raise KernelUnavailable(f"the CPU paged-attention kernel is unavailable: {_loaded['error']}")
        return _loaded["op"]


def kernel_dir() -> Path:
    if os.environ.get("ROLLOUT_KERNEL_DIR"):
        return Path(os.environ["ROLLOUT_KERNEL_DIR"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "rollout-engine" / "kernels"


def _command(source: Path, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths  # imports setuptools: only when building

    torch_lib = Path(torch.__file__).parent / "lib"
    vector = _VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    return [
        os.environ.get("CXX", "c++"),
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",  # at::parallel_for runs on torch's own OpenMP pool (same libgomp soname)
        *vector,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in include_paths()),
        str(source),
        "-o",
        str(output),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]


def _build() -> Path:
    """The library's path, compiled now unless an identical build exists."""
    capability = torch.backends.cpu.get_cpu_capability()
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), capability.encode()):
        key.update(part)
    key.update(" ".join(_VECTOR_FLAGS.get(capability, [])).encode())
    directory = kernel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"paged_attention_{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    with open(directory / (library.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same library
        if library.exists():
            return library
        fd, partial = tempfile.mkstemp(dir=directory, suffix=".so.partial")
        os.close(fd)
        try:
            done = subprocess.run(
                _command(SOURCE, Path(partial)), capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S
            )
            if done.returncode != 0:
                raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-4000:]}")
            os.replace(partial, library)  # atomic: readers see no library or a whole one
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library
