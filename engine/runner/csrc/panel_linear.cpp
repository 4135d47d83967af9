// A linear layer for few rows over a weight packed once in column panels: y = x W^T.
//
//   prefix_console::panel_linear(x, panels, bias) -> y
//
//   x       [M, K]        float32 or bfloat16, unit stride along K (any row stride)
//   panels  [N / P, K, P] x's dtype: the [N, K] weight cut into panels of P = 32 outputs, each stored
//                          k-major (`panels[j, k, c] = W[j * P + c, k]`); engine/runner/packed_linear.py packs it
//   bias    [N] or None   x's dtype
//   y       [M, N]        x's dtype, contiguous
//
// A decode step's linears have few rows and weights far larger than the caches, so their time is the
// weights' stream from memory. Each thread walks its own run of consecutive panels, one sequential stream,
// and for each panel computes every row: per k one load of the panel's P weights and one broadcast of
// x[r, k] per row, into R x (P / vector width) accumulators (a micro tile of R rows, all rows in tiles
// of R). The panel, read from memory once, stays in the core's L2 cache for the tiles after the first.
//
// Every output is one float32 sum over k in order, then the bias, rounded once to the dtype: the same
// whatever M is and wherever the row sits in x, so a row's result does not depend on its batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kPanel = 32;  // P: outputs per panel
constexpr int kVectors = kPanel / Vec::size();  // accumulators per row
constexpr int kMaxRows = 24 / kVectors;  // R: rows of a micro tile (R x kVectors accumulators in registers)

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

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

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
    for (int64_t c = 0; c < kPanel; ++c) {
      const float value = bias == nullptr ? out[c] : out[c] + widen(bias[c]);
      y[r * y_stride + c] = static_cast<T>(value);
    }
  }
}

template <typename T, int R = kMaxRows>
void rows_tail(int rows, const float* x, int64_t x_stride, const T* panel, int64_t K, const T* bias, T* y, int64_t y_stride) {
  if constexpr (R > 0) {
    if (rows == R) return micro_tile<R>(x, x_stride, panel, K, bias, y, y_stride);
    return rows_tail<T, R - 1>(rows, x, x_stride, panel, K, bias, y, y_stride);
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const at::Tensor x32 = x.to(at::kFloat);  // bf16 rows widened once, not once per panel
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), x_stride = x32.stride(0);
  const float* xs = x32.data_ptr<float>();
  const T* ps = panels.data_ptr<T>();
  const T* bs = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* ys = y.data_ptr<T>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const T* panel = ps + j * K * kPanel;
      const T* b = bs == nullptr ? nullptr : bs + j * kPanel;
      for (int64_t r = 0; r < M; r += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - r));
        rows_tail<T>(rows, xs + r * x_stride, x_stride, panel, K, b, ys + r * N + j * kPanel, N);
      }
    }
  });
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with unit stride along K");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be a contiguous [N / 32, K, 32] tensor");
  TORCH_CHECK(panels.size(1) == x.size(1), "x and the panels must share K");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type(), "x and the panels must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const int64_t M = x.size(0), K = x.size(1), num_panels = panels.size(0), N = num_panels * kPanel;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous [N] tensor of x's dtype");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "panel_linear",
    AT_DISPATCH_CASE(at::kFloat, [&] { run<scalar_t>(x, panels, bias, y); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { run<scalar_t>(x, panels, bias, y); }));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefix_console, m) { m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(prefix_console, CPU, m) { m.impl("panel_linear", &panel_linear); }
