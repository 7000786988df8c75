// mlxc's CUDA attention kernel for a few queries per row (runtime/model/cuda_attention.py says
// where it runs and why). MLX's mx.fast.cuda_kernel builds each call's kernel from a source
// string it assembles and hashes on every call; the string holds one call of
// ``mlxc::attention`` below, and this file is #included by its absolute path, so a call costs
// the host a ~1.6 KB string (with MLX's parameter list), not this file's text. Included after
// MLX's device header (Shape, Strides, cuda::std::numeric_limits, the half types).
#pragma once

namespace mlxc {
// The most chunks a row's keys split into (``cuda_attention.MAX_CHUNKS``): the merge keeps
// each chunk's maximum and sum of a tile's rows in shared memory.
constexpr int MAX_CHUNKS = 64;
// The most staged tokens a quantised cache holds (``cuda_attention.MAX_STAGED``): a block
// quantises those it reads into shared memory.
constexpr int MAX_STAGED = 32;

// A compile-time bool as an argument's type: ``with_flag(b, f)`` calls the generic lambda
// ``f`` compiled for each value of ``b``, so ``b`` is a constant in its body.
template <bool B>
struct Flag {
  static constexpr bool value = B;
};
template <typename F>
__device__ __forceinline__ void with_flag(bool b, const F& f) {
  if (b)
    f(Flag<true>{});
  else
    f(Flag<false>{});
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// A row's online softmax over a warp's 32 keys, a key per lane: this lane's score ``x`` (log2
// units; -inf where the row may not attend) folded into the row's maximum ``m`` (the same in
// every lane) and this lane's share of its sum ``s`` (summed across the warp at the end).
// Sets ``p``, the key's weight, and returns the factor the row's weighted sums are rescaled by.
// A row that has attended to nothing yet keeps m = -inf and sums of zero.
__device__ __forceinline__ float online_softmax(float x, float& m, float& s, float& p) {
  const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
  const float mn = fmaxf(m, warp_max(x));
  p = mn == NEG_INF ? 0.f : exp2f(x - mn);
  const float f = mn == NEG_INF ? 1.f : exp2f(m - mn);
  s = s * f + p;
  m = mn;
  return f;
}
// A key round's weights: each of R rows' score of this lane's key (``d``; ``use(r)``: whether
// row r may attend to the key) through the online softmax, the row's NA weighted sums rescaled,
// and its weight for the key in shared memory (``pw[r][lane]``) for the value pass.
template <int R, int NA, typename Use>
__device__ __forceinline__ void round_weights(const float* d, float* m, float* s,
    float (&acc)[R][NA], float (&pw)[R][32], int lane, const Use& use) {
  const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
  for (int r = 0; r < R; ++r) {
    float p;
    const float f = online_softmax(use(r) ? d[r] : NEG_INF, m[r], s[r], p);
    for (int j = 0; j < NA; ++j) acc[r][j] *= f;
    pw[r][lane] = p;
  }
}
// VE elements of a row from element e0 (a multiple of VE), as floats. Float rows: one 16-byte
// load where the head dim is contiguous and aligned (``vec``), else one element at a time.
// Packed rows (MLX's affine layout: values low bits first in uint32 words, a scale and a bias
// per GS elements): one word, VE = 32 / BITS elements of one group.
template <typename P, typename S, int BITS, int GS, int VE>
__device__ __forceinline__ void load_vec(const P* row, const S* scales, const S* biases,
    int e0, long long es, long long gs_stride, bool vec, float* out) {
  if constexpr (BITS == 0) {
    if (vec) {
      struct alignas(VE * sizeof(P)) Vec { P x[VE]; };
      const Vec v = *reinterpret_cast<const Vec*>(row + e0);
      for (int j = 0; j < VE; ++j) out[j] = static_cast<float>(v.x[j]);
    } else {
      for (int j = 0; j < VE; ++j) out[j] = static_cast<float>(row[(e0 + j) * es]);
    }
  } else {
    const uint32_t w = reinterpret_cast<const uint32_t*>(row)[e0 * BITS / 32];
    const int g = e0 / GS;
    const float sc = static_cast<float>(scales[g * gs_stride]);
    const float bi = static_cast<float>(biases[g * gs_stride]);
    for (int j = 0; j < VE; ++j)
      out[j] = sc * static_cast<float>((w >> (j * BITS)) & ((1u << BITS) - 1u)) + bi;
  }
}
// A lane's key scored against each of R rows: its elements [0, N) (``load(e0, out)``: VE of
// them from e0) dotted into the rows' running scores ``d``, against the rows' queries in shared
// memory (``qs``, 16-byte aligned) from column ``q0``. A key per lane, every row against it, no
// reduction across lanes. U loads are in flight at a time, then their products: one load at a
// time, each waited on before the next was issued, left a warp idle on every load's latency.
template <int R, int VE, int N, int QD, typename Load>
__device__ __forceinline__ void key_scores(const float (&qs)[R][QD], int q0, const Load& load,
    float* d) {
  static_assert(VE % 4 == 0 && N % VE == 0, "whole 16-byte reads of the queries");
  constexpr int U = (N / VE) % 4 == 0 ? 4 : (N / VE) % 2 == 0 ? 2 : 1;
  struct alignas(16) F4 { float x[4]; };
  for (int e0 = 0; e0 < N; e0 += U * VE) {
    float kr[U][VE];
#pragma unroll
    for (int u = 0; u < U; ++u) load(e0 + u * VE, kr[u]);
#pragma unroll
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < VE; j += 4) {
          const F4 q = *reinterpret_cast<const F4*>(&qs[r][q0 + e0 + u * VE + j]);
          for (int i = 0; i < 4; ++i) d[r] += q.x[i] * kr[u][j + i];
        }
  }
}
// A group of a float row as MLX's CUDA ``affine_quantize`` codes it, from the group's range
// (``lo``: its minimum; ``hi``: its maximum, or 0 if larger, as MLX's starts at 0), by the
// same operations in the same order: the scale and bias it codes with, and those it stores
// (rounded to S), which dequantisation reads. A quantised cache's staged tokens are coded
// through it (``code``), so they attend exactly as the packed tokens they become.
struct Rounding { float scale, bias, stored_scale, stored_bias; };
template <typename S, int BITS>
__device__ __forceinline__ Rounding rounding(float lo, float hi) {
  constexpr float n_bins = (1 << BITS) - 1;
  float scale = fmaxf((hi - lo) / n_bins, 1e-7f);
  const bool side = fabsf(lo) > fabsf(hi);
  scale = side ? scale : -scale;
  const float edge = side ? lo : hi;
  const float q0 = roundf(edge / scale);
  const bool at_zero = q0 == 0.0f;
  scale = at_zero ? scale : edge / q0;
  const float bias = at_zero ? 0.f : edge;
  return {scale, bias, static_cast<float>(static_cast<S>(scale)),
      static_cast<float>(static_cast<S>(bias))};
}
// The range's starting values, and one VE-element share of a group folded in.
constexpr float RANGE_LO = cuda::std::numeric_limits<float>::max(), RANGE_HI = 0.f;
template <int VE>
__device__ __forceinline__ void widen(const float* x, float& lo, float& hi) {
  for (int j = 0; j < VE; ++j) {
    lo = fminf(lo, x[j]);
    hi = fmaxf(hi, x[j]);
  }
}
// An element's code in a group coded as ``r`` says.
template <int BITS>
__device__ __forceinline__ uint32_t code(const Rounding& r, float x) {
  constexpr float n_bins = (1 << BITS) - 1;
  const uint8_t q = fminf(roundf((x - r.bias) / r.scale), n_bins);
  return q;
}
// A value another block of this launch wrote: a volatile load, from L2, not this SM's L1, and
// one the compiler keeps after the fence that orders it (an asm load such as CUDA's ldcg
// declares no memory access, so it could move above that fence).
__device__ __forceinline__ float load_uncached(const float* p) {
  return *reinterpret_cast<const volatile float*>(p);
}
// A 4-d index with broadcasting: a dimension of size 1 has stride 0.
__device__ __forceinline__ long long at4(
    const mlx::core::cu::Shape& shape, const mlx::core::cu::Strides& strides, int a, int b, int c, int d) {
  return (shape[0] == 1 ? 0 : a * strides[0]) + (shape[1] == 1 ? 0 : b * strides[1]) +
      (shape[2] == 1 ? 0 : c * strides[2]) + (shape[3] == 1 ? 0 : d * strides[3]);
}

// A chunked call's end, after every block has written its chunk's share of its rows (``part``
// [row, chunk]: D weighted sums, the maximum, the sum): the last of a block row's chunks to
// finish merges them all and writes the output (``write_out(r, e, M, tot, a)``) of its tile's
// first ``rows`` rows (``out_row(r)``: row r's place in ``part``). Each thread's shares are
// made visible to the device, then one ticket per block (``tickets``: zeros, one per block
// row, this launch's own).
template <int R, int D, typename Row, typename Write>
__device__ __forceinline__ void merge_chunks(const uint32_t* tickets, const float* part,
    int n_chunks, int rows, const Row& out_row, const Write& write_out) {
  const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0)
    last = atomicAdd(const_cast<uint32_t*>(tickets) + blockIdx.y, 1u) == n_chunks - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // The merge reads what other blocks wrote (``load_uncached``) in loads independent of one
  // another, so they overlap: first every chunk's maximum and sum of the tile's rows into
  // shared memory, one round of loads for the block, then each (row, element) its chunks'
  // weighted sums. (Chains of such loads, each waiting on the one before, were the likeliest
  // cause of a chunked call's ~30 us fixed device time on an H100: ``docs/performance.md``.)
  __shared__ float cm[R][MAX_CHUNKS], cs[R][MAX_CHUNKS];
  for (int i = threadIdx.x; i < R * n_chunks; i += blockDim.x) {
    const int r = i / n_chunks, c = i % n_chunks;
    const float* p = part + (out_row(r) * n_chunks + c) * (D + 2);
    cm[r][c] = load_uncached(p + D);
    cs[r][c] = load_uncached(p + D + 1);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
    const int r = i / D, e = i % D;
    if (r >= rows) continue;
    const float* p = part + out_row(r) * n_chunks * (D + 2) + e;
    float M = NEG_INF;
    for (int c = 0; c < n_chunks; ++c) M = fmaxf(M, cm[r][c]);
    float tot = 0.f, a = 0.f;
#pragma unroll 4
    for (int c = 0; c < n_chunks; ++c) {
      // A chunk that saw no key the row may attend to holds m = -inf and zero sums.
      const float f = cm[r][c] == NEG_INF ? 0.f : exp2f(cm[r][c] - M);
      tot += cs[r][c] * f;
      a += load_uncached(p + c * (D + 2)) * f;
    }
    write_out(r, e, M, tot, a);
  }
}

// One block per (row, KV head, tile of R query rows, chunk of keys). A KV head's query rows
// (its G = Hq / Hkv heads times L queries) share each key and value the block loads: GQA
// reads the cache once per KV head, not once per query head. The tile's queries sit in shared
// memory. WARPS warps take 32 keys at a time, a key per lane: each lane scores its key against
// every row (no reduction across lanes per key), the warp takes one maximum per row for the 32
// (online softmax, rescaled once per 32 keys, not per key), and writes the probabilities to
// shared memory; then the warp walks the 32 values KPL rows per load (each lane 16 bytes of a
// row: independent loads in flight, not one dependent 4-byte load per row), its lanes adding
// up their rows' shares once at the end. The warps' sums merge in shared memory. With one
// chunk the block writes the output, else its partial sums, and the last of a block row's
// chunks to finish merges them (a ticket per block row): one launch a call, not a
// second kernel for the merge, as a small decode step's time is its launches' host cost
// (``bench.encode_costs``).
// The queries per row, the mask kind, the sinks and the chunking are run-time values (``flags``:
// scale, mask kind, sinks): every variant is a JIT compile of a second or more,
// so only what shapes registers (dtypes, head dim, rows per tile, packing) is a template argument.
template <typename T, typename KT, typename S, int D, int R, int BITS, int GS, int WARPS,
    typename SK>
__device__ __forceinline__ void attention(
    const T* q, const mlx::core::cu::Shape& q_shape, const mlx::core::cu::Strides& q_strides,
    const KT* k, const mlx::core::cu::Shape& k_shape, const mlx::core::cu::Strides& k_strides,
    const KT* v, const mlx::core::cu::Strides& v_strides,
    const S* k_scales, const mlx::core::cu::Strides& k_scales_strides,
    const S* k_biases, const mlx::core::cu::Strides& k_biases_strides,
    const S* v_scales, const mlx::core::cu::Strides& v_scales_strides,
    const S* v_biases, const mlx::core::cu::Strides& v_biases_strides,
    const T* k_recent, const mlx::core::cu::Strides& k_recent_strides,
    const T* v_recent, const mlx::core::cu::Strides& v_recent_strides,
    const bool* mask, const mlx::core::cu::Shape& mask_shape,
    const mlx::core::cu::Strides& mask_strides,
    const SK* sinks, const float* flags, const int32_t* lengths, const uint32_t* tickets,
    T* out, float* part) {
  // A load takes VE elements of a row (16 bytes of floats, one word of packed values). For
  // the values, LPR lanes cover a row's D elements and a warp loads KPL rows at once.
  constexpr int VE = BITS == 0 ? 16 / sizeof(KT) : 32 / BITS;
  constexpr int LPR = D / VE, KPL = 32 / LPR;
  constexpr float LOG2E = 1.4426950408889634f;
  const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
  const int chunk = blockIdx.x, n_chunks = gridDim.x;
  // The keys attended are the first ``lengths[0]`` of ``k``/``v`` (a cache's whole buffers, or
  // exactly the live keys), then, where they are packed, the first ``lengths[1]`` of
  // ``k_recent``/``v_recent`` ([B, Hkv, n, D], the queries' dtype): a quantised cache's newest
  // tokens, not yet quantised (``cache.StagingMixin``), read as quantising would store them
  // (``rounding``). Lengths, not shapes: a call on whole buffers keeps its shapes from step to
  // step, so ``cuda_attention`` replays it compiled.
  const int Hq = q_shape[1], L = q_shape[2], Hkv = k_shape[1], Tp = lengths[0];
  const int Tk = Tp + (BITS != 0 ? lengths[1] : 0);
  const int G = Hq / Hkv, n_rows = G * L, tiles = (n_rows + R - 1) / R;
  const int tile = blockIdx.y % tiles, kvh = (blockIdx.y / tiles) % Hkv;
  const int b = blockIdx.y / (tiles * Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float sc = flags[0] * LOG2E;
  const int mask_kind = static_cast<int>(flags[1]);  // 0 none, 1 causal, 2 boolean array
  const bool has_sinks = flags[2] != 0.f;

  // Row r of the tile: query head h = kvh * G + g, query l (rows past n_rows idle).
  alignas(16) __shared__ float qs[R][D];  // read 16 bytes at a time (key_scores)
  __shared__ float ps[WARPS][R][32];
  int rh[R], rl[R];
  float m[R], s[R], acc[R][VE];
  for (int r = 0; r < R; ++r) {
    const int rr = min(tile * R + r, n_rows - 1);
    rh[r] = kvh * G + rr / L; rl[r] = rr % L;
    for (int j = 0; j < VE; ++j) acc[r][j] = 0.f;
    m[r] = NEG_INF; s[r] = 0.f;
  }
  // Row r's place in the output, [B, Hq, L] flattened.
  auto out_row = [&](int r) { return (static_cast<long long>(b) * Hq + rh[r]) * L + rl[r]; };
  for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
    const int r = i / D, e = i % D;
    qs[r][e] = static_cast<float>(
        q[b * q_strides[0] + rh[r] * q_strides[1] + rl[r] * q_strides[2] + e * q_strides[3]]) * sc;
  }
  __syncthreads();
  const int per_chunk = (Tk + n_chunks - 1) / n_chunks;
  const int start = chunk * per_chunk, end = min(Tk, start + per_chunk);
  const auto* krow = k + b * k_strides[0] + kvh * k_strides[1];
  const auto* vrow = v + b * v_strides[0] + kvh * v_strides[1];
  const auto* ksc = k_scales + b * k_scales_strides[0] + kvh * k_scales_strides[1];
  const auto* kbi = k_biases + b * k_biases_strides[0] + kvh * k_biases_strides[1];
  const auto* vsc = v_scales + b * v_scales_strides[0] + kvh * v_scales_strides[1];
  const auto* vbi = v_biases + b * v_biases_strides[0] + kvh * v_biases_strides[1];
  const auto* krec = k_recent + b * k_recent_strides[0] + kvh * k_recent_strides[1];
  const auto* vrec = v_recent + b * v_recent_strides[0] + kvh * v_recent_strides[1];
  // Float rows with a contiguous head dim on 16-byte boundaries (every cache's): vector loads.
  const bool vec = BITS == 0 && k_strides[3] == 1 && v_strides[3] == 1 &&
      k_strides[2] % VE == 0 && v_strides[2] % VE == 0 &&
      (reinterpret_cast<uintptr_t>(krow) | reinterpret_cast<uintptr_t>(vrow)) % 16 == 0;
  const bool rvec = k_recent_strides[3] == 1 && v_recent_strides[3] == 1 &&
      k_recent_strides[2] % VE == 0 && v_recent_strides[2] % VE == 0 &&
      (reinterpret_cast<uintptr_t>(krec) | reinterpret_cast<uintptr_t>(vrec)) %
          (VE * sizeof(T)) == 0;
  // This lane's share of the value rows: row sub of each KPL, elements [ve, ve + VE).
  const int sub = lane / LPR, ve = (lane % LPR) * VE;
  // The staged tokens this chunk reads (the ``lengths[1]`` after the packed ones), quantised
  // once for the block into shared memory in the packed layout: both passes then read them as
  // they read packed tokens. (Rounded inside the passes instead, by the lanes whose keys were
  // staged while the warp's other lanes waited, and by shuffles across the value rows, they
  // took ~9 of a 4-bit decode call's ~26 us on an H100: ``docs/performance.md``, s45.)
  constexpr int WORDS = BITS == 0 ? 1 : D * BITS / 32, GROUPS = BITS == 0 ? 1 : D / GS;
  constexpr int STAGED = BITS == 0 ? 1 : MAX_STAGED;
  __shared__ uint32_t staged_codes[2][STAGED][WORDS];  // keys, then values
  __shared__ float staged_scales[2][STAGED][GROUPS], staged_biases[2][STAGED][GROUPS];
  if constexpr (BITS != 0) {
    // An item is one word's VE elements of a staged row; a group's GS / VE items are adjacent
    // lanes of a warp, which range the group together (every lane takes part in each round).
    const int s0 = max(start, Tp) - Tp, items = max(0, end - max(start, Tp)) * WORDS;
    for (int i0 = 0; i0 < items; i0 += blockDim.x) {
      const int i = i0 + threadIdx.x, w = i % WORDS;
      const int st = s0 + (i < items ? i / WORDS : 0);  // past the items, a row (not stored)
      for (int kv = 0; kv < 2; ++kv) {
        float x[VE];
        if (kv == 0)
          load_vec<T, S, 0, GS, VE>(krec + st * k_recent_strides[2], ksc, kbi, w * VE,
              k_recent_strides[3], 0, rvec, x);
        else
          load_vec<T, S, 0, GS, VE>(vrec + st * v_recent_strides[2], vsc, vbi, w * VE,
              v_recent_strides[3], 0, rvec, x);
        float lo = RANGE_LO, hi = RANGE_HI;
        widen<VE>(x, lo, hi);
        for (int o = 1; o < GS / VE; o <<= 1) {
          lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
          hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        const Rounding r = rounding<S, BITS>(lo, hi);
        uint32_t word = 0;
        for (int j = 0; j < VE; ++j) word |= code<BITS>(r, x[j]) << (j * BITS);
        if (i < items) {
          staged_codes[kv][st][w] = word;
          if (w % (GS / VE) == 0) {
            staged_scales[kv][st][w * VE / GS] = r.stored_scale;
            staged_biases[kv][st][w * VE / GS] = r.stored_bias;
          }
        }
      }
    }
    if (items > 0) __syncthreads();  // block-uniform; float kernels and other chunks skip it
  }
  // The key rounds, compiled for vector loads of float rows and for element-wise ones
  // (``VEC``, a constant: no branch sits between a lane's loads, which can then overlap).
  auto rounds = [&](auto vec_flag) {
    constexpr bool VEC = decltype(vec_flag)::value;
    // Elements e0.. of key (kv 0) or value (kv 1) row t: packed below Tp, staged (coded in
    // shared memory above) from there (never with float keys: BITS == 0 leaves no branch
    // between a lane's loads).
    auto load_row = [&](int kv, int t, int e0, float* out) {
      if (BITS == 0 || t < Tp) {
        if (kv == 0)
          load_vec<KT, S, BITS, GS, VE>(krow + t * k_strides[2], ksc + t * k_scales_strides[2],
              kbi + t * k_biases_strides[2], e0, k_strides[3], k_scales_strides[3], VEC, out);
        else
          load_vec<KT, S, BITS, GS, VE>(vrow + t * v_strides[2], vsc + t * v_scales_strides[2],
              vbi + t * v_biases_strides[2], e0, v_strides[3], v_scales_strides[3], VEC, out);
      } else if constexpr (BITS != 0) {
        load_vec<uint32_t, float, BITS, GS, VE>(staged_codes[kv][t - Tp],
            staged_scales[kv][t - Tp], staged_biases[kv][t - Tp], e0, 1, 1, false, out);
      }
    };
    for (int t0 = start + warp * 32; t0 < end; t0 += WARPS * 32) {
      const int t = t0 + lane;  // this lane's key
      float d[R];
      for (int r = 0; r < R; ++r) d[r] = 0.f;
      if (t < end)
        key_scores<R, VE, D>(qs, 0, [&](int e0, float* out) { load_row(0, t, e0, out); }, d);
      round_weights(d, m, s, acc, ps[warp], lane, [&](int r) {
        bool use = t < end;
        if (use && mask_kind == 1) use = t <= Tk - L + rl[r];
        else if (use && mask_kind == 2)
          use = mask[at4(mask_shape, mask_strides, b, rh[r], rl[r], t)];
        return use;
      });
      __syncwarp();
      // KPL value rows per warp load, and UV such loads issued before any is used: the loads
      // overlap.
      const int n_keys = min(32, end - t0);
      constexpr int UV = 4;
      static_assert(32 % (KPL * UV) == 0, "whole batches of value rows");
#pragma unroll
      for (int b0 = 0; b0 < 32; b0 += KPL * UV) {
        float vr[UV][VE];
        // Rows past the chunk's end load its last row, weighted 0 (no branch between loads).
#pragma unroll
        for (int i = 0; i < UV; ++i)
          load_row(1, t0 + min(b0 + i * KPL + sub, n_keys - 1), ve, vr[i]);
#pragma unroll
        for (int i = 0; i < UV; ++i) {
          const int u = b0 + i * KPL + sub;
          if (u < n_keys) {
            for (int r = 0; r < R; ++r) {
              const float p = ps[warp][r][u];
              for (int j = 0; j < VE; ++j) acc[r][j] += p * vr[i][j];
            }
          }
        }
      }
      __syncwarp();
    }
  };
  with_flag(vec, rounds);
  for (int r = 0; r < R; ++r) {
    s[r] = warp_sum(s[r]);
    // The KPL lanes that share elements [ve, ve + VE) add up their rows' sums.
    for (int o = LPR; o < 32; o <<= 1)
      for (int j = 0; j < VE; ++j) acc[r][j] += __shfl_xor_sync(0xffffffffu, acc[r][j], o);
  }

  __shared__ float wm[WARPS][R], ws[WARPS][R], wacc[WARPS][R][D];
  for (int r = 0; r < R; ++r) {
    if (lane == 0) { wm[warp][r] = m[r]; ws[warp][r] = s[r]; }
    if (lane < LPR)
      for (int j = 0; j < VE; ++j) wacc[warp][r][ve + j] = acc[r][j];
  }
  __syncthreads();
  // Row r's output (sinks folded in) from its maximum, sum and element e's weighted sum.
  auto write_out = [&](int r, int e, float M, float tot, float a) {
    if (has_sinks) {
      const float sk = static_cast<float>(sinks[rh[r]]) * LOG2E;
      const float M2 = fmaxf(M, sk);
      const float f = exp2f(M - M2);  // 0 when no key was attended to
      a *= f; tot = tot * f + exp2f(sk - M2);
    }
    out[out_row(r) * D + e] = static_cast<T>(tot > 0.f ? a / tot : 0.f);
  };
  for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
    const int r = i / D, e = i % D;
    if (tile * R + r >= n_rows) continue;
    float M = NEG_INF;
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, wm[w][r]);
    float tot = 0.f, a = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      if (wm[w][r] == NEG_INF) continue;  // this warp saw no key the row may attend to
      const float f = exp2f(wm[w][r] - M);
      tot += ws[w][r] * f;
      a += wacc[w][r][e] * f;
    }
    if (n_chunks == 1) {
      write_out(r, e, M, tot, a);
    } else {  // this chunk's share: [row, chunk] holds D weighted sums, the maximum, the sum
      float* p = part + (out_row(r) * n_chunks + chunk) * (D + 2);
      p[e] = a;
      if (e == 0) { p[D] = M; p[D + 1] = tot; }
    }
  }
  if (n_chunks > 1)
    merge_chunks<R, D>(tickets, part, n_chunks, n_rows - tile * R, out_row, write_out);
}

// MLA's decode attention (``latent.absorbed_attention``): each head's one query, in two parts
// (``q`` [B, H, 1, C]: the no-rope half moved into the latent space; ``q_pe`` [B, H, 1, RD]),
// against its row's live latents (``k`` [B, 1, T, C], keys and values alike) and rope keys
// (``k_pe`` [B, 1, T, RD]): a score is ``scale * (q . k + q_pe . k_pe)``, the output [B, H, 1,
// C] the softmax-weighted latents. One launch in place of the five kernels of the composed form
// (two score products, their sum, the softmax, the weighted sum), three of them cuBLAS products
// whose shapes move on with the key count every step.
// One block per (row, tile of R heads, chunk of keys): every head shares the one latent head,
// so a block reads each latent once for R heads. As ``attention``: a key per lane for the
// scores (the queries in shared memory, scaled), online softmax per 32 keys; then the warp
// walks those 32 latents as values, a row per load, each lane its C / 32 elements (a row's
// loads coalesce), so no lane sums need merging. The warps' sums add up in shared memory in a
// fixed order, and chunks merge as ``attention``'s do. ``mask``: a boolean array broadcast to
// [B, H, 1, T] where ``flags[1]`` is 1; ``flags[0]``: the scale. Latents and rope keys are
// floats, or (``BITS``: 4 or 8) a quantised cache's packed rows in MLX's affine layout, with
// their scales and biases, dequantised in registers (``--kv-bits``).
template <typename T, typename KT, typename S, int C, int RD, int R, int BITS, int GS,
    int WARPS>
__device__ __forceinline__ void latent_attention(
    const T* q, const mlx::core::cu::Shape& q_shape, const mlx::core::cu::Strides& q_strides,
    const T* q_pe, const mlx::core::cu::Strides& q_pe_strides,
    const KT* k, const mlx::core::cu::Shape& k_shape, const mlx::core::cu::Strides& k_strides,
    const S* k_scales, const mlx::core::cu::Strides& k_scales_strides,
    const S* k_biases, const mlx::core::cu::Strides& k_biases_strides,
    const KT* k_pe, const mlx::core::cu::Strides& k_pe_strides,
    const S* pe_scales, const mlx::core::cu::Strides& pe_scales_strides,
    const S* pe_biases, const mlx::core::cu::Strides& pe_biases_strides,
    const bool* mask, const mlx::core::cu::Shape& mask_shape,
    const mlx::core::cu::Strides& mask_strides,
    const float* flags, const uint32_t* tickets, T* out, float* part) {
  // A load takes VE elements of a row: 16 bytes of floats, or one word of packed values.
  constexpr int VE = BITS == 0 ? 16 / sizeof(KT) : 32 / BITS, NV = C / 32, D = C + RD;
  static_assert(NV % VE == 0 && RD % VE == 0, "a lane's loads are whole vectors or words");
  constexpr float LOG2E = 1.4426950408889634f;
  const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
  const int chunk = blockIdx.x, n_chunks = gridDim.x;
  const int H = q_shape[1], Tk = k_shape[2], tiles = (H + R - 1) / R;
  const int tile = blockIdx.y % tiles, b = blockIdx.y / tiles;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float sc = flags[0] * LOG2E;
  const bool masked = flags[1] != 0.f;

  // Row r of the tile: head rh[r] (rows past H repeat the last head and write nothing).
  alignas(16) __shared__ float qs[R][D];  // read 16 bytes at a time (key_scores)
  __shared__ float ps[WARPS][R][32];
  int rh[R];
  float m[R], s[R], acc[R][NV];
  for (int r = 0; r < R; ++r) {
    rh[r] = min(tile * R + r, H - 1);
    for (int j = 0; j < NV; ++j) acc[r][j] = 0.f;
    m[r] = NEG_INF; s[r] = 0.f;
  }
  for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
    const int r = i / D, e = i % D;
    const T x = e < C ? q[b * q_strides[0] + rh[r] * q_strides[1] + e * q_strides[3]]
                      : q_pe[b * q_pe_strides[0] + rh[r] * q_pe_strides[1] + (e - C) * q_pe_strides[3]];
    qs[r][e] = static_cast<float>(x) * sc;
  }
  __syncthreads();
  const int per_chunk = (Tk + n_chunks - 1) / n_chunks;
  const int start = chunk * per_chunk, end = min(Tk, start + per_chunk);
  const KT* krow = k + b * k_strides[0];
  const KT* perow = k_pe + b * k_pe_strides[0];
  const S* ksc = k_scales + b * k_scales_strides[0];
  const S* kbi = k_biases + b * k_biases_strides[0];
  const S* pesc = pe_scales + b * pe_scales_strides[0];
  const S* pebi = pe_biases + b * pe_biases_strides[0];
  // Float rows, contiguous on 16-byte boundaries (every cache's): vector loads.
  const bool vec = BITS == 0 && k_strides[3] == 1 && k_pe_strides[3] == 1 &&
      k_strides[2] % VE == 0 && k_pe_strides[2] % VE == 0 &&
      (reinterpret_cast<uintptr_t>(krow) | reinterpret_cast<uintptr_t>(perow)) % 16 == 0;
  // The key rounds, compiled for vector loads of float rows and for element-wise ones
  // (``VEC``, a constant: no branch sits between a lane's loads, which can then overlap).
  auto rounds = [&](auto vec_flag) {
    constexpr bool VEC = decltype(vec_flag)::value;
    // Elements e0.. of latent (or rope key) row t, as floats (packed ones dequantised).
    auto load_latent = [&](int t, int e0, float* out) {
      load_vec<KT, S, BITS, GS, VE>(krow + t * k_strides[2], ksc + t * k_scales_strides[2],
          kbi + t * k_biases_strides[2], e0, k_strides[3], k_scales_strides[3], VEC, out);
    };
    auto load_rope = [&](int t, int e0, float* out) {
      load_vec<KT, S, BITS, GS, VE>(perow + t * k_pe_strides[2], pesc + t * pe_scales_strides[2],
          pebi + t * pe_biases_strides[2], e0, k_pe_strides[3], pe_scales_strides[3], VEC, out);
    };
    for (int t0 = start + warp * 32; t0 < end; t0 += WARPS * 32) {
      const int t = t0 + lane;  // this lane's key
      float d[R];
      for (int r = 0; r < R; ++r) d[r] = 0.f;
      if (t < end) {
        key_scores<R, VE, C>(qs, 0, [&](int e0, float* out) { load_latent(t, e0, out); }, d);
        key_scores<R, VE, RD>(qs, C, [&](int e0, float* out) { load_rope(t, e0, out); }, d);
      }
      round_weights(d, m, s, acc, ps[warp], lane, [&](int r) {
        bool use = t < end;
        if (use && masked) use = mask[at4(mask_shape, mask_strides, b, rh[r], 0, t)];
        return use;
      });
      __syncwarp();
      // The 32 latents as values: a row per load, this lane's NV elements of each; the loads of
      // UV rows (about 32 floats) issued before any is used.
      const int n_keys = min(32, end - t0);
      constexpr int UV = NV >= 32 ? 1 : 32 / NV;
      for (int u0 = 0; u0 < n_keys; u0 += UV) {
        float vr[UV][NV];
#pragma unroll
        for (int i = 0; i < UV; ++i)  // past the chunk's end, its last row (not used)
          for (int j = 0; j < NV; j += VE)
            load_latent(t0 + min(u0 + i, n_keys - 1), lane * NV + j, vr[i] + j);
#pragma unroll
        for (int i = 0; i < UV; ++i) {  // a row past the end has weight 0 (``ps``)
          for (int r = 0; r < R; ++r) {
            const float p = ps[warp][r][u0 + i];
            for (int j = 0; j < NV; ++j) acc[r][j] += p * vr[i][j];
          }
        }
      }
      __syncwarp();
    }
  };
  with_flag(vec, rounds);
  for (int r = 0; r < R; ++r) s[r] = warp_sum(s[r]);

  // The block's maximum and sum per row, then its weighted sums: each warp's rescaled to the
  // block's maximum and added in turn, warp 0 first (the same bits every run).
  __shared__ float wm[WARPS][R], ws[WARPS][R], wacc[R][C];
  if (lane == 0)
    for (int r = 0; r < R; ++r) { wm[warp][r] = m[r]; ws[warp][r] = s[r]; }
  __syncthreads();
  float M[R], tot[R];
  for (int r = 0; r < R; ++r) {
    M[r] = NEG_INF;
    for (int w = 0; w < WARPS; ++w) M[r] = fmaxf(M[r], wm[w][r]);
    tot[r] = 0.f;
    for (int w = 0; w < WARPS; ++w)  // a warp that saw no key the row may attend to adds 0
      if (wm[w][r] != NEG_INF) tot[r] += ws[w][r] * exp2f(wm[w][r] - M[r]);
  }
  for (int w = 0; w < WARPS; ++w) {
    if (warp == w) {
      for (int r = 0; r < R; ++r) {
        const float f = m[r] == NEG_INF ? 0.f : exp2f(m[r] - M[r]);
        for (int j = 0; j < NV; ++j)
          wacc[r][lane * NV + j] = (w == 0 ? 0.f : wacc[r][lane * NV + j]) + acc[r][j] * f;
      }
    }
    __syncthreads();
  }
  auto out_row = [&](int r) { return static_cast<long long>(b) * H + rh[r]; };
  auto write_out = [&](int r, int e, float, float total, float a) {
    out[out_row(r) * C + e] = static_cast<T>(total > 0.f ? a / total : 0.f);
  };
  const int rows = H - tile * R;  // the tile's rows that are heads
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int r = i / C, e = i % C;
    if (r >= rows) continue;
    if (n_chunks == 1) {
      write_out(r, e, M[r], tot[r], wacc[r][e]);
    } else {  // this chunk's share: [row, chunk] holds C weighted sums, the maximum, the sum
      float* p = part + (out_row(r) * n_chunks + chunk) * (C + 2);
      p[e] = wacc[r][e];
      if (e == 0) { p[C] = M[r]; p[C + 1] = tot[r]; }
    }
  }
  if (n_chunks > 1) merge_chunks<R, C>(tickets, part, n_chunks, rows, out_row, write_out);
}

}  // namespace mlxc
