"""NVIDIA's runtime compiler (NVRTC) accepts mlxc's CUDA kernels (``runtime.model.cuda_attention``,
``runtime.model.cuda_matmul``), in CI.

``test_cuda_emulated.py`` compiles the kernel's source with g++ against an emulator, which
takes C++ that NVRTC may not (and the reverse: CUDA's intrinsics, its execution spaces), and
``test_cuda_attention.py`` needs a GPU, which CI has none of. NVRTC itself needs no GPU: it
comes as a pip package (``nvidia-cuda-nvrtc``, in the test extra on Linux x86-64, with the CUDA
and libcu++ headers the kernel includes). Here the source is laid out as MLX 0.32's
``mx.fast.cuda_kernel`` lays it out (its default header, then the kernel's ``.cuh`` #included
by its absolute path, one parameter per input plus its shape, strides and ndim where the source
names them, the template arguments as constants at the top of the function, the body inside
``mlx::core::cu``) and compiled for the H100/H200's sm_90a with MLX's options. MLX's own device
header is not shipped outside its CUDA wheel; a stand-in declares the two types the kernel
takes from it (``Shape``, ``Strides``, as MLX defines them).
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from mlxc.runtime.model import cuda_attention as ca
from mlxc.runtime.model import cuda_matmul as cm


def _cuda_root() -> Path | None:
    """The pip-installed CUDA 13 tree (``nvidia/cu13``: NVRTC, headers), if any."""
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        root = Path(base) / "cu13"
        if (root / "lib" / "libnvrtc.so.13").exists() and (root / "include" / "cccl").exists():
            return root
    return None


CUDA = _cuda_root()
pytestmark = pytest.mark.skipif(
    CUDA is None, reason="no NVRTC (the test extra installs nvidia-cuda-nvrtc on Linux x86-64)"
)

# What the kernel takes from MLX's "mlx/backend/cuda/device/utils.cuh" (MAX_NDIM is 10 there).
MLX_UTILS = """
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""
CUDA_TYPES = {
    mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float",
    mx.uint32: "uint32_t", mx.int32: "int32_t", mx.bool_: "bool",
}  # fmt: skip


def _kernel_source(inputs, outputs, template, source=ca._SOURCE, header=ca._HEADER) -> str:
    """The kernel of ``source`` and ``header`` as MLX's ``cuda_kernel`` builds it for these
    input/output dtypes and template arguments (``build_kernel`` in MLX's
    ``backend/cuda/custom_kernel.cpp``)."""
    lines = [
        '#include "mlx/backend/cuda/device/utils.cuh"',
        "#include <cooperative_groups.h>",
        header,
        "namespace mlx::core::cu {",
        "namespace cg = cooperative_groups;",
        "__global__ void custom_kernel_mlxc(",
    ]
    params = []
    for name, dtype in inputs:
        params.append(f"const {CUDA_TYPES[dtype]}* {name}")
        if f"{name}_shape" in source:
            params.append(f"const __grid_constant__ Shape {name}_shape")
        if f"{name}_strides" in source:
            params.append(f"const __grid_constant__ Strides {name}_strides")
        if f"{name}_ndim" in source:
            params.append(f"const __grid_constant__ int {name}_ndim")
    params += [f"{CUDA_TYPES[dtype]}* {name}" for name, dtype in outputs]
    lines.append(",\n".join(params) + ") {")
    for name, value in template:
        if isinstance(value, mx.Dtype):
            lines.append(f"using {name} = {CUDA_TYPES[value]};")
        elif isinstance(value, bool):
            lines.append(f"constexpr bool {name} = {str(value).lower()};")
        else:
            lines.append(f"constexpr int {name} = {value};")
    lines += [source, "}", "}  // namespace mlx::core::cu"]
    return "\n".join(lines)


def _compile(source: str) -> tuple[int, str]:
    """NVRTC's result code and log for ``source``, compiled as MLX compiles a custom kernel."""
    nvrtc = ctypes.CDLL(str(CUDA / "lib" / "libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    headers = (ctypes.c_char_p * 1)(MLX_UTILS.encode())
    names = (ctypes.c_char_p * 1)(b"mlx/backend/cuda/device/utils.cuh")
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 1, headers, names) == 0  # fmt: skip
    options = [
        b"--device-as-default-execution-space",  # MLX's: the kernel's lambdas need it
        b"--gpu-architecture=sm_90a",
        f"--include-path={CUDA / 'include'}".encode(),
        f"--include-path={CUDA / 'include' / 'cccl'}".encode(),
    ]
    result = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))  # fmt: skip
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return result, log.value.decode(errors="replace")


# The kernel is a C++ template (``mlxc::attention``): a variant compiles its own branches only.
# Float keys and 4- and 8-bit packed ones, in each activation dtype, at both head dims.
VARIANTS = [
    (mx.bfloat16, 0, 128, 8), (mx.bfloat16, 4, 64, 4), (mx.float16, 8, 128, 1),
    (mx.float32, 0, 64, 2), (mx.float32, 4, 128, 1),
    (mx.bfloat16, 8, 128, 8),  # the most shared memory: 8 rows' sums, 8-bit staged codes
]  # fmt: skip


@pytest.mark.parametrize("dtype, bits, head_dim, rows", VARIANTS)
def test_nvrtc_compiles_the_kernel(dtype, bits, head_dim, rows):
    key = mx.uint32 if bits else dtype
    dtypes = [dtype, key, key, dtype, dtype, dtype, dtype, dtype, dtype, mx.bool_, dtype]
    inputs = list(zip(ca._INPUTS, [*dtypes, mx.float32, mx.int32, mx.uint32], strict=True))
    outputs = list(zip(ca._OUTPUTS, [dtype, mx.float32], strict=True))
    template = ca._template(dtype, key, dtype, head_dim, rows, bits, 64 if bits else 1)
    result, log = _compile(_kernel_source(inputs, outputs, template))
    assert result == 0, log[-4000:]
    assert "warning" not in log, log[-4000:]


# MLA's decode kernel (``mlxc::latent_attention``) at DeepSeek's and MiniCPM3's widths, on
# float latents and 4- and 8-bit packed ones.
@pytest.mark.parametrize(
    "dtype, C, RD, bits",
    [
        (mx.bfloat16, 512, 64, 0),
        (mx.float16, 256, 32, 0),
        (mx.float32, 256, 32, 0),
        (mx.bfloat16, 512, 64, 4),
        (mx.float16, 256, 64, 8),
    ],
)
def test_nvrtc_compiles_the_latent_kernel(dtype, C, RD, bits):
    key = mx.uint32 if bits else dtype
    dtypes = [dtype, dtype, key, dtype, dtype, key, dtype, dtype, mx.bool_, mx.float32, mx.uint32]
    inputs = list(zip(ca._LATENT_INPUTS, dtypes, strict=True))
    outputs = list(zip(ca._OUTPUTS, [dtype, mx.float32], strict=True))
    rows = ca._latent_rows(16, C)
    template = ca._latent_template(dtype, key, dtype, C, RD, rows, bits, 64 if bits else 1)
    result, log = _compile(_kernel_source(inputs, outputs, template, ca._LATENT_SOURCE))
    assert result == 0, log[-4000:]
    assert "warning" not in log, log[-4000:]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_nvrtc_compiles_the_matmul_kernel(dtype):
    template = cm._launch((4, 64), dtype, 48)["template"]
    inputs, outputs = [("x", dtype), ("w", dtype)], [("y", dtype)]
    header = ca.include_header(cm.KERNEL_FILE)
    result, log = _compile(_kernel_source(inputs, outputs, template, cm._SOURCE, header))
    assert result == 0, log[-4000:]
    assert "warning" not in log, log[-4000:]
