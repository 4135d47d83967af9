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
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElements = 16384;  // below this many elements per thread, one thread does all

int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

// Per-thread row buffers: float rows to compute in, and one row of the tensor's dtype to round through.
template <typename scalar_t>
struct RowBuffers {
  explicit RowBuffers(int64_t n) : a(n), b(n), c(n), rounded(n) {}
  std::vector<float> a, b, c;
  std::vector<scalar_t> rounded;

  // values[0:n] rounded to scalar_t's precision, in place (float32 values stay as they are)
  void round(float* values, int64_t n) {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      at::vec::convert(values, rounded.data(), n);
      at::vec::convert(rounded.data(), values, n);
    }
  }
};

Vec add(Vec x, Vec y) { return x + y; }
Vec mul(Vec x, Vec y) { return x * y; }

// out = dtype(weight * dtype(x * rsqrt(mean(x^2) + eps))); x is one row of n float values (overwritten).
template <typename scalar_t>
void normalize_row(float* x, const float* weight, int64_t n, float eps, scalar_t* out, RowBuffers<scalar_t>& buffers) {
  int64_t d = 0;
  Vec squares(0.0f);
  for (; d + Vec::size() <= n; d += Vec::size()) {
    const Vec v = Vec::loadu(x + d);
    squares = squares + v * v;  // squares rounded, then summed, as pow(2) then mean do
  }
  float sum = at::vec::vec_reduce_all<float>(add, squares);
  for (; d < n; ++d) sum += x[d] * x[d];
  const Vec inverse(1.0f / std::sqrt(sum / static_cast<float>(n) + eps));
  at::vec::map([&](Vec v) { return v * inverse; }, x, x, n);
  buffers.round(x, n);
  at::vec::map2(mul, x, weight, x, n);
  at::vec::convert(x, out, n);
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [T, N]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be [N]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and ", name, " must share a dtype");
}

template <typename scalar_t>
std::vector<float> floats(const at::Tensor& weight) {
  std::vector<float> values(weight.numel());
  at::vec::convert(weight.data_ptr<scalar_t>(), values.data(), weight.numel());
  return values;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "x");
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const std::vector<float> w = floats<scalar_t>(weight);
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      RowBuffers<scalar_t> buffers(n);
      for (int64_t t = begin; t < end; ++t) {
        at::vec::convert(src + t * n, buffers.a.data(), n);
        normalize_row<scalar_t>(buffers.a.data(), w.data(), n, static_cast<float>(eps), dst + t * n, buffers);
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
    const scalar_t* add_rows = delta.data_ptr<scalar_t>();
    const std::vector<float> w = floats<scalar_t>(weight);
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      RowBuffers<scalar_t> buffers(n);
      float* sum = buffers.a.data();
      for (int64_t t = begin; t < end; ++t) {
        at::vec::convert(h + t * n, sum, n);
        at::vec::convert(add_rows + t * delta_stride, buffers.b.data(), n);
        at::vec::map2(add, sum, sum, buffers.b.data(), n);
        at::vec::convert(sum, h + t * n, n);  // hidden + delta, rounded to hidden's dtype
        buffers.round(sum, n);
        normalize_row<scalar_t>(sum, w.data(), n, static_cast<float>(eps), dst + t * n, buffers);
      }
    });
  });
  return out;
}

// silu(x) = x / (1 + exp(-x)), as torch's CPU kernel computes it
Vec silu(Vec x) { return x / (Vec(1.0f) + x.neg().exp()); }

// out[0:n] = silu(gate) * up over float32 rows, vector by vector; the tail (n not a multiple of the vector)
// through partial loads, so every element takes the same vector arithmetic as the buffered path. Full
// vectors take plain loads and stores: with the count-taking forms in the loop, GCC emits masked stores
// throughout, and two threads of them ran 3x slower than plain ones on this CPU (a 2,048 x 1,536 call:
// 3.4 ms against 1.1 ms; one thread 2.1 ms either way).
void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  const int64_t whole = n - n % Vec::size();
  for (int64_t d = 0; d < whole; d += Vec::size()) (silu(Vec::loadu(gate + d)) * Vec::loadu(up + d)).store(out + d);
  if (whole < n) {
    const int count = static_cast<int>(n - whole);
    (silu(Vec::loadu(gate + whole, count)) * Vec::loadu(up + whole, count)).store(out + whole, count);
  }
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with unit stride along 2I");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, inner}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {  // nothing to widen or round: one pass, no row copies
    const float* src = gate_up.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, rows, row_grain(2 * inner), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_and_mul_row(src + t * stride, src + t * stride + inner, dst + t * inner, inner);
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(2 * inner), [&](int64_t begin, int64_t end) {
      RowBuffers<scalar_t> buffers(inner);
      float *gate = buffers.a.data(), *up = buffers.b.data();
      for (int64_t t = begin; t < end; ++t) {
        at::vec::convert(src + t * stride, gate, inner);
        at::vec::convert(src + t * stride + inner, up, inner);
        // silu, rounded before the product
        at::vec::map(silu, gate, gate, inner);
        buffers.round(gate, inner);
        at::vec::map2(mul, gate, gate, up, inner);
        at::vec::convert(gate, dst + t * inner, inner);
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
    const int64_t width = heads * D;  // one token's heads side by side (heads are D apart)
    at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      RowBuffers<scalar_t> buffers(width);
      std::vector<float> row_cos(width), row_sin(width);  // the token's cos and sin, once per head
      float *values = buffers.a.data(), *rotated = buffers.b.data(), *products = buffers.c.data();
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          at::vec::convert(c + t * D, row_cos.data() + h * D, D);
          at::vec::convert(s + t * D, row_sin.data() + h * D, D);
        }
        scalar_t* token = x + t * stride;
        at::vec::convert(token, values, width);
        // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) per head: each product rounded, then the sum
        for (int64_t h = 0; h < width; h += D) {
          for (int64_t i = 0; i < half; ++i) {
            rotated[h + i] = -values[h + i + half];
            rotated[h + i + half] = values[h + i];
          }
        }
        at::vec::map2(mul, products, values, row_cos.data(), width);
        buffers.round(products, width);
        at::vec::map2(mul, rotated, rotated, row_sin.data(), width);
        buffers.round(rotated, width);
        at::vec::map2(add, products, products, rotated, width);
        at::vec::convert(products, token, width);
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
