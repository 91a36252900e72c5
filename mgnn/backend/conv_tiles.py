"""Register-blocked SIMD tiles of the Numba convolution core, written as LLVM IR.

A convolution on mgnn's flat padded layout (see the conv section of :mod:`numba_cpu`) is, per
output channel c and run position j,

    z[c, j] = sum over input channels i and taps t of  w[c, i, t] * xp[i, offs[t] + j],

and its kernel gradient is g[t, c, i] = sum_j s[c, j] xp[i, offs[t] + j]. Both are dense
products whose operands are unit-stride runs shifted by the tap offsets, so they need no im2col
copy and no BLAS: a tile keeps an MR x NV block of SIMD accumulators in registers (MR output
channels times NV vectors of VL run positions), and each (i, t) costs NV vector loads, MR
broadcasts and MR NV fused multiply-adds. LLVM does not find this blocking in a loop nest (it
vectorises the innermost loop and keeps the accumulators in memory), so the tiles are Numba
intrinsics that emit the vector code directly: `<VL x float>` accumulators (promoted to
registers), `llvm.fma`, unaligned vector loads. The width follows the host: 32-byte vectors
(AVX2, 16 registers: MR 4, NV 3) or 64-byte (AVX-512, 32 registers: MR 8, NV 3).

Each tile sums in one fixed order (i, then t, one accumulator per lane; the kernel gradient's
lanes added by a fixed halving tree at the end), so its results do not depend on threads or
on which path called it. Arrays are flat (1-D, C-contiguous) and addressed by element offsets;
a tile reads whole vectors, so its callers give the operands slack (see :data:`BLK`).
"""
import llvmlite.binding as _llb
import numba
from llvmlite import ir
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

#: bytes of a SIMD register on this host (what Numba compiles for)
VBYTES = 64 if "+avx512f" in _llb.get_host_cpu_features().flatten().split(",") else 32
#: output channels (rows) per tile
MR = 8 if VBYTES == 64 else 4
#: vectors of run positions per tile (forward / input vjp) or taps per tile (kernel gradient)
NV = 3


def vl(dtype):
    """Elements of ``dtype`` (a NumPy dtype) in one SIMD vector."""
    return VBYTES // dtype.itemsize


def blk(dtype):
    """Run positions one forward tile covers: callers round run lengths up to it and give
    every operand read at a run position that much slack."""
    return NV * vl(dtype)


def _flat(ty, what):
    if not (isinstance(ty, numba.types.Array) and ty.ndim == 1 and ty.layout == "C"
            and ty.dtype in (numba.types.float32, numba.types.float64)):
        raise TypingError(f"{what} must be a 1-D C-contiguous float32/float64 array, got {ty}")


def _lower_args(context, builder, signature, args):
    """An intrinsic's arguments as LLVM values: arrays as their data pointers, integers
    (literal or not) as i64."""
    out = []
    for v, t in zip(args, signature.args):
        if isinstance(t, numba.types.Array):
            out.append(context.make_array(t)(context, builder, v).data)
        else:
            out.append(context.cast(builder, v, t, numba.types.int64))
    return out


def _vec_type(context, dtype):
    return ir.VectorType(context.get_value_type(dtype), VBYTES // (dtype.bitwidth // 8))


def _i64(v):
    return ir.Constant(ir.IntType(64), v)


def _vload(builder, base_ptr, index, vt, align):
    p = builder.gep(base_ptr, [index])
    return builder.load(builder.bitcast(p, vt.as_pointer()), align=align)


def _fma(builder, vt):
    name = "llvm.fma.v%d%s" % (vt.count, "f32" if vt.element == ir.FloatType() else "f64")
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt] * 3), name)


def _lane_sum(builder, v):
    """The sum of the lanes of vector ``v`` by a fixed tree: the upper half added to the lower
    half until one lane is left (log2 VL shuffles and vector adds instead of VL - 1 scalar
    extracts and adds, the kernel gradient's cost at small images). A fixed order: the same
    bits on every call."""
    n = v.type.count
    if n & (n - 1):
        raise ValueError(f"_lane_sum needs a power-of-two vector width, got {n} lanes")
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                    ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(n))))
        hi = builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                    ir.Constant(ir.VectorType(ir.IntType(32), n),
                                                list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


def _zeroed(builder, vt, n):
    """n allocas of vt set to zero (in the entry block: mem2reg keeps them in registers)."""
    zero = ir.Constant(vt, [vt.element(0)] * vt.count)
    return [cgutils.alloca_once_value(builder, zero) for _ in range(n)]


@intrinsic(prefer_literal=True)
def conv_tile(typingctx, z, zo, ldz, nz, xp, xo, ldx, w, wo, offs, ntap, nci):
    """z[zo + r ldz + j] = sum_{i < nci, t < ntap} w[wo + (i ntap + t) MR + r]
    xp[xo + i ldx + offs[t] + j] for rows r < min(MR, nz) and j < NV VL (rows MR > r >= nz
    are computed and not stored: their weights should be zero or finite).

    z, xp, w : 1-D C-contiguous arrays of one float dtype; offs : 1-D int64 tap offsets;
    zo, ldz, nz, xo, ldx, wo, ntap, nci : int64. Reads xp[xo + i ldx + offs[t] : + NV VL]."""
    for a, what in ((z, "z"), (xp, "xp"), (w, "w")):
        _flat(a, what)
    if not (z.dtype == xp.dtype == w.dtype):
        raise TypingError(f"conv_tile: dtypes differ ({z.dtype}, {xp.dtype}, {w.dtype})")
    sig = numba.types.none(z, zo, ldz, nz, xp, xo, ldx, w, wo, offs, ntap, nci)
    dt = z.dtype

    def codegen(context, builder, signature, args):
        zp, zo_, ldz_, nz_, xpp, xo_, ldx_, wp, wo_, op, ntap_, nci_ = _lower_args(
            context, builder, signature, args)
        vt = _vec_type(context, dt)
        align = dt.bitwidth // 8
        fma = _fma(builder, vt)
        accs = _zeroed(builder, vt, MR * NV)
        splat = ir.Constant(ir.VectorType(ir.IntType(32), vt.count), [0] * vt.count)
        with cgutils.for_range(builder, nci_) as li:
            xrow = builder.add(xo_, builder.mul(li.index, ldx_))
            wrow = builder.mul(li.index, ntap_)
            with cgutils.for_range(builder, ntap_) as lt:
                base = builder.add(xrow, builder.load(builder.gep(op, [lt.index])))
                xs = [_vload(builder, xpp, builder.add(base, _i64(v * vt.count)), vt, align)
                      for v in range(NV)]
                wb = builder.add(wo_, builder.mul(builder.add(wrow, lt.index), _i64(MR)))
                for r in range(MR):
                    ws = builder.load(builder.gep(wp, [builder.add(wb, _i64(r))]))
                    wv = builder.insert_element(ir.Constant(vt, ir.Undefined), ws,
                                                ir.Constant(ir.IntType(32), 0))
                    wv = builder.shuffle_vector(wv, ir.Constant(vt, ir.Undefined), splat)
                    for v in range(NV):
                        a = accs[r * NV + v]
                        builder.store(builder.call(fma, [wv, xs[v], builder.load(a)]), a)
        for r in range(MR):
            with builder.if_then(builder.icmp_signed(">", nz_, _i64(r)), likely=True):
                row = builder.add(zo_, builder.mul(_i64(r), ldz_))
                for v in range(NV):
                    p = builder.gep(zp, [builder.add(row, _i64(v * vt.count))])
                    builder.store(builder.load(accs[r * NV + v]),
                                  builder.bitcast(p, vt.as_pointer()), align=align)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic(prefer_literal=True)
def kgrad_tile(typingctx, g, go, ldr, ldq, nr, nq, s, so, lds, xp, xo, offs, t0, n):
    """g[go + r ldr + q ldq] = sum_{j < n} s[so + r' lds + j] xp[xo + offs[t0 + q] + j] for
    r < min(MR, nr), q < min(NV, nq) (r' = min(r, nr - 1): rows past nr read the last one and
    are not stored; taps past nq read tap t0); n a multiple of VL. The per-lane partial sums
    are added at the end by a fixed tree (:func:`_lane_sum`).

    g, s, xp : 1-D C-contiguous arrays of one float dtype; offs : 1-D int64 tap offsets; the
    rest int64."""
    for a, what in ((g, "g"), (s, "s"), (xp, "xp")):
        _flat(a, what)
    if not (g.dtype == s.dtype == xp.dtype):
        raise TypingError(f"kgrad_tile: dtypes differ ({g.dtype}, {s.dtype}, {xp.dtype})")
    sig = numba.types.none(g, go, ldr, ldq, nr, nq, s, so, lds, xp, xo, offs, t0, n)
    dt = g.dtype

    def codegen(context, builder, signature, args):
        gp, go_, ldr_, ldq_, nr_, nq_, sp, so_, lds_, xpp, xo_, op, t0_, n_ = _lower_args(
            context, builder, signature, args)
        vt = _vec_type(context, dt)
        align = dt.bitwidth // 8
        fma = _fma(builder, vt)
        accs = _zeroed(builder, vt, MR * NV)
        last_r = builder.sub(nr_, _i64(1))
        srow = []
        for r in range(MR):
            rr = builder.select(builder.icmp_signed(">", nr_, _i64(r)), _i64(r), last_r)
            srow.append(builder.add(so_, builder.mul(rr, lds_)))
        xbase = []
        for q in range(NV):
            qq = builder.select(builder.icmp_signed(">", nq_, _i64(q)), _i64(q), _i64(0))
            off = builder.load(builder.gep(op, [builder.add(t0_, qq)]))
            xbase.append(builder.add(xo_, off))
        nvec = builder.sdiv(n_, _i64(vt.count))
        with cgutils.for_range(builder, nvec) as lj:
            j = builder.mul(lj.index, _i64(vt.count))
            xs = [_vload(builder, xpp, builder.add(xbase[q], j), vt, align) for q in range(NV)]
            for r in range(MR):
                sv = _vload(builder, sp, builder.add(srow[r], j), vt, align)
                for q in range(NV):
                    a = accs[r * NV + q]
                    builder.store(builder.call(fma, [sv, xs[q], builder.load(a)]), a)
        for r in range(MR):
            with builder.if_then(builder.icmp_signed(">", nr_, _i64(r)), likely=True):
                for q in range(NV):
                    with builder.if_then(builder.icmp_signed(">", nq_, _i64(q)), likely=True):
                        total = _lane_sum(builder, builder.load(accs[r * NV + q]))
                        idx = builder.add(go_, builder.add(builder.mul(_i64(r), ldr_),
                                                           builder.mul(_i64(q), ldq_)))
                        builder.store(total, builder.gep(gp, [idx]))
        return context.get_dummy_value()
    return sig, codegen
