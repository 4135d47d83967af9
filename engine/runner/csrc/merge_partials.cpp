// Two partial attention results over disjoint key sets merged into the first, in place.
//
//   prefix_console::merge_partials_(out, lse, other_out, other_lse) -> ()
//
//   out        [R, H, D]  the rows' results so far, overwritten (any row and head strides, unit stride along D)
//   lse        [R, H]     float32, their log-sum-exps (any strides)
//   other_out  [R, H, D]  the same rows over the other keys, out's dtype (any strides, unit along D)
//   other_lse  [R, H]     float32
//
// out = lerp(out, other_out, w) with w = sigmoid(other_lse - lse) = exp(other_lse) / (exp(lse) +
// exp(other_lse)), in float32 and rounded once to out's dtype: the result over both key sets, exactly as
// engine/runner/attention_kernels.py's `merge_partials` computes it (torch.lerp's two-sided formula), in
// one pass instead of five ops and a copy. lse is left as it was (no later call reads it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

void merge_partials_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& other_out, const at::Tensor& other_lse) {
  TORCH_CHECK(out.dim() == 3 && other_out.sizes() == out.sizes(), "out and other_out must be one [R, H, D] shape");
  TORCH_CHECK(lse.dim() == 2 && other_lse.dim() == 2 && lse.size(0) == out.size(0) && lse.size(1) == out.size(1) &&
                  other_lse.sizes() == lse.sizes(),
              "lse and other_lse must be [R, H] for out [R, H, D]");
  TORCH_CHECK(out.stride(2) == 1 && other_out.stride(2) == 1, "unit stride along the head dimension");
  TORCH_CHECK(out.scalar_type() == other_out.scalar_type(), "out and other_out must share a dtype");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && other_lse.scalar_type() == at::kFloat, "log-sum-exps must be float32");
  const int64_t R = out.size(0), H = out.size(1), D = out.size(2);
  const float* la = lse.data_ptr<float>();
  const float* lb = other_lse.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "merge_partials_", [&] {
    scalar_t* a = out.data_ptr<scalar_t>();
    const scalar_t* b = other_out.data_ptr<scalar_t>();
    at::parallel_for(0, R * H, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / H, h = i % H;
        const float x = lb[r * other_lse.stride(0) + h * other_lse.stride(1)] - la[r * lse.stride(0) + h * lse.stride(1)];
        const float w = 1.0f / (1.0f + std::exp(-x));
        scalar_t* row_a = a + r * out.stride(0) + h * out.stride(1);
        const scalar_t* row_b = b + r * other_out.stride(0) + h * other_out.stride(1);
        for (int64_t d = 0; d < D; ++d) {
          const float va = static_cast<float>(row_a[d]), diff = static_cast<float>(row_b[d]) - va;
          row_a[d] = static_cast<scalar_t>(w < 0.5f ? va + w * diff : static_cast<float>(row_b[d]) - diff * (1.0f - w));
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefix_console, m) {
  m.def("merge_partials_(Tensor(a!) out, Tensor lse, Tensor other_out, Tensor other_lse) -> ()");
}

TORCH_LIBRARY_IMPL(prefix_console, CPU, m) { m.impl("merge_partials_", &merge_partials_); }
