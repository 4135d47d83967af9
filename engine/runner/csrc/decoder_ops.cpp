// Elementwise steps of a Llama-family layer, each one pass over its rows instead of several torch ops
// (engine/runner/decoder_forward.py uses them on the CPU when this library is loaded):
//
//   add_rms_norm_(hidden, delta, weight, eps) -> normed    hidden += delta (in place), then rms_norm(hidden)
//   rms_norm(x, weight, eps) -> normed
//   silu_and_mul(gate_up) -> silu(gate_up[:, :I]) * gate_up[:, I:]
//   rope_(qk, cos, sin)                                     qk = qk * cos + rotate_half(qk) * sin (in place)
//
// Each rounds where transformers' eager ops round: RMSNorm normalizes in float32, casts to the model's
// dtype, then multiplies by its weight (one more rounding); SiLU rounds before the product; the rotary
// embedding rounds both products and their sum. Results equal the eager ops' except where the RMSNorm's
// mean, summed in another order, changes the last bit of its float32 scale factor (an ulp or two in
// float32; in bf16 a rounding flipped now and then). The library is compiled with -ffp-contract=off so that no product and sum fuse into one
// rounding that the eager ops do not have.
//
// Rows are [T, N] with unit stride along N; x and hidden contiguous; qk [T, heads, D] with any row
// stride and heads D apart (a view of the fused q|k|v output); cos, sin [T, D] contiguous.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElements = 16384;  // below this many elements per thread, one thread does all

int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

template <typename scalar_t>
inline scalar_t round_to(float value) {
  return static_cast<scalar_t>(value);
}

// out = weight * dtype(x * rsqrt(mean(x^2) + eps)), x one row of n values already in float.
template <typename scalar_t>
void normalize_row(const float* x, const scalar_t* weight, int64_t n, float eps, scalar_t* out) {
  int64_t d = 0;
  Vec squares(0.0f);
  for (; d + Vec::size() <= n; d += Vec::size()) {
    const Vec v = Vec::loadu(x + d);
    squares = squares + v * v;  // squares rounded, then summed, as pow(2) then mean do
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, squares);
  for (; d < n; ++d) sum += x[d] * x[d];
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (d = 0; d < n; ++d) {
    const scalar_t normed = round_to<scalar_t>(x[d] * inverse);
    out[d] = round_to<scalar_t>(static_cast<float>(weight[d]) * static_cast<float>(normed));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [T, N]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be [N]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and ", name, " must share a dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "x");
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      std::vector<float> row(n);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t d = 0; d < n; ++d) row[d] = static_cast<float>(src[t * n + d]);
        normalize_row<scalar_t>(row.data(), w, n, static_cast<float>(eps), dst + t * n);
      }
    });
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(hidden, weight, "hidden");
  TORCH_CHECK(delta.sizes() == hidden.sizes() && delta.scalar_type() == hidden.scalar_type() && delta.stride(1) == 1,
              "delta must be like hidden, with unit stride along N");
  auto out = at::empty_like(hidden);
  const int64_t rows = hidden.size(0), n = hidden.size(1), delta_stride = delta.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* h = hidden.data_ptr<scalar_t>();
    const scalar_t* add = delta.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      std::vector<float> row(n);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t d = 0; d < n; ++d) {
          const scalar_t sum = round_to<scalar_t>(static_cast<float>(h[t * n + d]) + static_cast<float>(add[t * delta_stride + d]));
          h[t * n + d] = sum;
          row[d] = static_cast<float>(sum);
        }
        normalize_row<scalar_t>(row.data(), w, n, static_cast<float>(eps), dst + t * n);
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with unit stride along 2I");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, inner}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(2 * inner), [&](int64_t begin, int64_t end) {
      std::vector<float> gate(inner);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = src + t * stride;
        const scalar_t* u = g + inner;
        for (int64_t d = 0; d < inner; ++d) gate[d] = static_cast<float>(g[d]);
        // silu(x) = x / (1 + exp(-x)), as torch's CPU kernel computes it
        at::vec::map([](Vec x) { return x / (Vec(1.0f) + x.neg().exp()); }, gate.data(), gate.data(), inner);
        for (int64_t d = 0; d < inner; ++d)
          dst[t * inner + d] = round_to<scalar_t>(static_cast<float>(round_to<scalar_t>(gate[d])) * static_cast<float>(u[d]));
      }
    });
  });
  return out;
}

void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "qk must be [T, heads, D], heads D apart");
  const int64_t rows = qk.size(0), heads = qk.size(1), D = qk.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == D && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && cos.scalar_type() == qk.scalar_type() && sin.scalar_type() == qk.scalar_type(),
              "cos and sin must be contiguous [T, D] in qk's dtype");
  const int64_t stride = qk.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rope_", [&] {
    scalar_t* x = qk.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(heads * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* ct = c + t * D;
        const scalar_t* st = s + t * D;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* head = x + t * stride + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(head[i]), x2 = static_cast<float>(head[i + half]);
            // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product rounded, then the sum
            const float first = static_cast<float>(round_to<scalar_t>(x1 * static_cast<float>(ct[i]))) +
                                static_cast<float>(round_to<scalar_t>(-x2 * static_cast<float>(st[i])));
            const float second = static_cast<float>(round_to<scalar_t>(x2 * static_cast<float>(ct[i + half]))) +
                                 static_cast<float>(round_to<scalar_t>(x1 * static_cast<float>(st[i + half])));
            head[i] = round_to<scalar_t>(first);
            head[i + half] = round_to<scalar_t>(second);
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefix_console, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) hidden, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(prefix_console, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_", &rope_);
}
