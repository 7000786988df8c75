"""An optimised BLAS for MLX's Linux CPU backend, loaded before MLX binds its own.

MLX's Linux CPU wheel (``mlx-cpu``) ships the netlib *reference* BLAS (``mlx_cpu.libs/libblas-*``):
float32 matmul runs at a few GFLOP/s. ``libmlx.so`` imports ``cblas_sgemm`` by name, and CPython
loads extension modules with ``RTLD_NOW``, so the symbol is bound once, when ``mlx.core`` is
imported: to the first ``cblas_sgemm`` in the process's *global* scope, else to the bundled
reference library. Loading OpenBLAS (or MKL, BLIS) with ``RTLD_GLOBAL`` *before* that import
therefore makes every MLX CPU matmul use it; loading it afterwards changes nothing (measured:
``LD_DEBUG=bindings`` shows the binding made at import, and a 1024^3 float32 matmul stays at the
reference speed). Hence the contract:

* :func:`preload` must run before the first ``import mlx.core`` in the process. It imports
  nothing heavy (no MLX, no numpy), is idempotent and never raises; ``mlxc/__init__.py`` calls it
  first thing, so every way into mlxc (the ``mlxc`` command, ``import mlxc``,
  ``from mlxc.runtime import ...``) gets it as long as MLX itself was not imported earlier.
* :func:`status` / :func:`log_status` say afterwards which BLAS MLX uses, or how to get one.

With OpenBLAS, products of a few rows (a decode step's, a verification's) also stay off its
GEMM: MLX calls ``cblas_sgemm`` for every float32 matmul, and OpenBLAS's sgemm packs the whole
weight even for one row (2.5x the time of its sgemv here). ``sgemm_few_rows.c``, compiled on
first use with the system's C compiler into ``$MLXC_HOME/blas`` (:func:`_few_rows_library`), is
a ``cblas_sgemm`` that sends one row to the BLAS's sgemv and 2-32 rows of ``x @ W^T`` to a kernel
of its own that reads each weight once (AVX-512; 2-24 rows with AVX2; its threads one per
core), 2-512 rows of a small ``x @ B`` (attention's weights times its values) to another
(AVX-512), everything else to the BLAS's sgemm; it is loaded globally just ahead of the BLAS, so MLX
binds to it. Without a compiler, or with ``MLXC_BLAS_FEW_ROWS=off``, every product stays on
sgemm.

Only a CPU device needs it: on macOS MLX uses Accelerate, and with a CUDA (or Metal) backend
installed the matmuls run on the GPU, so both are left alone. ``MLXC_BLAS=off`` disables the
preload; ``MLXC_BLAS=/path/libfoo.so`` picks the library. ``LD_PRELOAD=/path/libopenblas.so.0``
works too, for processes that import MLX before mlxc.
"""

from __future__ import annotations

import os
import sys

# Kept light: mlxc/__init__.py imports this module, so no logging/dataclasses/ctypes at the top.

INSTALL_HINT = (
    "install one for 10-50x faster float32 matmuls on the CPU: "
    "`apt-get install libopenblas0-pthread` (Debian/Ubuntu), "
    "`dnf install openblas-threads` (Fedora), `pacman -S openblas` (Arch)"
)


_OFF = ("0", "off", "no", "none", "false")  # MLXC_BLAS / MLXC_BLAS_FEW_ROWS settings


def _candidates() -> list[str]:
    """Optimised BLAS libraries with a CBLAS interface, best first (only existing files)."""
    import platform

    arch = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    multiarch = f"/usr/lib/{arch}-linux-gnu"
    paths = [
        # Debian / Ubuntu: libopenblas0-pthread, libopenblas0-openmp, libopenblas0 (serial)
        f"{multiarch}/openblas-pthread/libopenblas.so.0",
        f"{multiarch}/openblas-openmp/libopenblas.so.0",
        f"{multiarch}/libopenblas.so.0",
        # Fedora / RHEL (openblas-threads, openblas-openmp), Arch, Alpine, conda-like prefixes
        "/usr/lib64/libopenblasp.so.0",
        "/usr/lib64/libopenblaso.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
        "/usr/local/lib/libopenblas.so.0",
        os.path.join(sys.prefix, "lib", "libopenblas.so.0"),
        # Intel oneAPI MKL (single dynamic library with CBLAS)
        "/opt/intel/oneapi/mkl/latest/lib/libmkl_rt.so.2",
        "/opt/intel/oneapi/mkl/latest/lib/intel64/libmkl_rt.so.2",
        # BLIS (Debian libblis4-pthread provides CBLAS)
        f"{multiarch}/blis-pthread/libblis.so.4",
        f"{multiarch}/blis-openmp/libblis.so.4",
    ]
    seen, out = set(), []
    for p in paths:
        if p not in seen and os.path.isfile(p):
            seen.add(p)
            out.append(p)
    return out


class BlasStatus:
    """What :func:`preload` did. ``active``: MLX's CPU matmuls use ``library``.

    ``library``: path of the optimised BLAS loaded globally (None: none). ``name``: e.g.
    ``"OpenBLAS 0.3.21 ... Haswell MAX_THREADS=64, 2 threads"``, ``"reference BLAS"``, or
    ``"not needed"`` (GPU backend). ``reason``: one line for the log. ``few_rows``: the path of
    the compiled ``sgemm_few_rows.c`` MLX's ``cblas_sgemm`` goes through (None: straight to the
    BLAS).
    """

    __slots__ = ("active", "few_rows", "library", "name", "reason")

    def __init__(
        self,
        active: bool,
        library: str | None,
        name: str,
        reason: str,
        few_rows: str | None = None,
    ) -> None:
        self.active, self.library, self.name, self.reason = active, library, name, reason
        self.few_rows = few_rows

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self) -> str:
        return f"BlasStatus({', '.join(f'{k}={getattr(self, k)!r}' for k in self.__slots__)})"


_status: BlasStatus | None = None
_logged = False


def _backend_is_cpu_only() -> bool | None:
    """True when the installed MLX can only run on the CPU, judged without importing MLX.

    macOS: Metal (or Accelerate) -> False. Linux: an ``mlx_cuda*`` distribution next to the
    ``mlx`` package -> False; otherwise True. None when MLX is not installed.
    """
    if sys.platform == "darwin":
        return False
    if not sys.platform.startswith("linux"):
        return False
    import importlib.util

    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        site = os.path.dirname(os.path.abspath(loc))
        try:
            names = os.listdir(site)
        except OSError:
            continue
        if any(n.lower().startswith(("mlx_cuda", "mlx-cuda")) for n in names):
            return False
    return True


def _describe(lib) -> str:
    """Human name of a loaded BLAS (OpenBLAS reports its build; MKL its version)."""
    import ctypes

    try:
        get_config = lib.openblas_get_config
        get_config.restype = ctypes.c_char_p
        name = get_config().decode(errors="replace").strip()
        try:
            threads = lib.openblas_get_num_threads()
            name += f", {threads} threads"
        except AttributeError:
            pass
        return name
    except AttributeError:
        pass
    try:
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        return buf.value.decode(errors="replace").strip()
    except AttributeError:
        pass
    return os.path.basename(getattr(lib, "_name", "BLAS"))


def _load_global(path: str, few_rows: str | None) -> tuple[str, str | None, str] | None:
    """Load ``path`` globally if it exports ``cblas_sgemm``, with ``few_rows`` (the compiled
    ``sgemm_few_rows.c``, or None) bound to it and loaded globally ahead of it: (its name, the
    few-rows library loaded or None, why not), or None (never raises)."""
    import ctypes

    try:
        # Check locally first: a library without CBLAS must not enter the global scope.
        local = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        if not hasattr(local, "cblas_sgemm"):
            return None
        # The global scope is searched in load order: the few-rows cblas_sgemm must be first.
        why_not = _load_few_rows(few_rows, local) if few_rows else ""
        lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOW)  # promotes it to global
        return _describe(lib), None if why_not else few_rows, why_not
    except OSError:
        return None


FEW_ROWS_SOURCE = "sgemm_few_rows.c"  # next to this file
_CFLAGS = ("-O3", "-shared", "-fPIC", "-pthread")  # -O3 unrolls the kernel's loops over rows


def _few_rows_for(path: str) -> tuple[str | None, str]:
    """The compiled ``sgemm_few_rows.c`` to put ahead of the BLAS at ``path``: (its path, "")
    or (None, why not). Never raises."""
    if os.environ.get("MLXC_BLAS_FEW_ROWS", "").strip().lower() in _OFF:
        return None, "disabled (MLXC_BLAS_FEW_ROWS=off)"
    if "openblas" not in os.path.basename(path).lower():
        return None, "measured with OpenBLAS only"
    return _few_rows_library()


WIDEST_KERNEL = 2  # sgemm_few_rows.c's AVX512; 1 (AVX2) and 0 (sgemv per row) for tests


def _few_rows_kernel(lib: str) -> str:
    """The kernel the loaded ``lib`` runs products of a few rows with (by the CPU's flags)."""
    import ctypes

    kernel = ctypes.CDLL(lib).mlxc_sgemm_few_rows_kernel
    kernel.restype = ctypes.c_char_p
    return kernel().decode() or "sgemv per row"


def _load_few_rows(lib: str, blas) -> str:
    """Bind ``lib`` to ``blas`` (loaded locally, not yet global) and load it globally: "", or
    why not. Never raises."""
    import ctypes

    try:
        shim = ctypes.CDLL(lib, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        if not shim.mlxc_sgemm_few_rows_bind(ctypes.c_void_p(blas._handle), WIDEST_KERNEL):
            return "the BLAS has no cblas_sgemv"
        ctypes.CDLL(lib, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except (OSError, AttributeError) as e:
        try:
            os.unlink(lib)  # a damaged build (a full disk?): the next process builds it again
        except OSError:
            pass
        return f"{lib} did not load ({e})"
    return ""


# OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each call before they sleep, so
# through a forward they hold the cores the few-rows kernel's own threads need: a 9-row
# verification of the small llama took 85 ms with them spinning so long, 46-48 ms at 2^4-2^24
# cycles. 2^24 (~6 ms), because sleeping sooner slows runs of many small products (mlx-lm's MoE
# prefill 660 tokens/s at 2^28, 617 at 2^24, 510 at 2^4). Set before the library loads, unless
# the user did.
QUIET_OPENBLAS_THREADS = {"OPENBLAS_THREAD_TIMEOUT": "24"}


def _few_rows_library() -> tuple[str | None, str]:
    """``sgemm_few_rows.c`` compiled into ``$MLXC_HOME/blas`` (once per source and machine, with
    ``$CC`` or ``cc``; written under a temporary name and renamed, so concurrent first runs
    never load half a file): (its path, "") or (None, why not). Never raises."""
    import hashlib
    import platform
    import shlex
    import shutil
    import subprocess
    import tempfile

    from mlxc.runtime.home import mlxc_home

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), FEW_ROWS_SOURCE)
    try:
        with open(source, "rb") as f:
            built = f"{platform.machine()} {' '.join(_CFLAGS)}".encode()
            key = hashlib.sha256(f.read() + built).hexdigest()[:16]
        lib = os.path.join(mlxc_home(), "blas", f"sgemm_few_rows-{key}.so")
        if os.path.isfile(lib):
            return lib, ""
        cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or "gcc"]
        if shutil.which(cc[0]) is None:
            return None, f"no C compiler to build {FEW_ROWS_SOURCE} (install gcc, or set CC)"
        os.makedirs(os.path.dirname(lib), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(lib))
        os.close(fd)
        try:
            cmd = [*cc, *_CFLAGS, "-o", tmp, source, "-ldl"]
            env = {k: v for k, v in os.environ.items() if k not in ("LD_DEBUG", "LD_PRELOAD")}
            r = subprocess.run(
                cmd, capture_output=True, text=True, timeout=120, env=env, check=False
            )
            if r.returncode != 0:
                return None, f"{' '.join(cc)} could not build {FEW_ROWS_SOURCE}: {r.stderr[-300:]}"
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build {FEW_ROWS_SOURCE} ({e})"
    return lib, ""


def preload(device: str | None = None) -> BlasStatus:
    """Load an optimised BLAS globally for MLX's CPU backend; call before ``import mlx.core``.

    ``device``: ``"cpu"`` or ``"gpu"``; None infers it from the installed MLX without importing
    it (CPU only on Linux without a CUDA backend). A no-op on a GPU device, on macOS, when
    ``MLXC_BLAS=off``, and on every call after the first. Never raises; returns the status.
    """
    global _status
    if _status is not None:
        return _status
    try:
        _status = _preload(device)
    except Exception as e:  # noqa: BLE001 - never let start-up fail over an optimisation
        _status = BlasStatus(False, None, "reference BLAS", f"BLAS preload failed: {e!r}")
    return _status


def _preload(device: str | None) -> BlasStatus:
    setting = os.environ.get("MLXC_BLAS", "").strip()
    if setting.lower() in _OFF:
        return BlasStatus(False, None, "reference BLAS", "BLAS preload disabled (MLXC_BLAS=off)")
    if device is None:
        cpu_only = _backend_is_cpu_only()
        if cpu_only is False:
            return BlasStatus(
                False, None, "not needed", "BLAS preload skipped: MLX has a GPU backend here"
            )
    elif "cpu" not in str(device).lower():  # "cpu", "gpu", mx.Device(cpu, 0), ...
        return BlasStatus(False, None, "not needed", f"BLAS preload skipped: device {device}")
    if _preloaded_by_env():
        lib = os.environ.get("LD_PRELOAD", "")
        return BlasStatus(True, lib, lib, f"CPU matmuls use the BLAS in LD_PRELOAD ({lib})")
    paths = [setting] if setting else _candidates()
    if "mlx.core" in sys.modules:
        # Too late: MLX bound cblas_sgemm at import. Loading a library now would only cost
        # threads and memory, so say how to fix it instead.
        if not paths:
            return BlasStatus(False, None, "reference BLAS", f"no optimised BLAS: {INSTALL_HINT}")
        return BlasStatus(
            False,
            None,
            "reference BLAS",
            f"mlx.core was imported before mlxc, so MLX kept its reference BLAS although "
            f"{paths[0]} is installed: import mlxc before mlx, or run with LD_PRELOAD={paths[0]}",
        )
    for path in paths:
        chose = _choose_openblas_kernels(path)
        few_rows, why_not = _few_rows_for(path)
        if few_rows:
            for key, value in QUIET_OPENBLAS_THREADS.items():
                os.environ.setdefault(key, value)
        loaded = _load_global(path, few_rows)
        if loaded is not None:
            name, few_rows, not_loaded = loaded
            why_not = not_loaded or why_not
            how = f"; its kernels picked from the CPU's flags: {chose}" if chose else ""
            rows = (
                f"; products of few rows without its sgemm "
                f"({_few_rows_kernel(few_rows)} kernel, {few_rows})"
                if few_rows
                else f"; products of few rows stay on its sgemm: {why_not}"
            )
            reason = f"CPU matmuls use {name} ({path}){how}{rows}"
            return BlasStatus(True, path, name, reason, few_rows)
    if setting:
        return BlasStatus(
            False, None, "reference BLAS", f"MLXC_BLAS={setting} is not a BLAS with cblas_sgemm"
        )
    return BlasStatus(
        False,
        None,
        "reference BLAS",
        f"no optimised BLAS found: MLX uses its bundled reference BLAS; {INSTALL_HINT}",
    )


def openblas_kernels(flags: set[str]) -> str | None:
    """The OpenBLAS kernel family (``OPENBLAS_CORETYPE``) an x86-64 CPU with these
    ``/proc/cpuinfo`` flags runs best, or None (leave OpenBLAS's own choice)."""
    if {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def _choose_openblas_kernels(path: str) -> str | None:
    """Before ``path`` loads, when it is OpenBLAS and ``OPENBLAS_CORETYPE`` is unset: set it
    from the CPU's instruction set; the kernel family set, or None.

    OpenBLAS picks its kernels from the CPU's model id, and a virtual machine that reports a
    generic one ("Intel Xeon Processor") gets its Prescott (SSE3) kernels: a 1024^3 float32
    matmul ran at 8 GFLOP/s there against 101 with the AVX-512 ones, on the same 2 cores. The
    flags say what the CPU can run; on a CPU OpenBLAS does recognise, they name the family it
    would have picked for float32 anyway. The variable is read once, when the library loads.
    """
    if "openblas" not in os.path.basename(path).lower() or "OPENBLAS_CORETYPE" in os.environ:
        return None
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return None
    kernels = openblas_kernels(set(line.partition(":")[2].split()))
    if kernels is not None:
        os.environ["OPENBLAS_CORETYPE"] = kernels
    return kernels


def _preloaded_by_env() -> bool:
    return any("blas" in p or "mkl" in p for p in os.environ.get("LD_PRELOAD", "").split(":"))


def status() -> BlasStatus:
    """The preload's outcome (running :func:`preload` now if it never ran)."""
    return _status if _status is not None else preload()


def fast_cpu_matmul() -> bool:
    """Whether MLX's CPU matmuls run on an optimised BLAS: one preloaded here, or macOS's
    Accelerate (MLX's own build there)."""
    return sys.platform == "darwin" or status().active


def log_status(logger=None, *, force: bool = False) -> BlasStatus:
    """Log once which BLAS MLX's CPU backend uses (info), or how to install one (warning)."""
    import logging

    global _logged
    st = status()
    if _logged and not force:
        return st
    _logged = True
    if st.name == "not needed":
        return st
    (logger or logging.getLogger("mlxc.blas")).log(
        logging.INFO if st.active else logging.WARNING, st.reason
    )
    return st


class _PreloadOnMlxImport:
    """``sys.meta_path`` entry that runs :func:`preload` just before ``mlx.core`` is imported.

    It finds nothing itself (returns None, so the normal import proceeds) and removes itself
    on first use: importing mlxc costs nothing more, and only processes that use MLX load a BLAS.
    """

    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core":
            remove_import_hook()
            preload()


_hook = _PreloadOnMlxImport()


def install_import_hook() -> None:
    """Make the first ``import mlx.core`` after this call run :func:`preload` first.

    For ``mlxc/__init__.py``: costs a list insert, imports nothing. When MLX is already
    imported it is too late for a BLAS; :func:`status` then says so.
    """
    if _status is None and "mlx.core" not in sys.modules and _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def remove_import_hook() -> None:
    while _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def _reset_for_tests() -> None:
    global _status, _logged
    _status, _logged = None, False
