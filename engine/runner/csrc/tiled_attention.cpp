// Attention for many queries over contiguous keys, with its log-sum-exp, on register-blocked tiles.
//
//   prefix_console::tiled_attention(query, key, value, causal, scale) -> (out, lse)
//
//   query   [B, H, n, D]    any strides, unit stride along D; D a multiple of 16
//   key     [B, KV, L, D]   any strides, unit stride along D
//   value   like key
//   causal  true: n == L and query i sees keys 0..i; false: every query sees every key
//   out     [B, H, n, D]    query's dtype, a transposed view of token-major [B, n, H, D] storage
//   lse     [B, H, n]       float32 (a view of [B, n, H]): log-sum-exp of the scaled scores over the visible keys
//
// The runner's unmasked calls: a prefill's own tokens (causal) and many queries over one shared prefix.
// Query head h reads KV head h / G (G = H / KV). The G heads of a KV head and the n queries form the
// rows of one matrix, token-major (row r = query r / G, head r % G), so the heads that share a KV head
// read each key block once, and a tile of rows holds consecutive queries (close causal limits).
//
// Each (element, KV head)'s keys are packed in float32, transposed into blocks of KB keys
// ([L / KB][D][KB], zero padding): once up front when several tiles read each block; with one tile (a
// few decodes over a shared prefix), each task packs the blocks it reads, which no other task reads, so
// the packed copy never goes to memory. Values are read in place, in their dtype, widened on load. A
// task is a tile of rows over a range of key blocks; per key block and per micro tile of R rows it runs
//
//   scores  s[R, KB] = (scale q)[R, D] . K^T[D, KB]           R x NV vector accumulators, D steps
//   softmax m' = m, or max(m, max s) once some score passes m + 8;  c = exp(m - m');  p = exp(s - m');
//           l = c l + sum p;  m = m'
//   values  o[R, D] = c o + p[R, KB] . V[KB, D]                  R x NV vector accumulators, KB steps
//
// and at the end out = o / l, lse = m + log(l) (l is a vector of partial sums until then). The shift m
// only has to keep exp from overflowing, so it moves only when a score passes it by more than 8: weights
// stay below e^8, and most blocks skip the row maximum's reduction and the rescaling (7 % faster on
// SmolLM2's prefill shapes, fp32). Keys a row
// does not see (causality, padding) score -inf and weigh 0. A call with few tiles splits its keys into
// ranges whose partial results are merged by their log-sum-exps. Tasks are taken from a shared counter,
// the heaviest (latest causal) tiles first.
//
// Arithmetic is float32 whatever the dtype, as in the CPU flash kernel; results match it up to
// summation order. bf16 calls on a CPU with bf16 dot products (the build defines BF16_DOT_PRODUCTS) pack
// keys in pairs along D ([L / KB][D / 2][KB][2]) and values in pairs of keys ([L / KB][KB / 2][D][2]),
// and each vdpbf16ps adds two exact products to a float32 sum: twice the multiplies of a float32 FMA.
// The scores are those exact products' sums, scaled afterwards; the weights p are rounded to bf16
// before they multiply the values, as a bf16 GPU kernel rounds them (the output is bf16 anyway).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(BF16_DOT_PRODUCTS)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRows = 6;  // R: rows of a micro tile (R x NV accumulators + NV loads within 32 registers)
#else
constexpr int kRows = 3;  // 16 vector registers
#endif
constexpr int kVectors = 4;  // NV: vectors of keys (scores) or of the head dimension (values) per row
constexpr int64_t kBlockKeys = kVectors * Vec::size();  // KB
constexpr int kMicroTiles = 4;  // micro tiles per task tile: rows sharing one pass over a key block
constexpr int64_t kTileRows = kRows * kMicroTiles;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kShiftSlack = 8.0f;  // a row's softmax shift moves once a score passes it by more than this
static_assert(kBlockKeys % 16 == 0, "key blocks are transposed in 16 x 16 tiles");

struct Shape {
  int64_t batch, heads, kv_heads, group, queries, keys, head_dim;
  int64_t rows;  // group * queries per (element, KV head)
  int64_t tiles;  // ceil(rows / kTileRows)
  int64_t key_blocks;  // ceil(keys / KB)
  int64_t splits;  // key ranges per tile
  int64_t blocks_per_split;
  bool causal;
};

// s[r][0:NV vectors] = q[r] . kt[:, 0:NV vectors] for the R rows of a micro tile: the block's first
// NV * vector width keys (kt's rows are KB apart).
template <int NV>
inline void score_chunk(const float* q, const float* kt, int64_t D, float* s) {
  Vec acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec(0.0f);
  for (int64_t d = 0; d < D; ++d) {
    Vec k[NV];
    for (int v = 0; v < NV; ++v) k[v] = Vec::loadu(kt + d * kBlockKeys + v * Vec::size());
    for (int r = 0; r < kRows; ++r) {
      const Vec qd(q[r * D + d]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(qd, k[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(s + r * kBlockKeys + v * Vec::size());
}

// The scores of the block's first `vectors` vectors of keys (1..kVectors): the keys some row of the
// micro tile sees, so a causal diagonal or a short last block scores no more than it needs.
inline void score_tile(const float* q, const float* kt, int64_t D, int vectors, float* s) {
  static_assert(kVectors == 4, "one case per vector count");
  switch (vectors) {
    case 1: return score_chunk<1>(q, kt, D, s);
    case 2: return score_chunk<2>(q, kt, D, s);
    case 3: return score_chunk<3>(q, kt, D, s);
    default: return score_chunk<4>(q, kt, D, s);
  }
}

// NV vectors of float32 from src (widened from bf16/fp16 on load).
template <typename scalar_t, int NV>
inline void load_floats(const scalar_t* src, Vec (&out)[NV]) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (int v = 0; v < NV; ++v) out[v] = Vec::loadu(src + v * Vec::size());
  } else if constexpr (!std::is_same_v<scalar_t, at::BFloat16> && !std::is_same_v<scalar_t, at::Half>) {  // double
    float widened[NV * Vec::size()];
    for (int i = 0; i < NV * Vec::size(); ++i) widened[i] = static_cast<float>(src[i]);
    for (int v = 0; v < NV; ++v) out[v] = Vec::loadu(widened + v * Vec::size());
  } else {
    using Narrow = at::vec::Vectorized<scalar_t>;  // 2 x Vec::size() elements
    for (int v = 0; v < NV; v += 2) {
      const int count = std::min(2, NV - v) * Vec::size();
      auto [low, high] = at::vec::convert_to_float<scalar_t>(Narrow::loadu(src + v * Vec::size(), count));
      out[v] = low;
      if (v + 1 < NV) out[v + 1] = high;
    }
  }
}

// o[r][0:NV vectors] = correction[r] o[r][...] + sum_j p[r][j] vals[j][...] for the R rows of a micro
// tile, j < num_keys: one chunk of the head dimension (o's rows D apart, vals' rows vals_stride apart).
template <typename scalar_t, int NV>
inline void accumulate_chunk(const float* p, const float* correction, const scalar_t* vals, int64_t vals_stride, int64_t num_keys,
                             int64_t D, float* o) {
  Vec acc[kRows][NV];
  for (int r = 0; r < kRows; ++r) {
    const Vec c(correction[r]);
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::loadu(o + r * D + v * Vec::size()) * c;
  }
  for (int64_t j = 0; j < num_keys; ++j) {
    Vec x[NV];
    load_floats<scalar_t, NV>(vals + j * vals_stride, x);
    for (int r = 0; r < kRows; ++r) {
      const Vec pj(p[r * kBlockKeys + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(pj, x[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(o + r * D + v * Vec::size());
}

// The same over the whole head dimension (a multiple of the vector width), in chunks of up to NV vectors.
template <typename scalar_t>
inline void accumulate_tile(const float* p, const float* correction, const scalar_t* vals, int64_t vals_stride, int64_t num_keys,
                            int64_t D, float* o) {
  constexpr int64_t width = kVectors * Vec::size();
  int64_t dc = 0;
  for (; dc + width <= D; dc += width) accumulate_chunk<scalar_t, kVectors>(p, correction, vals + dc, vals_stride, num_keys, D, o + dc);
  switch ((D - dc) / Vec::size()) {
    case 3: accumulate_chunk<scalar_t, 3>(p, correction, vals + dc, vals_stride, num_keys, D, o + dc); break;
    case 2: accumulate_chunk<scalar_t, 2>(p, correction, vals + dc, vals_stride, num_keys, D, o + dc); break;
    case 1: accumulate_chunk<scalar_t, 1>(p, correction, vals + dc, vals_stride, num_keys, D, o + dc); break;
    default: break;
  }
}

// One row's scores of one key block -> weights, updating its shift (a running maximum, moved only when
// a score passes it by more than kShiftSlack) and its running sum (kept as one vector of partial sums,
// added up at the end); returns the factor its accumulated values are scaled by. Of the `width` scored
// keys (a multiple of the vector width), the first `visible` count; the rest weigh 0 (keys past `width`
// are never read). A row that sees none of the block keeps its state (factor 1, weights 0).
inline float softmax_row(float* s, int64_t visible, int64_t width, float& running_max, float* running_sums) {
  if (visible <= 0) {
    std::fill(s, s + width, 0.0f);
    return 1.0f;
  }
  std::fill(s + visible, s + width, kNegInf);
  Vec top = Vec::loadu(s);
  for (int64_t j = Vec::size(); j < width; j += Vec::size()) top = at::vec::maximum(top, Vec::loadu(s + j));
  float shift = running_max, correction = 1.0f;
  constexpr int kNoLane = (1 << Vec::size()) - 1;
  if ((top > Vec(running_max + kShiftSlack)).zero_mask() != kNoLane) {  // some score passes the slack (or the first block)
    shift = std::max(running_max, at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, top));
    correction = std::exp(running_max - shift);  // exp(-inf - finite) = 0 clears the empty start
  }
  Vec sum = Vec::loadu(running_sums) * Vec(correction);
  for (int64_t j = 0; j < width; j += Vec::size()) {
    const Vec p = (Vec::loadu(s + j) - Vec(shift)).exp_u20();
    p.store(s + j);
    sum = sum + p;
  }
  sum.store(running_sums);
  running_max = shift;
  return correction;
}

// out[i][j] = rows[j][i] for the KB rows of a block and `width` 32-bit lanes each (rows row_stride
// apart, out [width][KB]): 16 x 16 transposes, the lanes past the last multiple of 16 one by one. Lanes
// are moved, never computed on, so bf16 pairs can travel as float32 lanes.
inline void transpose_block(const float* rows, int64_t row_stride, int64_t width, float* out) {
  int64_t i = 0;
  for (; i + 16 <= width; i += 16)
    for (int64_t j = 0; j < kBlockKeys; j += 16)
      at::vec::transpose_mxn<float, 16, 16>(rows + j * row_stride + i, row_stride, out + i * kBlockKeys + j, kBlockKeys);
  for (; i < width; ++i)  // bf16 key pairs of head dimensions 16 and 48: 8 lanes left
    for (int64_t j = 0; j < kBlockKeys; ++j) out[i * kBlockKeys + j] = rows[j * row_stride + i];
}

#if defined(BF16_DOT_PRODUCTS)
constexpr bool kBf16Pairs = true;  // bf16 calls run on the CPU's bf16 dot products (vdpbf16ps)
#else
constexpr bool kBf16Pairs = false;
#endif

// The bf16 path (defined where the build has BF16_DOT_PRODUCTS). A block's keys are packed as pairs along
// the head dimension, [D / 2][KB][2], and its values as pairs of consecutive keys, [KB / 2][D][2], both
// zero past the last key; each vdpbf16ps adds two exact products to a float32 sum.
void pack_key_pairs(const at::BFloat16* key, int64_t key_stride, int64_t count, int64_t D, at::BFloat16* out, float* staging);
void pack_value_pairs(const at::BFloat16* value, int64_t value_stride, int64_t count, int64_t D, at::BFloat16* out);
void score_pairs(const at::BFloat16* q, const at::BFloat16* key_pairs, int64_t D, int vectors, float scale, float* s);
void accumulate_pairs(const float* p, int vectors, const float* correction, const at::BFloat16* value_pairs, int64_t num_keys,
                      int64_t D, float* o);

#if defined(BF16_DOT_PRODUCTS)
// Only these functions use the bf16 dot products: the rest of the library keeps the instruction set
// torch's own kernels were built for.
#pragma GCC push_options
#pragma GCC target("avx512bf16")

static_assert(Vec::size() == 16 && kBlockKeys == 64, "the bf16 path is written for 512-bit vectors");

// The 32-bit pair of bf16 at p (any alignment).
inline int32_t pair_at(const at::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

// The pairs are moved as 32-bit words: rows of D / 2 words into staging [KB][D / 2] (zero past the last
// key), then transposed as float32 lanes.
void pack_key_pairs(const at::BFloat16* key, int64_t key_stride, int64_t count, int64_t D, at::BFloat16* out, float* staging) {
  const int64_t words = D / 2;
  for (int64_t j = 0; j < count; ++j) std::memcpy(staging + j * words, key + j * key_stride, words * sizeof(float));
  std::fill(staging + count * words, staging + kBlockKeys * words, 0.0f);
  transpose_block(staging, words, words, reinterpret_cast<float*>(out));
}

void pack_value_pairs(const at::BFloat16* value, int64_t value_stride, int64_t count, int64_t D, at::BFloat16* out) {
  // element e of a 32-wide output: pair e / 2 of the chunk, from the first key (e even) or the second
  alignas(64) int16_t low[32], high[32];
  for (int e = 0; e < 32; ++e) low[e] = static_cast<int16_t>(e / 2 + (e % 2) * 32), high[e] = static_cast<int16_t>(low[e] + 16);
  const __m512i low_index = _mm512_load_si512(low), high_index = _mm512_load_si512(high);
  for (int64_t pair = 0; pair < kBlockKeys / 2; ++pair) {
    const int64_t first = 2 * pair;
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 mask = D - d >= 32 ? ~__mmask32{0} : (__mmask32{1} << (D - d)) - 1;
      const __m512i a = first < count ? _mm512_maskz_loadu_epi16(mask, value + first * value_stride + d) : _mm512_setzero_si512();
      const __m512i b = first + 1 < count ? _mm512_maskz_loadu_epi16(mask, value + (first + 1) * value_stride + d) : _mm512_setzero_si512();
      at::BFloat16* dst = out + (pair * D + d) * 2;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, low_index, b));
      if (D - d > 16) _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, high_index, b));
    }
  }
}

// s[r][0:NV vectors] = scale (q[r] . keys) for the R rows of a micro tile: the block's first NV * 16 keys.
template <int NV>
void score_pairs_chunk(const at::BFloat16* q, const at::BFloat16* key_pairs, int64_t D, float scale, float* s) {
  __m512 acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; ++i) {
    __m512bh k[NV];
    for (int v = 0; v < NV; ++v) k[v] = (__m512bh)_mm512_loadu_si512(key_pairs + (i * kBlockKeys + v * 16) * 2);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh qr = (__m512bh)_mm512_set1_epi32(pair_at(q + r * D + 2 * i));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], k[v], qr);
    }
  }
  const __m512 factor = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + r * kBlockKeys + v * 16, _mm512_mul_ps(acc[r][v], factor));
}

void score_pairs(const at::BFloat16* q, const at::BFloat16* key_pairs, int64_t D, int vectors, float scale, float* s) {
  static_assert(kVectors == 4, "one case per vector count");
  switch (vectors) {
    case 1: return score_pairs_chunk<1>(q, key_pairs, D, scale, s);
    case 2: return score_pairs_chunk<2>(q, key_pairs, D, scale, s);
    case 3: return score_pairs_chunk<3>(q, key_pairs, D, scale, s);
    default: return score_pairs_chunk<4>(q, key_pairs, D, scale, s);
  }
}

// o[r][0:NV vectors] = correction[r] o[r] + sum_j p[r][j] v[j] over `key_pairs` pairs of keys: one chunk
// of the head dimension (value_pairs already offset to it, rows of 2 D; p rows of KB bf16).
template <int NV>
void accumulate_pairs_chunk(const at::BFloat16* p, const float* correction, const at::BFloat16* value_pairs, int64_t key_pairs,
                            int64_t D, float* o) {
  __m512 acc[kRows][NV];
  for (int r = 0; r < kRows; ++r) {
    const __m512 c = _mm512_set1_ps(correction[r]);
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + v * 16), c);
  }
  for (int64_t pair = 0; pair < key_pairs; ++pair) {
    __m512bh x[NV];
    for (int v = 0; v < NV; ++v) x[v] = (__m512bh)_mm512_loadu_si512(value_pairs + pair * 2 * D + v * 32);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(pair_at(p + r * kBlockKeys + 2 * pair));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x[v], pr);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + r * D + v * 16, acc[r][v]);
}

// The weights p[R][KB] (float32; the first `vectors` vectors of each row are set) are rounded to bf16,
// then multiplied into the whole head dimension.
void accumulate_pairs(const float* p, int vectors, const float* correction, const at::BFloat16* value_pairs, int64_t num_keys,
                      int64_t D, float* o) {
  alignas(64) at::BFloat16 weights[kRows * kBlockKeys];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < vectors; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + r * kBlockKeys + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * kBlockKeys + v * 16)));
  const int64_t key_pairs = (num_keys + 1) / 2;
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) accumulate_pairs_chunk<4>(weights, correction, value_pairs + 2 * d, key_pairs, D, o + d);
  switch ((D - d) / 16) {
    case 3: accumulate_pairs_chunk<3>(weights, correction, value_pairs + 2 * d, key_pairs, D, o + d); break;
    case 2: accumulate_pairs_chunk<2>(weights, correction, value_pairs + 2 * d, key_pairs, D, o + d); break;
    case 1: accumulate_pairs_chunk<1>(weights, correction, value_pairs + 2 * d, key_pairs, D, o + d); break;
    default: break;
  }
}

#pragma GCC pop_options
#endif

// Whether a call of this dtype runs on the bf16 dot products (keys and values packed in pairs).
template <typename scalar_t>
constexpr bool kPaired = kBf16Pairs && std::is_same_v<scalar_t, at::BFloat16>;

// Working memory of one thread.
struct Scratch {
  std::vector<float> q, o, s, running_max, running_sums, correction;  // running_sums: a vector of partial sums a row
  std::vector<at::BFloat16> q_bf16;  // the bf16 path's query rows, unscaled
  std::vector<float> block_keys, staging;  // a block packed in the task (float32 keys or bf16 key pairs)
  std::vector<at::BFloat16> block_values;  // the bf16 path's value pairs of that block
  // packs_blocks: the tasks pack their own blocks (else the block buffers stay empty)
  Scratch(int64_t D, bool packs_blocks)
      : q(kTileRows * D), o(kTileRows * D), s(kRows * kBlockKeys), running_max(kTileRows), running_sums(kTileRows * Vec::size()), correction(kRows),
        q_bf16(kTileRows * D), block_keys(packs_blocks ? kBlockKeys * D : 0), staging(packs_blocks ? kBlockKeys * D : 0),
        block_values(packs_blocks ? kBlockKeys * D : 0) {}
};

// One (element, KV head)'s keys and values: rows in place, and the blocks packed up front when many tiles
// read each of them (null when the tasks pack their own: one tile, so each block is read once).
template <typename scalar_t>
struct KeyValues {
  const scalar_t* key;
  int64_t key_stride;
  const scalar_t* value;
  int64_t value_stride;
  const void* packed_keys;  // [blocks][D * KB]: float32 keys [D][KB], or bf16 key pairs
  const at::BFloat16* packed_values;  // bf16 path: value pairs [blocks][KB * D]
};

// One key block of one (element, KV head): its keys transposed into keys_t [D][KB] in float32, zero past
// the last key.
template <typename scalar_t>
void pack_block(const Shape& sh, const scalar_t* key, int64_t key_stride, int64_t block, float* keys_t, float* staging) {
  const int64_t D = sh.head_dim, first = block * kBlockKeys, count = std::min(kBlockKeys, sh.keys - first);
  const float* rows = reinterpret_cast<const float*>(key + first * key_stride);
  int64_t row_stride = key_stride;
  if (!std::is_same_v<scalar_t, float> || count < kBlockKeys) {  // widen (and zero-pad) into staging [KB][D]
    for (int64_t j = 0; j < count; ++j) at::vec::convert(key + (first + j) * key_stride, staging + j * D, D);
    std::fill(staging + count * D, staging + kBlockKeys * D, 0.0f);
    rows = staging, row_stride = D;
  }
  transpose_block(rows, row_stride, D, keys_t);
}

// Key block `block` in the layout its path reads: float32 keys [D][KB] into keys_out; on bf16 dot
// products key pairs into keys_out and value pairs into values_out.
template <typename scalar_t>
void pack_key_block(const Shape& sh, const KeyValues<scalar_t>& kv, int64_t block, void* keys_out, at::BFloat16* values_out, float* staging) {
  if constexpr (kPaired<scalar_t>) {
    const int64_t first = block * kBlockKeys, count = std::min(kBlockKeys, sh.keys - first);
    pack_key_pairs(kv.key + first * kv.key_stride, kv.key_stride, count, sh.head_dim, static_cast<at::BFloat16*>(keys_out), staging);
    pack_value_pairs(kv.value + first * kv.value_stride, kv.value_stride, count, sh.head_dim, values_out);
  } else {
    pack_block<scalar_t>(sh, kv.key, kv.key_stride, block, static_cast<float*>(keys_out), staging);
  }
}

// The tile's rows [first_row, first_row + kTileRows) over key blocks [block_begin, block_end):
// o / l and m + log(l) per row into out_rows [kTileRows, D] and lse_rows [kTileRows] (rows past the
// matrix are computed on copies of its last row and not used). The float32 path reads packed keys and
// the values in place; the bf16 path packed key pairs and value pairs.
template <typename scalar_t>
void run_tile(
    const Shape& sh, const scalar_t* query, const int64_t* q_strides, int64_t kv_head, int64_t first_row,
    const KeyValues<scalar_t>& kv, int64_t block_begin, int64_t block_end, float scale,
    float* out_rows, float* lse_rows, Scratch& w) {
  const int64_t D = sh.head_dim;
  int64_t limit[kTileRows];  // keys visible to each row
  for (int64_t i = 0; i < kTileRows; ++i) {
    const int64_t row = std::min(first_row + i, sh.rows - 1);
    const int64_t token = row / sh.group, head = kv_head * sh.group + row % sh.group;
    limit[i] = sh.causal ? token + 1 : sh.keys;
    const scalar_t* query_row = query + head * q_strides[0] + token * q_strides[1];
    if constexpr (kPaired<scalar_t>) {
      std::copy(query_row, query_row + D, w.q_bf16.data() + i * D);
    } else {
      at::vec::convert(query_row, w.q.data() + i * D, D);
      at::vec::map([scale](Vec x) { return x * Vec(scale); }, w.q.data() + i * D, w.q.data() + i * D, D);
    }
  }
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  std::fill(w.running_max.begin(), w.running_max.end(), kNegInf);
  std::fill(w.running_sums.begin(), w.running_sums.end(), 0.0f);
  const int64_t last_needed = sh.causal ? (limit[kTileRows - 1] - 1) / kBlockKeys + 1 : block_end;
  for (int64_t block = block_begin; block < std::min(block_end, last_needed); ++block) {
    const int64_t first_key = block * kBlockKeys;
    const void* block_keys = w.block_keys.data();
    const at::BFloat16* block_value_pairs = w.block_values.data();
    if (kv.packed_keys == nullptr) {
      pack_key_block(sh, kv, block, w.block_keys.data(), w.block_values.data(), w.staging.data());
    } else if constexpr (kPaired<scalar_t>) {
      block_keys = static_cast<const at::BFloat16*>(kv.packed_keys) + block * D * kBlockKeys;
      block_value_pairs = kv.packed_values + block * D * kBlockKeys;
    } else {
      block_keys = static_cast<const float*>(kv.packed_keys) + block * D * kBlockKeys;
    }
    for (int micro = 0; micro < kMicroTiles; ++micro) {
      const int64_t base = micro * kRows;
      if (limit[base + kRows - 1] <= first_key) continue;  // limits never fall along a tile
      int64_t visible[kRows], most_visible = 0;
      for (int r = 0; r < kRows; ++r) {
        visible[r] = std::min(kBlockKeys, std::min(limit[base + r], sh.keys) - first_key);
        most_visible = std::max(most_visible, visible[r]);
      }
      const int vectors = static_cast<int>((most_visible + Vec::size() - 1) / Vec::size());
      if constexpr (kPaired<scalar_t>) {
        score_pairs(w.q_bf16.data() + base * D, static_cast<const at::BFloat16*>(block_keys), D, vectors, scale, w.s.data());
      } else {
        score_tile(w.q.data() + base * D, static_cast<const float*>(block_keys), D, vectors, w.s.data());
      }
      for (int r = 0; r < kRows; ++r)
        w.correction[r] = softmax_row(w.s.data() + r * kBlockKeys, visible[r], vectors * Vec::size(), w.running_max[base + r],
                                      w.running_sums.data() + (base + r) * Vec::size());
      if constexpr (kPaired<scalar_t>) {
        accumulate_pairs(w.s.data(), vectors, w.correction.data(), block_value_pairs, most_visible, D, w.o.data() + base * D);
      } else {
        accumulate_tile<scalar_t>(w.s.data(), w.correction.data(), kv.value + first_key * kv.value_stride, kv.value_stride, most_visible, D,
                                  w.o.data() + base * D);
      }
    }
  }
  for (int64_t i = 0; i < kTileRows; ++i) {
    // no visible key: out 0, lse -inf; a NaN score's row stays NaN (its sum is NaN)
    const float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, Vec::loadu(w.running_sums.data() + i * Vec::size()));
    const float inverse = sum == 0.0f ? 0.0f : 1.0f / sum;
    at::vec::map([inverse](Vec x) { return x * Vec(inverse); }, out_rows + i * D, w.o.data() + i * D, D);
    lse_rows[i] = sum == 0.0f ? kNegInf : w.running_max[i] + std::log(sum);
  }
}

// Runs body(task) for every task in [0, count) on the intra-op threads, each taking the next task from a
// shared counter (tiles differ in cost, so a static split would leave a thread idle).
template <typename F>
void for_each_task(int64_t count, int64_t head_dim, bool packs_blocks, const F& body) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(head_dim, packs_blocks);
    for (int64_t task = next.fetch_add(1); task < count; task = next.fetch_add(1)) body(task, scratch);
  });
}

std::tuple<at::Tensor, at::Tensor> tiled_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool causal, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "query, key and value must be 4-D");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "unit stride along the head dimension");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value must have one shape");
  Shape sh{};
  sh.batch = query.size(0), sh.heads = query.size(1), sh.queries = query.size(2), sh.head_dim = query.size(3);
  sh.kv_heads = key.size(1), sh.keys = key.size(2);
  TORCH_CHECK(key.size(0) == sh.batch && key.size(3) == sh.head_dim, "key must be [B, KV, L, D] for query [B, H, n, D]");
  TORCH_CHECK(sh.kv_heads > 0 && sh.heads % sh.kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(sh.head_dim > 0 && sh.head_dim % 16 == 0, "head dimension ", sh.head_dim, " is not a multiple of 16");
  TORCH_CHECK(sh.keys > 0 || sh.queries == 0, "queries need at least one key");
  TORCH_CHECK(!causal || sh.queries == sh.keys, "causal calls need as many queries as keys");
  sh.group = sh.heads / sh.kv_heads;
  sh.rows = sh.group * sh.queries;
  sh.causal = causal;
  sh.tiles = (sh.rows + kTileRows - 1) / kTileRows;
  sh.key_blocks = (sh.keys + kBlockKeys - 1) / kBlockKeys;
  // Few tiles (decodes over a shared prefix): split the keys so every thread has work, keeping at least
  // 4 key blocks per range. Causal tiles already differ in length, and there are many of them.
  const int64_t units = sh.batch * sh.kv_heads * sh.tiles;
  const int64_t wanted = 4 * at::get_num_threads();
  sh.splits = causal || units >= wanted ? 1 : std::max<int64_t>(1, std::min((wanted + units - 1) / units, sh.key_blocks / 4));
  sh.blocks_per_split = (sh.key_blocks + sh.splits - 1) / sh.splits;
  sh.splits = (sh.key_blocks + sh.blocks_per_split - 1) / sh.blocks_per_split;

  // token-major storage ([B, n, H, D] and [B, n, H], returned transposed): the runner's rows of heads
  auto out = at::empty({sh.batch, sh.queries, sh.heads, sh.head_dim}, query.options()).transpose(1, 2);
  auto lse = at::empty({sh.batch, sh.queries, sh.heads}, query.options().dtype(at::kFloat)).transpose(1, 2);
  if (out.numel() == 0) return {out, lse.fill_(kNegInf)};
  const int64_t D = sh.head_dim, padded_keys = sh.key_blocks * kBlockKeys, pairs = sh.batch * sh.kv_heads;
  // Blocks packed up front when several tiles read each (float32 keys, or bf16 key and value pairs);
  // with one tile a pair, each task packs the blocks it reads, which it alone reads.
  const bool paired = kBf16Pairs && query.scalar_type() == at::kBFloat16;
  const bool pack_up_front = sh.tiles > 1;
  auto keys_t = pack_up_front ? at::empty({pairs, padded_keys * D}, query.options().dtype(paired ? at::kBFloat16 : at::kFloat)) : at::Tensor();
  auto value_pairs = pack_up_front && paired ? at::empty({pairs, padded_keys * D}, query.options()) : at::Tensor();
  // partial results: [units, splits, kTileRows, D] and [units, splits, kTileRows]
  auto partial_out = at::empty({units * sh.splits * kTileRows * D}, query.options().dtype(at::kFloat));
  auto partial_lse = at::empty({units * sh.splits * kTileRows}, query.options().dtype(at::kFloat));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "tiled_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    float* po = partial_out.data_ptr<float>();
    float* pl = partial_lse.data_ptr<float>();
    // packed blocks: [pairs][blocks][D * KB] elements of the path's key layout (and value pairs)
    char* packed_keys = pack_up_front ? static_cast<char*>(keys_t.data_ptr()) : nullptr;
    at::BFloat16* packed_values = value_pairs.defined() ? value_pairs.data_ptr<at::BFloat16>() : nullptr;
    const int64_t key_bytes = pack_up_front ? keys_t.element_size() : 0;
    const auto block_offset = [&](int64_t pair, int64_t block) { return (pair * sh.key_blocks + block) * D * kBlockKeys; };
    const auto pair_kv = [&](int64_t pair) {
      const int64_t b = pair / sh.kv_heads, h = pair % sh.kv_heads;
      return KeyValues<scalar_t>{k + b * key.stride(0) + h * key.stride(1), key.stride(2), v + b * value.stride(0) + h * value.stride(1),
                                 value.stride(2), packed_keys == nullptr ? nullptr : packed_keys + block_offset(pair, 0) * key_bytes,
                                 packed_values == nullptr ? nullptr : packed_values + block_offset(pair, 0)};
    };
    if (pack_up_front) {
      at::parallel_for(0, pairs * sh.key_blocks, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> staging(kBlockKeys * D);
        for (int64_t unit = begin; unit < end; ++unit) {
          const int64_t pair = unit / sh.key_blocks, block = unit % sh.key_blocks;
          pack_key_block(sh, pair_kv(pair), block, packed_keys + block_offset(pair, block) * key_bytes,
                         packed_values == nullptr ? nullptr : packed_values + block_offset(pair, block), staging.data());
        }
      });
    }
    const int64_t q_strides[2] = {query.stride(1), query.stride(2)};
    for_each_task(units * sh.splits, D, !pack_up_front, [&](int64_t task, Scratch& scratch) {
      // heaviest first: causal tiles grow with their index
      const int64_t unit = units - 1 - task / sh.splits, split = task % sh.splits;
      const int64_t tile = unit % sh.tiles, pair = unit / sh.tiles;
      const int64_t first_block = split * sh.blocks_per_split;
      run_tile<scalar_t>(sh, q + pair / sh.kv_heads * query.stride(0), q_strides, pair % sh.kv_heads, tile * kTileRows, pair_kv(pair),
                         first_block, std::min(sh.key_blocks, first_block + sh.blocks_per_split), static_cast<float>(scale),
                         po + (unit * sh.splits + split) * kTileRows * D, pl + (unit * sh.splits + split) * kTileRows, scratch);
    });
    scalar_t* o = out.data_ptr<scalar_t>();
    float* l = lse.data_ptr<float>();
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> merged(D);
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t tile = unit % sh.tiles, pair = unit / sh.tiles;
        const int64_t b = pair / sh.kv_heads, h = pair % sh.kv_heads;
        for (int64_t i = 0; i < kTileRows && tile * kTileRows + i < sh.rows; ++i) {
          const int64_t row = tile * kTileRows + i, token = row / sh.group, head = h * sh.group + row % sh.group;
          scalar_t* out_row = o + ((b * sh.queries + token) * sh.heads + head) * D;
          float& lse_row = l[(b * sh.queries + token) * sh.heads + head];
          if (sh.splits == 1) {  // one key range: its result is the row's
            at::vec::convert(po + (unit * kTileRows + i) * D, out_row, D);
            lse_row = pl[unit * kTileRows + i];
            continue;
          }
          // out = sum_s exp(lse_s - M) out_s / sum_s exp(lse_s - M), lse = M + log of that sum
          // (a NaN part makes the row NaN, as one pass over all keys would)
          float top = kNegInf;
          bool nan = false;
          for (int64_t s = 0; s < sh.splits; ++s) {
            const float part_lse = pl[(unit * sh.splits + s) * kTileRows + i];
            nan |= std::isnan(part_lse);
            top = std::max(top, part_lse);
          }
          std::fill(merged.begin(), merged.end(), nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
          float total = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
          if (!nan && top != kNegInf) {
            for (int64_t s = 0; s < sh.splits; ++s) {
              const float weight = std::exp(pl[(unit * sh.splits + s) * kTileRows + i] - top);
              const float* part = po + ((unit * sh.splits + s) * kTileRows + i) * D;
              for (int64_t d = 0; d < D; ++d) merged[d] += weight * part[d];
              total += weight;
            }
            for (int64_t d = 0; d < D; ++d) merged[d] /= total;
          }
          at::vec::convert(merged.data(), out_row, D);
          lse_row = total == 0.0f ? kNegInf : top + std::log(total);
        }
      }
    });
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefix_console, m) {
  m.def("tiled_attention(Tensor query, Tensor key, Tensor value, bool causal, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prefix_console, CPU, m) { m.impl("tiled_attention", &tiled_attention); }
