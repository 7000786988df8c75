// The CUDA constructs runtime/model/cuda_attention.py's kernel uses, on a CPU: each thread of a
// block is a std::thread, __syncwarp and __syncthreads are barriers, a shuffle goes through a
// slot array between two barriers (a vote too), __shared__ arrays are function statics; blocks
// run one at a time, so an atomic add is a plain one and fences are no-ops. Enough to run the
// kernel's logic in CI, which has no GPU (tests/test_cuda_emulated.py); NVRTC, bf16, memory
// ordering across blocks and timing stay with tests/test_cuda_attention.py on a CUDA machine.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__

struct Dim3 { int x, y, z; };
static thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::unique_ptr<std::barrier<>> warp_barrier[32];
static float shuffle_slot[32][32];

inline void __syncwarp() { warp_barrier[threadIdx.x / 32]->arrive_and_wait(); }
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int lane_mask) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncwarp();
  shuffle_slot[w][lane] = x;
  __syncwarp();
  const float y = shuffle_slot[w][lane ^ lane_mask];
  __syncwarp();
  return y;
}
static bool vote_slot[32][32];
inline bool __any_sync(unsigned, bool p) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncwarp();
  vote_slot[w][lane] = p;
  __syncwarp();
  bool any = false;
  for (int l = 0; l < 32; ++l) any = any || vote_slot[w][l];
  __syncwarp();
  return any;
}
inline float exp2f(float x) { return std::exp2(x); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::exchange(*p, *p + v); }
inline void __threadfence() {}
using std::max;
using std::min;
namespace cuda { namespace std { using ::std::numeric_limits; } }
namespace mlx { namespace core { namespace cu {
struct Shape { int v[8]; int operator[](int i) const { return v[i]; } };
struct Strides { long long v[8]; long long operator[](int i) const { return v[i]; } };
}}}

// Runs body() as every thread of every block of the grid, one block at a time.
inline void launch(Dim3 grid, int threads, const std::function<void()>& body) {
  gridDim = grid;
  blockDim = {threads, 1, 1};
  for (int by = 0; by < grid.y; ++by) {
    for (int bx = grid.x - 1; bx >= 0; --bx) {  // backwards: no block may count on coming last
      blockIdx = {bx, by, 0};
      std::barrier<> block(threads);
      block_barrier = &block;
      for (int w = 0; w < (threads + 31) / 32; ++w) {
        warp_barrier[w] = std::make_unique<std::barrier<>>(32);
      }
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([t, &body] {
          threadIdx = {t, 0, 0};
          body();
        });
      }
      for (auto& t : pool) t.join();
    }
  }
}

// A raw file as an 8-byte-aligned buffer of X.
template <typename X>
struct Buffer {
  std::vector<double> raw;
  X* data() { return reinterpret_cast<X*>(raw.data()); }
};
template <typename X>
Buffer<X> load(const char* path) {
  std::ifstream f(path, std::ios::binary);
  f.seekg(0, std::ios::end);
  const size_t n = f.tellg();
  f.seekg(0);
  Buffer<X> b;
  b.raw.resize(n / sizeof(double) + 2);
  f.read(reinterpret_cast<char*>(b.raw.data()), n);
  return b;
}

// --- for runtime/model/cuda_matmul.cuh ---------------------------------------------------------
// A bf16 value as stored (the high half of a float32), rounded to nearest even from a float.
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  explicit __nv_bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};
inline float bf16_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
struct uint4 { uint32_t x, y, z, w; };
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

// PTX's mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 by its fragment layout: lane
// (g, t) = (lane / 4, lane % 4) holds a's rows g and g + 8, columns 2t, 2t + 1 (registers 0,
// 1) and 2t + 8, 2t + 9 (registers 2, 3), b's rows 2t, 2t + 1 (register 0) and 2t + 8,
// 2t + 9 (register 1) of column g, and d's rows g (d[0], d[1]) and g + 8 (d[2], d[3]) of
// columns 2t, 2t + 1. bf16 only (the emulator's one 16-bit type).
#define MLXC_EMULATED_MMA
static uint32_t mma_a[32][32][4], mma_b[32][32][2];
namespace mlxc {
template <bool BF16>
inline void mma16816(float* d, const uint32_t* a, const uint32_t* b) {
  static_assert(BF16, "the emulator has bf16 only");
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  __syncwarp();
  for (int i = 0; i < 4; ++i) mma_a[w][lane][i] = a[i];
  for (int i = 0; i < 2; ++i) mma_b[w][lane][i] = b[i];
  __syncwarp();
  auto half = [](uint32_t reg, int k) { return bf16_float((reg >> (16 * (k % 2))) & 0xffffu); };
  for (int c = 0; c < 4; ++c) {
    const int row = g + (c >= 2 ? 8 : 0), col = 2 * t + (c & 1);
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) {
      const int holder = (k % 8) / 2;  // the t of the lanes holding column (a) / row (b) k
      const float av = half(mma_a[w][(row % 8) * 4 + holder][(row >= 8) + 2 * (k >= 8)], k);
      const float bv = half(mma_b[w][col * 4 + holder][k >= 8], k);
      sum += av * bv;
    }
    d[c] += sum;
  }
  __syncwarp();
}
}  // namespace mlxc
