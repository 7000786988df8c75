"""runtime/blas.py: an optimised BLAS is found and bound before MLX, and nothing ever breaks.

A BLAS only takes effect when loaded before ``import mlx.core`` (the binding of ``cblas_sgemm``
is made at import), and this test process has MLX imported already, so the effect is checked in
subprocesses, through the dynamic linker's own account (``LD_DEBUG=bindings``): a check, not a
timing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import pytest

from mlxc.runtime import blas


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("MLXC_BLAS", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    blas._reset_for_tests()
    yield
    blas._reset_for_tests()
    blas.remove_import_hook()


def _child(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("MLXC_BLAS", "LD_PRELOAD")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
    )


installed = pytest.mark.skipif(
    not blas._candidates(),
    reason="no optimised BLAS installed (apt-get install libopenblas0-pthread)",
)

_PRELOAD_THEN_MATMUL = """
import json
from mlxc.runtime import blas
st = blas.preload({device!r})
import mlx.core as mx
a = mx.ones((64, 64))
mx.eval(a @ a)
print("STATUS" + json.dumps(st.as_dict()))
"""


def _status_of(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("STATUS"))
    return json.loads(line[len("STATUS") :])


def _sgemm_binding(stderr: str) -> str:
    """The library libmlx.so bound ``cblas_sgemm`` to, from LD_DEBUG=bindings output."""
    for line in stderr.splitlines():
        if "libmlx" in line and "`cblas_sgemm'" in line:
            return line.split(" to ")[1]
    raise AssertionError("no cblas_sgemm binding for libmlx in the LD_DEBUG output")


@installed
def test_preload_finds_the_installed_blas_and_mlx_binds_to_it():
    r = _child(_PRELOAD_THEN_MATMUL.format(device="cpu"), LD_DEBUG="bindings")
    assert r.returncode == 0, r.stderr[-2000:]
    st = _status_of(r.stdout)
    assert st["active"] and os.path.isfile(st["library"])
    assert "reference" not in st["name"]
    bound = _sgemm_binding(r.stderr)
    # with OpenBLAS and a C compiler MLX binds to the few-rows routing, which calls the BLAS
    want = st["few_rows"] or st["library"]
    assert os.path.basename(want).split(".so")[0] in bound, bound


def test_openblas_kernels_follow_the_instruction_set():
    avx512 = {"sse3", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq"}
    assert blas.openblas_kernels(avx512 | {"avx512vl"}) == "SkylakeX"
    assert blas.openblas_kernels(avx512) == "Haswell"  # no AVX-512VL: SkylakeX's need it
    assert blas.openblas_kernels({"sse3", "avx", "avx2", "fma"}) == "Haswell"
    assert blas.openblas_kernels({"sse3", "avx"}) is None  # OpenBLAS's own choice


@installed
def test_preload_sets_openblas_kernels_unless_the_user_did():
    code = _PRELOAD_THEN_MATMUL.format(device="cpu") + (
        "import os; print('CORETYPE', os.environ.get('OPENBLAS_CORETYPE'))"
    )
    # This process's own preload set OPENBLAS_CORETYPE: the child must start without it.
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "MLXC_BLAS")}
    with open("/proc/cpuinfo") as f:
        flags = set(next((ln for ln in f if ln.startswith("flags")), "").partition(":")[2].split())
    want = blas.openblas_kernels(flags) if "openblas" in blas._candidates()[0] else None
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"CORETYPE {want}" in r.stdout
    if want:
        assert want in _status_of(r.stdout)["name"]  # OpenBLAS reports the kernels it runs
    r = _child(code, OPENBLAS_CORETYPE="Haswell")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CORETYPE Haswell" in r.stdout and "kernels picked" not in r.stdout


def test_without_preload_mlx_keeps_its_bundled_reference_blas():
    r = _child("import mlx.core as mx; a = mx.ones((8, 8)); mx.eval(a @ a)", LD_DEBUG="bindings")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mlx_cpu.libs" in _sgemm_binding(r.stderr) or "libblas" in _sgemm_binding(r.stderr)


@installed
def test_import_hook_preloads_on_the_first_mlx_import():
    code = (
        "import json, sys\n"
        "from mlxc.runtime import blas\n"
        "blas.install_import_hook()\n"
        "assert blas._status is None  # nothing loaded until MLX is imported\n"
        "import mlx.core\n"
        "assert blas._hook not in sys.meta_path\n"
        "print('STATUS' + json.dumps(blas.status().as_dict()))\n"
    )
    r = _child(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _status_of(r.stdout)["active"]


def test_gpu_device_is_a_no_op():
    r = _child(
        "import json\nfrom mlxc.runtime import blas\nst = blas.preload('gpu')\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('STATUS' + json.dumps(dict(st.as_dict(), mapped='openblas' in maps)))\n"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    st = _status_of(r.stdout)
    assert not st["active"] and st["library"] is None and st["name"] == "not needed"
    assert not st["mapped"]


def test_a_cuda_backend_next_to_mlx_means_no_preload(tmp_path, monkeypatch):
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx_cuda_13-0.32.4.dist-info").mkdir()
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "mlx")])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: spec)
    monkeypatch.setattr(sys, "platform", "linux")
    assert blas._backend_is_cpu_only() is False
    st = blas.preload()
    assert not st.active and st.name == "not needed"


def test_no_blas_installed_never_raises_and_says_how_to_install(monkeypatch):
    monkeypatch.setattr(blas, "_candidates", list)
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)  # as if before MLX
    st = blas.preload("cpu")
    assert not st.active and st.library is None
    assert "apt-get install libopenblas0-pthread" in st.reason


def test_too_late_says_so_and_loads_nothing(monkeypatch):
    import mlx.core  # noqa: F401 - this test is about a process that imported MLX first

    monkeypatch.setattr(blas, "_candidates", lambda: ["/some/libopenblas.so.0"])
    st = blas.preload("cpu")
    assert not st.active and st.library is None
    assert "LD_PRELOAD=/some/libopenblas.so.0" in st.reason


@pytest.mark.parametrize("setting", ["/nonexistent/libopenblas.so.0", "libm.so.6"])
def test_a_bad_mlxc_blas_setting_never_raises(monkeypatch, setting):
    monkeypatch.setenv("MLXC_BLAS", setting)
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    st = blas.preload("cpu")  # libm has no cblas_sgemm: checked before any global load
    assert not st.active and setting in st.reason


def test_mlxc_blas_off_disables(monkeypatch):
    monkeypatch.setenv("MLXC_BLAS", "off")
    st = blas.preload("cpu")
    assert not st.active and "disabled" in st.reason


def test_an_internal_error_becomes_a_status(monkeypatch):
    def boom(device):
        raise RuntimeError("boom")

    monkeypatch.setattr(blas, "_preload", boom)
    st = blas.preload("cpu")
    assert not st.active and "boom" in st.reason


def test_log_status_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(blas, "_candidates", list)
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    with caplog.at_level("INFO", logger="mlxc.blas"):
        blas.log_status()
        blas.log_status()
    assert len(caplog.records) == 1 and caplog.records[0].levelname == "WARNING"


# Products MLX sends to cblas_sgemm with few rows or columns, in each layout it passes (rows and
# columns, either operand transposed), with a beta, and more rows than the routing takes, against
# numpy in float64.
_FEW_ROWS_PRODUCTS = """
import json
from mlxc.runtime import blas
st = blas.preload("cpu")
import mlx.core as mx
import numpy as np

rng = np.random.default_rng(0)
w, wt, x, col, c, x3, x5 = (rng.standard_normal(s).astype(np.float32) for s in
                            [(96, 64), (64, 96), (1, 64), (64, 1), (1, 96), (3, 64), (5, 64)])
m = {k: mx.array(v) for k, v in dict(w=w, wt=wt, x=x, col=col, c=c, x3=x3, x5=x5).items()}
cases = {
    "row @ W^T": (lambda: m["x"] @ m["w"].T, x @ w.T),
    "row @ W": (lambda: m["x"] @ m["wt"], x @ wt),
    "transposed column @ W": (lambda: m["col"].T @ m["wt"], col.T @ wt),
    "W @ column": (lambda: m["w"] @ m["col"], w @ col),
    "W^T^T @ row^T": (lambda: m["wt"].T @ m["x"].T, wt.T @ x.T),
    "addmm, beta 0.5": (lambda: mx.addmm(m["c"], m["x"], m["w"].T, alpha=2.0, beta=0.5),
                        0.5 * c + 2.0 * x @ w.T),
    "three rows": (lambda: m["x3"] @ m["w"].T, x3 @ w.T),
    "five rows": (lambda: m["x5"] @ m["w"].T, x5 @ w.T),
}
errors = {}
for name, (ours, want) in cases.items():
    got = ours()
    mx.eval(got)
    want = want.astype(np.float64)
    errors[name] = float(np.max(np.abs(np.array(got) - want)) / np.max(np.abs(want)))
print("ERRORS" + json.dumps(errors))
print("STATUS" + json.dumps(st.as_dict()))
"""


@installed
def test_few_rows_products_go_through_the_routing_and_equal_numpy(tmp_path):
    r = _child(_FEW_ROWS_PRODUCTS, MLXC_HOME=str(tmp_path), LD_DEBUG="bindings")
    assert r.returncode == 0, r.stderr[-2000:]
    st = _status_of(r.stdout)
    if "openblas" not in st["library"] or not shutil.which("cc"):
        pytest.skip(f"no few-rows routing here: {st['reason']}")
    assert st["few_rows"].startswith(str(tmp_path / "blas"))  # built into $MLXC_HOME
    assert "sgemm_few_rows" in _sgemm_binding(r.stderr)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("ERRORS"))
    errors = json.loads(line[len("ERRORS") :])
    # float32 sums of 64 products against float64: ~1e-7 of the largest
    assert all(e < 1e-5 for e in errors.values()), errors


@installed
def test_few_rows_routing_off_or_without_a_compiler_keeps_the_blas(tmp_path):
    for env, why in (
        ({"MLXC_BLAS_FEW_ROWS": "off"}, "MLXC_BLAS_FEW_ROWS=off"),
        ({"CC": str(tmp_path / "no-such-cc")}, "no C compiler"),
    ):
        r = _child(_PRELOAD_THEN_MATMUL.format(device="cpu"), MLXC_HOME=str(tmp_path), **env)
        assert r.returncode == 0, r.stderr[-2000:]
        st = _status_of(r.stdout)
        assert st["active"] and st["few_rows"] is None
        if "openblas" in st["library"]:
            assert why in st["reason"], st["reason"]
    assert not (tmp_path / "blas").exists() or not list((tmp_path / "blas").iterdir())


@installed
@pytest.mark.parametrize("order", ["row", "col"])
@pytest.mark.parametrize("widest", [2, 1, 0], ids=["avx512", "avx2", "sgemv"])
def test_the_routing_follows_cblas_for_every_layout(tmp_path, monkeypatch, order, widest):
    """``sgemm_few_rows.c`` called directly (loaded locally, bound to the installed BLAS), for
    the layouts MLX never passes too: column-major, padded leading dimensions, transposes; with
    each kernel the CPU has (``widest``: the widest it may use; 0: one sgemv a row)."""
    import ctypes

    import numpy as np

    monkeypatch.setenv("MLXC_HOME", str(tmp_path))
    path = blas._candidates()[0]
    lib, why = blas._few_rows_library()
    if lib is None or "openblas" not in path:
        pytest.skip(f"no few-rows routing here: {why}")
    shim = ctypes.CDLL(lib, mode=os.RTLD_LOCAL)
    assert shim.mlxc_sgemm_few_rows_bind(ctypes.c_void_p(ctypes.CDLL(path)._handle), widest)
    want = ["sgemv per row", "avx2", "avx512"][widest]
    if blas._few_rows_kernel(lib) != want:
        pytest.skip(f"this CPU has no {want} kernel")
    f32p = ctypes.POINTER(ctypes.c_float)
    rng = np.random.default_rng(1)

    def stored(mat, trans, pad):
        """``mat`` (what op() must give) laid out as CBLAS reads it: (buffer, leading dim)."""
        held = mat.T if trans else mat
        if order == "col":
            held = held.T  # column-major storage is the row-major storage of the transpose
        buf = np.zeros((held.shape[0], held.shape[1] + pad), np.float32)
        buf[:, : held.shape[1]] = held
        return buf, buf.shape[1]

    # (x @ W^T of 2..24 rows streams on AVX2, of 2..32 rows on AVX-512; more go to the BLAS's
    # GEMM; k past one vector and odd widths exercise the vector loop's tail and a block of
    # weight rows cut short; n past SMALL / k splits a product over the threads. x @ B of
    # 2..512 rows on AVX-512 goes by rows of B, 64 columns at a time: n of several such blocks,
    # the last one short, and attention's 64-wide values of a decode step and a verification)
    shapes = [(1, 7, 5), (6, 1, 5), (1, 1, 3), (4, 7, 5), (6, 3, 5), (17, 7, 5)]
    shapes += [(m, 33, 21) for m in (2, 3, 6, 7, 12, 16, 24, 25, 32, 33)]
    shapes += [(m, 8200, 67) for m in (2, 9, 32)]
    shapes += [(m, 150, 40) for m in (2, 5, 20, 100, 512, 513)] + [(4, 64, 130), (20, 64, 130)]
    for m, n, k in shapes:
        for ta in (False, True):
            for tb in (False, True):
                a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
                c0 = rng.standard_normal((m, n))
                abuf, lda = stored(a, ta, 2)
                bbuf, ldb = stored(b, tb, 3)
                cbuf, ldc = stored(c0, False, 1)
                shim.cblas_sgemm(
                    101 if order == "row" else 102,
                    112 if ta else 111,
                    112 if tb else 111,
                    *(ctypes.c_int(v) for v in (m, n, k)),
                    ctypes.c_float(1.5),
                    abuf.ctypes.data_as(f32p),
                    ctypes.c_int(lda),
                    bbuf.ctypes.data_as(f32p),
                    ctypes.c_int(ldb),
                    ctypes.c_float(0.5),
                    cbuf.ctypes.data_as(f32p),
                    ctypes.c_int(ldc),
                )
                got = cbuf[:, :m].T if order == "col" else cbuf[:, :n]
                want = 1.5 * a @ b + 0.5 * c0
                assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (m, n, k, ta, tb)
