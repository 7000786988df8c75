/* cblas_sgemm for MLX's CPU backend that sends products of one row (or one column) to the
 * BLAS's cblas_sgemv, and every other product to its cblas_sgemm.
 *
 * Why: MLX computes every float32 matmul with cblas_sgemm, and OpenBLAS's sgemm packs the whole
 * right-hand matrix into panels even for one row, so a decode step's x[1, K] @ W^T reads and
 * writes each weight about three times: on a 2-core AMD EPYC a 2048 x 8192 product took 3.4 ms
 * through sgemm against 1.3 ms through sgemv. runtime/blas.py compiles this file, binds it to
 * the BLAS it loads (mlxc_sgemm_one_row_bind) and loads it globally ahead of that BLAS, so
 * libmlx.so's cblas_sgemm resolves here. */
#include <dlfcn.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;

/* Takes the dlopen handle of the BLAS; 1 when it has both functions. */
int mlxc_sgemm_one_row_bind(void *blas) {
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
  if (k > 0 && m == 1) { /* c[0, :] = alpha op(B)^T op(A)[0, :] + beta c[0, :] */
    int incx = ta == NO_TRANS ? 1 : lda;
    if (tb == NO_TRANS) /* B is K x N */
      blas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    else /* B is N x K */
      blas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    return;
  }
  if (k > 0 && n == 1) { /* c[:, 0] = alpha op(A) op(B)[:, 0] + beta c[:, 0] */
    int incx = tb == NO_TRANS ? ldb : 1;
    if (ta == NO_TRANS) /* A is M x K */
      blas_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, incx, beta, c, ldc);
    else /* A is K x M */
      blas_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, incx, beta, c, ldc);
    return;
  }
  blas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
