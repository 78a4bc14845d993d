/* Fused CPU kernels for the ConvLSTM cell of tmcore's torch backend.
 *
 * One translation unit: the shared math and helpers are here, the kernels in one
 * file per family (depthwise.inc, read.inc, gates.inc, local.inc), included below
 * once per dtype (suffix _f32 / _f64). All work on contiguous row-major arrays,
 * called through ctypes (tmcore.backends.native.calls) or as XLA FFI targets
 * (jax_ffi.cc). The cell's four entries:
 *
 *   dw_fwd   x (B,Cin,P) -> y (B,Cin,P): the n depthwise 3-tap passes (one per
 *            spatial axis, zero padded, bias after each pass) of one plane at a
 *            time, so the intermediate stages never leave the cache.
 *   dw_bwd   x, dy -> dx, dtaps (n,Cin,3), dbias (n,Cin): recomputes the stages
 *            of each plane, then runs the passes backwards.
 *   gates_fwd z (B,4C,P), c (B,C,P) -> h', c' (i, f, o, g quarters of z).
 *   gates_bwd z, c, g_h, g_c -> dz (B,4C,P), dc: recomputes the gates.
 *
 * and, for the torch backend's fused CPU scan, entries that read and write the
 * halves of concat([x, h]) where they lie (no concatenated copy) and add the
 * parameter gradients of a step into float64 accumulators:
 *
 *   dw2_fwd  input channels [0, Ca) from xa, the rest from xb, each part with its
 *            own batch stride (elements); otherwise dw_fwd.
 *   dw2_bwd  the same split for x and for dx; the tap / bias gradients are ADDED
 *            to acc_taps (n,Cin,3) / acc_bias (n,Cin) (float64).
 *   read_fwd one n-linear read per batch element (grid_sample bilinear, border
 *            padding, align_corners: the 2^n corners of the cell it falls in), h
 *            (B,C,P), coords (B,n) and out (B,C) at given batch strides.
 *   read_bwd its VJP: ADDS g x weight to dh (B,C,P) and writes dcoords (B,n)
 *            (zero at and beyond the border, right-sided at interior integers; a
 *            NaN coordinate makes its read, coordinate gradient and the whole dh
 *            of its batch element NaN, as the torch fast path does).
 *   gates2_fwd / gates2_bwd  gates_fwd / gates_bwd with the pointwise bias zb (4C)
 *            added to z in the kernel (NULL: none); gates2_bwd adds the bias
 *            gradient sum_{b,p} dz to acc_zb (4C, float64; NULL: not wanted).
 *
 * and the box kernels of the fused CPU local scan (local.inc), and
 *
 *   step_fwd one step of the dense scan in one call (small grids' steps): the read of h
 *            (row b at reads + b * rds),
 *            the Gaussian write (the generic splat's operations, exp from libm), the
 *            depthwise passes, the pointwise product and the gates -> h', c'; rows
 *            with reset[b] start from zeros, rows with active[b] == 0 keep the state
 *            they entered with (masks: uint8 or NULL); h_saved / c_saved (or NULL)
 *            get the entering state (the scan's checkpoint).
 *
 * and, for the torch module's decode token (token.inc),
 *
 *   token_fwd one token of every row (each at its own slot of its chunk) in one call:
 *            the norm (LayerNorm or none), the token joining its chunk, the read where a
 *            row's chunk starts, the heads and step_fwd (the other rows inactive) where
 *            one completes, the read-out and the gated residual; arguments passed as
 *            arrays (in, out, sizes, scalars).
 *
 * Every entry returns 0, or TM_ENOMEM when a scratch allocation failed (the
 * outputs are then undefined; the caller raises MemoryError). Callers check
 * shapes and contiguity before calling: the kernels trust them.
 *
 * The pointwise 2C -> 4C matrix product stays in torch (BLAS), between dw and
 * gates. Operation order follows the torch path (bias + t1 x, then + t0 x[-1],
 * then + t2 x[+1]) so both round alike. float32 gates use a polynomial exp
 * that vectorizes (about 2 ulp) and takes each gate as a fraction (numerator /
 * denominator, e = exp(-|x|) so nothing overflows), so that a step needs two divisions
 * instead of five; float64 uses libm and the plain formulas. NaN propagates.
 *
 * Threads: OpenMP. Loaded after torch, the soname libgomp.so.1 resolves to the
 * copy torch already holds, so both share one thread pool.
 */
#ifndef TM_TEMPLATE
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

#define TM_ENOMEM 1

/* malloc(count * size), or NULL when the product overflows size_t or a
 * count is negative (so that a huge grid fails cleanly instead of wrapping). */
static void *tm_alloc(i64 count, size_t size) {
    if (count < 0 || (size != 0 && (uint64_t)count > SIZE_MAX / size)) return NULL;
    return malloc(count == 0 ? 1 : (size_t)count * size); /* never NULL for 0 */
}

/* ------------------------------------------------------------------ math -- */

/* exp for float32 by range reduction x = k ln2 + r, |r| <= ln2/2, and a
 * degree-6 polynomial for exp(r) (the classic single-precision minimax fit);
 * 2^k is built in the exponent bits. Branch-free so loops vectorize. xc must
 * lie in the float32 range (the callers clamp it). */
static inline float exp_core_f32(float xc) {
    float k = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* exp_core_f32 of x clamped to the float32 range; beyond it +inf / 0 as libm gives,
 * so sigmoid(-inf) is exactly 0 (not the 2.9e-39 of the clamped polynomial), like
 * torch's. */
static inline float exp_f32(float x) {
    float big = 88.3762626647949f, small = -87.3365447504f;
    float xc = x > big ? big : x;          /* NaN fails both tests and stays NaN */
    xc = xc < small ? small : xc;
    float result = exp_core_f32(xc);
    result = x > 88.7228394f ? INFINITY : result;  /* NaN: both tests false, stays NaN */
    return x < small ? 0.0f : result;
}

static inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

/* tanh: odd polynomial below 0.625 (no cancellation near 0: tanh_small_f32), else
 * 1 - 2 / (exp(2|x|) + 1) with the sign restored. */
static inline float tanh_small_f32(float x) {
    float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    return x + x * z * p;
}

static inline float tanh_f32(float x) {
    float a = fabsf(x);
    float small = tanh_small_f32(x);
    float large = 1.0f - 2.0f / (exp_f32(2.0f * a) + 1.0f);
    large = copysignf(large, x);
    return a < 0.625f ? small : large;      /* NaN: a < 0.625 false, large is NaN */
}

static inline double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }
static inline double tanh_f64(double x) { return tanh(x); }

/* ----------------------------------------------------------------- helpers -- */

/* Called by every thread of a parallel region right after allocating its scratch
 * buffer: flags a failed allocation, waits for the whole team, and returns whether any
 * thread failed, so that all threads skip the work together (the caller then returns
 * TM_ENOMEM). The barrier is orphaned, which OpenMP allows; without OpenMP the pragmas
 * are ignored and this is a NULL check. */
static int tm_team_alloc_failed(const void *scratch, int *failed) {
    if (scratch == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp barrier
    int any;
#pragma omp atomic read
    any = *failed;
    return any;
}

static void plane_geometry(const i64 *shape, int n, i64 *P, i64 *strides) {
    i64 s = 1;
    for (int a = n - 1; a >= 0; --a) { strides[a] = s; s *= shape[a]; }
    *P = s;
}

/* exp(x) for x <= 0 (NaN stays NaN): exp_f32 without the overflow side. */
static inline float expneg_f32(float x) {
    float small = -87.3365447504f;
    float xc = x < small ? small : x;
    float result = exp_core_f32(xc);
    return x < small ? 0.0f : result;
}

/* sigmoid(x) = num / den with e = exp(-|x|) in [0, 1]: no overflow, den in [1, 2]. */
static inline void sigmoid_nd_f32(float x, float *num, float *den) {
    float e = expneg_f32(-fabsf(x));
    *num = x >= 0.0f ? 1.0f : e;  /* NaN: e is NaN */
    *den = 1.0f + e;
}

/* tanh(x) = num / den: the odd polynomial of tanh_f32 below 0.625 (den 1), else
 * sign(x) (1 - e) / (1 + e) with e = exp(-2|x|). */
static inline void tanh_nd_f32(float x, float *num, float *den) {
    float a = fabsf(x);
    float small = tanh_small_f32(x);
    float e = expneg_f32(-2.0f * a);
    int near0 = a < 0.625f;  /* NaN: false, and the large form is NaN */
    *num = near0 ? small : copysignf(1.0f - e, x);
    *den = near0 ? 1.0f : 1.0f + e;
}

/* ------------------------------------------------ local-scan box helpers -- */

#define TM_EINDEX 2

/* Whether every box of `size` at start (B, n) (NULL: 0) lies inside `shape`. */
static int tm_boxes_fit(const i64 *start, i64 B, int n, const i64 *shape, const i64 *size) {
    for (int a = 0; a < n; ++a)
        if (size[a] < 0 || shape[a] < 0 || size[a] > shape[a]) return 0;
    if (start == NULL) return 1;
    for (i64 b = 0; b < B; ++b)
        for (int a = 0; a < n; ++a) {
            i64 s = start[b * n + a];
            if (s < 0 || s > shape[a] - size[a]) return 0;
        }
    return 1;
}

/* shape / start padded in front to 4 axes (size 1, start 0); row-major strides. */
static void tm_pad4(int n, const i64 *v, i64 fill, i64 *out) {
    for (int a = 0; a < 4; ++a) out[a] = a < 4 - n ? fill : v[a - (4 - n)];
}

static void tm_strides4(const i64 *shape4, i64 *strides4, i64 *cells) {
    i64 s = 1;
    for (int a = 3; a >= 0; --a) { strides4[a] = s; s *= shape4[a]; }
    *cells = s;
}

/* ------------------------------------------------------------- the kernels -- */

#define TM_TEMPLATE
#define T float
#define NAME(x) x##_f32
#define SIGMOID sigmoid_f32
#define TANH tanh_f32
#define TM_FRACTION_GATES
#include __FILE__
#undef T
#undef NAME
#undef SIGMOID
#undef TANH
#undef TM_FRACTION_GATES
#define T double
#define NAME(x) x##_f64
#define SIGMOID sigmoid_f64
#define TANH tanh_f64
#include __FILE__

#else /* TM_TEMPLATE: the kernels, once per dtype T */
#include "depthwise.inc"
#include "read.inc"
#include "gates.inc"
#include "local.inc"
#include "step.inc"
#include "token.inc"
#endif /* TM_TEMPLATE */
