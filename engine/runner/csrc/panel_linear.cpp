// A linear layer for few rows over a weight packed once in column panels: y = x W^T.
//
//   prefix_console::pack_panels(weight) -> panels      the [N, K] weight in the layout panel_linear reads
//   prefix_console::panel_linear(x, panels, bias) -> y
//
//   weight  [N, K]        float32 or bfloat16, N a multiple of P = 32
//   panels  float32, and bfloat16 without the CPU's bf16 dot products: [N / P, K, P], each panel of P
//           outputs stored k-major (`panels[j, k, c] = W[j * P + c, k]`);
//           bfloat16 with them (built where the CPU has avx512_bf16): [N / P, ceil(K / 2), P, 2], k in pairs
//           (`panels[j, i, c, h] = W[j * P + c, 2 i + h]`, zero past K)
//   x       [M, K]        the weight's dtype, unit stride along K (any row stride)
//   bias    [N] or None   x's dtype
//   y       [M, N]        x's dtype, contiguous
//
// A decode step's linears have few rows and weights far larger than the caches, so their time is the
// weights' stream from memory. Each thread walks its own run of consecutive panels, one sequential stream,
// and for each panel computes every row, in micro tiles of R rows whose R x P outputs stay in vector
// registers along k. The panel, read from memory once, stays in the core's L2 cache for the tiles after
// the first.
//
//   float32, or bfloat16 widened: per k one load of the panel's P weights and one broadcast of x[r, k]
//       per row into float32 fused multiply-adds; every output is one float32 sum over k in order.
//   bfloat16 on bf16 dot products (vdpbf16ps): per pair of k one load of 2 P weights and one broadcast
//       of the pair x[r, 2i:2i+2] per row; each instruction adds both products of a pair to the float32
//       sum (twice the multiplies of a float32 FMA per instruction, half the bytes per weight).
//
// Then the bias, in float32, and one rounding to the dtype. Nothing depends on M or on where a row sits
// in x, so a row's result does not depend on its batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(BF16_DOT_PRODUCTS)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kPanel = 32;  // P: outputs per panel
constexpr int kVectors = kPanel / Vec::size();  // accumulators per row
constexpr int kMaxRows = 24 / kVectors;  // R: rows of a micro tile (R x kVectors accumulators in registers)
#if defined(BF16_DOT_PRODUCTS)
constexpr bool kPairedBf16 = true;  // bf16 panels hold k in pairs, multiplied by bf16 dot products
constexpr int kMaxPairedRows = 12;  // 12 x 2 accumulators
#else
constexpr bool kPairedBf16 = false;
#endif

// The P weights of one panel row, widened to float32.
inline void load_row(const float* p, Vec (&w)[kVectors]) {
  for (int v = 0; v < kVectors; ++v) w[v] = Vec::loadu(p + v * Vec::size());
}

inline void load_row(const at::BFloat16* p, Vec (&w)[kVectors]) {
  static_assert(at::vec::Vectorized<at::BFloat16>::size() == 2 * Vec::size(), "a bf16 vector widens into two");
  for (int v = 0; v < kVectors; v += 2) {
    auto [low, high] = at::vec::convert_to_float<at::BFloat16>(at::vec::Vectorized<at::BFloat16>::loadu(p + v * Vec::size()));
    w[v] = low;
    w[v + 1] = high;
  }
}

// y[0:P] = out[0:P] (+ bias), rounded once to the dtype: the end of one row of a micro tile.
template <typename T>
inline void store_row(const float* out, const T* bias, T* y) {
  for (int64_t c = 0; c < kPanel; ++c) y[c] = static_cast<T>(bias == nullptr ? out[c] : out[c] + static_cast<float>(bias[c]));
}

// body(panel, first_row, rows) for every micro tile of at most max_rows rows of every panel: each thread
// takes a run of consecutive panels and all rows of each.
template <typename F>
void for_each_tile(int64_t num_panels, int64_t M, int max_rows, const F& body) {
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t r = 0; r < M; r += max_rows) body(j, r, static_cast<int>(std::min<int64_t>(max_rows, M - r)));
  });
}

// y[r, 0:P] = x[r, :] . panel[:, 0:P] (+ bias) for the R rows of one micro tile.
template <int R, typename T>
void micro_tile(const float* x, int64_t x_stride, const T* panel, int64_t K, const T* bias, T* y, int64_t y_stride) {
  Vec acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = Vec(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    Vec w[kVectors];
    load_row(panel + k * kPanel, w);
    for (int r = 0; r < R; ++r) {
      const Vec xr(x[r * x_stride + k]);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = at::vec::fmadd(xr, w[v], acc[r][v]);
    }
  }
  float out[kPanel];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVectors; ++v) acc[r][v].store(out + v * Vec::size());
    store_row(out, bias, y + r * y_stride);
  }
}

template <typename T, int R = kMaxRows>
void rows_tail(int rows, const float* x, int64_t x_stride, const T* panel, int64_t K, const T* bias, T* y, int64_t y_stride) {
  if constexpr (R > 0) {
    if (rows == R) return micro_tile<R>(x, x_stride, panel, K, bias, y, y_stride);
    return rows_tail<T, R - 1>(rows, x, x_stride, panel, K, bias, y, y_stride);
  }
}

#if defined(BF16_DOT_PRODUCTS)
// Only these functions use the bf16 dot products (the build defines BF16_DOT_PRODUCTS where the CPU has them):
// the rest of the library keeps the instruction set torch's own kernels were built for.
#pragma GCC push_options
#pragma GCC target("avx512bf16")

// y[r, 0:P] = x[r, :] . panel (+ bias) for the R rows of one micro tile, k in pairs: panel [K2][P][2] and
// x rows of 2 * K2 bf16 (zero past K).
template <int R>
void paired_micro_tile(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* panel, int64_t K2, const at::BFloat16* bias,
                       at::BFloat16* y, int64_t y_stride) {
  static_assert(kPanel == 32, "a panel's pairs are two 512-bit vectors");
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < K2; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel + kPanel);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * i, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
    }
  }
  float out[kPanel];
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out, acc[r][0]);
    _mm512_storeu_ps(out + 16, acc[r][1]);
    store_row(out, bias, y + r * y_stride);
  }
}

template <int R = kMaxPairedRows>
void paired_rows_tail(int rows, const at::BFloat16* x, int64_t x_stride, const at::BFloat16* panel, int64_t K2,
                      const at::BFloat16* bias, at::BFloat16* y, int64_t y_stride) {
  if constexpr (R > 0) {
    if (rows == R) return paired_micro_tile<R>(x, x_stride, panel, K2, bias, y, y_stride);
    return paired_rows_tail<R - 1>(rows, x, x_stride, panel, K2, bias, y, y_stride);
  }
}

void run_paired(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), K2 = panels.size(1), N = y.size(1);
  const at::Tensor xs = K % 2 == 0 ? x : at::constant_pad_nd(x, {0, 1});  // rows of whole pairs
  const int64_t x_stride = xs.stride(0);
  const at::BFloat16* xp = xs.data_ptr<at::BFloat16>();
  const at::BFloat16* ps = panels.data_ptr<at::BFloat16>();
  const at::BFloat16* bs = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* ys = y.data_ptr<at::BFloat16>();
  for_each_tile(panels.size(0), M, kMaxPairedRows, [&](int64_t j, int64_t r, int rows) {
    paired_rows_tail(rows, xp + r * x_stride, x_stride, ps + j * K2 * 2 * kPanel, K2, bs == nullptr ? nullptr : bs + j * kPanel,
                     ys + r * N + j * kPanel, N);
  });
}

#pragma GCC pop_options
#endif

template <typename T>
void run(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const at::Tensor x32 = x.to(at::kFloat);  // bf16 rows widened once, not once per panel
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), x_stride = x32.stride(0);
  const float* xs = x32.data_ptr<float>();
  const T* ps = panels.data_ptr<T>();
  const T* bs = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* ys = y.data_ptr<T>();
  for_each_tile(panels.size(0), M, kMaxRows, [&](int64_t j, int64_t r, int rows) {
    rows_tail<T>(rows, xs + r * x_stride, x_stride, ps + j * K * kPanel, K, bs == nullptr ? nullptr : bs + j * kPanel,
                 ys + r * N + j * kPanel, N);
  });
}

bool paired(at::ScalarType dtype) { return kPairedBf16 && dtype == at::kBFloat16; }

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % kPanel == 0, "weight must be [N, K] with N a multiple of 32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const int64_t N = weight.size(0), K = weight.size(1);
  if (paired(weight.scalar_type())) {
    const at::Tensor even = K % 2 == 0 ? weight : at::constant_pad_nd(weight, {0, 1});
    return even.reshape({N / kPanel, kPanel, (K + 1) / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  return weight.reshape({N / kPanel, kPanel, K}).transpose(1, 2).contiguous();
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with unit stride along K");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type(), "x and the panels must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const bool pairs = paired(x.scalar_type());
  if (pairs) {
    TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kPanel && panels.size(3) == 2 && panels.is_contiguous(),
                "panels must be pack_panels' contiguous [N / 32, ceil(K / 2), 32, 2] tensor");
    TORCH_CHECK(panels.size(1) == (x.size(1) + 1) / 2, "x and the panels must share K");
  } else {
    TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
                "panels must be pack_panels' contiguous [N / 32, K, 32] tensor");
    TORCH_CHECK(panels.size(1) == x.size(1), "x and the panels must share K");
  }
  const int64_t M = x.size(0), N = panels.size(0) * kPanel;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous [N] tensor of x's dtype");
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(BF16_DOT_PRODUCTS)
  if (pairs) {
    run_paired(x, panels, bias, y);
    return y;
  }
#endif
  AT_DISPATCH_SWITCH(x.scalar_type(), "panel_linear",
    AT_DISPATCH_CASE(at::kFloat, [&] { run<scalar_t>(x, panels, bias, y); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { run<scalar_t>(x, panels, bias, y); }));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefix_console, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefix_console, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
