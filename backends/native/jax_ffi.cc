// XLA FFI handlers (JAX on the CPU) around the fused cell kernels of kernels.c.
//
// Built by tmcore.backends.native.build together with kernels.c against the XLA FFI
// headers that jaxlib ships (jax.ffi.include_dir()); registered as the CPU
// custom-call targets tmcore_{dw_fwd,dw_bwd,gates_fwd,gates_bwd}_{f32,f64}.
// Shapes are read from the buffers: x (B, Cin, *S) with 1 to 4 spatial axes,
// z (B, 4C, *S), c (B, C, *S). Buffers are dense row-major (XLA's default layout).
// A kernel that cannot allocate its scratch memory returns nonzero; the handler
// then returns a RESOURCE_EXHAUSTED error, which JAX raises as an XlaRuntimeError.
#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" {
int dw_fwd_f32(const float *, float *, const float *, const float *, int64_t, int64_t, int,
                const int64_t *);
int dw_fwd_f64(const double *, double *, const double *, const double *, int64_t, int64_t,
                int, const int64_t *);
int dw_bwd_f32(const float *, const float *, float *, float *, float *, const float *,
                const float *, int64_t, int64_t, int, const int64_t *);
int dw_bwd_f64(const double *, const double *, double *, double *, double *, const double *,
                const double *, int64_t, int64_t, int, const int64_t *);
int gates_fwd_f32(const float *, const float *, float *, float *, int64_t, int64_t, int64_t);
int gates_fwd_f64(const double *, const double *, double *, double *, int64_t, int64_t,
                   int64_t);
int gates_bwd_f32(const float *, const float *, const float *, const float *, float *, float *,
                   int64_t, int64_t, int64_t);
int gates_bwd_f64(const double *, const double *, const double *, const double *, double *,
                   double *, int64_t, int64_t, int64_t);
}

namespace {

template <ffi::DataType T> struct Kernels;
template <> struct Kernels<ffi::F32> {
  static constexpr auto dw_fwd = dw_fwd_f32;
  static constexpr auto dw_bwd = dw_bwd_f32;
  static constexpr auto gates_fwd = gates_fwd_f32;
  static constexpr auto gates_bwd = gates_bwd_f32;
};
template <> struct Kernels<ffi::F64> {
  static constexpr auto dw_fwd = dw_fwd_f64;
  static constexpr auto dw_bwd = dw_bwd_f64;
  static constexpr auto gates_fwd = gates_fwd_f64;
  static constexpr auto gates_bwd = gates_bwd_f64;
};

// (B, C, spatial shape, prod(spatial)) of a (B, C, *S) buffer.
struct Layout {
  int64_t batch = 0, channels = 0, cells = 1, shape[4] = {0, 0, 0, 0};
  int n = 0;
};

template <typename Buf> bool layout_of(const Buf &buf, Layout *out) {
  auto dims = buf.dimensions();
  out->n = static_cast<int>(dims.size()) - 2;
  if (out->n < 1 || out->n > 4) return false;
  out->batch = dims[0];
  out->channels = dims[1];
  for (int a = 0; a < out->n; ++a) {
    out->shape[a] = dims[a + 2];
    out->cells *= dims[a + 2];
  }
  return true;
}

// The handler's result for a kernel's return code (0: success, else out of memory).
ffi::Error status(int code, const char *kernel) {
  if (code == 0) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    std::string("tmcore ") + kernel +
                        ": out of memory (the fused CPU kernel could not allocate its scratch)");
}

// InvalidArgument unless `buf` holds exactly `expected` elements (the kernels index
// every buffer from the layout of x or c, so a short one would be read out of bounds).
template <typename Buf> bool sized(const Buf &buf, int64_t expected) {
  return static_cast<int64_t>(buf.element_count()) == expected;
}

ffi::Error bad_size(const char *what) {
  return ffi::Error::InvalidArgument(std::string(what) +
                                     ": size does not match the layout of x / c");
}

ffi::Error bad_rank(const char *what) {
  return ffi::Error::InvalidArgument(std::string(what) +
                                     ": expected (B, C, *S) with 1 to 4 spatial axes");
}

template <ffi::DataType T>
ffi::Error DwFwd(ffi::Buffer<T> x, ffi::Buffer<T> taps, ffi::Buffer<T> bias,
                 ffi::ResultBuffer<T> y) {
  Layout l;
  if (!layout_of(x, &l)) return bad_rank("x");
  const int64_t all = l.batch * l.channels * l.cells;
  if (!sized(taps, l.n * l.channels * 3) || !sized(bias, l.n * l.channels) ||
      !sized(*y, all))
    return bad_size("dw_fwd taps (n, C, 3) / bias (n, C) / y");
  return status(Kernels<T>::dw_fwd(x.typed_data(), y->typed_data(), taps.typed_data(),
                                   bias.typed_data(), l.batch, l.channels, l.n, l.shape),
                "dw_fwd");
}

template <ffi::DataType T>
ffi::Error DwBwd(ffi::Buffer<T> x, ffi::Buffer<T> dy, ffi::Buffer<T> taps, ffi::Buffer<T> bias,
                 ffi::ResultBuffer<T> dx, ffi::ResultBuffer<T> dtaps,
                 ffi::ResultBuffer<T> dbias) {
  Layout l;
  if (!layout_of(x, &l)) return bad_rank("x");
  const int64_t all = l.batch * l.channels * l.cells;
  if (!sized(dy, all) || !sized(taps, l.n * l.channels * 3) || !sized(bias, l.n * l.channels) ||
      !sized(*dx, all) || !sized(*dtaps, l.n * l.channels * 3) ||
      !sized(*dbias, l.n * l.channels))
    return bad_size("dw_bwd dy / taps (n, C, 3) / bias (n, C) / results");
  return status(Kernels<T>::dw_bwd(x.typed_data(), dy.typed_data(), dx->typed_data(),
                                   dtaps->typed_data(), dbias->typed_data(), taps.typed_data(),
                                   bias.typed_data(), l.batch, l.channels, l.n, l.shape),
                "dw_bwd");
}

template <ffi::DataType T>
ffi::Error GatesFwd(ffi::Buffer<T> z, ffi::Buffer<T> c, ffi::ResultBuffer<T> h_out,
                    ffi::ResultBuffer<T> c_out) {
  Layout l;
  if (!layout_of(c, &l)) return bad_rank("c");
  const int64_t all = l.batch * l.channels * l.cells;
  if (!sized(z, 4 * all) || !sized(*h_out, all) || !sized(*c_out, all))
    return bad_size("gates_fwd z (B, 4C, *S) / results");
  return status(Kernels<T>::gates_fwd(z.typed_data(), c.typed_data(), h_out->typed_data(),
                                      c_out->typed_data(), l.batch, l.channels, l.cells),
                "gates_fwd");
}

template <ffi::DataType T>
ffi::Error GatesBwd(ffi::Buffer<T> z, ffi::Buffer<T> c, ffi::Buffer<T> g_h, ffi::Buffer<T> g_c,
                    ffi::ResultBuffer<T> dz, ffi::ResultBuffer<T> dc) {
  Layout l;
  if (!layout_of(c, &l)) return bad_rank("c");
  const int64_t all = l.batch * l.channels * l.cells;
  if (!sized(z, 4 * all) || !sized(g_h, all) || !sized(g_c, all) || !sized(*dz, 4 * all) ||
      !sized(*dc, all))
    return bad_size("gates_bwd z (B, 4C, *S) / g_h / g_c / results");
  return status(Kernels<T>::gates_bwd(z.typed_data(), c.typed_data(), g_h.typed_data(),
                                      g_c.typed_data(), dz->typed_data(), dc->typed_data(),
                                      l.batch, l.channels, l.cells),
                "gates_bwd");
}

}  // namespace

// The binding of a handler: `args` input buffers, then `rets` (>= 1) result buffers, all
// of T. Each step returns the next binding as a prvalue (bindings cannot be copied or
// moved from outside), so the recursion ends on the last result, not on a parameter.
template <ffi::DataType T, int args, int rets, typename Binding> auto Buffers(Binding binding) {
  static_assert(rets >= 1, "a handler returns at least one buffer");
  if constexpr (args > 0) {
    return Buffers<T, args - 1, rets>(std::move(binding).template Arg<ffi::Buffer<T>>());
  } else if constexpr (rets > 1) {
    return Buffers<T, 0, rets - 1>(std::move(binding).template Ret<ffi::Buffer<T>>());
  } else {
    return std::move(binding).template Ret<ffi::Buffer<T>>();
  }
}

#define TM_HANDLERS(T, SFX)                                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(tmcore_dw_fwd_##SFX, DwFwd<T>,                                  \
                                (Buffers<T, 3, 1>(ffi::Ffi::Bind())));                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(tmcore_dw_bwd_##SFX, DwBwd<T>,                                  \
                                (Buffers<T, 4, 3>(ffi::Ffi::Bind())));                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(tmcore_gates_fwd_##SFX, GatesFwd<T>,                            \
                                (Buffers<T, 2, 2>(ffi::Ffi::Bind())));                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(tmcore_gates_bwd_##SFX, GatesBwd<T>,                            \
                                (Buffers<T, 4, 2>(ffi::Ffi::Bind())));

TM_HANDLERS(ffi::F32, f32)
TM_HANDLERS(ffi::F64, f64)
