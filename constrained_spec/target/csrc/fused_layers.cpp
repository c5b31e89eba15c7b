// The compact Llama forward's layers for a few new tokens (a one-token step, a verify pass, a
// batch's rows), fused into one call: llama.py's Python loop spends more time dispatching its
// ~35 small ops per layer than the 4-bit matmuls take (git show 8fe3c79:docs/measurements.md). The matmuls are
// torch's int4 weight-only kernel or our own (int4_mm, AVX-512 BF16), whichever the linears run
// (the same values as the Python loop's); norms, rotary, attention and the MLP's gate are plain
// loops here.
//
// Every token's values depend on its own inputs and its own cache only, computed by the same
// code in the same order whatever the number of tokens or rows: a verify pass computes bit for
// bit what one-token steps would, and a batch row what it would alone (tests check both).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#include <ATen/cpu/vec/vec.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>  // arch_prctl: a process asks Linux for the AMX tile registers
#include <unistd.h>
#endif

#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "blocks.h"  // weight blocks times int8 activations: AVX2, NEON, the scalar reference

namespace {

// at::parallel_for is OpenMP's parallel region compiled into this file, which a compiler without
// OpenMP (Apple's clang) turns into a plain loop: built that way (kernels.fused_build retries
// without -fopenmp), the chunks go to torch's inter-op threads instead, the caller taking the first.
// Every chunk computes what it would on any thread (no result depends on the split).
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#ifdef _OPENMP
  at::parallel_for(begin, end, grain, f);
#else
  if (begin >= end) return;
  const int64_t most = grain > 0 ? (end - begin + grain - 1) / grain : end - begin;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), most));
  const int64_t chunk = (end - begin + threads - 1) / threads;
  std::atomic<int64_t> left(threads - 1);
  std::mutex m;
  std::condition_variable done;
  for (int64_t t = 1; t < threads; ++t)
    at::launch([&, t] {
      const int64_t from = begin + t * chunk;
      if (from < end) f(from, std::min(end, from + chunk));
      std::lock_guard<std::mutex> lock(m);
      if (--left == 0) done.notify_one();
    });
  f(begin, std::min(end, begin + chunk));
  std::unique_lock<std::mutex> lock(m);
  done.wait(lock, [&] { return left == 0; });
#endif
}

using at::BFloat16;
using at::Tensor;
using Vec = at::vec::Vectorized<float>;

// Independent partial sums: the compiler vectorizes them, and every call adds in the same order.
constexpr int64_t LANES = 16;

float dot(const float* a, const float* b, int64_t n) {
  float partial[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int64_t l = 0; l < LANES; ++l) partial[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) partial[i % LANES] += a[i] * b[i];
  for (int64_t width = LANES / 2; width > 0; width /= 2)  // a tree: vector shuffles, not 16 adds
    for (int64_t l = 0; l < width; ++l) partial[l] += partial[l + width];
  return partial[0];
}

// A table of rows (V, d): float32 rows, or q (V, d) int8 with scales (V, d/group), one a group of
// columns (kernels.BlockRows, the token embedding and the LM head's rows): Q8_0's, groups of 32
// with fp16 scales, or Q6_K's, sub-blocks of 16 with float32 scales d·sc. A row is dequantized
// where it is read, to the float32 values a float32 copy would hold (|q| ≤ 127 times an fp16
// value, or |q| ≤ 32 times an fp16 value times an int8, is exact in float32). `scales` empty:
// float32 rows (kernels.table_tensors).
struct Rows {
  const float* values = nullptr;
  const int8_t* q = nullptr;
  const at::Half* half_scales = nullptr;  // Q8_0's d
  const float* float_scales = nullptr;    // Q6_K's d·sc
  int64_t count, d, group = 0;

  Rows(const Tensor& table, const Tensor& table_scales) : count(table.size(0)), d(table.size(1)) {
    TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && d % 32 == 0, "a table: (V, d) contiguous");
    if (table_scales.numel() == 0) {
      TORCH_CHECK(table.scalar_type() == at::kFloat, "a table without scales: float32 rows");
      values = table.data_ptr<float>();
      return;
    }
    const auto kind = table_scales.scalar_type();
    TORCH_CHECK(table.scalar_type() == at::kChar && (kind == at::kHalf || kind == at::kFloat) &&
                    table_scales.dim() == 2 && table_scales.is_contiguous() &&
                    table_scales.size(0) == count && d % table_scales.size(1) == 0,
                "a table of blocks: q (V, d) int8, scales (V, d/group) fp16 or float32");
    q = table.data_ptr<int8_t>();
    group = d / table_scales.size(1);
    if (kind == at::kHalf)
      half_scales = table_scales.data_ptr<at::Half>();
    else
      float_scales = table_scales.data_ptr<float>();
  }

  // row t in float32: the table's own, or dequantized into `scratch` (d floats) and returned
  const float* row(int64_t t, float* scratch) const {
    if (values != nullptr) return values + t * d;
    const int64_t groups = d / group;
    const int8_t* row_q = q + t * d;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = half_scales != nullptr ? static_cast<float>(half_scales[t * groups + g])
                                                 : float_scales[t * groups + g];
      for (int64_t j = 0; j < group; ++j)
        scratch[group * g + j] = scale * static_cast<float>(row_q[group * g + j]);
    }
    return scratch;
  }
};

// p[from..n) ← exp(p − max p), p[0..from) ← 0 (positions a sliding window masks); returns
// their sum. Lane l sums the entries j ≡ l (mod the vector width) in order, so leading zeros
// change no sum: a query's values do not depend on where below its window a pass starts.
float exp_shifted(float* p, int64_t from, int64_t n) {
  float top = -INFINITY;
  for (int64_t j = from; j < n; ++j) top = std::max(top, p[j]);
  Vec sum(0.f);
  for (int64_t j = 0; j < n; j += Vec::size()) {
    int64_t count = std::min<int64_t>(Vec::size(), n - j);
    Vec e = (Vec::loadu(p + j, count) - Vec(top)).exp_u20();
    e = Vec::set(Vec(0.f), e, count);
    if (j < from) {  // masked lanes: exactly 0
      float lanes[Vec::size()];
      e.store(lanes);
      for (int64_t l = 0; l < std::min<int64_t>(Vec::size(), from - j); ++l) lanes[l] = 0.f;
      e = Vec::loadu(lanes);
    }
    e.store(p + j, count);
    sum = sum + e;
  }
  float lanes[Vec::size()], total = 0.f;
  sum.store(lanes);
  for (float lane : lanes) total += lane;
  return total;
}

// p[0..n) ← cap·tanh(p / cap): soft-capped scores (Gemma 2), each from its own score alone, so a
// query's capped scores do not depend on the pass either.
void soft_cap(float* p, int64_t n, float cap) {
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - j);
    ((Vec::loadu(p + j, count) / Vec(cap)).tanh() * Vec(cap)).store(p + j, count);
  }
}

// Keys are stored in tiles of KEY_TILE positions, (capacity / KEY_TILE, hd, KEY_TILE): a vector
// of positions' element e is one load, and a tile's hd × KEY_TILE floats are contiguous, so a
// pass reads its keys from memory in order, where position-last rows (one per element) had it
// read hd streams at once, more than the prefetchers follow (benchmarks/results/key-tiles).
constexpr int64_t KEY_TILE = 16;
static_assert(KEY_TILE % Vec::size() == 0, "a vector of positions within one tile");

inline int64_t key_at(int64_t position, int64_t hd) {  // element 0 of a position's key
  return position / KEY_TILE * hd * KEY_TILE + position % KEY_TILE;
}

// The attention of up to Q queries that share one key/value head (the heads of its group, the
// tokens of one row), query i over positions [0, n[i]), n ascending: each vector of K and V read
// serves all Q queries, where one query at a time read every vector once per query (from the L2
// cache after the first). Each score still sums its hd products in order and each output its
// n[i] products in order, so every query's values are bit for bit what it gets alone, whichever
// queries share its pass.

template <int64_t Q, int64_t B>
void scores_block(const float* q, const float* k, int64_t hd, int64_t j, int64_t count,
                  float* scores, int64_t stride, int64_t base) {  // scores[i·stride + j − base..]
  constexpr int64_t W = Vec::size();
  Vec acc[Q][B];
  for (auto& row : acc)
    for (auto& a : row) a = Vec(0.f);
  const float* tiles[B];  // element 0 of positions j + b·W..
  for (int64_t b = 0; b < B; ++b) tiles[b] = k + key_at(j + b * W, hd);
  for (int64_t e = 0; e < hd; ++e) {
    Vec keys[B];
    for (int64_t b = 0; b < B; ++b)
      keys[b] = b + 1 < B ? Vec::loadu(tiles[b] + e * KEY_TILE) : Vec::loadu(tiles[b] + e * KEY_TILE, count);
    for (int64_t i = 0; i < Q; ++i) {
      const Vec qe(q[i * hd + e]);
      for (int64_t b = 0; b < B; ++b) acc[i][b] = at::vec::fmadd(qe, keys[b], acc[i][b]);
    }
  }
  for (int64_t i = 0; i < Q; ++i)
    for (int64_t b = 0; b < B; ++b)
      acc[i][b].store(scores + i * stride + j - base + b * W, b + 1 < B ? W : count);
}

Vec load_bf16(const BFloat16* p, int64_t count) {  // count ≤ Vec::size() values, as floats
  if (count == Vec::size()) {
    Vec out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
  }
  float part[Vec::size()] = {0.f};
  for (int64_t i = 0; i < count; ++i) part[i] = static_cast<float>(p[i]);
  return Vec::loadu(part);
}

// sums[i·hd + c..] = Σ_{base ≤ j < n} p[i·stride + j − base]·V[j, c..], positions every query
// sees (or has masked: p = 0 there).
template <int64_t Q, int64_t B>
void values_block(const float* p, int64_t stride, const BFloat16* v, int64_t base, int64_t n,
                  int64_t hd, int64_t c, int64_t count, float* sums) {
  constexpr int64_t W = Vec::size();
  Vec acc[Q][B];
  for (auto& row : acc)
    for (auto& a : row) a = Vec(0.f);
  for (int64_t j = base; j < n; ++j) {
    const BFloat16* vj = v + j * hd + c;
    Vec values[B];
    for (int64_t b = 0; b < B; ++b) values[b] = load_bf16(vj + b * W, b + 1 < B ? W : count);
    for (int64_t i = 0; i < Q; ++i) {
      const Vec pj(p[i * stride + j - base]);
      for (int64_t b = 0; b < B; ++b) acc[i][b] = at::vec::fmadd(pj, values[b], acc[i][b]);
    }
  }
  for (int64_t i = 0; i < Q; ++i)
    for (int64_t b = 0; b < B; ++b) acc[i][b].store(sums + i * hd + c + b * W, b + 1 < B ? W : count);
}

// Q queries (q: Q × hd, scaled, in order of n) of one key/value head, K in tiles, V (capacity,
// hd) bf16: out (Q × hd) = softmax(q·K)·V over each query's positions [lo[i], n[i]) (lo: its
// sliding window's first, else 0; lo and n ascending), the scores q·K soft-capped where cap > 0.
// The pass starts at the tile holding lo[0], the positions below a query's lo weighing exactly 0,
// so that each query's sums run over the same positions in the same order (from a tile boundary,
// whatever the other queries) as it would alone. The positions every query sees go through the shared passes, each
// query's own last ones after (continuing its sums in the same order).
template <int64_t Q>
void attend(const float* q, const float* k, const BFloat16* v, const int64_t* lo, const int64_t* n,
            int64_t hd, float cap, float* scores, int64_t stride, float* out) {
  constexpr int64_t W = Vec::size(), B = 4;
  const int64_t longest = n[Q - 1], shared = n[0], base = lo[0] / KEY_TILE * KEY_TILE;
  int64_t j = base;
  for (; j + B * W <= longest; j += B * W) scores_block<Q, B>(q, k, hd, j, W, scores, stride, base);
  for (; j < longest; j += W)
    scores_block<Q, 1>(q, k, hd, j, std::min(W, longest - j), scores, stride, base);
  if (cap > 0.f)
    for (int64_t i = 0; i < Q; ++i) soft_cap(scores + i * stride, n[i] - base, cap);
  float total[Q];
  for (int64_t i = 0; i < Q; ++i) total[i] = exp_shifted(scores + i * stride, lo[i] - base, n[i] - base);
  int64_t c = 0;
  for (; c + B * W <= hd; c += B * W) values_block<Q, B>(scores, stride, v, base, shared, hd, c, W, out);
  for (; c < hd; c += W)
    values_block<Q, 1>(scores, stride, v, base, shared, hd, c, std::min(W, hd - c), out);
  for (int64_t i = 0; i < Q; ++i)
    for (c = 0; c < hd; c += W) {
      const int64_t count = std::min(W, hd - c);
      Vec acc = Vec::loadu(out + i * hd + c, count);
      for (int64_t jj = shared; jj < n[i]; ++jj)
        acc = at::vec::fmadd(Vec(scores[i * stride + jj - base]), load_bf16(v + jj * hd + c, count), acc);
      (acc / Vec(total[i])).store(out + i * hd + c, count);
    }
}

// Queries a pass of attend takes at most: its Q × B accumulators and B loaded vectors fit the
// 32 AVX-512 registers (AVX2 has 16).
constexpr int64_t QUERIES = Vec::size() >= 16 ? 6 : 3;

void attend_some(int64_t queries, const float* q, const float* k, const BFloat16* v, const int64_t* lo,
                 const int64_t* n, int64_t hd, float cap, float* scores, int64_t stride, float* out) {
  switch (queries) {
#define ATTEND(Q) \
  case Q: return attend<Q>(q, k, v, lo, n, hd, cap, scores, stride, out);
    ATTEND(1) ATTEND(2) ATTEND(3) ATTEND(4) ATTEND(5) ATTEND(6)
#undef ATTEND
  }
  TORCH_CHECK(false, "attend: ", queries, " queries in one pass");
}

// The per-token work outside the matmuls and attention (norms, rotary, the MLP's gate, the
// residual adds) runs on the threads past this many tokens (from 2 tokens on measured the same
// on passes of 4 and 8: benchmarks/results/token-threads/threshold.txt).
constexpr int64_t TOKENS_A_THREAD = 8;

// rows (n, d) → x·rsqrt(mean(x²) + eps)·weight, as the bf16 input of a 4-bit matmul.
void rms_norm(const float* x, const float* weight, BFloat16* out, int64_t n, int64_t d, float eps) {
  parallel_for(0, n, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(d);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * d;
      float inverse = 1.f / std::sqrt(dot(row, row, d) / d + eps);
      for (int64_t j = 0; j < d; ++j) scratch[j] = row[j] * inverse * weight[j];
      at::vec::convert(scratch.data(), out + r * d, d);
    }
  });
}

#if defined(__AVX512BF16__)
constexpr bool HAVE_AVX512_BF16 = true;

// R ≤ 8 rows of x times one tile column of the 4-bit weight (16 outputs). A nibble q becomes
// the bf16 number 128 + q by OR-ing 0x4300 into its 16-bit half (128 + q has 8 significant
// bits), so vdpbf16ps sums (128 + q)·x in float32; each group's epilogue takes 136·Σx away:
// w = (q − 8)·scale + zero. A row sums a group's 32 products in 4 chains of 8 (one per vector
// of tiles: a single chain would wait on each dot product's latency), added as (0 + 1) + (2 + 3).
// The vectors go one at a time through all R rows, so that R rows' chains fit the registers
// (the totals wait in memory): 8 rows share each unpacked vector, where 4 rows a tile, with all
// 4 chains of each row live at once, ran 1.2× slower. Each row runs the same instructions in the
// same order whatever R, so its outputs do not depend on the rows computed beside it.
// Vector 4c + m of a group (v: the group's tile c): 16 lanes of the bf16 pair (128 + q, 128 + q')
// of inputs 8c + 2m and 8c + 2m + 1, OR-ing 0x4300 into each nibble's 16-bit half.
inline __m512i unpacked(__m512i v, int m) {
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 4 * m), nibbles, bias, 0xEA);
}

// Group g's 16 scales and 16 zeros (bf16) as float32.
inline void group_scales(const BFloat16* scales, int64_t g, __m512& s, __m512& z) {
  const __m512i sz = _mm512_loadu_si512(scales + g * 32);  // 16 scales, then 16 zeros
  s = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(sz)), 16));
  z = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(sz, 1)), 16));
}

template <int64_t R>
void int4_tile(const int32_t* tile, const BFloat16* scales, const uint32_t* x, int64_t row_pairs,
               const float* sums, int64_t groups, BFloat16* out, int64_t out_stride) {
  const __m512 offset = _mm512_set1_ps(136.f);
  alignas(64) float total[R][16] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m512 first[R], sum[R];  // chain 0, then 0 + 1; chain 2, then the group's (0 + 1) + (2 + 3)
    for (int64_t c = 0; c < 4; ++c) {  // 8 inputs a vector: 4 pairs, nibbles 4m and 16 + 4m
      const __m512i v = _mm512_loadu_si512(tile + (g * 4 + c) * 16);
      __m512 chain[R];
      for (auto& a : chain) a = _mm512_setzero_ps();
      for (int m = 0; m < 4; ++m) {
        const __m512i w = unpacked(v, m);
        const int64_t pair = g * 16 + c * 4 + m;
        for (int64_t r = 0; r < R; ++r)
          chain[r] = _mm512_dpbf16_ps(chain[r], (__m512bh)w,
                                      (__m512bh)_mm512_set1_epi32(x[r * row_pairs + pair]));
      }
      for (int64_t r = 0; r < R; ++r) {
        if (c == 0 || c == 2) sum[r] = chain[r];
        else if (c == 1) first[r] = _mm512_add_ps(sum[r], chain[r]);
        else sum[r] = _mm512_add_ps(first[r], _mm512_add_ps(sum[r], chain[r]));
      }
    }
    __m512 s, z;
    group_scales(scales, g, s, z);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 X = _mm512_set1_ps(sums[r * groups + g]);
      __m512 t = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(offset, X, sum[r]), _mm512_load_ps(total[r]));
      _mm512_store_ps(total[r], _mm512_fmadd_ps(z, X, t));
    }
  }
  for (int64_t r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total[r])));
}
// A prompt's dense kernel on AVX-512 BF16 (kernels.Int4Linear's "avx512-bf16" prefill): R ≤ 8
// rows of x times B ≤ 2 tile columns of the bf16 copy in AMX B tiles (dense_amx's layout: a tile
// column's K/2 k-pairs are K/2 vectors of 16 outputs' bf16 pairs, one after the other). Each output
// sums its K/2 pair products in order in one float32 chain (the scales are in the copy: no
// per-group epilogue, which took a quarter of int4_tile's instructions), so a row's outputs
// depend on its own inputs only, whatever R and B.
template <int64_t R, int64_t B>
void dense_tile(const __m512i* w, int64_t column_stride, const uint32_t* x, int64_t pairs,
                BFloat16* out, int64_t N) {
  __m512 sum[R][B];
  for (auto& row : sum)
    for (auto& s : row) s = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i v[B];
    for (int64_t b = 0; b < B; ++b) v[b] = _mm512_loadu_si512(w + b * column_stride + p);
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(x[r * pairs + p]);
      for (int64_t b = 0; b < B; ++b) sum[r][b] = _mm512_dpbf16_ps(sum[r][b], (__m512bh)v[b], xr);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < B; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + b * 16),
                          (__m256i)_mm512_cvtneps_pbh(sum[r][b]));
}

// All n rows through B tile columns, 8 rows at a time (the columns stay in cache for the next).
template <int64_t B>
void dense_rows(const __m512i* w, int64_t pairs, const uint32_t* x, int64_t n, BFloat16* out,
                int64_t N) {
  for (int64_t r = 0; r < n;) {
    const uint32_t* xr = x + r * pairs;
    BFloat16* o = out + r * N;
    switch (std::min<int64_t>(n - r, 8)) {
      case 8: dense_tile<8, B>(w, pairs, xr, pairs, o, N), r += 8; break;
      case 7: dense_tile<7, B>(w, pairs, xr, pairs, o, N), r += 7; break;
      case 6: dense_tile<6, B>(w, pairs, xr, pairs, o, N), r += 6; break;
      case 5: dense_tile<5, B>(w, pairs, xr, pairs, o, N), r += 5; break;
      case 4: dense_tile<4, B>(w, pairs, xr, pairs, o, N), r += 4; break;
      case 3: dense_tile<3, B>(w, pairs, xr, pairs, o, N), r += 3; break;
      case 2: dense_tile<2, B>(w, pairs, xr, pairs, o, N), r += 2; break;
      default: dense_tile<1, B>(w, pairs, xr, pairs, o, N), r += 1;
    }
  }
}

void dense_avx512(const BFloat16* x, int64_t n, int64_t K, const BFloat16* w, int64_t blocks,
                  BFloat16* out, int64_t N) {
  const int64_t pairs = K / 2;  // a tile column: pairs vectors of 64 bytes
  const auto* pairs_of = reinterpret_cast<const uint32_t*>(x);
  const auto* columns = reinterpret_cast<const __m512i*>(w);
  parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t two = begin; two < end; ++two) {  // tile columns 2·two and 2·two + 1
      const int64_t b = 2 * two;
      if (b + 1 < blocks)
        dense_rows<2>(columns + b * pairs, pairs, pairs_of, n, out + b * 16, N);
      else
        dense_rows<1>(columns + b * pairs, pairs, pairs_of, n, out + b * 16, N);
    }
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same sums on AMX tiles, 16 or 32 rows of x at once: per group the 16 vectors of a tile
// column, unpacked as int4_tile unpacks them (vector 4c + m: row k-pair 4c + m of B, 16 columns
// of bf16 pairs), are one B tile; x's 32 inputs of the group (up to 16 rows a tile) an A tile; tdpbf16ps sums each output's 32 products in order (one chain) in float32.
// The epilogue is int4_tile's. A row's outputs depend on its own inputs only, whatever the rows
// beside it.
bool amx_ready() {  // Linux hands out the tile registers only to a process that asks for them
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0;
  return ready;
}

// Tiles 0 and 2 (C and A) hold `first` rows, 1 and 3 `second`, the B tiles 4 and 5 16 k-pairs:
// a pass of few rows moves and multiplies only those (a one-token step: 64 bytes, not 1 KB).
void amx_config(int first, int second) {
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;  // palette 1: 16 rows of 64 bytes a tile at most
  for (int t = 0; t < 6; ++t) {
    config[16 + 2 * t] = 64;  // bytes a row (little-endian uint16 at byte 16 + 2t)
    config[48 + t] = t >= 4 ? 16 : t % 2 ? second : first;  // rows
  }
  _tile_loadconfig(config);
}

// One group's B tile: the 16 vectors of its tile column as int4_tile unpacks them.
inline void unpack_group(const int32_t* tile, int64_t g, uint32_t (*b)[16]) {
  for (int64_t c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(tile + (g * 4 + c) * 16);
    for (int m = 0; m < 4; ++m) _mm512_store_si512(b[c * 4 + m], unpacked(v, m));
  }
}

// int4_tile's epilogue for group g over `rows` rows of sums c (float32, 16 a row).
inline void add_group(const float (*c)[16], const BFloat16* scales, const float* sums,
                      int64_t groups, int64_t g, int64_t rows, float (*total)[16]) {
  const __m512 offset = _mm512_set1_ps(136.f);
  __m512 s, z;
  group_scales(scales, g, s, z);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 X = _mm512_set1_ps(sums[r * groups + g]);
    __m512 t = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(offset, X, _mm512_load_ps(c[r])),
                               _mm512_load_ps(total[r]));
    _mm512_store_ps(total[r], _mm512_fmadd_ps(z, X, t));
  }
}

// Up to 16 rows: two groups in flight on distinct tiles (C 0/1, A 2/3, B 4/5), each added to
// the totals in group order. Up to 32 rows: one group at a time, rows 16– on C 1, A 3. The
// tiles are configured for the rows (amx_config).
template <int TILES>
void int4_amx(const int32_t* tile, const BFloat16* scales, const uint32_t* x, int64_t row_pairs,
              const float* sums, int64_t groups, int64_t rows, BFloat16* out, int64_t out_stride) {
  alignas(64) uint32_t b[2][16][16];
  alignas(64) float c[2][16][16], total[TILES * 16][16] = {};
  const int64_t stride = row_pairs * 4;
  int64_t g = 0;
  if (TILES == 1)
    for (; g + 2 <= groups; g += 2) {
      unpack_group(tile, g, b[0]);
      unpack_group(tile, g + 1, b[1]);
      _tile_loadd(4, b[0], 64);
      _tile_loadd(5, b[1], 64);
      _tile_loadd(2, x + g * 16, stride);
      _tile_loadd(3, x + (g + 1) * 16, stride);
      _tile_zero(0);
      _tile_zero(1);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 5);
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      add_group(c[0], scales, sums, groups, g, rows, total);
      add_group(c[1], scales, sums, groups, g + 1, rows, total);
    }
  for (; g < groups; ++g) {
    unpack_group(tile, g, b[0]);
    _tile_loadd(4, b[0], 64);
    _tile_loadd(2, x + g * 16, stride);
    _tile_zero(0);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, c[0], 64);
    if (TILES == 2) {
      _tile_loadd(3, x + 16 * row_pairs + g * 16, stride);
      _tile_zero(1);
      _tile_dpbf16ps(1, 3, 4);
      _tile_stored(1, c[1], 64);
    }
    add_group(c[0], scales, sums, groups, g, std::min<int64_t>(rows, 16), total);
    if (TILES == 2) add_group(c[1], scales, sums + 16 * groups, groups, g, rows - 16, total + 16);
  }
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total[r])));
}

// A prompt's dense kernel (kernels.Int4Linear's "amx-bf16" prefill): x times a bf16 copy of the
// weight in AMX B tiles (N/16, K/32, 16, 32): tile (b, g) holds outputs 16b.. over inputs 32g..,
// k-pair p and output j at [p][2j], [p][2j + 1]. Each 16 × 16 output tile sums the K/32 groups in
// order on one C tile (the scales are in the copy: no per-group epilogue), so a row's outputs
// depend on its own inputs only, whatever the rows beside it. rows: a multiple of 16.
void dense_amx(const BFloat16* x, int64_t rows, int64_t K, const BFloat16* w, int64_t blocks,
               BFloat16* out, int64_t N) {
  const int64_t groups = K / 32, row_tiles = rows / 16;
  parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1; tiles 0-3 C, 4-5 A, 6-7 B: 16 rows of 64 bytes each
    for (int t = 0; t < 8; ++t) config[16 + 2 * t] = 64, config[48 + t] = 16;
    _tile_loadconfig(config);
    alignas(64) float c[16][16];
    for (int64_t pair = begin; pair < end; ++pair) {  // 2 tile columns, 2 row tiles at a time
      const int64_t b0 = 2 * pair, cols = std::min<int64_t>(2, blocks - b0);
      for (int64_t rt = 0; rt < row_tiles; rt += 2) {
        const int64_t tiles = std::min<int64_t>(2, row_tiles - rt);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t g = 0; g < groups; ++g) {
          const BFloat16 *a = x + rt * 16 * K + g * 32, *b = w + (b0 * groups + g) * 512;
          _tile_loadd(4, a, K * 2);
          _tile_loadd(6, b, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (cols == 2) {
            _tile_loadd(7, b + groups * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (tiles == 2) {
            _tile_loadd(5, a + 16 * K, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (cols == 2) _tile_dpbf16ps(3, 5, 7);
          }
        }
        for (int t = 0; t < 2 * tiles; ++t) {
          if (t % 2 >= cols) continue;
          switch (t) {  // a tile register is an immediate
            case 0: _tile_stored(0, c, 64); break;
            case 1: _tile_stored(1, c, 64); break;
            case 2: _tile_stored(2, c, 64); break;
            default: _tile_stored(3, c, 64);
          }
          BFloat16* o = out + (rt + t / 2) * 16 * N + (b0 + t % 2) * 16;
          for (int r = 0; r < 16; ++r)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + r * N),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c[r])));
        }
      }
    }
    _tile_release();
  });
}
#endif
#else
constexpr bool HAVE_AVX512_BF16 = false;
#endif

bool amx_bf16() {  // whether int4_mm can take AMX tiles here: compiled in, and granted
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_ready();
#else
  return false;
#endif
}

}  // namespace

// x (n, K) bf16 times a 4-bit weight (N, K) packed by kernels.Int4Linear.use_kernel: tiles
// (N/16, K/8, 16) int32, lane i of tile (b, c) holding row 16b + i's inputs 8c..8c+7 as nibbles
// (input 8c + 2m at bits 4m, 8c + 2m + 1 at bits 16 + 4m); scales (N/16, K/32, 2, 16) bf16, the
// scale then the zero of rows 16b.. in group g. Returns (n, N) bf16: float32 sums, rounded once,
// as torch's kernel does. The tiles' shape names the instructions: (N/16, K/8, 16) AVX-512 BF16
// dot products, rows up to 8 at a time through each tile column (read from memory once for all
// of them); the same tiles viewed as (N/16, K/32, 4, 16) AMX tiles, 32 rows at a time.
Tensor int4_mm(const Tensor& x, const Tensor& tiles, const Tensor& scales) {
  TORCH_CHECK(HAVE_AVX512_BF16, "this build has no AVX-512 BF16 instructions (CPU without avx512_bf16)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: (n, K) bf16");
  const bool amx = tiles.dim() == 4;
  TORCH_CHECK(tiles.scalar_type() == at::kInt && tiles.is_contiguous() && tiles.size(-1) == 16 &&
                  (amx ? tiles.size(1) * 32 == x.size(1) && tiles.size(2) == 4
                       : tiles.dim() == 3 && tiles.size(1) * 8 == x.size(1)),
              "tiles: (N/16, K/8, 16) or (N/16, K/32, 4, 16) int32");
  TORCH_CHECK(!amx || amx_bf16(), "this build or process has no AMX BF16 tiles (amx_bf16)");
  const int64_t n = x.size(0), K = x.size(1), blocks = tiles.size(0), groups = K / 32;
  TORCH_CHECK(K % 32 == 0 && scales.is_contiguous() && scales.scalar_type() == at::kBFloat16 &&
                  scales.numel() == blocks * groups * 32,
              "scales: (N/16, K/32, 2, 16) bf16");
  Tensor out = at::empty({n, blocks * 16}, x.options());
#if defined(__AVX512BF16__)
  const BFloat16* X = x.data_ptr<BFloat16>();
  std::vector<float> sums(n * groups);  // Σx per row and group, in order
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = 0; k < 32; ++k) s += static_cast<float>(X[r * K + g * 32 + k]);
      sums[r * groups + g] = s;
    }
  const auto* pairs = reinterpret_cast<const uint32_t*>(X);
  const int32_t* T = tiles.data_ptr<int32_t>();
  const BFloat16* S = scales.data_ptr<BFloat16>();
  BFloat16* O = out.data_ptr<BFloat16>();
  const int64_t N = blocks * 16, pairs_per_row = K / 2;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx) {
    parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = 0; r < n; r += 32) {  // 32 rows at a time through every tile column
        const int64_t rows = std::min<int64_t>(n - r, 32);
        // per thread and pass: the tile configuration is a thread's state
        amx_config(std::min<int64_t>(rows, 16), rows > 16 ? rows - 16 : rows);
        const uint32_t* xr = pairs + r * pairs_per_row;
        const float* sr = sums.data() + r * groups;
        for (int64_t b = begin; b < end; ++b) {
          const int32_t* tile = T + b * (K / 8) * 16;
          const BFloat16* scale = S + b * groups * 32;
          BFloat16* o = O + r * N + b * 16;
          if (rows > 16)
            int4_amx<2>(tile, scale, xr, pairs_per_row, sr, groups, rows, o, N);
          else
            int4_amx<1>(tile, scale, xr, pairs_per_row, sr, groups, rows, o, N);
        }
      }
      _tile_release();
    });
    return out;
  }
#endif
  parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* tile = T + b * (K / 8) * 16;
      const BFloat16* scale = S + b * groups * 32;
      for (int64_t r = 0; r < n;) {
        const uint32_t* xr = pairs + r * pairs_per_row;
        const float* sr = sums.data() + r * groups;
        BFloat16* o = O + r * N + b * 16;
        switch (std::min<int64_t>(n - r, 8)) {  // the tile column stays in cache for the next
          case 8: int4_tile<8>(tile, scale, xr, pairs_per_row, sr, groups, o, N), r += 8; break;
          case 7: int4_tile<7>(tile, scale, xr, pairs_per_row, sr, groups, o, N), r += 7; break;
          case 6: int4_tile<6>(tile, scale, xr, pairs_per_row, sr, groups, o, N), r += 6; break;
          case 5: int4_tile<5>(tile, scale, xr, pairs_per_row, sr, groups, o, N), r += 5; break;
          case 4: int4_tile<4>(tile, scale, xr, pairs_per_row, sr, groups, o, N), r += 4; break;
          case 3: int4_tile<3>(tile, scale, xr, pairs_per_row, sr, groups, o, N), r += 3; break;
          case 2: int4_tile<2>(tile, scale, xr, pairs_per_row, sr, groups, o, N), r += 2; break;
          default: int4_tile<1>(tile, scale, xr, pairs_per_row, sr, groups, o, N), r += 1;
        }
      }
    }
  });
#endif
  return out;
}

// x (n, K) bf16 times a bf16 weight copy in AMX B tiles (N/16, K/32, 16, 32): (n, N) bf16,
// float32 sums rounded once, on AMX tiles (dense_amx) or with AVX-512 BF16 dot products
// (dense_avx512). Row r's outputs depend on row r of x only.
Tensor dense_mm(const Tensor& x, const Tensor& tiles, bool amx) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: (n, K) bf16");
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 4 && tiles.is_contiguous() &&
                  tiles.size(1) * 32 == x.size(1) && tiles.size(2) == 16 && tiles.size(3) == 32,
              "tiles: (N/16, K/32, 16, 32) bf16");
  if (!amx) {
    TORCH_CHECK(HAVE_AVX512_BF16, "this build has no AVX-512 BF16 instructions (CPU without avx512_bf16)");
    Tensor out = at::empty({x.size(0), tiles.size(0) * 16}, x.options());
#if defined(__AVX512BF16__)
    dense_avx512(x.data_ptr<BFloat16>(), x.size(0), x.size(1), tiles.data_ptr<BFloat16>(),
                 tiles.size(0), out.data_ptr<BFloat16>(), out.size(1));
#endif
    return out;
  }
  TORCH_CHECK(amx_bf16(), "this build or process has no AMX BF16 tiles (amx_bf16)");
  const int64_t n = x.size(0), K = x.size(1), blocks = tiles.size(0), padded = (n + 15) / 16 * 16;
  Tensor in = x, out = at::empty({padded, blocks * 16}, x.options());
  if (padded != n) {  // zero rows to whole tiles
    in = at::zeros({padded, K}, x.options());
    in.narrow(0, 0, n).copy_(x);
  }
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  dense_amx(in.data_ptr<BFloat16>(), padded, K, tiles.data_ptr<BFloat16>(), blocks,
            out.data_ptr<BFloat16>(), blocks * 16);
#endif
  return padded == n ? out : out.narrow(0, 0, n);
}

namespace {

// x's rows as blocks::Acts (blocks.h: int8 per group of 32), owning the storage.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<int32_t> sum;
  blocks::Acts acts;
};

Quantized quantize(const Tensor& x) {  // (blocks.h's scalar quantize_row: the same on every ISA)
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) % blocks::GROUP == 0,
              "x: (n, K) bf16 or float32, K a multiple of 32");
  const int64_t n = x.size(0), K = x.size(1), groups = K / blocks::GROUP;
  Quantized out{std::vector<int8_t>(n * K), std::vector<float>(n * groups), std::vector<float>(n * groups),
                std::vector<int32_t>(n * groups), {}};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto* raw = static_cast<const char*>(x.data_ptr());
  parallel_for(0, n, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* q = &out.q[r * K];
      float *d = &out.d[r * groups], *ds = &out.dsum[r * groups];
      int32_t* sum = &out.sum[r * groups];
      if (bf16)
        blocks::quantize_row(reinterpret_cast<const uint16_t*>(raw) + r * K, K, q, d, sum, ds);
      else
        blocks::quantize_row(reinterpret_cast<const float*>(raw) + r * K, K, q, d, sum, ds);
    }
  });
  out.acts = {out.q.data(), out.d.data(), out.sum.data(), out.dsum.data(), K};
  return out;
}

// Whether a linear's tiles are blocks.h's (8 rows a tile) rather than int4_mm's (16) or torch's pack.
bool is_blocks(const Tensor& tiles) { return tiles.scalar_type() == at::kInt && tiles.size(-1) == blocks::LANES; }

// x quantized (n rows) times blocks.h tiles (N/8, K·bits/32, 8) and scales (N/8, K/32, 1 + zeros, 8):
// (n, N) bf16, every row from its own inputs alone. `reference`: the scalar reference instead.
Tensor blocks_matmul(const Quantized& x, int64_t n, const Tensor& tiles, const Tensor& scales, bool reference) {
  const int64_t K = x.acts.K, count = tiles.size(0);
  const int64_t bits = tiles.dim() == 3 ? tiles.size(1) * blocks::GROUP / K : 0;
  TORCH_CHECK(is_blocks(tiles) && tiles.is_contiguous() && tiles.size(1) * blocks::GROUP == bits * K &&
                  (bits == 4 || bits == 5 || bits == 8),
              "tiles: (N/8, K·bits/32, 8) int32, bits 4, 5 or 8");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == count && scales.size(1) * blocks::GROUP == K && scales.size(3) == 8 &&
                  (scales.size(2) == (bits == 5 ? 3 : 2) || (bits == 8 && scales.size(2) == 3)),
              "scales: (N/8, K/32, 1 + zeros, 8) bf16, one zero (4-bit), two (5-bit), one or two (8-bit)");
  const int zeros = scales.size(2) - 1;
  Tensor out = at::empty({n, count * blocks::LANES}, tiles.options().dtype(at::kBFloat16));
  const auto* T = reinterpret_cast<const uint32_t*>(tiles.data_ptr<int32_t>());
  const auto* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<BFloat16>());
  auto* O = reinterpret_cast<uint16_t*>(out.data_ptr<BFloat16>());
  parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    blocks::columns(bits, zeros, T, S, x.acts, n, begin, end, O, count * blocks::LANES, reference);
  });
  return out;
}

// torch's int4 weight-only kernel for its own pack (uint8), ours (int4_mm) for our tiles (int32),
// blocks.h's for its tiles (which take the input once whatever the copies: 8-bit weights)
Tensor int4_matmul(const Tensor& x, const Tensor& packed, const Tensor& scale_zero, int64_t copies) {
  if (is_blocks(packed)) return blocks_matmul(quantize(x), x.size(0), packed, scale_zero, false);
  const Tensor input = copies > 1 ? x.repeat({1, copies}) : x;
  if (packed.scalar_type() == at::kInt) return int4_mm(input, packed, scale_zero);
  return at::_weight_int4pack_mm_for_cpu(input, packed, 32, scale_zero);
}

// x += y·residual (y bf16), rows (n, d): a branch's residual add, the branch × residual first
// (Granite's residual_multiplier; 1: no multiply, the other families' sums as they were)
void add_bf16(float* x, const Tensor& y, float residual) {
  const BFloat16* v = y.data_ptr<BFloat16>();
  const int64_t d = y.size(1);
  parallel_for(0, y.size(0), TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    if (residual == 1.f)
      for (int64_t i = begin * d; i < end * d; ++i) x[i] += static_cast<float>(v[i]);
    else
      for (int64_t i = begin * d; i < end * d; ++i) x[i] += static_cast<float>(v[i]) * residual;
  });
}

// x += rms_norm(y)·weight·residual, y (n, d) bf16: a branch's output normed before its residual
// add (families.SANDWICH_NORMS' post_attention_norm and post_ffw_norm), in float32; residual as
// in add_bf16.
void add_normed(float* x, const Tensor& y, const float* weight, float eps, float residual) {
  const BFloat16* v = y.data_ptr<BFloat16>();
  const int64_t d = y.size(1);
  parallel_for(0, y.size(0), TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t r = begin; r < end; ++r) {
      at::vec::convert(v + r * d, row.data(), d);
      const float inverse = 1.f / std::sqrt(dot(row.data(), row.data(), d) / d + eps);
      if (residual == 1.f)
        for (int64_t j = 0; j < d; ++j) x[r * d + j] += row[j] * inverse * weight[j];
      else
        for (int64_t j = 0; j < d; ++j) x[r * d + j] += row[j] * inverse * weight[j] * residual;
    }
  });
}

// The MLP's gate on rows (n, 2I) bf16 [gate | up] → act(gate)·up (n, I) bf16; act: SiLU (0) or
// gelu with the tanh approximation (1: GeGLU), families.ACTIVATIONS.
Tensor gated_mlp(const Tensor& gate_up, int64_t activation) {
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  Tensor gated = at::empty({N, I}, gate_up.options());
  parallel_for(0, N, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    std::vector<float> g(I), u(I);
    const Vec one(1.f), half(0.5f), root(0.7978845608028654f), cubic(0.044715f);  // √(2/π)
    for (int64_t t = begin; t < end; ++t) {
      const BFloat16* in = gate_up.data_ptr<BFloat16>() + t * 2 * I;
      at::vec::convert(in, g.data(), I);
      at::vec::convert(in + I, u.data(), I);
      for (int64_t j = 0; j < I; j += Vec::size()) {
        int64_t count = std::min<int64_t>(Vec::size(), I - j);
        Vec a = Vec::loadu(g.data() + j, count), b = Vec::loadu(u.data() + j, count);
        Vec act = activation == 0 ? a / (one + a.neg().exp_u20())
                                  : half * a * (one + (root * (a + cubic * a * a * a)).tanh());
        (act * b).store(g.data() + j, count);
      }
      at::vec::convert(g.data(), gated.data_ptr<BFloat16>() + t * I, I);
    }
  });
  return gated;
}

}  // namespace

// ids (N,) int64: the new tokens, embedded from embed (V, d) (Rows: float32, or int8 with embed_scales) ×
// embed_scale; rows r = 0.. take sizes[r]
// of them, at positions starts[r].., into keys[r] ((L, KV, capacity / 16, hd, 16) float32: tiles) and
// values[r] ((L, KV, capacity, hd) bf16: the q/k/v matmul's outputs are bf16, so nothing is
// rounded), room reserved. cos and sin (R, P, hd): R tables of the rotary factors of positions
// 0..P-1, layer l rotating by table rotary[l]. Per layer l, linears 4l..4l+3 are q/k/v, o,
// gate/up, down (torch int4 packs: packed, scale_zero, copies of the input), or where ``dense``
// is not empty (a prompt's prefill) their bf16 copies in AMX tiles (dense_mm: on AMX where
// ``dense_amx``, else with AVX-512 BF16); norms k·l.. its k RMSNorm weights (families.Block: k = 2,
// before attention and before the MLP, or 4: after each as well); final_norm the last. biases:
// none, or per layer the q/k/v matmul's bias (width,) float32 (Qwen2); qk_norms: none, or per
// layer the RMSNorm weights (hd,) float32 of each query head and each key head, applied before
// rotary (Qwen3, Gemma 3). activation: the MLP's (gated_mlp); scores are q·k × attention_scale;
// windows[l] > 0: layer l's queries see the last windows[l] positions only (a key at distance
// ≥ windows[l] is masked); each branch's output × residual_scale before its residual add (1:
// none); attention_cap > 0: the scores soft-capped, cap·tanh(scores / cap), after their scale and
// before the mask (Gemma 2; 0: none). Returns the features (N, d): the last layer's output after
// the final norm; the caches hold the new keys and values.
Tensor fused_layers(const Tensor& ids, const Tensor& embed, const Tensor& embed_scales,
                    const Tensor& cos, const Tensor& sin,
                    const std::vector<Tensor>& packed, const std::vector<Tensor>& scale_zero,
                    const std::vector<int64_t>& copies, const std::vector<Tensor>& dense,
                    bool dense_amx, const std::vector<Tensor>& norms,
                    const std::vector<Tensor>& biases, const std::vector<Tensor>& qk_norms,
                    const Tensor& final_norm, const std::vector<Tensor>& keys,
                    const std::vector<Tensor>& values, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& sizes, int64_t heads, int64_t kv_heads, double eps,
                    int64_t activation, double embed_scale, double attention_scale,
                    const std::vector<int64_t>& windows, const std::vector<int64_t>& rotary,
                    double residual_scale, double attention_cap) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids: (N,) int64");
  const Rows embed_rows(embed, embed_scales);
  const int64_t N = ids.size(0), d = embed_rows.d, layers = static_cast<int64_t>(packed.size()) / 4;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(packed.size()) == 4 * layers, "packed: four linears a layer");
  const int64_t k_norms = static_cast<int64_t>(norms.size()) / layers;
  TORCH_CHECK((k_norms == 2 || k_norms == 4) && k_norms * layers == static_cast<int64_t>(norms.size()),
              "norms: two or four a layer");
  TORCH_CHECK(activation == 0 || activation == 1, "activation: 0 (SiLU) or 1 (gelu-tanh)");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == layers && static_cast<int64_t>(rotary.size()) == layers,
              "windows, rotary: one per layer");
  Tensor x = at::empty({N, d}, ids.options().dtype(at::kFloat));
  const float embed_factor = static_cast<float>(embed_scale);
  for (int64_t t = 0; t < N; ++t) {
    const int64_t id = ids.data_ptr<int64_t>()[t];
    TORCH_CHECK(0 <= id && id < embed_rows.count, "a token id beyond the embedding");
    float* row = x.data_ptr<float>() + t * d;
    const float* e = embed_rows.row(id, row);  // dequantized in place, or the table's own
    if (e != row) std::copy_n(e, d, row);
    if (embed_factor != 1.f)
      for (int64_t j = 0; j < d; ++j) row[j] *= embed_factor;
  }
  TORCH_CHECK(cos.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() && sin.sizes() == cos.sizes(),
              "cos, sin: (R, P, hd)");
  for (int64_t l = 0; l < layers; ++l)
    TORCH_CHECK(0 <= rotary[l] && rotary[l] < cos.size(0) && windows[l] >= 0, "rotary[l]: a table; windows[l] ≥ 0");
  const int64_t hd = cos.size(2), half = hd / 2, group = heads / kv_heads, table = cos.size(1) * hd;
  const int64_t width = (heads + 2 * kv_heads) * hd;
  const int64_t rows = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> row(N), position(N), first(rows);
  for (int64_t r = 0, t = 0; r < rows; ++r) {
    first[r] = t;
    for (int64_t i = 0; i < sizes[r]; ++i, ++t) row[t] = r, position[t] = starts[r] + i;
  }
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == rows && static_cast<int64_t>(values.size()) == rows,
              "one cache per row");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(keys[r].scalar_type() == at::kFloat && values[r].scalar_type() == at::kBFloat16 &&
                    keys[r].is_contiguous() && values[r].is_contiguous() && keys[r].dim() == 5 &&
                    keys[r].size(4) == KEY_TILE && keys[r].size(2) * KEY_TILE == values[r].size(2) &&
                    values[r].size(2) >= starts[r] + sizes[r],
                "each row's cache: contiguous, with room for its new positions");
  int64_t longest = 0;
  for (int64_t p : position) longest = std::max(longest, p + 1);
  TORCH_CHECK(longest <= cos.size(1), "positions beyond the rotary tables");

  // attention tasks (row, key/value head, its first query, how many): a row's queries of one
  // key/value head are its tokens × the group's heads, token-major (n ascending), split so that
  // every thread has two tasks or more (a one-token step: 3 heads, 2 threads)
  const int64_t splits = (2 * at::get_num_threads() + rows * kv_heads - 1) / (rows * kv_heads);
  std::vector<std::array<int64_t, 4>> tasks;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t queries = sizes[r] * group;
    const int64_t each = std::min(QUERIES, std::max<int64_t>(1, (queries + splits - 1) / splits));
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      for (int64_t from = 0; from < queries; from += each)
        tasks.push_back({r, kv, from, std::min(each, queries - from)});
  }

  float* X = x.data_ptr<float>();
  const float* C = cos.data_ptr<float>();
  const float* S = sin.data_ptr<float>();
  const float scale = static_cast<float>(attention_scale), residual = static_cast<float>(residual_scale);
  const float cap = static_cast<float>(attention_cap);
  TORCH_CHECK(cap >= 0.f, "attention_cap: 0 (none) or the cap");
  auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  Tensor normed = at::empty({N, d}, bf16), attended = at::empty({N, heads * hd}, bf16);
  std::vector<float> q(N * heads * hd);
  TORCH_CHECK(dense.empty() || dense.size() == packed.size(), "dense: none, or one per linear");
  TORCH_CHECK(biases.empty() || static_cast<int64_t>(biases.size()) == layers, "biases: none, or one per layer");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "qk_norms: none, or two per layer");
  for (const Tensor& b : biases)
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == width, "a bias: (width,) float32");
  for (const Tensor& w : qk_norms)
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == hd, "a q/k norm: (hd,) float32");
  const auto linear = [&](const Tensor& input, int64_t i) {
    return dense.empty() ? int4_matmul(input, packed[i], scale_zero[i], copies[i]) : dense_mm(input, dense[i], dense_amx);
  };

  for (int64_t l = 0; l < layers; ++l) {
    // attention: q, k, v of every token; rotary on q and k; k and v into the token's cache
    rms_norm(X, norms[k_norms * l].data_ptr<float>(), normed.data_ptr<BFloat16>(), N, d, eps);
    Tensor h = linear(normed, 4 * l);
    const BFloat16* H = h.data_ptr<BFloat16>();
    const float* bias = biases.empty() ? nullptr : biases[l].data_ptr<float>();
    parallel_for(0, N, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
      std::vector<float> in(hd);
      for (int64_t t = begin; t < end; ++t) {
        const Tensor &K = keys[row[t]], &V = values[row[t]];
        const int64_t capacity = V.size(2);
        const float *c = C + rotary[l] * table + position[t] * hd, *s = S + rotary[l] * table + position[t] * hd;
        for (int64_t head = 0; head < heads + 2 * kv_heads; ++head) {
          for (int64_t j = 0; j < hd; ++j) in[j] = static_cast<float>(H[t * width + head * hd + j]);
          if (bias)
            for (int64_t j = 0; j < hd; ++j) in[j] += bias[head * hd + j];
          if (head >= heads + kv_heads) {  // a value: no rotary, no norm
            const int64_t kv = l * kv_heads + head - heads - kv_heads;
            BFloat16* out = V.data_ptr<BFloat16>() + (kv * capacity + position[t]) * hd;
            for (int64_t j = 0; j < hd; ++j) out[j] = static_cast<BFloat16>(in[j]);
            continue;
          }
          if (!qk_norms.empty()) {  // each head's RMSNorm over its hd values
            const float* w = qk_norms[2 * l + (head < heads ? 0 : 1)].data_ptr<float>();
            const float inverse = 1.f / std::sqrt(dot(in.data(), in.data(), hd) / hd + static_cast<float>(eps));
            for (int64_t j = 0; j < hd; ++j) in[j] = in[j] * inverse * w[j];
          }
          // a query, or a key (in its tile: element j at j·KEY_TILE)
          const int64_t kv = l * kv_heads + head - heads;
          float* out = head < heads ? &q[(t * heads + head) * hd]
                                    : K.data_ptr<float>() + kv * hd * capacity + key_at(position[t], hd);
          const int64_t step = head < heads ? 1 : KEY_TILE;
          for (int64_t j = 0; j < half; ++j) {  // transformers' layout: pairs (j, j + hd/2)
            float a = in[j], b = in[j + half];
            out[j * step] = a * c[j] - b * s[j];
            out[(j + half) * step] = b * c[j + half] + a * s[j + half];
          }
        }
      }
    });
    BFloat16* A = attended.data_ptr<BFloat16>();
    // a task is up to QUERIES queries of one row and one key/value head (its group's heads at
    // each of the row's tokens, in order): they read the same keys and values, once a pass
    // (tasks), and the next task of the same row and head finds them in the core's cache
    parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(QUERIES * longest), queries(QUERIES * hd), out(QUERIES * hd);
      // place: the query's offset in q and in A (token, head); lo, n: the positions it sees
      int64_t lo[QUERIES], n[QUERIES], place[QUERIES];
      for (int64_t task = begin; task < end; ++task) {
        const auto [r, kv, from, count] = tasks[task];
        const Tensor &K = keys[r], &V = values[r];
        const int64_t offset = (l * kv_heads + kv) * V.size(2) * hd;
        for (int64_t i = 0; i < count; ++i) {  // the row's token (from + i) / group, at one head
          const int64_t t = first[r] + (from + i) / group, head = kv * group + (from + i) % group;
          place[i] = (t * heads + head) * hd;
          n[i] = position[t] + 1;
          lo[i] = windows[l] > 0 ? std::max<int64_t>(0, n[i] - windows[l]) : 0;
          for (int64_t e = 0; e < hd; ++e) queries[i * hd + e] = q[place[i] + e] * scale;
        }
        attend_some(count, queries.data(), K.data_ptr<float>() + offset, V.data_ptr<BFloat16>() + offset,
                    lo, n, hd, cap, scores.data(), longest, out.data());
        for (int64_t i = 0; i < count; ++i) at::vec::convert(&out[i * hd], A + place[i], hd);
      }
    });
    if (k_norms == 4) add_normed(X, linear(attended, 4 * l + 1), norms[4 * l + 1].data_ptr<float>(), eps, residual);
    else add_bf16(X, linear(attended, 4 * l + 1), residual);

    // MLP: down(act(gate) · up)
    rms_norm(X, norms[k_norms * l + k_norms / 2].data_ptr<float>(), normed.data_ptr<BFloat16>(), N, d, eps);
    Tensor gated = gated_mlp(linear(normed, 4 * l + 2), activation);
    if (k_norms == 4) add_normed(X, linear(gated, 4 * l + 3), norms[4 * l + 3].data_ptr<float>(), eps, residual);
    else add_bf16(X, linear(gated, 4 * l + 3), residual);
  }
  const float* weight = final_norm.data_ptr<float>();  // the final RMSNorm, in float32
  for (int64_t t = 0; t < N; ++t) {
    float* row = X + t * d;
    const float inverse = 1.f / std::sqrt(dot(row, row, d) / d + eps);
    for (int64_t j = 0; j < d; ++j) row[j] = row[j] * inverse * weight[j];
  }
  return x;
}

// The Q8_0 LM head (kernels.Q8Head, which states the bound) in one call: x (n, d) float32 rounded
// to bf16 (denormals flushed), fed twice through the head's 4-bit blocks (packed, scale_zero);
// per position, each logit's bound u·|a| + ‖x‖·T0 + ‖x − x̃‖·T1 + ‖S‖·T2 + T3 from terms (V, 4);
// then every legal logit whose upper end reaches the largest legal lower end is recomputed in
// float32 from its row of weight (V, d) (Rows: float32, or int8 with weight_scales). legal: (n, V)
// bool, or empty (every token legal). Returns the logits (n, V) float32: the blocks' values,
// float32's where recomputed.
Tensor q8_head(const Tensor& x, const Tensor& packed, const Tensor& scale_zero, const Tensor& terms,
               const Tensor& weight, const Tensor& weight_scales, const Tensor& legal, double roundoff) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: (n, d) float32");
  const Rows rows(weight, weight_scales);
  const int64_t n = x.size(0), d = x.size(1), V = rows.count;
  TORCH_CHECK(rows.d == d && terms.is_contiguous() && terms.size(0) == V && terms.size(1) == 4,
              "weight (V, d), terms (V, 4)");
  const bool masked = legal.defined() && legal.numel() > 0;
  TORCH_CHECK(!masked || (legal.scalar_type() == at::kBool && legal.is_contiguous() &&
                          legal.size(0) == n && legal.size(1) == V),
              "legal: (n, V) bool");
  const float* X = x.data_ptr<float>();
  // x̃, what the blocks multiply: x in int8 groups (blocks.h's 8-bit tiles, fed once), else in bf16
  // with denormals flushed (int4_mm's or torch's 4-bit halves, fed twice)
  const bool int8 = is_blocks(packed);
  const Quantized quantized = int8 ? quantize(x) : Quantized{};
  Tensor fed = int8 ? Tensor() : at::empty({n, 2 * d}, x.options().dtype(at::kBFloat16));
  BFloat16* F = int8 ? nullptr : fed.data_ptr<BFloat16>();
  std::vector<float> scales(n * 4);  // ‖x‖, ‖x − x̃‖, ‖S‖, 1
  for (int64_t r = 0; r < n; ++r) {
    const float* row = X + r * d;
    float xx = 0.f, dd = 0.f, ss = 0.f, group = 0.f;
    for (int64_t j = 0; j < d; ++j) {
      float v;
      if (int8) {
        v = quantized.d[(r * d + j) / 32] * quantized.q[r * d + j];
      } else {
        BFloat16 b = static_cast<BFloat16>(row[j]);
        v = static_cast<float>(b);
        if (std::fabs(v) < 0x1p-126f) v = 0.f, b = static_cast<BFloat16>(0.f);  // flushed
        F[r * 2 * d + j] = F[r * 2 * d + d + j] = b;
      }
      xx += row[j] * row[j], dd += (row[j] - v) * (row[j] - v), group += std::fabs(v);
      if (j % 32 == 31) ss += group * group, group = 0.f;
    }
    scales[r * 4 + 0] = std::sqrt(xx), scales[r * 4 + 1] = std::sqrt(dd);
    scales[r * 4 + 2] = std::sqrt(ss), scales[r * 4 + 3] = 1.f;
  }
  const Tensor approx = int8 ? blocks_matmul(quantized, n, packed, scale_zero, false)
                             : int4_matmul(fed, packed, scale_zero, 1);  // (n, ≥ V) bf16
  const BFloat16* A = approx.data_ptr<BFloat16>();
  const int64_t stride = approx.size(1);
  Tensor out = at::empty({n, V}, x.options());
  float* O = out.data_ptr<float>();
  const float* T = terms.data_ptr<float>();
  std::vector<float> scratch(d);  // a recomputed row, dequantized
  const bool* L = masked ? legal.data_ptr<bool>() : nullptr;
  const float u = static_cast<float>(roundoff);
  std::vector<float> upper(V);
  for (int64_t r = 0; r < n; ++r) {
    const float* s = &scales[r * 4];
    const BFloat16* a = A + r * stride;
    const bool* ok = masked ? L + r * V : nullptr;
    float* o = O + r * V;
    float best = -INFINITY;
    for (int64_t t = 0; t < V; ++t) {
      const float* c = T + t * 4;
      const float v = static_cast<float>(a[t]);
      const float bound = u * std::fabs(v) + s[0] * c[0] + s[1] * c[1] + s[2] * c[2] + s[3] * c[3];
      o[t] = v, upper[t] = v + bound;
      if (!ok || ok[t]) best = std::max(best, v - bound);
    }
    for (int64_t t = 0; t < V; ++t)
      if ((!ok || ok[t]) && upper[t] >= best) o[t] = dot(rows.row(t, scratch.data()), X + r * d, d);
  }
  return out;
}

// x (n, K) bf16 or float32 times a weight in blocks.h's tiles: (n, N) bf16 (kernels.Int4Linear's
// "avx2" and "neon" kernels); `reference`: through the scalar reference, for the tests.
Tensor blocks_mm(const Tensor& x, const Tensor& tiles, const Tensor& scales, bool reference) {
  return blocks_matmul(quantize(x), x.size(0), tiles, scales, reference);
}

// Bitmasks (bit t of byte t / 8 set iff token t is legal; one bytes object of V / 8 bytes per
// state) as a (rows, V) bool tensor, in one call: after a forward has streamed the weights through
// the caches, each numpy or torch call costs tens of microseconds, and the three a conversion
// took there were the largest part of a round's constraint work (git show 8fe3c79:docs/measurements.md).
// SPREAD[b]: byte b's 8 bits as 8 bools, lowest bit first (little-endian: the first byte of the word).
const std::array<uint64_t, 256> SPREAD = [] {
  std::array<uint64_t, 256> table{};
  for (int b = 0; b < 256; ++b)
    for (int i = 0; i < 8; ++i) table[b] |= static_cast<uint64_t>((b >> i) & 1) << (8 * i);
  return table;
}();

Tensor unpack_bits(const py::list& rows, int64_t V) {
  const int64_t n = static_cast<int64_t>(rows.size());
  Tensor out = at::empty({n, V}, at::kBool);
  bool* o = out.data_ptr<bool>();
  for (int64_t r = 0; r < n; ++r) {
    PyObject* row = rows[r].ptr();
    TORCH_CHECK(PyBytes_Check(row) && PyBytes_GET_SIZE(row) * 8 >= V, "unpack_bits: row ", r,
                " is not a bytes object of at least ", (V + 7) / 8, " bytes");
    const auto* bits = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(row));
    bool* dst = o + r * V;
    int64_t t = 0;
#if defined(__AVX512BW__)
    const __m512i ones = _mm512_set1_epi8(1);  // 64 bits at a time: a byte 1 where the bit is set
    for (; t + 64 <= V; t += 64) {
      uint64_t word;
      std::memcpy(&word, bits + (t >> 3), 8);
      _mm512_storeu_si512(dst + t, _mm512_maskz_mov_epi8(word, ones));
    }
#endif
    for (; t + 8 <= V; t += 8) std::memcpy(dst + t, &SPREAD[bits[t >> 3]], 8);
    for (; t < V; ++t) dst[t] = (bits[t >> 3] >> (t & 7)) & 1;
  }
  return out;
}

// Each row's number of legal tokens in a pass's masks (rows, V) bool: the head's narrow test. torch
// sums a bool tensor through int64, a fifth of a batch round's time on 64 rows after a forward.
std::vector<int64_t> count_legal(const Tensor& masks) {
  TORCH_CHECK(masks.scalar_type() == at::kBool && masks.dim() == 2 && masks.is_contiguous() &&
                  masks.device().is_cpu(),
              "count_legal: masks must be a contiguous (rows, V) bool tensor on the CPU");
  const int64_t n = masks.size(0), V = masks.size(1);
  const auto* bytes = reinterpret_cast<const uint8_t*>(masks.data_ptr<bool>());
  std::vector<int64_t> counts(n);
  for (int64_t r = 0; r < n; ++r) {
    uint32_t count = 0;  // bytes are 0 or 1: the compiler sums them in vectors
    for (int64_t t = 0; t < V; ++t) count += bytes[r * V + t];
    counts[r] = count;
  }
  return counts;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object, so they run without the GIL: the server's HTTP thread
  // streams replies while the decode thread computes. unpack_bits reads a list: it keeps it.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("fused_layers", &fused_layers, "The compact Llama's layers for a few new tokens",
        nogil);
  m.def("int4_mm", &int4_mm, "x (n, K) bf16 times a 4-bit weight in our tiles: (n, N) bf16",
        nogil);
  m.def("dense_mm", &dense_mm, "x (n, K) bf16 times a bf16 weight in AMX B tiles: (n, N) bf16",
        nogil);
  m.def("q8_head", &q8_head, "The Q8_0 LM head's logits, the top ones recomputed in float32",
        nogil);
  m.def("count_legal", &count_legal, "each row's number of true entries of (rows, V) bool masks",
        nogil);
  m.def("unpack_bits", &unpack_bits, "bitmasks (bytes, bit t: token t) as a (rows, V) bool tensor");
  m.def("blocks_mm", &blocks_mm, "x (n, K) bf16 or float32, int8 per group, times blocks.h tiles: (n, N) bf16",
        py::arg("x"), py::arg("tiles"), py::arg("scales"), py::arg("reference") = false, nogil);
  m.def("blocks_isa", [] { return std::string(blocks::isa()); }, "blocks.h's variant compiled in");
  m.def("avx512_bf16", [] { return HAVE_AVX512_BF16; }, "whether int4_mm was compiled in");
  m.def("amx_bf16", &amx_bf16, "whether int4_mm takes AMX tiles here (compiled in, and granted)");
}
