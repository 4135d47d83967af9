// Decode attention over paged K/V read in place: one query per element, its keys named by its block list.
//
//   prefix_console::paged_decode(query, key_cache, value_cache, blocks, fields, block_size, window, scale)
//       -> (out, lse)
//
//   query        [B, H, D]          one query row per element (any row/head strides, unit stride along D)
//   key_cache    [KV, N, S, D]      one layer's keys: head-major blocks of S slots (the runner's layout)
//   value_cache  like key_cache
//   blocks       [B, M] int64       each element's physical blocks, in key order (padding: any valid block)
//   fields       [B, 2 + M] int64   per element: query position, valid slots, then the logical block of
//                                   each listed block (the same fields the padded call's mask is built from)
//   window       0 for full attention, else W: a key at p is visible to a query at q when q - W < p <= q
//   out          [B, H, D]          query's dtype
//   lse          [B, H] float32     log-sum-exp of the scaled scores over the visible keys
//
// Slot j of element b (j < valid slots) is slot j % S of blocks[b, j / S], at position
// fields[b, 2 + j / S] * S + j % S; it is visible when that position is within the window of the query
// position (causality: not after it). Invisible and padding slots are never read, so a non-finite value
// there cannot reach another element's result. Query head h reads KV head h / (H / KV).
//
// Each (element, KV head) is one task: its H / KV query heads walk the element's blocks once, with the
// streaming softmax (running maximum m, sum l, weighted value sum acc, all float32):
//
//   per block:  s = scale * q . k for its visible slots;  m' = max(m, max s);  c = exp(m - m')
//               l = c * l + sum exp(s - m');  acc = c * acc + sum exp(s - m') v;  m = m'
//   at the end: out = acc / l;  lse = m + log(l)     (no visible key: out 0, lse -inf)
//
// A block is one page of a KV head's memory, and an element's blocks are scattered: while a block is
// scored, the next block's rows are prefetched, one row of keys and one of values per key scored (AMD's
// Zen drops prefetches issued in one burst), unless the next block is the adjacent page, which the
// hardware prefetchers follow anyway. Measured on SmolLM2's 9 x 3 heads of 64, fp32, 30 layers' caches,
// 2 threads, scattered blocks: 64 decodes of 64 own tokens 607-722 us a layer without, 447-471 with;
// one decode over 1,056 keys 193-222 us and 130-157; in the engine's 64-decode step 21.4-22.9 ms of
// kernel time a step without, 17.5-17.6 with. Over adjacent blocks: unchanged (60 and 61 us).
//
// Arithmetic is float32 whatever the cache dtype (bf16/fp16 values are widened on load), as the
// fused CPU flash kernel does; results match it up to summation order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

struct Layout {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
  float scale;
};

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  Vec sum(0.0f);
  for (; d + Vec::size() <= n; d += Vec::size()) sum = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), sum);
  float total = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, sum);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

// Asks for one row of keys and one of values (row_bytes each) to be brought into the cache.
inline void prefetch_row(const char* key_row, const char* value_row, int64_t row_bytes) {
  for (int64_t offset = 0; offset < row_bytes; offset += 64) {  // 64: a cache line
    __builtin_prefetch(key_row + offset, 0, 3);
    __builtin_prefetch(value_row + offset, 0, 3);
  }
}

// Rows [lo, hi) of a block of S x D values in float32: the cache's own memory when it is float32, else
// widened into `buffer` (same layout).
template <typename scalar_t>
const float* block_as_floats(const scalar_t* block, int64_t lo, int64_t hi, int64_t D, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return block;
  } else {
    at::vec::convert(block + lo * D, buffer + lo * D, (hi - lo) * D);
    return buffer;
  }
}

// acc[0:D] = correction * acc + sum over slots s in [lo, hi) of p[s] * values[s, 0:D]: per chunk of up
// to four vectors, the accumulators stay in registers across the block's slots.
inline void accumulate_values(float* acc, float correction, const float* p, const float* values, int64_t lo, int64_t hi, int64_t D) {
  constexpr int64_t kChunk = 4 * Vec::size();
  int64_t d = 0;
  for (; d + kChunk <= D; d += kChunk) {
    Vec a[4];
    for (int i = 0; i < 4; ++i) a[i] = Vec::loadu(acc + d + i * Vec::size()) * Vec(correction);
    for (int64_t s = lo; s < hi; ++s) {
      const Vec weight(p[s]);
      for (int i = 0; i < 4; ++i) a[i] = at::vec::fmadd(weight, Vec::loadu(values + s * D + d + i * Vec::size()), a[i]);
    }
    for (int i = 0; i < 4; ++i) a[i].store(acc + d + i * Vec::size());
  }
  for (; d + Vec::size() <= D; d += Vec::size()) {
    Vec a = Vec::loadu(acc + d) * Vec(correction);
    for (int64_t s = lo; s < hi; ++s) a = at::vec::fmadd(Vec(p[s]), Vec::loadu(values + s * D + d), a);
    a.store(acc + d);
  }
  for (; d < D; ++d) {
    float a = acc[d] * correction;
    for (int64_t s = lo; s < hi; ++s) a += p[s] * values[s * D + d];
    acc[d] = a;
  }
}

// One (element, KV head): the group of query heads that reads it. `scratch` holds, in float32, the
// group's scaled queries and accumulators (group * D each), their scores (group * S, head-major), their
// running maxima and sums (group each) and one block of keys and one of values (S * D each, used when
// the cache is not float32).
template <typename scalar_t>
void attend_one(
    const Layout& lay,
    const scalar_t* query,  // this element's first query head of the group; heads `head_stride` apart
    int64_t head_stride,
    const scalar_t* keys,  // this KV head's blocks: [N, S, D]
    const scalar_t* values,
    const int64_t* blocks,  // [M]
    const int64_t* fields,  // [2 + M]
    scalar_t* out,  // [group, D], contiguous within the element's row
    float* lse,  // [group]
    float* scratch) {
  const int64_t group = lay.num_heads / lay.num_kv_heads, D = lay.head_dim, S = lay.block_size;
  float* q = scratch;
  float* acc = q + group * D;
  float* scores = acc + group * D;  // [head of the group, slot]
  float* running_max = scores + group * S;
  float* running_sum = running_max + group;
  float* key_buffer = running_sum + group;
  float* value_buffer = key_buffer + S * D;
  for (int64_t g = 0; g < group; ++g) {
    at::vec::convert(query + g * head_stride, q + g * D, D);
    for (int64_t d = 0; d < D; ++d) q[g * D + d] *= lay.scale;
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.0f;
  }
  std::fill(acc, acc + group * D, 0.0f);

  const int64_t query_pos = fields[0], valid = fields[1];
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t b = 0; b < lay.max_blocks && b * S < valid; ++b) {
    // The next block's rows are prefetched while this one is scored (see the header).
    const bool has_next = b + 1 < lay.max_blocks && (b + 1) * S < valid;
    const bool prefetch = has_next && blocks[b + 1] != blocks[b] + 1;  // the hardware follows the next page
    const int64_t next = prefetch ? blocks[b + 1] * S * D : 0;
    const int64_t first_pos = fields[2 + b] * S;
    // The block's visible slots are one run [lo, hi): positions increase along the block.
    int64_t lo = 0, hi = std::min(S, valid - b * S);
    hi = std::min(hi, query_pos - first_pos + 1);
    if (lay.window > 0) lo = std::max<int64_t>(lo, query_pos - lay.window + 1 - first_pos);
    if (lo >= hi) continue;
    const float* block_keys = block_as_floats(keys + blocks[b] * S * D, lo, hi, D, key_buffer);
    const float* block_values = block_as_floats(values + blocks[b] * S * D, lo, hi, D, value_buffer);
    for (int64_t s = lo; s < hi; ++s) {
      if (prefetch) prefetch_row(reinterpret_cast<const char*>(keys + next + s * D), reinterpret_cast<const char*>(values + next + s * D), row_bytes);
      for (int64_t g = 0; g < group; ++g) scores[g * S + s] = dot(q + g * D, block_keys + s * D, D);
    }
    for (int64_t g = 0; g < group; ++g) {
      float* p = scores + g * S;
      const float block_max = std::max(running_max[g], at::vec::reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, p + lo, hi - lo));
      // exp(-inf - finite) = 0 clears the empty start. A NaN score never becomes the maximum (std::max
      // keeps its first argument), but its exp is NaN and reaches this element's sum and output (and no
      // other element's).
      const float correction = running_max[g] == block_max ? 1.0f : std::exp(running_max[g] - block_max);
      running_max[g] = block_max;
      at::vec::map([block_max](Vec x) { return (x - Vec(block_max)).exp(); }, p + lo, p + lo, hi - lo);
      const float block_sum = at::vec::reduce_all<float>([](Vec x, Vec y) { return x + y; }, p + lo, hi - lo);
      running_sum[g] = running_sum[g] * correction + block_sum;
      accumulate_values(acc + g * D, correction, p, block_values, lo, hi, D);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float sum = running_sum[g];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[g * D + d] * inverse);
    lse[g] = sum > 0.0f ? running_max[g] + std::log(sum) : -std::numeric_limits<float>::infinity();
  }
}

std::tuple<at::Tensor, at::Tensor> paged_decode(
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& blocks,
    const at::Tensor& fields,
    int64_t block_size,
    int64_t window,
    double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [B, H, D] with unit stride along D");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous(), "key_cache must be a contiguous [KV, N, S, D]");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(), "value_cache must match key_cache");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query, key_cache and value_cache must share a dtype");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KV = key_cache.size(0), N = key_cache.size(1), S = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && S == block_size, "cache blocks must be [S = block_size, D]");
  TORCH_CHECK(KV > 0 && H % KV == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == B && blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              "blocks must be a contiguous int64 [B, M]");
  const int64_t M = blocks.size(1);
  TORCH_CHECK(fields.dim() == 2 && fields.size(0) == B && fields.size(1) == 2 + M &&
                  fields.scalar_type() == at::kLong && fields.is_contiguous(),
              "fields must be a contiguous int64 [B, 2 + M]");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  // Every block id is read, so every one is checked: an id past the cache would read foreign memory.
  const int64_t* block_ids = blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * M; ++i)
    TORCH_CHECK(block_ids[i] >= 0 && block_ids[i] < N, "block id ", block_ids[i], " outside the cache's ", N, " blocks");
  const int64_t* field_values = fields.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(field_values[b * (2 + M) + 1] <= M * S, "element ", b, " has more valid slots than its blocks hold");

  auto out = at::empty({B, H, D}, query.options());
  auto lse = at::empty({B, H}, query.options().dtype(at::kFloat));
  const Layout lay{H, KV, D, S, M, window, static_cast<float>(scale)};
  const int64_t group = H / KV;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = key_cache.data_ptr<scalar_t>();
    const scalar_t* v = value_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    float* l = lse.data_ptr<float>();
    at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(2 * group * D + group * S + 2 * group + 2 * S * D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / KV, h = task % KV;
        attend_one<scalar_t>(
            lay, q + b * query.stride(0) + h * group * query.stride(1), query.stride(1),
            k + h * N * S * D, v + h * N * S * D, block_ids + b * M, field_values + b * (2 + M),
            o + (b * H + h * group) * D, l + b * H + h * group, scratch.data());
      }
    });
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(prefix_console, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor blocks, Tensor fields, "
      "int block_size, int window, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prefix_console, CPU, m) { m.impl("paged_decode", &paged_decode); }
