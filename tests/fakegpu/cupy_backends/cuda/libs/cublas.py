"""A fake cuBLAS for the fake cupy (tests only): ``<t>gemmStridedBatched`` with cuBLAS's exact
column-major, raw-pointer contract, computed with NumPy on the host memory the pointers name, so
the GPU backend's cuBLAS argument mapping (operation flags, leading dimensions, batch strides,
zero and negative strides) is checked on a machine without a GPU."""
import ctypes

import numpy as np

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1
calls = []  # (name, m, n, k, batchCount) of every GEMM, for tests
_mode = {}


def getPointerMode(handle):
    return _mode.get(handle, CUBLAS_POINTER_MODE_HOST)


def setPointerMode(handle, mode):
    _mode[handle] = mode


def _matrix(ptr, rows, cols, ld, dtype):
    """The column-major rows x cols matrix at address ``ptr`` with leading dimension ld (a view
    of that memory)."""
    itemsize = np.dtype(dtype).itemsize
    n = (cols - 1) * ld + rows
    ctype = ctypes.c_float if np.dtype(dtype) == np.float32 else ctypes.c_double
    flat = np.ctypeslib.as_array((ctype * n).from_address(ptr))  # writable, no copy
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (itemsize, ld * itemsize))


def _gemm(dtype, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
          beta, C, ldc, strideC, batchCount):
    assert getPointerMode(handle) == CUBLAS_POINTER_MODE_HOST, "alpha/beta are host pointers"
    assert ldc >= m and lda >= (m if transa == CUBLAS_OP_N else k)
    assert ldb >= (k if transb == CUBLAS_OP_N else n)
    calls.append(("gemmStridedBatched", m, n, k, batchCount))
    itemsize = np.dtype(dtype).itemsize
    a0 = np.frombuffer((ctypes.c_char * itemsize).from_address(alpha), dtype)[0]
    b0 = np.frombuffer((ctypes.c_char * itemsize).from_address(beta), dtype)[0]
    import cupy  # the fake: under stream capture the GEMM runs at the graph's launches
    if cupy._capture is not None:  # (alpha and beta: host values, read at capture, as cuBLAS)
        cupy._capture.append(lambda: _run(dtype, transa, transb, m, n, k, a0, A, lda, strideA,
                                          B, ldb, strideB, b0, C, ldc, strideC, batchCount))
        return
    _run(dtype, transa, transb, m, n, k, a0, A, lda, strideA, B, ldb, strideB, b0, C, ldc,
         strideC, batchCount)


def _run(dtype, transa, transb, m, n, k, a0, A, lda, strideA, B, ldb, strideB, b0, C, ldc,
         strideC, batchCount):
    itemsize = np.dtype(dtype).itemsize
    for p in range(batchCount):
        a = _matrix(A + p * strideA * itemsize, *((m, k) if transa == CUBLAS_OP_N else (k, m)),
                    lda, dtype)
        b = _matrix(B + p * strideB * itemsize, *((k, n) if transb == CUBLAS_OP_N else (n, k)),
                    ldb, dtype)
        c = _matrix(C + p * strideC * itemsize, m, n, ldc, dtype)
        a = a if transa == CUBLAS_OP_N else a.T
        b = b if transb == CUBLAS_OP_N else b.T
        res = a0 * (a @ b) + (b0 * c if b0 != 0 else 0)
        c[...] = res


def sgemmStridedBatched(*args):
    _gemm(np.float32, *args)


def dgemmStridedBatched(*args):
    _gemm(np.float64, *args)
