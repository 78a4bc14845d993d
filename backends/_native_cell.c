/* Fused CPU kernels for the ConvLSTM cell of tmcore's torch backend.
 *
 * Four entries per dtype (suffix _f32 / _f64; the second half of this file is
 * included twice, once per dtype), all on contiguous row-major
 * arrays, called through ctypes by backends/_native.py:
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
 * 2^k is built in the exponent bits. Branch-free so loops vectorize. Beyond
 * the float32 range it returns +inf / 0 as libm does, so sigmoid(-inf) is
 * exactly 0 (not the 2.9e-39 of the clamped polynomial), like torch's. */
static inline float exp_f32(float x) {
    float big = 88.3762626647949f, small = -87.3365447504f;
    float xc = x > big ? big : x;          /* NaN fails both tests and stays NaN */
    xc = xc < small ? small : xc;
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
    float result = p * scale;
    result = x > 88.7228394f ? INFINITY : result;  /* NaN: both tests false, stays NaN */
    return x < small ? 0.0f : result;
}

static inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

/* tanh: odd polynomial below 0.625 (no cancellation near 0), else
 * 1 - 2 / (exp(2|x|) + 1) with the sign restored. */
static inline float tanh_f32(float x) {
    float a = fabsf(x);
    float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    float small = x + x * z * p;
    float large = 1.0f - 2.0f / (exp_f32(2.0f * a) + 1.0f);
    large = copysignf(large, x);
    return a < 0.625f ? small : large;      /* NaN: a < 0.625 false, large is NaN */
}

static inline double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }
static inline double tanh_f64(double x) { return tanh(x); }

/* ------------------------------------------------------- depthwise passes -- */

/* Every pass works on one flat plane of P = prod(shape) values; along axis a the
 * neighbours of m are m -+ stride (stride = prod(shape[a+1:])), and
 * edges[(2a) P + m] / edges[(2a+1) P + m] say whether m has a left / right
 * neighbour on that axis. One flat loop per pass vectorizes whatever the axis
 * length; the first and last `stride` values are looped apart so that no
 * neighbour load leaves the plane. */
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
    float result = p * scale;
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
    float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    float small = x + x * z * p;
    float e = expneg_f32(-2.0f * a);
    int near0 = a < 0.625f;  /* NaN: false, and the large form is NaN */
    *num = near0 ? small : copysignf(1.0f - e, x);
    *den = near0 ? 1.0f : 1.0f + e;
}

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
#undef TM_PLANE
#undef TM_ZB
#define T double
#define NAME(x) x##_f64
#define SIGMOID sigmoid_f64
#define TANH tanh_f64
#include __FILE__

#else /* TM_TEMPLATE: the kernels, once per dtype T */

static T *NAME(edges)(const i64 *shape, int n) {
    i64 P, strides[4];
    plane_geometry(shape, n, &P, strides);
    T *e = (T *)tm_alloc(P > 0 && 2 * n > INT64_MAX / P ? -1 : 2 * n * P, sizeof(T));
    if (e == NULL) return NULL;
    for (int a = 0; a < n; ++a)
        for (i64 m = 0; m < P; ++m) {
            i64 k = (m / strides[a]) % shape[a];
            e[(2 * a) * P + m] = (T)(k != 0);
            e[(2 * a + 1) * P + m] = (T)(k != shape[a] - 1);
        }
    return e;
}

/* dst = ((bias + t1 x) + t0 x[-1]) + t2 x[+1] (the torch order), given the two
 * neighbour values already loaded; a missing neighbour adds nothing. */
static inline T NAME(fwd_at)(T x, T x_left, T x_right, int left, int right, T t0, T t1,
                             T t2, T bias) {
    T l = left ? t0 * x_left : (T)0;
    T r = right ? t2 * x_right : (T)0;
    return ((bias + t1 * x) + l) + r;
}

/* The regions of a pass: [0, r1) has no left neighbour in the plane, [r2, P) no right
 * one (r1 = min(st, P), r2 = max(P - st, 0)); where a neighbour lies in the plane, the
 * load is safe and the edge masks decide, so every region is a plain vector loop. */
static void NAME(pass_fwd)(const T *restrict x, T *restrict y, i64 P, i64 st,
                           const T *restrict hl, const T *restrict hr, const T *taps, T bias) {
    const T t0 = taps[0], t1 = taps[1], t2 = taps[2];
    i64 r1 = st < P ? st : P, r2 = P - st > 0 ? P - st : 0;
    i64 a_end = r1 < r2 ? r1 : r2, c_start = r1 > r2 ? r1 : r2;
#pragma omp simd
    for (i64 m = 0; m < a_end; ++m)  /* right neighbour only */
        y[m] = NAME(fwd_at)(x[m], 0, x[m + st], 0, hr[m] != 0, t0, t1, t2, bias);
#pragma omp simd
    for (i64 m = r1; m < r2; ++m)    /* both */
        y[m] = NAME(fwd_at)(x[m], x[m - st], x[m + st], hl[m] != 0, hr[m] != 0, t0, t1, t2,
                            bias);
    for (i64 m = r2; m < r1; ++m)    /* neither (an axis of size 1) */
        y[m] = NAME(fwd_at)(x[m], 0, 0, 0, 0, t0, t1, t2, bias);
#pragma omp simd
    for (i64 m = c_start; m < P; ++m)  /* left neighbour only */
        y[m] = NAME(fwd_at)(x[m], x[m - st], 0, hl[m] != 0, 0, t0, t1, t2, bias);
}

/* Backward of one pass at m: din = (t1 g + t2 g[-1]) + t0 g[+1] (the flipped taps, in
 * the torch order), and the tap / bias gradient terms. */
typedef struct { T t0, t1, t2, bias; } NAME(tap_sums);

static inline T NAME(bwd_at)(T g, T g_left, T g_right, T x, T x_left, T x_right, int left,
                             int right, T t0, T t1, T t2, NAME(tap_sums) *acc) {
    g_left = left ? g_left : (T)0;
    x_left = left ? x_left : (T)0;
    g_right = right ? g_right : (T)0;
    x_right = right ? x_right : (T)0;
    acc->t0 += g * x_left;
    acc->t1 += g * x;
    acc->t2 += g * x_right;
    acc->bias += g;
    return (t1 * g + t2 * g_left) + t0 * g_right;
}

static void NAME(pass_bwd)(const T *restrict x, const T *restrict g, T *restrict din, i64 P,
                           i64 st, const T *restrict hl, const T *restrict hr, const T *taps,
                           double *acc) {
    const T t0 = taps[0], t1 = taps[1], t2 = taps[2];
    i64 r1 = st < P ? st : P, r2 = P - st > 0 ? P - st : 0;
    i64 a_end = r1 < r2 ? r1 : r2, c_start = r1 > r2 ? r1 : r2;
    T a0 = 0, a1 = 0, a2 = 0, ab = 0;
#define TM_BWD_REGION(lo, hi, GL, GR, XL, XR, L, R)                                       \
    _Pragma("omp simd reduction(+:a0, a1, a2, ab)")                                      \
    for (i64 m = (lo); m < (hi); ++m) {                                                  \
        NAME(tap_sums) s = {0, 0, 0, 0};                                                 \
        din[m] = NAME(bwd_at)(g[m], GL, GR, x[m], XL, XR, L, R, t0, t1, t2, &s);          \
        a0 += s.t0;                                                                      \
        a1 += s.t1;                                                                      \
        a2 += s.t2;                                                                      \
        ab += s.bias;                                                                    \
    }
    TM_BWD_REGION(0, a_end, 0, g[m + st], 0, x[m + st], 0, hr[m] != 0)
    TM_BWD_REGION(r1, r2, g[m - st], g[m + st], x[m - st], x[m + st], hl[m] != 0, hr[m] != 0)
    TM_BWD_REGION(r2, r1, 0, 0, 0, 0, 0, 0)
    TM_BWD_REGION(c_start, P, g[m - st], 0, x[m - st], 0, hl[m] != 0, 0)
#undef TM_BWD_REGION
    acc[0] += (double)a0;
    acc[1] += (double)a1;
    acc[2] += (double)a2;
    acc[3] += (double)ab;
}

/* Plane (b, ch) of an input split in two parts: channels [0, Ca) in xa, the others in
 * xb, with batch strides xa_bs / xb_bs (elements). */
#define TM_PLANE(xa, xa_bs, xb, xb_bs, Ca, P, b, ch) \
    ((ch) < (Ca) ? (xa) + (b) * (xa_bs) + (ch) * (P) \
                 : (xb) + (b) * (xb_bs) + ((ch) - (Ca)) * (P))

static int NAME(dw_fwd_core)(const T *xa, i64 xa_bs, const T *xb, i64 xb_bs, i64 Ca, T *y,
                             const T *taps, const T *bias, i64 B, i64 Cin, int n,
                             const i64 *shape) {
    i64 P, strides[4];
    plane_geometry(shape, n, &P, strides);
    T *edges = NAME(edges)(shape, n);
    if (edges == NULL) return TM_ENOMEM;
    int failed = 0;
#pragma omp parallel
    {
        T *tmp = (T *)tm_alloc(P, sizeof(T));
        if (!tm_team_alloc_failed(tmp, &failed)) {
#pragma omp for schedule(static)
            for (i64 plane = 0; plane < B * Cin; ++plane) {
                i64 b = plane / Cin, ch = plane % Cin;
                const T *src = TM_PLANE(xa, xa_bs, xb, xb_bs, Ca, P, b, ch);
                T *out = y + plane * P;
                /* ping-pong so that the last pass lands in out */
                T *bufs[2] = {(n % 2) ? out : tmp, (n % 2) ? tmp : out};
                for (int a = 0; a < n; ++a) {
                    T *dst = bufs[a % 2];
                    NAME(pass_fwd)(src, dst, P, strides[a], edges + 2 * a * P,
                                   edges + (2 * a + 1) * P, taps + (a * Cin + ch) * 3,
                                   bias[a * Cin + ch]);
                    src = dst;
                }
            }
        }
        free(tmp);
    }
    free(edges);
    return failed ? TM_ENOMEM : 0;
}

int NAME(dw_fwd)(const T *x, T *y, const T *taps, const T *bias, i64 B, i64 Cin, int n,
                 const i64 *shape) {
    i64 P, strides[4];
    plane_geometry(shape, n, &P, strides);
    return NAME(dw_fwd_core)(x, Cin * P, x, Cin * P, Cin, y, taps, bias, B, Cin, n, shape);
}

int NAME(dw2_fwd)(const T *xa, i64 xa_bs, const T *xb, i64 xb_bs, i64 Ca, T *y,
                  const T *taps, const T *bias, i64 B, i64 Cin, int n, const i64 *shape) {
    return NAME(dw_fwd_core)(xa, xa_bs, xb, xb_bs, Ca, y, taps, bias, B, Cin, n, shape);
}

/* Parallel over channels (each thread owns its channels' tap gradients); per plane
 * the stages 1..n-1 are recomputed into a scratch buffer, then undone in reverse.
 * The tap / bias gradients are added to acc_taps / acc_bias (float64). */
static int NAME(dw_bwd_core)(const T *xa, i64 xa_bs, const T *xb, i64 xb_bs, i64 Ca,
                             const T *dy, T *dxa, i64 dxa_bs, T *dxb, i64 dxb_bs,
                             double *acc_taps, double *acc_bias, const T *taps,
                             const T *bias, i64 B, i64 Cin, int n, const i64 *shape) {
    i64 P, strides[4];
    plane_geometry(shape, n, &P, strides);
    T *edges = NAME(edges)(shape, n);
    if (edges == NULL) return TM_ENOMEM;
    int failed = 0;
#pragma omp parallel
    {
        T *work = (T *)tm_alloc(P > 0 && n + 1 > INT64_MAX / P ? -1 : P * (n + 1), sizeof(T));
        if (!tm_team_alloc_failed(work, &failed)) {
#pragma omp for schedule(static)
            for (i64 ch = 0; ch < Cin; ++ch) {
                double acc[4][4] = {{0}};
                for (i64 b = 0; b < B; ++b) {
                    const T *stage[4];
                    stage[0] = TM_PLANE(xa, xa_bs, xb, xb_bs, Ca, P, b, ch);
                    for (int a = 1; a < n; ++a) {
                        T *dst = work + (size_t)(a - 1) * P;
                        NAME(pass_fwd)(stage[a - 1], dst, P, strides[a - 1],
                                       edges + 2 * (a - 1) * P, edges + (2 * a - 1) * P,
                                       taps + ((a - 1) * Cin + ch) * 3,
                                       bias[(a - 1) * Cin + ch]);
                        stage[a] = dst;
                    }
                    T *g0 = work + (size_t)(n - 1) * P, *g1 = work + (size_t)n * P;
                    const T *grad = dy + (b * Cin + ch) * P;
                    T *dx_plane = (T *)TM_PLANE(dxa, dxa_bs, dxb, dxb_bs, Ca, P, b, ch);
                    for (int a = n - 1; a >= 0; --a) {
                        T *out = a == 0 ? dx_plane : ((n - 1 - a) % 2 ? g1 : g0);
                        NAME(pass_bwd)(stage[a], grad, out, P, strides[a], edges + 2 * a * P,
                                       edges + (2 * a + 1) * P, taps + (a * Cin + ch) * 3,
                                       acc[a]);
                        grad = out;
                    }
                }
                for (int a = 0; a < n; ++a) {
                    for (int k = 0; k < 3; ++k) acc_taps[(a * Cin + ch) * 3 + k] += acc[a][k];
                    acc_bias[a * Cin + ch] += acc[a][3];
                }
            }
        }
        free(work);
    }
    free(edges);
    return failed ? TM_ENOMEM : 0;
}

int NAME(dw_bwd)(const T *x, const T *dy, T *dx, T *dtaps, T *dbias, const T *taps,
                 const T *bias, i64 B, i64 Cin, int n, const i64 *shape) {
    i64 P, strides[4];
    plane_geometry(shape, n, &P, strides);
    double *acc = (double *)calloc((size_t)(4 * n * Cin > 0 ? 4 * n * Cin : 1), sizeof(double));
    if (acc == NULL) return TM_ENOMEM;
    int status = NAME(dw_bwd_core)(x, Cin * P, x, Cin * P, Cin, dy, dx, Cin * P, dx, Cin * P,
                                   acc, acc + 3 * n * Cin, taps, bias, B, Cin, n, shape);
    for (i64 k = 0; k < 3 * n * Cin; ++k) dtaps[k] = (T)acc[k];
    for (i64 k = 0; k < n * Cin; ++k) dbias[k] = (T)acc[3 * n * Cin + k];
    free(acc);
    return status;
}

int NAME(dw2_bwd)(const T *xa, i64 xa_bs, const T *xb, i64 xb_bs, i64 Ca, const T *dy,
                  T *dxa, i64 dxa_bs, T *dxb, i64 dxb_bs, double *acc_taps, double *acc_bias,
                  const T *taps, const T *bias, i64 B, i64 Cin, int n, const i64 *shape) {
    return NAME(dw_bwd_core)(xa, xa_bs, xb, xb_bs, Ca, dy, dxa, dxa_bs, dxb, dxb_bs, acc_taps,
                             acc_bias, taps, bias, B, Cin, n, shape);
}

/* Per-axis corner geometry of one read: lower index, weights of the lower / upper
 * corner, whether the upper corner exists, d(upper weight)/d(coordinate) (the lower
 * one's is its negative); returns whether a coordinate is NaN. Mirrors the generic
 * tent profiles: clip the coordinate, u = (x + 1) (S - 1) / 2 clamped to [0, S - 1],
 * lower = floor(u), slope (S - 1) / 2 strictly inside (0, S - 1), else 0. */
static int NAME(read_geometry)(const T *coords, int n, const i64 *shape, i64 *lo, T *w0,
                               T *w1, int *has_hi, T *slope) {
    int nan = 0;
    for (int a = 0; a < n; ++a) {
        T x = coords[n - 1 - a];  /* component k addresses axis n - 1 - k */
        if (x != x) nan = 1;
        T half = (T)(shape[a] - 1) / 2;
        T xc = x < -1 ? (T)-1 : (x > 1 ? (T)1 : x);
        T u = (xc + 1) * half;
        T top = (T)(shape[a] - 1);
        T cl = u < 0 ? (T)0 : (u > top ? top : u);
        T lower = nan ? (T)0 : floor(cl);
        T frac = cl - lower;
        lo[a] = (i64)lower;
        w0[a] = 1 - frac;
        w1[a] = frac;
        has_hi[a] = lo[a] + 1 < shape[a];
        slope[a] = (u > 0 && u < top) ? half : (T)0;
    }
    return nan;
}

int NAME(read_fwd)(const T *h, const T *coords, i64 cs, T *out, i64 os, i64 B, i64 C, int n,
                   const i64 *shape) {
    i64 P, strides[4];
    plane_geometry(shape, n, &P, strides);
    for (i64 b = 0; b < B; ++b) {
        i64 lo[4];
        T w0[4], w1[4], slope[4];
        int has_hi[4];
        int nan = NAME(read_geometry)(coords + b * cs, n, shape, lo, w0, w1, has_hi, slope);
        T *o = out + b * os;
        const T *hb = h + b * C * P;
        for (i64 ch = 0; ch < C; ++ch) o[ch] = nan ? (T)NAN : (T)0;
        if (nan) continue;
        for (int corner = 0; corner < (1 << n); ++corner) {
            T w = 1;
            i64 off = 0;
            int skip = 0;
            for (int a = 0; a < n; ++a) {
                int up = (corner >> a) & 1;
                if (up && !has_hi[a]) skip = 1;
                w *= up ? w1[a] : w0[a];
                off += (lo[a] + up) * strides[a];
            }
            if (skip) continue;
            for (i64 ch = 0; ch < C; ++ch) o[ch] += w * hb[ch * P + off];
        }
    }
    return 0;
}

int NAME(read_bwd)(const T *h, const T *coords, i64 cs, const T *g, i64 gs, T *dh,
                   T *dcoords, i64 dcs, i64 B, i64 C, int n, const i64 *shape) {
    i64 P, strides[4];
    plane_geometry(shape, n, &P, strides);
    for (i64 b = 0; b < B; ++b) {
        i64 lo[4];
        T w0[4], w1[4], slope[4], dsum[4] = {0, 0, 0, 0};
        int has_hi[4];
        int nan = NAME(read_geometry)(coords + b * cs, n, shape, lo, w0, w1, has_hi, slope);
        const T *hb = h + b * C * P, *gb = g + b * gs;
        T *dhb = dh + b * C * P, *dc = dcoords + b * dcs;
        if (nan) {
            for (i64 k = 0; k < C * P; ++k) dhb[k] = (T)NAN;
            for (int a = 0; a < n; ++a) dc[a] = (T)NAN;
            continue;
        }
        for (int corner = 0; corner < (1 << n); ++corner) {
            T w = 1, dw[4];
            i64 off = 0;
            int skip = 0;
            for (int a = 0; a < n; ++a) {
                int up = (corner >> a) & 1;
                if (up && !has_hi[a]) skip = 1;
                off += (lo[a] + up) * strides[a];
            }
            if (skip) continue;
            for (int a = 0; a < n; ++a) {
                int up = (corner >> a) & 1;
                w *= up ? w1[a] : w0[a];
                T d = up ? slope[a] : -slope[a];
                for (int a2 = 0; a2 < n; ++a2)
                    if (a2 != a) d *= ((corner >> a2) & 1) ? w1[a2] : w0[a2];
                dw[a] = d;
            }
            T gv = 0;
            for (i64 ch = 0; ch < C; ++ch) {
                dhb[ch * P + off] += gb[ch] * w;
                gv += gb[ch] * hb[ch * P + off];
            }
            for (int a = 0; a < n; ++a) dsum[a] += gv * dw[a];
        }
        for (int a = 0; a < n; ++a) dc[n - 1 - a] = dsum[a];
    }
    return 0;
}

/* The pointwise bias of quarter q (0: i, 1: f, 2: o, 3: g) of channel ch, or 0. */
#define TM_ZB(zb, C, q, ch) ((zb) != NULL ? (zb)[(q) * (C) + (ch)] : (T)0)

int NAME(gates2_fwd)(const T *restrict z, const T *restrict zb, const T *restrict c,
                     T *restrict h_out, T *restrict c_out, i64 B, i64 C, i64 P) {
#pragma omp parallel for schedule(static)
    for (i64 plane = 0; plane < B * C; ++plane) {
        i64 b = plane / C, ch = plane % C;
        const T *zi = z + (b * 4 * C + ch) * P, *zf = zi + C * P, *zo = zf + C * P;
        const T *zg = zo + C * P;
        const T *cp = c + plane * P;
        T *hp = h_out + plane * P, *cn = c_out + plane * P;
        const T bi = TM_ZB(zb, C, 0, ch), bf = TM_ZB(zb, C, 1, ch);
        const T bo = TM_ZB(zb, C, 2, ch), bg = TM_ZB(zb, C, 3, ch);
#pragma omp simd
        for (i64 p = 0; p < P; ++p) {
#ifdef TM_FRACTION_GATES
            /* each gate as numerator / denominator (denominators in [1, 2]), so that
             * c' and h' take one division each instead of five in all */
            T ni, di, nf, df, no, dO, ng, dg, nt, dt;
            NAME(sigmoid_nd)(zi[p] + bi, &ni, &di);
            NAME(sigmoid_nd)(zf[p] + bf, &nf, &df);
            NAME(sigmoid_nd)(zo[p] + bo, &no, &dO);
            NAME(tanh_nd)(zg[p] + bg, &ng, &dg);
            T dig = di * dg;
            T cnew = (nf * cp[p] * dig + ni * ng * df) / (df * dig);
            cn[p] = cnew;
            NAME(tanh_nd)(cnew, &nt, &dt);
            hp[p] = (no * nt) / (dO * dt);
#else
            T i = SIGMOID(zi[p] + bi), f = SIGMOID(zf[p] + bf), o = SIGMOID(zo[p] + bo);
            T g = TANH(zg[p] + bg);
            T cnew = f * cp[p] + i * g;
            cn[p] = cnew;
            hp[p] = o * TANH(cnew);
#endif
        }
    }
    return 0;
}

int NAME(gates_fwd)(const T *restrict z, const T *restrict c, T *restrict h_out,
                    T *restrict c_out, i64 B, i64 C, i64 P) {
    return NAME(gates2_fwd)(z, NULL, c, h_out, c_out, B, C, P);
}

int NAME(gates2_bwd)(const T *restrict z, const T *restrict zb, const T *restrict c,
                     const T *restrict gh, const T *restrict gc, T *restrict dz,
                     T *restrict dc, double *restrict acc_zb, i64 B, i64 C, i64 P) {
    /* per-plane sums of dz (B, 4, C) for acc_zb, added in batch order after the loop */
    double *sums = acc_zb != NULL ? (double *)tm_alloc(B * 4 * C, sizeof(double)) : NULL;
    if (acc_zb != NULL && sums == NULL) return TM_ENOMEM;
#pragma omp parallel for schedule(static)
    for (i64 plane = 0; plane < B * C; ++plane) {
        i64 b = plane / C, ch = plane % C;
        i64 q = (b * 4 * C + ch) * P;
        const T *zi = z + q, *zf = zi + C * P, *zo = zf + C * P, *zg = zo + C * P;
        T *di = dz + q, *df = di + C * P, *d_o = df + C * P, *dg = d_o + C * P;
        const T *cp = c + plane * P, *ghp = gh + plane * P, *gcp = gc + plane * P;
        T *dcp = dc + plane * P;
        const T bi = TM_ZB(zb, C, 0, ch), bf = TM_ZB(zb, C, 1, ch);
        const T bo = TM_ZB(zb, C, 2, ch), bg = TM_ZB(zb, C, 3, ch);
#pragma omp simd
        for (i64 p = 0; p < P; ++p) {
#ifdef TM_FRACTION_GATES  /* the gates as fractions again: two divisions, not five */
            T ni, di_, nf, df_, no, do_, ng, dg_, nt, dt;
            NAME(sigmoid_nd)(zi[p] + bi, &ni, &di_);
            NAME(sigmoid_nd)(zf[p] + bf, &nf, &df_);
            NAME(sigmoid_nd)(zo[p] + bo, &no, &do_);
            NAME(tanh_nd)(zg[p] + bg, &ng, &dg_);
            T r1 = 1 / (di_ * df_ * dg_);
            T i = ni * (df_ * dg_) * r1, f = nf * (di_ * dg_) * r1, g = ng * (di_ * df_) * r1;
            T cnew = f * cp[p] + i * g;
            NAME(tanh_nd)(cnew, &nt, &dt);
            T r2 = 1 / (do_ * dt);
            T o = no * dt * r2, tc = nt * do_ * r2;
#else
            T i = SIGMOID(zi[p] + bi), f = SIGMOID(zf[p] + bf), o = SIGMOID(zo[p] + bo);
            T g = TANH(zg[p] + bg);
            T cnew = f * cp[p] + i * g;
            T tc = TANH(cnew);
#endif
            T dcn = gcp[p] + ghp[p] * o * (1 - tc * tc);
            di[p] = dcn * g * (i - i * i);
            df[p] = dcn * cp[p] * (f - f * f);
            d_o[p] = ghp[p] * tc * (o - o * o);
            dg[p] = dcn * i * (1 - g * g);
            dcp[p] = dcn * f;
        }
        if (sums != NULL) {  /* a second pass over the rows just written (in cache) */
            T si = 0, sf = 0, so = 0, sg = 0;
#pragma omp simd reduction(+:si, sf, so, sg)
            for (i64 p = 0; p < P; ++p) {
                si += di[p];
                sf += df[p];
                so += d_o[p];
                sg += dg[p];
            }
            double *row = sums + b * 4 * C + ch;
            row[0] = si;
            row[C] = sf;
            row[2 * C] = so;
            row[3 * C] = sg;
        }
    }
    if (sums != NULL) {
        for (i64 b = 0; b < B; ++b)
            for (i64 k = 0; k < 4 * C; ++k) acc_zb[k] += sums[b * 4 * C + k];
        free(sums);
    }
    return 0;
}

int NAME(gates_bwd)(const T *restrict z, const T *restrict c, const T *restrict gh,
                    const T *restrict gc, T *restrict dz, T *restrict dc, i64 B, i64 C,
                    i64 P) {
    return NAME(gates2_bwd)(z, NULL, c, gh, gc, dz, dc, NULL, B, C, P);
}

/* ------------------------------------------- the fused CPU local scan -- */
/*
 * Boxes of (B, C, *shape) grids for the torch backend's fused local scan
 * (update="local"): one box per batch element, of `size` cells per axis, at a
 * per-element start (B, n) int64 (NULL: 0). Every entry checks that each box it
 * reads or writes lies inside its grid (and 1 <= n <= 4) before touching memory,
 * and returns TM_EINDEX (nothing written) otherwise.
 *
 *   box_op   mode 0: dst box = src box; mode 1: dst box = src box inside the
 *            window, 0 elsewhere; mode 2: dst box = (inside the window ? 0 : dst box)
 *            + src box. The window of element b: box cells win_off[b] + [0, win_size)
 *            in the box's own coordinates (modes 1, 2; no memory is indexed by it).
 *   corner_read_bwd  the VJP of the 2^n-corner read from its corner box (B, C, K):
 *            ADDS g (B, C) x dense (B, K) into dh's corner box and writes
 *            dcoords[b, n - 1 - a] = sum_k (sum_c g box)[k] sdense[b, a, k].
 *   local_geometry / box_write_bwd  (below) every step's window, box, written box
 *            and read corners at once, and the written boxes' VJP.
 */
#ifndef TM_LOCAL_ONCE
#define TM_LOCAL_ONCE
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
#endif

int NAME(box_op)(const T *src, const i64 *src_shape, const i64 *src_start, T *dst,
                 const i64 *dst_shape, const i64 *dst_start, const i64 *size,
                 const i64 *win_off, const i64 *win_size, int mode, i64 B, i64 C, int n) {
    if (n < 1 || n > 4 || B < 0 || C < 0 || mode < 0 || mode > 2) return TM_EINDEX;
    if ((mode != 0) && (win_off == NULL || win_size == NULL)) return TM_EINDEX;
    if (!tm_boxes_fit(src_start, B, n, src_shape, size)
        || !tm_boxes_fit(dst_start, B, n, dst_shape, size)) return TM_EINDEX;
    i64 ss[4], ds[4], sz[4], sst[4], dst_st[4], sp, dp;
    tm_pad4(n, src_shape, 1, ss);
    tm_pad4(n, dst_shape, 1, ds);
    tm_pad4(n, size, 1, sz);
    tm_strides4(ss, sst, &sp);
    tm_strides4(ds, dst_st, &dp);
    for (i64 b = 0; b < B; ++b) {
        i64 s0[4], d0[4], wo[4] = {0, 0, 0, 0}, ws[4];
        i64 zero[4] = {0, 0, 0, 0};
        tm_pad4(n, src_start ? src_start + b * n : zero, 0, s0);
        tm_pad4(n, dst_start ? dst_start + b * n : zero, 0, d0);
        if (mode != 0) {
            tm_pad4(n, win_off + b * n, 0, wo);
            tm_pad4(n, win_size, 1, ws);
        }
        for (i64 ch = 0; ch < C; ++ch) {
            const T *sb = src + (b * C + ch) * sp;
            T *db = dst + (b * C + ch) * dp;
            for (i64 j0 = 0; j0 < sz[0]; ++j0)
                for (i64 j1 = 0; j1 < sz[1]; ++j1)
                    for (i64 j2 = 0; j2 < sz[2]; ++j2) {
                        const T *s = sb + (s0[0] + j0) * sst[0] + (s0[1] + j1) * sst[1]
                                     + (s0[2] + j2) * sst[2] + s0[3];
                        T *d = db + (d0[0] + j0) * dst_st[0] + (d0[1] + j1) * dst_st[1]
                               + (d0[2] + j2) * dst_st[2] + d0[3];
                        if (mode == 0) {
                            for (i64 j3 = 0; j3 < sz[3]; ++j3) d[j3] = s[j3];
                            continue;
                        }
                        int row = j0 >= wo[0] && j0 < wo[0] + ws[0] && j1 >= wo[1]
                                  && j1 < wo[1] + ws[1] && j2 >= wo[2] && j2 < wo[2] + ws[2];
                        for (i64 j3 = 0; j3 < sz[3]; ++j3) {
                            int in = row && j3 >= wo[3] && j3 < wo[3] + ws[3];
                            if (mode == 1) d[j3] = in ? s[j3] : (T)0;
                            else d[j3] = (in ? (T)0 : d[j3]) + s[j3];
                        }
                    }
        }
    }
    return 0;
}

int NAME(corner_read_bwd)(T *dh, const i64 *shape, const i64 *start, const i64 *corners,
                          const T *dense, const T *sdense, const T *box, const T *g, i64 gs,
                          T *dcoords, i64 dcs, i64 B, i64 C, int n) {
    if (n < 1 || n > 4 || B < 0 || C < 0) return TM_EINDEX;
    for (int a = 0; a < n; ++a)
        if (corners[a] < 1 || corners[a] > 2) return TM_EINDEX;
    if (!tm_boxes_fit(start, B, n, shape, corners)) return TM_EINDEX;
    i64 strides[4], P = 1, K = 1;
    for (int a = n - 1; a >= 0; --a) { strides[a] = P; P *= shape[a]; K *= corners[a]; }
    for (i64 b = 0; b < B; ++b) {
        const i64 *st = start + b * n;
        const T *dn = dense + b * K, *sd = sdense + b * n * K, *bx = box + b * C * K;
        const T *gb = g + b * gs;
        T *dhb = dh + b * C * P, dsum[4] = {0, 0, 0, 0};
        for (i64 k = 0; k < K; ++k) {
            i64 off = 0, rest = k;
            for (int a = n - 1; a >= 0; --a) {  /* C order: the last axis fastest */
                off += (st[a] + rest % corners[a]) * strides[a];
                rest /= corners[a];
            }
            T gv = 0;
            for (i64 ch = 0; ch < C; ++ch) {
                dhb[ch * P + off] += gb[ch] * dn[k];
                gv += gb[ch] * bx[ch * K + k];
            }
            for (int a = 0; a < n; ++a) dsum[a] += gv * sd[a * K + k];
        }
        for (int a = 0; a < n; ++a) dcoords[b * dcs + (n - 1 - a)] = dsum[a];
    }
    return 0;
}

/* local_geometry: what the fused local forward needs from the writes and reads of
 * all T steps, per time-major row r = t B + b (the inputs are batch-major (B, T, ...)):
 * the window start, box start and window offset in the box (R, n) int64, the read's
 * corner start (R, n) int64 and weights (R, K) (the outer product of the per-axis
 * n-linear weights, axis 0 slowest), and the written box (R, C, *box): the Gaussian
 * profiles (centres: the grid's cell centres per axis, concatenated) restricted to
 * the window, times the content. The formulas of tmcore.local (window_geometry,
 * _corners, _box_write) and tmcore.splat.gaussian_profiles, in the same operation
 * order (exp from libm). radius < 0: no truncation. The box / window / corner sizes
 * the caller allocated for are checked against the formulas (TM_EINDEX). */
/* The window start and the box start on one axis for a write at the normalized
 * coordinate x (tmcore.local.window_geometry's formulas; a NaN coordinate gives 0). */
static inline void NAME(window_axis)(T x, i64 shape, i64 size, i64 box, i64 *win_start,
                                     i64 *box_start) {
    T half = (T)(shape - 1) / 2, top = (T)(shape - 1);
    T u = (x + 1) * half;
    u = u < 0 ? (T)0 : (u > top ? top : u);
    T st = nearbyint(u) - (T)(size / 2);
    T hi = (T)(shape - size);
    st = st < 0 ? (T)0 : (st > hi ? hi : st);
    T bs = st - 1, bhi = (T)(shape - box);
    bs = bs < 0 ? (T)0 : (bs > bhi ? bhi : bs);
    *win_start = st == st ? (i64)st : 0;
    *box_start = bs == bs ? (i64)bs : 0;
}

/* One cell's unnormalized Gaussian weight at `offset` from the write centre
 * (tmcore.splat.gaussian_profiles: exp(-offset^2 / denom); denom 0 keeps only the
 * centre; radius >= 0 truncates at radius * sigma). */
static inline T NAME(gauss_weight)(T offset, T denom, double radius, T sigma) {
    T square = offset * offset;
    T p = denom == 0 ? exp(-(square > 0 ? (T)INFINITY : square)) : exp(-square / denom);
    if (radius >= 0) {
        T off_abs = offset < 0 ? -offset : offset;
        p = off_abs <= (T)radius * sigma ? p : p * 0;
    }
    return p;
}

int NAME(local_geometry)(const T *read_coords, const T *write_coords, const T *sigma,
                         const T *content, const T *centres, i64 B, i64 Tn, i64 C, int n,
                         const i64 *shape, i64 window, const i64 *size, const i64 *box,
                         const i64 *corners, double eps, double radius, i64 *win_start,
                         i64 *box_start, i64 *win_off, i64 *corner_start, T *dense,
                         T *volumes, T *sdense) {
    if (n < 1 || n > 4 || B < 0 || Tn < 0 || C < 0 || window < 1) return TM_EINDEX;
    i64 Pb = 1, K = 1, first[4], pfirst[4], at = 0, pat = 0;
    for (int a = 0; a < n; ++a) {
        i64 s = shape[a];
        if (s < 1 || size[a] != (window < s ? window : s)
            || box[a] != (window + 2 < s ? window + 2 : s) || corners[a] != (s == 1 ? 1 : 2))
            return TM_EINDEX;
        Pb *= box[a];
        K *= corners[a];
        first[a] = at;
        at += s;
        pfirst[a] = pat;
        pat += box[a];
    }
    T *prof_buf = (T *)tm_alloc(pat, sizeof(T));
    if (prof_buf == NULL) return TM_ENOMEM;
    for (i64 t = 0; t < Tn; ++t)
        for (i64 b = 0; b < B; ++b) {
            i64 r = t * B + b, src = b * Tn + t;
            const T *wc = write_coords + src * n, *rc = read_coords + src * n;
            T s = sigma[src];
            T denom = (T)2 * s * s + (T)eps;
            T *prof[4];
            for (int a = 0; a < n; ++a) prof[a] = prof_buf + pfirst[a];
            /* window and box (a NaN coordinate puts them at 0) */
            for (int a = 0; a < n; ++a)
                NAME(window_axis)(wc[n - 1 - a], shape[a], size[a], box[a],
                                  &win_start[r * n + a], &box_start[r * n + a]);
            for (int a = 0; a < n; ++a) {
                i64 ws = win_start[r * n + a], bs = box_start[r * n + a];
                win_off[r * n + a] = ws - bs;
                T mu = wc[n - 1 - a];
                for (i64 j = 0; j < box[a]; ++j) {
                    i64 idx = bs + j;
                    T p = 0;
                    if (idx >= ws && idx < ws + size[a])
                        p = NAME(gauss_weight)(centres[first[a] + idx] - mu, denom, radius, s);
                    prof[a][j] = p;
                }
            }
            /* the written box: content x the outer product (axis 0 slowest) */
            T *vol = volumes + r * C * Pb;
            for (i64 m = 0; m < Pb; ++m) {
                i64 rest = m;
                i64 jj[4];
                for (int a = n - 1; a >= 0; --a) { jj[a] = rest % box[a]; rest /= box[a]; }
                T w = prof[0][jj[0]];
                for (int a = 1; a < n; ++a) w = w * prof[a][jj[a]];
                vol[m] = w;  /* the weight, scaled per channel below */
            }
            const T *cv = content + src * C;
            for (i64 ch = C - 1; ch >= 0; --ch)
                for (i64 m = 0; m < Pb; ++m) vol[ch * Pb + m] = cv[ch] * vol[m];
            /* the read's corners */
            T wt[4][2], sl[4][2];
            for (int a = 0; a < n; ++a) {
                T half = (T)(shape[a] - 1) / 2, top = (T)(shape[a] - 1);
                T x = rc[n - 1 - a];
                x = x < -1 ? (T)-1 : (x > 1 ? (T)1 : x);
                T u = (x + 1) * half;
                T cl = u < 0 ? (T)0 : (u > top ? top : u);
                T lhi = (T)(shape[a] - 2 > 0 ? shape[a] - 2 : 0);
                T lo = floor(cl);
                lo = lo < 0 ? (T)0 : (lo > lhi ? lhi : lo);
                T frac = cl - lo;
                corner_start[r * n + a] = lo == lo ? (i64)lo : 0;
                wt[a][0] = 1 - frac;
                wt[a][1] = frac;
                T step = ((u > 0 && u < top) ? (T)1 : (T)0) + u * 0;  /* NaN for a NaN u */
                step = step * half;
                sl[a][0] = -step;
                sl[a][1] = step;
            }
            T *dn = dense + r * K;
            for (i64 k = 0; k < K; ++k) {
                i64 rest = k, kk[4];
                for (int a = n - 1; a >= 0; --a) { kk[a] = rest % corners[a]; rest /= corners[a]; }
                T w = wt[0][kk[0]];
                for (int a = 1; a < n; ++a) w = w * wt[a][kk[a]];
                dn[k] = w;
                if (sdense == NULL) continue;
                for (int a = 0; a < n; ++a) {  /* axis a's weight replaced by its slope */
                    T d = a == 0 ? sl[0][kk[0]] : wt[0][kk[0]];
                    for (int a2 = 1; a2 < n; ++a2) d = d * (a2 == a ? sl[a2][kk[a2]] : wt[a2][kk[a2]]);
                    sdense[(r * n + a) * K + k] = d;
                }
            }
        }
    free(prof_buf);
    return 0;
}

/* box_write_bwd: the VJP of local_geometry's written boxes for g (R, C, *box)
 * (time-major rows): d_coords (B, T, n), d_sigma (B, T), d_content (B, T, C), by the
 * rules of tmcore.local's _box_write_bwd (the splat's VJP for one write, on the box;
 * the window's position a constant). Same arguments and checks as local_geometry. */
int NAME(box_write_bwd)(const T *write_coords, const T *sigma, const T *content,
                        const T *centres, i64 B, i64 Tn, i64 C, int n, const i64 *shape,
                        i64 window, const i64 *size, const i64 *box, double eps,
                        double radius, const T *g, T *d_coords, T *d_sigma, T *d_content) {
    if (n < 1 || n > 4 || B < 0 || Tn < 0 || C < 0 || window < 1) return TM_EINDEX;
    i64 Pb = 1, first[4], pfirst[4], at = 0, pat = 0;
    for (int a = 0; a < n; ++a) {
        i64 s = shape[a];
        if (s < 1 || size[a] != (window < s ? window : s)
            || box[a] != (window + 2 < s ? window + 2 : s))
            return TM_EINDEX;
        Pb *= box[a];
        first[a] = at;
        at += s;
        pfirst[a] = pat;
        pat += box[a];
    }
    T *buf = (T *)tm_alloc(2 * pat + 2 * Pb, sizeof(T));  /* sizes of a real grid's box */
    if (buf == NULL) return TM_ENOMEM;
    T *dense = buf + 2 * pat, *weighted = dense + Pb;
    for (i64 t = 0; t < Tn; ++t)
        for (i64 b = 0; b < B; ++b) {
            i64 r = t * B + b, src = b * Tn + t;
            const T *wc = write_coords + src * n;
            T s = sigma[src];
            T denom = (T)2 * s * s + (T)eps;
            T *prof[4], *offs[4];
            for (int a = 0; a < n; ++a) {
                prof[a] = buf + pfirst[a];
                offs[a] = buf + pat + pfirst[a];
                T mu = wc[n - 1 - a];
                i64 ws, b0;
                NAME(window_axis)(mu, shape[a], size[a], box[a], &ws, &b0);
                for (i64 j = 0; j < box[a]; ++j) {
                    i64 idx = b0 + j;
                    T offset = centres[first[a] + idx] - mu;
                    T p = 0;
                    if (idx >= ws && idx < ws + size[a])
                        p = NAME(gauss_weight)(offset, denom, radius, s);
                    prof[a][j] = p;
                    offs[a][j] = offset;
                }
            }
            const T *gr = g + r * C * Pb, *cv = content + src * C;
            for (i64 m = 0; m < Pb; ++m) {
                i64 rest = m, jj[4];
                for (int a = n - 1; a >= 0; --a) { jj[a] = rest % box[a]; rest /= box[a]; }
                T w = prof[0][jj[0]];
                for (int a = 1; a < n; ++a) w = w * prof[a][jj[a]];
                dense[m] = w;
                T cg = 0;
                for (i64 ch = 0; ch < C; ++ch) cg += cv[ch] * gr[ch * Pb + m];
                weighted[m] = cg * w;
            }
            T *dct = d_content + src * C;
            for (i64 ch = 0; ch < C; ++ch) {
                T acc = 0;
                for (i64 m = 0; m < Pb; ++m) acc += dense[m] * gr[ch * Pb + m];
                dct[ch] = acc;
            }
            T moment2 = 0, dmu[4];
            for (int a = 0; a < n; ++a) {
                T sm = 0, sq = 0;
                for (i64 m = 0; m < Pb; ++m) {
                    i64 rest = m, j = 0;
                    for (int a2 = n - 1; a2 >= a; --a2) { j = rest % box[a2]; rest /= box[a2]; }
                    T o = offs[a][j];
                    sm += weighted[m] * o;
                    sq += weighted[m] * (prof[a][j] == 0 ? (T)0 : o * o);
                }
                dmu[a] = sm;
                moment2 = a == 0 ? sq : moment2 + sq;
            }
            T mu_scale = denom == 0 ? (T)0 : (T)2 / denom;
            T sig_scale = denom == 0 ? (T)0 : (T)4 * s / (denom * denom);
            for (int a = 0; a < n; ++a) d_coords[src * n + (n - 1 - a)] = dmu[a] * mu_scale;
            d_sigma[src] = moment2 * sig_scale;
        }
    free(buf);
    return 0;
}

#endif /* TM_TEMPLATE */
