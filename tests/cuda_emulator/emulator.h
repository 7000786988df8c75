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
