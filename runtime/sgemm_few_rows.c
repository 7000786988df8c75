/* cblas_sgemm for MLX's CPU backend that computes products of up to FEW_ROWS rows (or columns)
 * with the BLAS's cblas_sgemv, one call a row, and every other product with its cblas_sgemm.
 *
 * Why: MLX computes every float32 matmul with cblas_sgemm, and OpenBLAS's sgemm packs the whole
 * right-hand matrix into panels even for one row, so a decode step's x[1, K] @ W^T reads and
 * writes each weight about three times. On a 2-core AMD EPYC (OpenBLAS 0.3.21) a 2048 x 8192
 * product of one row took 3.4 ms through sgemm against 1.3 ms through sgemv, and 4 rows 6.6 ms
 * against 5.2 ms as 4 sgemv calls (a weight that fits the cache: 2-3x faster up to 9 rows; 5 rows
 * of a 32000 x 1024 weight, 13.1 against 12.7 ms, is where sgemm starts to win).
 * runtime/blas.py compiles this file, binds it to the BLAS it loads (mlxc_sgemm_few_rows_bind)
 * and loads it globally ahead of that BLAS, so libmlx.so's cblas_sgemm resolves here. */
#include <dlfcn.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };
enum { FEW_ROWS = 4 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;

/* Takes the dlopen handle of the BLAS; 1 when it has both functions. */
int mlxc_sgemm_few_rows_bind(void *blas) {
  blas_sgemm = (sgemm_fn)dlsym(blas, "cblas_sgemm");
  blas_sgemv = (sgemv_fn)dlsym(blas, "cblas_sgemv");
  return blas_sgemm != NULL && blas_sgemv != NULL;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  if (order == COL_MAJOR) { /* the same memory as row-major C^T = op(B)^T op(A)^T */
    cblas_sgemm(ROW_MAJOR, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
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
