/* cblas_sgemm for MLX's CPU backend: products of few rows without OpenBLAS's GEMM.
 *
 * MLX computes every float32 matmul with cblas_sgemm, and OpenBLAS's sgemm packs the whole
 * right-hand matrix into panels before it multiplies, even for one row: a decode step's
 * x[1, K] @ W^T reads and writes each weight about three times. On a 2-core AMD EPYC
 * (OpenBLAS 0.3.21) a 2048 x 8192 product of one row took 3.4 ms through sgemm against 1.3 ms
 * through sgemv. So, by the number of rows M of a row-major product (a column-major one is the
 * same memory as its transpose, row-major):
 *   - M = 1 (or one column): the BLAS's cblas_sgemv;
 *   - 2 <= M <= STREAM_ROWS, x @ W^T with AVX2 and FMA (what nn.Linear asks): `streamed`, which
 *     reads each weight row once for all M rows, over the cores (a verification, a decode
 *     batch of a few rows): 9 rows of an 8192 x 1024 weight took 3.4 ms on one thread, where
 *     OpenBLAS's sgemm took 3.6 on two;
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
/* STREAM_ROWS: the small llama's verification forward of 9 / 12 / 16 rows took 49 / 62 / 75 ms
 * streamed against 88 / 111 / 64 through OpenBLAS's sgemm, whose 16-row tiles fit. */
enum { FEW_ROWS = 4, STREAM_ROWS = 15, GROUP = 6, MAX_THREADS = 16 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;
static int can_stream; /* the CPU has AVX2 and FMA */

#if defined(__x86_64__)
#include <immintrin.h>

/* out[i][c] = x[i, :] . w_c[:] for GM <= GROUP rows of x and the two weight rows w0, w1: each
 * 8 floats of a weight row loaded once for every row of x, the sums kept in registers. */
#define PAIR(GM)                                                                               \
  __attribute__((target("avx2,fma"))) static void pair_##GM(                                  \
      int k, const float *x, int ldx, const float *w0, const float *w1, float out[][2]) {     \
    __m256 a0[GM], a1[GM];                                                                    \
    for (int i = 0; i < GM; i++) a0[i] = a1[i] = _mm256_setzero_ps();                         \
    int k8 = k & ~7;                                                                          \
    for (int p = 0; p < k8; p += 8) {                                                         \
      __m256 v0 = _mm256_loadu_ps(w0 + p), v1 = _mm256_loadu_ps(w1 + p);                      \
      for (int i = 0; i < GM; i++) {                                                          \
        __m256 xv = _mm256_loadu_ps(x + (size_t)i * ldx + p);                                 \
        a0[i] = _mm256_fmadd_ps(v0, xv, a0[i]);                                               \
        a1[i] = _mm256_fmadd_ps(v1, xv, a1[i]);                                               \
      }                                                                                       \
    }                                                                                         \
    for (int i = 0; i < GM; i++) {                                                            \
      float s0[8], s1[8], t0 = 0.0f, t1 = 0.0f;                                               \
      _mm256_storeu_ps(s0, a0[i]);                                                            \
      _mm256_storeu_ps(s1, a1[i]);                                                            \
      for (int l = 0; l < 8; l++) t0 += s0[l], t1 += s1[l];                                   \
      const float *xi = x + (size_t)i * ldx;                                                  \
      for (int p = k8; p < k; p++) t0 += w0[p] * xi[p], t1 += w1[p] * xi[p];                  \
      out[i][0] = t0, out[i][1] = t1;                                                         \
    }                                                                                         \
  }
PAIR(1) PAIR(2) PAIR(3) PAIR(4) PAIR(5) PAIR(6)
typedef void (*pair_fn)(int, const float *, int, const float *, const float *, float[][2]);
static const pair_fn PAIRS[GROUP + 1] = {NULL, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6};
#endif

/* A product's columns n0 <= j < n1: y[i, j] = alpha x[i, :] . w[j, :] + beta y[i, j]. */
typedef struct {
  int m, k, ldx, ldw, ldy, n, parts;
  float alpha, beta;
  const float *x, *w;
  float *y;
} product;

static void columns(const product *p, int n0, int n1) {
#if defined(__x86_64__)
  float out[GROUP][2];
  for (int j = n0; j < n1; j += 2) {
    const float *w0 = p->w + (size_t)j * p->ldw, *w1 = j + 1 < n1 ? w0 + p->ldw : w0;
    for (int g = 0; g < p->m; g += GROUP) {
      int gm = p->m - g < GROUP ? p->m - g : GROUP;
      PAIRS[gm](p->k, p->x + (size_t)g * p->ldx, p->ldx, w0, w1, out);
      for (int i = 0; i < gm; i++) {
        float *yi = p->y + (size_t)(g + i) * p->ldy + j;
        for (int c = 0; c < 2 && j + c < n1; c++)  /* gemm's beta = 0 never reads y */
          yi[c] = p->alpha * out[i][c] + (p->beta == 0.0f ? 0.0f : p->beta * yi[c]);
      }
    }
  }
#else
  (void)p, (void)n0, (void)n1;
#endif
}

static void part(const product *p, int index) {
  int per = ((p->n + p->parts - 1) / p->parts + 1) & ~1; /* whole pairs of weight rows */
  int n0 = index * per, n1 = n0 + per < p->n ? n0 + per : p->n;
  if (n0 < n1) columns(p, n0, n1);
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
  if (pthread_mutex_trylock(&pool_busy) != 0) {
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

/* Takes the dlopen handle of the BLAS; 1 when it has both functions. */
int mlxc_sgemm_few_rows_bind(void *blas) {
  blas_sgemm = (sgemm_fn)dlsym(blas, "cblas_sgemm");
  blas_sgemv = (sgemv_fn)dlsym(blas, "cblas_sgemv");
#if defined(__x86_64__)
  __builtin_cpu_init();
  can_stream = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  static int registered;
  if (!registered++) pthread_atfork(NULL, NULL, after_fork_in_child);
  return blas_sgemm != NULL && blas_sgemv != NULL;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  if (order == COL_MAJOR) { /* the same memory as row-major C^T = op(B)^T op(A)^T */
    cblas_sgemm(ROW_MAJOR, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
    return;
  }
  if (k > 0 && m > 1 && m <= STREAM_ROWS && n > 1 && ta == NO_TRANS && tb == TRANS &&
      can_stream) {
    streamed((product){m, k, lda, ldb, ldc, n, 1, alpha, beta, a, b, c});
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
