/* cblas_sgemm for MLX's CPU backend: products of few rows without OpenBLAS's GEMM.
 *
 * MLX computes every float32 matmul with cblas_sgemm, and OpenBLAS's sgemm packs the whole
 * right-hand matrix into panels before it multiplies, even for one row: a decode step's
 * x[1, K] @ W^T reads and writes each weight about three times. On a 2-core AMD EPYC
 * (OpenBLAS 0.3.21) a 2048 x 8192 product of one row took 3.4 ms through sgemm against 1.3 ms
 * through sgemv. So, by the number of rows M of a row-major product (a column-major one is the
 * same memory as its transpose, row-major):
 *   - M = 1 (or one column): the BLAS's cblas_sgemv;
 *   - 2 <= M <= AVX512_ROWS (AVX2_ROWS on a CPU with AVX2 and FMA but no AVX-512), x @ W^T
 *     (what nn.Linear asks): `streamed`, which reads each weight row once for all M rows, over
 *     the cores (a verification, a decode batch of a few rows);
 *   - 2 <= M <= AXPY_ROWS of x @ B, B not transposed and of fewer than SMALL floats
 *     (attention's weights times its values), on AVX-512: `by_rows_of_b`, on the calling
 *     thread, which adds each row of B, scaled, to the sums of every row of x;
 *   - otherwise up to FEW_ROWS rows or columns: one cblas_sgemv a row or column;
 *   - everything else: the BLAS's cblas_sgemm.
 * runtime/blas.py compiles this file, binds it to the BLAS it loads (mlxc_sgemm_few_rows_bind)
 * and loads it globally ahead of that BLAS, so libmlx.so's cblas_sgemm resolves here. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };
/* AVX512_ROWS, AVX2_ROWS: up to these, `streamed` was faster than OpenBLAS's sgemm on
 * 2048 x 8192 weights (the AVX-512 kernel against its SkylakeX kernels at 32 rows: 4.3 ms
 * against 5.1, 64 rows 6.9 against 6.7; the AVX2 kernel against its Haswell ones at 24 rows:
 * 6.8 against 8.8, 32 rows 9.3 against 7.6).
 * SMALL: a product of fewer weight floats runs on the calling thread alone; waking a helper
 * costs more than it saves (9 rows by attention's 640 x 64 keys: 23 us on two threads, 16 on
 * one; by a 1024 x 256 weight: 79 against 45).
 * AXPY_ROWS: up to these, x @ B of fewer than SMALL floats of B goes by rows of B on one
 * thread (`by_rows_of_b`); against OpenBLAS's sgemm on two, by 4 x 2,048 x 64 values: 4 rows
 * 60-88 us against 112-117, 64 rows 297-330 against 335-338, 512 rows 2.1-2.2 ms against
 * 2.5-2.6; by 4 x 640 x 64: 4-36 rows 0.9-1x, 64 rows 1.1-1.3x, 512 rows 0.9x the time.
 * GROUP: rows of x a kernel takes at once; BLOCK: the most weight rows it takes. */
enum { FEW_ROWS = 4, AVX512_ROWS = 32, AVX2_ROWS = 24, AXPY_ROWS = 512, SMALL = 1 << 19 };
enum { GROUP = 6, BLOCK = 4, MAX_THREADS = 16 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;
enum { NONE, AVX2, AVX512 }; /* the kernels the CPU can run */
static int isa;

#if defined(__x86_64__)
#include <immintrin.h>

/* Each kernel computes out[i][c] = x[i, :] . w[c][:] for GM <= GROUP rows of x and a block of
 * weight rows: each vector of a weight row is loaded once for every row of x, the sums kept in
 * registers (GM x the block's accumulators). The same columns of the next block's rows,
 * `ahead` floats on, are prefetched: the hardware's prefetcher stops at each row's end (a
 * 4 KiB page at K = 1024). The small llama's 33 products by 9 rows took 24-25 ms without
 * that or with prefetching along the same rows, 19.7 with it. */
#define UNROLL _Pragma("GCC unroll 8")
/* A vector the kernel uses several times stays in a register: left to itself GCC folds one
 * used by up to three FMAs into each as a memory operand, a load per use. The AVX-512 kernel
 * for 2-3 rows of x then loaded each weight vector once a row, bound by its loads: 9 rows
 * (6 + 3) of four products of 2,048 x 8,192 and like weights took 9.5-10.3 ms against 7.5-7.8
 * with this, 8 rows 8.1-8.5 against 7.7; the AVX2 kernel loaded x twice, 9 / 12 / 16 rows
 * 10.8-11.5 / 13.7-14.3 / 19.3 ms against 8.2-8.4 / 10.2 / 14.0. */
#define IN_REGISTER(v) __asm__("" : "+v"(v))

/* AVX-512: four weight rows, 16 floats a step, the tail of a row masked. */
#define QUAD(GM)                                                                                 \
  __attribute__((target("avx512f"))) static void quad_##GM(                                      \
      int k, const float *x, int ldx, const float *const w[], size_t ahead,                      \
      float out[][BLOCK]) {                                                                      \
    __m512 a[GM][4], v[4];                                                                       \
    UNROLL for (int i = 0; i < GM; i++) UNROLL for (int c = 0; c < 4; c++) a[i][c] =             \
        _mm512_setzero_ps();                                                                     \
    int k16 = k & ~15;                                                                           \
    for (int p = 0; p < k16; p += 16) {                                                          \
      UNROLL for (int c = 0; c < 4; c++) {                                                       \
        v[c] = _mm512_loadu_ps(w[c] + p);                                                        \
        IN_REGISTER(v[c]);                                                                       \
        _mm_prefetch((const char *)(w[c] + ahead + p), _MM_HINT_T0);                             \
      }                                                                                          \
      UNROLL for (int i = 0; i < GM; i++) {                                                      \
        __m512 xv = _mm512_loadu_ps(x + (size_t)i * ldx + p);                                    \
        UNROLL for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(v[c], xv, a[i][c]);         \
      }                                                                                          \
    }                                                                                            \
    if (k16 < k) {                                                                               \
      __mmask16 tail = (__mmask16)((1u << (k - k16)) - 1);                                       \
      UNROLL for (int c = 0; c < 4; c++) v[c] = _mm512_maskz_loadu_ps(tail, w[c] + k16);         \
      UNROLL for (int i = 0; i < GM; i++) {                                                      \
        __m512 xv = _mm512_maskz_loadu_ps(tail, x + (size_t)i * ldx + k16);                      \
        UNROLL for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(v[c], xv, a[i][c]);         \
      }                                                                                          \
    }                                                                                            \
    UNROLL for (int i = 0; i < GM; i++) UNROLL for (int c = 0; c < 4; c++) out[i][c] =           \
        _mm512_reduce_add_ps(a[i][c]);                                                           \
  }

/* AVX2 and FMA: two weight rows, 8 floats a step, the tail of a row in scalars. */
#define PAIR(GM)                                                                                 \
  __attribute__((target("avx2,fma"))) static void pair_##GM(                                     \
      int k, const float *x, int ldx, const float *const w[], size_t ahead,                      \
      float out[][BLOCK]) {                                                                      \
    __m256 a[GM][2];                                                                             \
    UNROLL for (int i = 0; i < GM; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();                 \
    int k8 = k & ~7;                                                                             \
    for (int p = 0; p < k8; p += 8) {                                                            \
      __m256 v0 = _mm256_loadu_ps(w[0] + p), v1 = _mm256_loadu_ps(w[1] + p);                     \
      _mm_prefetch((const char *)(w[0] + ahead + p), _MM_HINT_T0);                               \
      _mm_prefetch((const char *)(w[1] + ahead + p), _MM_HINT_T0);                               \
      UNROLL for (int i = 0; i < GM; i++) {                                                      \
        __m256 xv = _mm256_loadu_ps(x + (size_t)i * ldx + p);                                    \
        IN_REGISTER(xv);                                                                         \
        a[i][0] = _mm256_fmadd_ps(v0, xv, a[i][0]);                                              \
        a[i][1] = _mm256_fmadd_ps(v1, xv, a[i][1]);                                              \
      }                                                                                          \
    }                                                                                            \
    UNROLL for (int i = 0; i < GM; i++) {                                                        \
      const float *xi = x + (size_t)i * ldx;                                                     \
      for (int c = 0; c < 2; c++) {                                                              \
        float s[8], t = 0.0f;                                                                    \
        _mm256_storeu_ps(s, a[i][c]);                                                            \
        for (int l = 0; l < 8; l++) t += s[l];                                                   \
        for (int p = k8; p < k; p++) t += w[c][p] * xi[p];                                       \
        out[i][c] = t;                                                                           \
      }                                                                                          \
    }                                                                                            \
  }

typedef void (*kernel_fn)(int, const float *, int, const float *const[], size_t,
                          float[][BLOCK]);
QUAD(1) QUAD(2) QUAD(3) QUAD(4) QUAD(5) QUAD(6)
PAIR(1) PAIR(2) PAIR(3) PAIR(4) PAIR(5) PAIR(6)
static const kernel_fn QUADS[GROUP + 1] = {NULL, quad_1, quad_2, quad_3, quad_4, quad_5, quad_6};
static const kernel_fn PAIRS[GROUP + 1] = {NULL, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6};

/* x @ B with B stored K x N, not transposed, for GM <= GROUP rows of x and WIDE columns of B
 * (four vectors, masked past `cols`): each step loads a row of B once and adds x[i, p] times it
 * to every row's sums, where OpenBLAS's sgemm packs B and wakes its threads (see AXPY_ROWS). */
enum { WIDE = 64 };
#define AXPY(GM)                                                                                 \
  __attribute__((target("avx512f"))) static void axpy_##GM(                                      \
      int k, const float *x, int ldx, const float *b, int ldb, int cols, float out[][WIDE]) {    \
    __m512 a[GM][4], v[4];                                                                       \
    __mmask16 mask[4];                                                                           \
    UNROLL for (int c = 0; c < 4; c++) {                                                         \
      int left = cols - 16 * c;                                                                  \
      mask[c] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;   \
    }                                                                                            \
    UNROLL for (int i = 0; i < GM; i++) UNROLL for (int c = 0; c < 4; c++) a[i][c] =             \
        _mm512_setzero_ps();                                                                     \
    for (int p = 0; p < k; p++) {                                                                \
      UNROLL for (int c = 0; c < 4; c++) {                                                       \
        v[c] = _mm512_maskz_loadu_ps(mask[c], b + (size_t)p * ldb + 16 * c);                     \
        IN_REGISTER(v[c]);                                                                       \
      }                                                                                          \
      UNROLL for (int i = 0; i < GM; i++) {                                                      \
        __m512 xv = _mm512_set1_ps(x[(size_t)i * ldx + p]);                                      \
        UNROLL for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(xv, v[c], a[i][c]);         \
      }                                                                                          \
    }                                                                                            \
    UNROLL for (int i = 0; i < GM; i++) UNROLL for (int c = 0; c < 4; c++)                       \
        _mm512_storeu_ps(out[i] + 16 * c, a[i][c]);                                              \
  }

typedef void (*axpy_fn)(int, const float *, int, const float *, int, int, float[][WIDE]);
AXPY(1) AXPY(2) AXPY(3) AXPY(4) AXPY(5) AXPY(6)
static const axpy_fn AXPYS[GROUP + 1] = {NULL, axpy_1, axpy_2, axpy_3, axpy_4, axpy_5, axpy_6};
#endif

/* A product y = alpha x @ w^T + beta y of m rows (w stored N x K, what nn.Linear asks). */
typedef struct {
  int m, k, ldx, ldw, ldy, n, parts;
  float alpha, beta;
  const float *x, *w;
  float *y;
} product;

/* y[i][c] = alpha out[i][c] + beta y[i][c] for `rows` x `cols` (a kernel's sums, `width` a row
 * in out). */
static void scaled_store(float *y, int ldy, float alpha, float beta, const float *out, int width,
                         int rows, int cols) {
  for (int i = 0; i < rows; i++) {
    float *yi = y + (size_t)i * ldy;
    for (int c = 0; c < cols; c++) /* gemm's beta = 0 never reads y */
      yi[c] = alpha * out[(size_t)i * width + c] + (beta == 0.0f ? 0.0f : beta * yi[c]);
  }
}

/* Rows g..g+gm of y, columns j..j+cols, from the kernel's out. */
static void store(const product *p, int g, int gm, int j, int cols, float out[][BLOCK]) {
  scaled_store(p->y + (size_t)g * p->ldy + j, p->ldy, p->alpha, p->beta, &out[0][0], BLOCK, gm,
               cols);
}

/* The product's columns n0 <= j < n1. */
static void columns(const product *p, int n0, int n1) {
#if defined(__x86_64__)
  float out[GROUP][BLOCK];
  const kernel_fn *kernels = isa == AVX512 ? QUADS : PAIRS;
  int width = isa == AVX512 ? 4 : 2; /* weight rows a kernel takes */
  for (int j = n0; j < n1; j += width) {
    size_t ahead = j + 2 * width <= n1 ? (size_t)width * p->ldw : 0; /* the next block */
    const float *w[BLOCK]; /* past n1, the last row again: computed, never stored */
    for (int c = 0; c < width; c++) w[c] = p->w + (size_t)(j + c < n1 ? j + c : n1 - 1) * p->ldw;
    for (int g = 0; g < p->m; g += GROUP) {
      int gm = p->m - g < GROUP ? p->m - g : GROUP;
      kernels[gm](p->k, p->x + (size_t)g * p->ldx, p->ldx, w, ahead, out);
      store(p, g, gm, j, n1 - j < width ? n1 - j : width, out);
    }
  }
#else
  (void)p, (void)n0, (void)n1;
#endif
}

static void part(const product *p, int index) {
  int per = ((p->n + p->parts - 1) / p->parts + BLOCK - 1) & ~(BLOCK - 1); /* whole blocks */
  int n0 = index * per, n1 = n0 + per < p->n ? n0 + per : p->n;
  if (n0 < n1) columns(p, n0, n1);
}

/* y = alpha x @ b + beta y, b stored k x n (row-major, not transposed), on the calling thread:
 * WIDE columns at a time, the rows in groups of at most GROUP shared out evenly. */
static void by_rows_of_b(int m, int n, int k, float alpha, const float *x, int ldx,
                         const float *b, int ldb, float beta, float *y, int ldy) {
#if defined(__x86_64__)
  float out[GROUP][WIDE];
  int groups = (m + GROUP - 1) / GROUP;
  for (int j = 0; j < n; j += WIDE) {
    int cols = n - j < WIDE ? n - j : WIDE;
    for (int g = 0, left = groups; left > 0; left--) {
      int gm = (m - g) / left;
      AXPYS[gm](k, x + (size_t)g * ldx, ldx, b + j, ldb, cols, out);
      scaled_store(y + (size_t)g * ldy + j, ldy, alpha, beta, &out[0][0], WIDE, gm, cols);
      g += gm;
    }
  }
#else
  (void)m, (void)n, (void)k, (void)alpha, (void)x, (void)ldx, (void)b, (void)ldb, (void)beta;
  (void)y, (void)ldy;
#endif
}

/* Helper threads, one per further core, started on first use. A product is split into one
 * part per thread; the caller runs the first. One product at a time: a caller finding the
 * pool busy (another MLX stream's product) runs its whole product itself. */
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, finished = PTHREAD_COND_INITIALIZER;
static product job;
static unsigned long generation;
static int pending, helpers = -1; /* -1: not started */

static void *helper(void *arg) {
  int index = (int)(intptr_t)arg;
  unsigned long seen = 0;
  pthread_mutex_lock(&lock);
  for (;;) {
    while (generation == seen) pthread_cond_wait(&wake, &lock);
    seen = generation;
    product p = job;
    pthread_mutex_unlock(&lock);
    part(&p, index);
    pthread_mutex_lock(&lock);
    if (--pending == 0) pthread_cond_signal(&finished);
  }
  return NULL;
}

/* In a child after fork() the helpers are gone: start again, unlocked, on first use. */
static void after_fork_in_child(void) {
  pthread_mutex_t unlocked = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t fresh = PTHREAD_COND_INITIALIZER;
  pool_busy = lock = unlocked;
  wake = finished = fresh;
  pending = 0, helpers = -1;
}

static void start_helpers(void) {
  cpu_set_t cpus;
  int cores = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  int want = (cores < MAX_THREADS ? cores : MAX_THREADS) - 1;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  helpers = 0;
  for (int i = 1; i <= want; i++) {
    pthread_t t;
    if (pthread_create(&t, &attr, helper, (void *)(intptr_t)i) != 0) break;
    helpers++;
  }
  pthread_attr_destroy(&attr);
}

static void streamed(product p) {
  if ((size_t)p.n * p.k < SMALL || pthread_mutex_trylock(&pool_busy) != 0) {
    p.parts = 1;
    part(&p, 0);
    return;
  }
  if (helpers < 0) start_helpers();
  p.parts = helpers + 1;
  if (helpers > 0) {
    pthread_mutex_lock(&lock);
    job = p, pending = helpers, generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
  }
  part(&p, 0);
  pthread_mutex_lock(&lock);
  while (pending > 0) pthread_cond_wait(&finished, &lock);
  pthread_mutex_unlock(&lock);
  pthread_mutex_unlock(&pool_busy);
}

/* Takes the dlopen handle of the BLAS and the widest kernel to use (AVX512; less in tests);
 * 1 when the BLAS has both functions. */
int mlxc_sgemm_few_rows_bind(void *blas, int widest) {
  blas_sgemm = (sgemm_fn)dlsym(blas, "cblas_sgemm");
  blas_sgemv = (sgemv_fn)dlsym(blas, "cblas_sgemv");
  isa = NONE;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = AVX2;
  if (__builtin_cpu_supports("avx512f")) isa = AVX512;
#endif
  if (isa > widest) isa = widest;
  static int registered;
  if (!registered++) pthread_atfork(NULL, NULL, after_fork_in_child);
  return blas_sgemm != NULL && blas_sgemv != NULL;
}

/* The kernel `streamed` uses: "avx512", "avx2" or "" (none: one sgemv a row). */
const char *mlxc_sgemm_few_rows_kernel(void) {
  return isa == AVX512 ? "avx512" : isa == AVX2 ? "avx2" : "";
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  if (order == COL_MAJOR) { /* the same memory as row-major C^T = op(B)^T op(A)^T */
    cblas_sgemm(ROW_MAJOR, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
    return;
  }
  int most = isa == AVX512 ? AVX512_ROWS : isa == AVX2 ? AVX2_ROWS : 0;
  if (k > 0 && m > 1 && m <= most && n > 1 && ta == NO_TRANS && tb == TRANS) {
    streamed((product){m, k, lda, ldb, ldc, n, 1, alpha, beta, a, b, c});
    return;
  }
  if (isa == AVX512 && k > 0 && m > 1 && m <= AXPY_ROWS && n > FEW_ROWS &&
      (size_t)n * k < SMALL && ta == NO_TRANS && tb == NO_TRANS) {
    by_rows_of_b(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (k > 0 && m <= FEW_ROWS) { /* row i of C = alpha op(B)^T op(A)[i, :] + beta C[i, :] */
    for (int i = 0; i < m; i++) {
      const float *x = ta == NO_TRANS ? a + (size_t)i * lda : a + i; /* op(A)[i, :] */
      int incx = ta == NO_TRANS ? 1 : lda;
      float *y = c + (size_t)i * ldc;
      if (tb == NO_TRANS) /* B is K x N */
        blas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, x, incx, beta, y, 1);
      else /* B is N x K */
        blas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, x, incx, beta, y, 1);
    }
    return;
  }
  if (k > 0 && n <= FEW_ROWS) { /* column j of C = alpha op(A) op(B)[:, j] + beta C[:, j] */
    for (int j = 0; j < n; j++) {
      const float *x = tb == NO_TRANS ? b + j : b + (size_t)j * ldb; /* op(B)[:, j] */
      int incx = tb == NO_TRANS ? ldb : 1;
      if (ta == NO_TRANS) /* A is M x K */
        blas_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, x, incx, beta, c + j, ldc);
      else /* A is K x M */
        blas_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, x, incx, beta, c + j, ldc);
    }
    return;
  }
  blas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
