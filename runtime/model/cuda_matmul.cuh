// mlxc's CUDA matmul for a few rows (runtime/model/cuda_matmul.py says where it runs and why):
// y[M, N] = x[M, K] w[N, K]^T in bf16 or fp16 on tensor cores (PTX mma m16n8k16, float sums),
// for 2 to 32 rows of x. #included by its absolute path after MLX's device header, as
// cuda_attention.cuh is.
#pragma once

namespace mlxc {

// d += a b for one m16n8k16 tile: a 16 x 16 (rows, k), b 16 x 8 (k, columns), each register
// a pair of 16-bit values, the lower-indexed one in the low half. (tests/cuda_emulator has its
// own, on a CPU.)
#ifndef MLXC_EMULATED_MMA
template <bool BF16>
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, const uint32_t* b) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}
#endif

// Elements e .. e + 7 of a row of 16-bit values as four pairs: one 16-byte load where the
// arrays are 16-byte aligned (``vec``), else one element at a time.
template <typename T>
__device__ __forceinline__ uint4 load8(const T* row, int e, bool vec) {
  if (vec) return *reinterpret_cast<const uint4*>(row + e);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(row) + e;
  return make_uint4(h[0] | (uint32_t(h[1]) << 16), h[2] | (uint32_t(h[3]) << 16),
      h[4] | (uint32_t(h[5]) << 16), h[6] | (uint32_t(h[7]) << 16));
}

// One block per NT tiles of 8 columns of y (8 rows of w each) and 16 rows of x (blockIdx.y:
// which 16; rows past M read as zeros); its KW warps split K in steps of 32 and add up their
// sums in shared memory at the end. A step of a warp is one 16-byte load per lane from each of
// its 8 x NT rows of w (the weights: every byte read once per 16 rows, in full 32-byte
// sectors), two from x (L1 and L2 serve them: every block reads its 16 rows) and two mmas per
// tile of columns. A k-step's 32 values map to the two mmas' k slots out of order, the same
// order for x and w, so that each lane's share of a row is 8 consecutive values: lane (g, t)
// (g = lane / 4, t = lane % 4) holds k = 8t .. 8t + 7 of its row, slots {2t, 2t + 1} and
// {2t + 8, 2t + 9} of the first mma taking k = 8t .. 8t + 3, those of the second
// 8t + 4 .. 8t + 7. The sum over k does not depend on the order. x is [..., K] (its rows:
// every leading dim), w [N, K], y [..., N].
template <typename T, bool BF16, int NT, int KW>
__device__ __forceinline__ void rows_matmul(const T* x, const mlx::core::cu::Shape& x_shape,
    int x_ndim, const T* w, const mlx::core::cu::Shape& w_shape, T* y) {
  int M = 1;
  for (int d = 0; d < x_ndim - 1; ++d) M *= x_shape[d];
  const int K = x_shape[x_ndim - 1], N = w_shape[0];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * 8 * NT, m0 = 16 * blockIdx.y;
  const bool vec = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const T* wrow[NT];
  bool w_in[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int n = n0 + 8 * j + g;
    w_in[j] = n < N;
    wrow[j] = w + static_cast<long long>(w_in[j] ? n : 0) * K;
  }
  const bool x_in[2] = {m0 + g < M, m0 + g + 8 < M};  // rows g and g + 8 of the tile
  const T* xrow[2] = {x + static_cast<long long>(x_in[0] ? m0 + g : 0) * K,
      x + static_cast<long long>(x_in[1] ? m0 + g + 8 : 0) * K};
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;

  const int steps = K / 32;
#pragma unroll 4
  for (int s = warp; s < steps; s += KW) {
    const int e = 32 * s + 8 * t;
    uint4 b[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) b[j] = w_in[j] ? load8(wrow[j], e, vec) : zero;
    const uint4 a0 = x_in[0] ? load8(xrow[0], e, vec) : zero;
    const uint4 a1 = x_in[1] ? load8(xrow[1], e, vec) : zero;
    const uint32_t a_lo[4] = {a0.x, a1.x, a0.y, a1.y}, a_hi[4] = {a0.z, a1.z, a0.w, a1.w};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint32_t b_lo[2] = {b[j].x, b[j].y}, b_hi[2] = {b[j].z, b[j].w};
      mma16816<BF16>(acc[j], a_lo, b_lo);
      mma16816<BF16>(acc[j], a_hi, b_hi);
    }
  }

  // The warps' sums, added up by the whole block. Lane (g, t)'s sums c of a column tile: row
  // g (c = 0, 1) or g + 8 (c = 2, 3), column 2t + (c & 1).
  constexpr int PER_WARP = NT * 4 * 32;
  __shared__ float sums[KW][PER_WARP];
#pragma unroll
  for (int j = 0; j < NT; ++j)
    for (int c = 0; c < 4; ++c) sums[warp][(j * 4 + c) * 32 + lane] = acc[j][c];
  __syncthreads();
  for (int idx = threadIdx.x; idx < PER_WARP; idx += 32 * KW) {
    float total = 0.f;
    for (int v = 0; v < KW; ++v) total += sums[v][idx];
    const int l = idx % 32, c = (idx / 32) % 4, j = idx / 128;
    const int row = m0 + l / 4 + (c >= 2 ? 8 : 0), col = n0 + 8 * j + 2 * (l % 4) + (c & 1);
    if (row < M && col < N) y[static_cast<long long>(row) * N + col] = static_cast<T>(total);
  }
}

}  // namespace mlxc
