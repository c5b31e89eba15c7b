// The compact Llama forward's layers for a few new tokens (a one-token step, a verify pass, a
// batch's rows), fused into one call: llama.py's Python loop spends more time dispatching its
// ~35 small ops per layer than the 4-bit matmuls take (git show 8fe3c79:docs/measurements.md).
// The matmuls are our own kernels (int4_mm on AVX-512 BF16 or AMX tiles, blocks.h's on int8
// activations), whichever the linears run (the same values as the Python loop's); norms,
// rotary, attention and the MLP's gate are plain loops here.
//
// Every token's values depend on its own inputs and its own cache only, computed by the same
// code in the same order whatever the number of tokens or rows: a verify pass computes bit for
// bit what one-token steps would, and a batch row what it would alone (tests check both).
//
// No torch, no Python: a library with a plain C ABI (abi.h), built once per instruction-set
// variant when the package is built (setup.py, isa.py), loaded by compiled.py. Errors are C++
// exceptions inside, a status and a message (cs_last_error) at the ABI.

#include "abi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>  // arch_prctl: a process asks Linux for the AMX tile registers
#include <unistd.h>
#endif

#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "blocks.h"  // weight blocks times int8 activations: AVX2, NEON, the scalar reference
#include "parallel.h"
#include "vec.h"

#ifndef CS_VARIANT
#define CS_VARIANT "unnamed"
#endif

namespace {

using bf16 = uint16_t;  // bf16 bits
using parallel::parallel_for;
using vec::Vec;

// A failed check: the message the binding raises (TORCH_CHECK's part before the port).
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

#define CHECK(condition, ...) \
  if (!(condition)) fail(__VA_ARGS__)

// n values of T, not initialized (torch's at::empty, where std::vector would zero them first).
template <class T>
std::unique_ptr<T[]> uninitialized(int64_t n) {
  return std::unique_ptr<T[]>(new T[std::max<int64_t>(n, 1)]);
}

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

float from_half(uint16_t h) {  // fp16 → float32, exact
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 31;
  uint32_t mantissa = h & 0x3FF, bits;
  if (exponent == 31) {
    bits = sign | 0x7F800000 | mantissa << 13;  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalized in float32
    int shift = 0;
    while (!(mantissa & 0x400)) mantissa <<= 1, ++shift;
    bits = sign | static_cast<uint32_t>(113 - shift) << 23 | (mantissa & 0x3FF) << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// A table of rows (V, d) (cs_rows; kernels.BlockRows, the token embedding and the LM head's
// rows): float32 rows, or int8 q with one scale per group of columns: Q8_0's, groups of 32 with
// fp16 scales, or Q6_K's, sub-blocks of 16 with float32 scales d·sc. A row is dequantized where
// it is read, to the float32 values a float32 copy would hold (|q| ≤ 127 times an fp16 value, or
// |q| ≤ 32 times an fp16 value times an int8, is exact in float32).
struct Rows {
  const cs_rows& table;

  explicit Rows(const cs_rows& rows) : table(rows) {
    CHECK(rows.values != nullptr && rows.d % 32 == 0, "a table: (V, d), d a multiple of 32");
    CHECK(rows.scale_kind == 0 || (rows.scales != nullptr && rows.group > 0 && rows.d % rows.group == 0),
          "a table of blocks: q (V, d) int8, scales (V, d/group) fp16 or float32");
  }

  // row t in float32: the table's own, or dequantized into `scratch` (d floats) and returned
  const float* row(int64_t t, float* scratch) const {
    const int64_t d = table.d;
    if (table.scale_kind == 0) return static_cast<const float*>(table.values) + t * d;
    const int64_t group = table.group, groups = d / group;
    const int8_t* row_q = static_cast<const int8_t*>(table.values) + t * d;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = table.scale_kind == 1
                              ? from_half(static_cast<const uint16_t*>(table.scales)[t * groups + g])
                              : static_cast<const float*>(table.scales)[t * groups + g];
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
      for (int64_t b = 0; b < B; ++b) acc[i][b] = vec::fmadd(qe, keys[b], acc[i][b]);
    }
  }
  for (int64_t i = 0; i < Q; ++i)
    for (int64_t b = 0; b < B; ++b)
      acc[i][b].store(scores + i * stride + j - base + b * W, b + 1 < B ? W : count);
}

// sums[i·hd + c..] = Σ_{base ≤ j < n} p[i·stride + j − base]·V[j, c..], positions every query
// sees (or has masked: p = 0 there).
template <int64_t Q, int64_t B>
void values_block(const float* p, int64_t stride, const bf16* v, int64_t base, int64_t n,
                  int64_t hd, int64_t c, int64_t count, float* sums) {
  constexpr int64_t W = Vec::size();
  Vec acc[Q][B];
  for (auto& row : acc)
    for (auto& a : row) a = Vec(0.f);
  for (int64_t j = base; j < n; ++j) {
    const bf16* vj = v + j * hd + c;
    Vec values[B];
    for (int64_t b = 0; b < B; ++b) values[b] = vec::load_bf16(vj + b * W, b + 1 < B ? W : count);
    for (int64_t i = 0; i < Q; ++i) {
      const Vec pj(p[i * stride + j - base]);
      for (int64_t b = 0; b < B; ++b) acc[i][b] = vec::fmadd(pj, values[b], acc[i][b]);
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
// whatever the other queries) as it would alone. The positions every query sees go through the
// shared passes, each query's own last ones after (continuing its sums in the same order).
template <int64_t Q>
void attend(const float* q, const float* k, const bf16* v, const int64_t* lo, const int64_t* n,
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
        acc = vec::fmadd(Vec(scores[i * stride + jj - base]), vec::load_bf16(v + jj * hd + c, count), acc);
      (acc / Vec(total[i])).store(out + i * hd + c, count);
    }
}

// Queries a pass of attend takes at most: its Q × B accumulators and B loaded vectors fit the
// 32 AVX-512 registers (AVX2 has 16).
constexpr int64_t QUERIES = Vec::size() >= 16 ? 6 : 3;

void attend_some(int64_t queries, const float* q, const float* k, const bf16* v, const int64_t* lo,
                 const int64_t* n, int64_t hd, float cap, float* scores, int64_t stride, float* out) {
  switch (queries) {  // 1..QUERIES by construction (fused_layers' tasks)
#define ATTEND(Q) \
  case Q: return attend<Q>(q, k, v, lo, n, hd, cap, scores, stride, out);
    ATTEND(1) ATTEND(2) ATTEND(3) ATTEND(4) ATTEND(5) ATTEND(6)
#undef ATTEND
  }
}

// The per-token work outside the matmuls and attention (norms, rotary, the MLP's gate, the
// residual adds) runs on the threads past this many tokens (from 2 tokens on measured the same
// on passes of 4 and 8: benchmarks/results/token-threads/threshold.txt).
constexpr int64_t TOKENS_A_THREAD = 8;

// rows (n, d) → x·rsqrt(mean(x²) + eps)·weight, as the bf16 input of a 4-bit matmul.
void rms_norm(const float* x, const float* weight, bf16* out, int64_t n, int64_t d, float eps) {
  parallel_for(0, n, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(d);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * d;
      float inverse = 1.f / std::sqrt(dot(row, row, d) / d + eps);
      for (int64_t j = 0; j < d; ++j) scratch[j] = row[j] * inverse * weight[j];
      vec::to_bf16(scratch.data(), out + r * d, d);
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
inline void group_scales(const bf16* scales, int64_t g, __m512& s, __m512& z) {
  const __m512i sz = _mm512_loadu_si512(scales + g * 32);  // 16 scales, then 16 zeros
  s = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(sz)), 16));
  z = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(sz, 1)), 16));
}

template <int64_t R>
void int4_tile(const int32_t* tile, const bf16* scales, const uint32_t* x, int64_t row_pairs,
               const float* sums, int64_t groups, bf16* out, int64_t out_stride) {
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
                bf16* out, int64_t N) {
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
void dense_rows(const __m512i* w, int64_t pairs, const uint32_t* x, int64_t n, bf16* out,
                int64_t N) {
  for (int64_t r = 0; r < n;) {
    const uint32_t* xr = x + r * pairs;
    bf16* o = out + r * N;
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

void dense_avx512(const bf16* x, int64_t n, int64_t K, const bf16* w, int64_t blocks,
                  bf16* out, int64_t N) {
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
#if defined(__linux__)
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0;
  return ready;
#else
  return false;  // (no test has run AMX tiles on another OS)
#endif
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
inline void add_group(const float (*c)[16], const bf16* scales, const float* sums,
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
void int4_amx(const int32_t* tile, const bf16* scales, const uint32_t* x, int64_t row_pairs,
              const float* sums, int64_t groups, int64_t rows, bf16* out, int64_t out_stride) {
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
void dense_amx(const bf16* x, int64_t rows, int64_t K, const bf16* w, int64_t blocks,
               bf16* out, int64_t N) {
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
          const bf16 *a = x + rt * 16 * K + g * 32, *b = w + (b0 * groups + g) * 512;
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
          bf16* o = out + (rt + t / 2) * 16 * N + (b0 + t % 2) * 16;
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

// x (n, K) bf16 times a 4-bit weight (N, K) packed by kernels.Int4Linear.use_kernel: tiles
// (N/16, K/8, 16) int32, lane i of tile (b, c) holding row 16b + i's inputs 8c..8c+7 as nibbles
// (input 8c + 2m at bits 4m, 8c + 2m + 1 at bits 16 + 4m); scales (N/16, K/32, 2, 16) bf16, the
// scale then the zero of rows 16b.. in group g. out (n, N) bf16: float32 sums, rounded once, as
// torch's kernel does. The tiles' shape names the instructions: (N/16, K/8, 16) AVX-512 BF16
// dot products, rows up to 8 at a time through each tile column (read from memory once for all
// of them); the same tiles viewed as (N/16, K/32, 4, 16) AMX tiles, 32 rows at a time.
void int4_mm([[maybe_unused]] const bf16* X, [[maybe_unused]] int64_t n, const cs_linear& w,
             [[maybe_unused]] bf16* O) {
  CHECK(HAVE_AVX512_BF16, "this build has no AVX-512 BF16 instructions (CPU without avx512_bf16)");
  const bool amx = w.layout == CS_INT4_AMX;
  CHECK(w.layout == CS_INT4 || amx, "int4_mm: a weight in int4_mm's tiles");
  CHECK(!amx || amx_bf16(), "this build or process has no AMX BF16 tiles (amx_bf16)");
  const int64_t K = w.inputs, N = w.outputs;
  CHECK(K % 32 == 0 && N % 16 == 0, "tiles: (N/16, K/8, 16), K a multiple of 32");
#if defined(__AVX512BF16__)
  const int64_t blocks = N / 16, groups = K / 32;
  std::vector<float> sums(n * groups);  // Σx per row and group, in order
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = 0; k < 32; ++k) s += blocks::from_bf16(X[r * K + g * 32 + k]);
      sums[r * groups + g] = s;
    }
  const auto* pairs = reinterpret_cast<const uint32_t*>(X);
  const int32_t* T = w.tiles;
  const bf16* S = w.scales;
  const int64_t pairs_per_row = K / 2;
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
          const bf16* scale = S + b * groups * 32;
          bf16* o = O + r * N + b * 16;
          if (rows > 16)
            int4_amx<2>(tile, scale, xr, pairs_per_row, sr, groups, rows, o, N);
          else
            int4_amx<1>(tile, scale, xr, pairs_per_row, sr, groups, rows, o, N);
        }
      }
      _tile_release();
    });
    return;
  }
#endif
  parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* tile = T + b * (K / 8) * 16;
      const bf16* scale = S + b * groups * 32;
      for (int64_t r = 0; r < n;) {
        const uint32_t* xr = pairs + r * pairs_per_row;
        const float* sr = sums.data() + r * groups;
        bf16* o = O + r * N + b * 16;
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
}

// x (n, K) bf16 times a bf16 weight copy in AMX B tiles (N/16, K/32, 16, 32): out (n, N) bf16,
// float32 sums rounded once, on AMX tiles (dense_amx) or with AVX-512 BF16 dot products
// (dense_avx512). Row r's outputs depend on row r of x only.
void dense_mm([[maybe_unused]] const bf16* x, [[maybe_unused]] int64_t n, int64_t K,
              [[maybe_unused]] const bf16* tiles, [[maybe_unused]] int64_t blocks, bool amx,
              [[maybe_unused]] bf16* out) {
  CHECK(K % 32 == 0, "dense_mm: K a multiple of 32");
  CHECK(HAVE_AVX512_BF16, "this build has no AVX-512 BF16 instructions (CPU without avx512_bf16)");
  if (!amx) {
#if defined(__AVX512BF16__)
    dense_avx512(x, n, K, tiles, blocks, out, blocks * 16);
#endif
    return;
  }
  CHECK(amx_bf16(), "this build or process has no AMX BF16 tiles (amx_bf16)");
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const int64_t padded = (n + 15) / 16 * 16, N = blocks * 16;
  if (padded == n) return dense_amx(x, n, K, tiles, blocks, out, N);
  std::vector<bf16> in(padded * K, 0), whole(padded * N);  // zero rows to whole tiles
  std::copy_n(x, n * K, in.data());
  dense_amx(in.data(), padded, K, tiles, blocks, whole.data(), N);
  std::copy_n(whole.data(), n * N, out);
#endif
}

// x's rows as blocks::Acts (blocks.h: int8 per group of 32), owning the storage.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<int32_t> sum;
  blocks::Acts acts;
};

// (blocks.h's scalar quantize_row: the same on every ISA) x (n, K) bf16 bits or float32.
Quantized quantize(const void* x, bool is_bf16, int64_t n, int64_t K) {
  CHECK(K % blocks::GROUP == 0, "x: (n, K), K a multiple of 32");
  const int64_t groups = K / blocks::GROUP;
  Quantized out{std::vector<int8_t>(n * K), std::vector<float>(n * groups), std::vector<float>(n * groups),
                std::vector<int32_t>(n * groups), {}};
  parallel_for(0, n, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* q = &out.q[r * K];
      float *d = &out.d[r * groups], *ds = &out.dsum[r * groups];
      int32_t* sum = &out.sum[r * groups];
      if (is_bf16)
        blocks::quantize_row(static_cast<const uint16_t*>(x) + r * K, K, q, d, sum, ds);
      else
        blocks::quantize_row(static_cast<const float*>(x) + r * K, K, q, d, sum, ds);
    }
  });
  out.acts = {out.q.data(), out.d.data(), out.sum.data(), out.dsum.data(), K};
  return out;
}

// x quantized (n rows) times blocks.h tiles (N/8, K·bits/32, 8) and scales (N/8, K/32, 1 + zeros, 8):
// out (n, N) bf16, every row from its own inputs alone. `reference`: the scalar reference instead.
void blocks_matmul(const Quantized& x, int64_t n, const cs_linear& w, bool reference, bf16* out) {
  CHECK(w.layout == CS_BLOCKS && w.inputs == x.acts.K && w.outputs % blocks::LANES == 0,
        "blocks_mm: a weight in blocks.h's tiles, K the input's");
  CHECK((w.bits == 4 && w.zeros == 1) || (w.bits == 5 && w.zeros == 2) || (w.bits == 8 && (w.zeros == 1 || w.zeros == 2)),
        "tiles: bits 4 (one zero), 5 (two) or 8 (one or two)");
  const int64_t count = w.outputs / blocks::LANES, N = w.outputs;
  const auto* T = reinterpret_cast<const uint32_t*>(w.tiles);
  parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    blocks::columns(w.bits, w.zeros, T, w.scales, x.acts, n, begin, end, out, N, reference);
  });
}

// x (n, K) bf16 times one of the model's linears (our kernels only: torch's 4-bit pack runs the
// Python layers): out (n, N) bf16. blocks.h's tiles take the input once whatever the copies
// (8-bit weights); int4_mm's take it `copies` times along K.
void matmul(const bf16* x, int64_t n, int64_t K, const cs_linear& w, bf16* out) {
  if (w.layout == CS_BLOCKS) return blocks_matmul(quantize(x, true, n, K), n, w, false, out);
  CHECK(w.copies >= 1 && w.inputs == K * w.copies, "a linear's tiles: its input's K times copies");
  if (w.copies == 1) return int4_mm(x, n, w, out);
  std::vector<bf16> repeated(n * K * w.copies);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < w.copies; ++c) std::copy_n(x + r * K, K, repeated.data() + (r * w.copies + c) * K);
  int4_mm(repeated.data(), n, w, out);
}

// x += y·residual (y bf16), rows (n, d): a branch's residual add, the branch × residual first
// (Granite's residual_multiplier; 1: no multiply, the other families' sums as they were)
void add_bf16(float* x, const bf16* v, int64_t n, int64_t d, float residual) {
  parallel_for(0, n, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    if (residual == 1.f)
      for (int64_t i = begin * d; i < end * d; ++i) x[i] += blocks::from_bf16(v[i]);
    else
      for (int64_t i = begin * d; i < end * d; ++i) x[i] += blocks::from_bf16(v[i]) * residual;
  });
}

// x += rms_norm(y)·weight·residual, y (n, d) bf16: a branch's output normed before its residual
// add (families.SANDWICH_NORMS' post_attention_norm and post_ffw_norm), in float32; residual as
// in add_bf16.
void add_normed(float* x, const bf16* v, int64_t n, int64_t d, const float* weight, float eps,
                float residual) {
  parallel_for(0, n, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t r = begin; r < end; ++r) {
      vec::from_bf16(v + r * d, row.data(), d);
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
void gated_mlp(const bf16* gate_up, int64_t N, int64_t I, int64_t activation, bf16* gated) {
  parallel_for(0, N, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
    std::vector<float> g(I), u(I);
    const Vec one(1.f), half(0.5f), root(0.7978845608028654f), cubic(0.044715f);  // √(2/π)
    for (int64_t t = begin; t < end; ++t) {
      const bf16* in = gate_up + t * 2 * I;
      vec::from_bf16(in, g.data(), I);
      vec::from_bf16(in + I, u.data(), I);
      for (int64_t j = 0; j < I; j += Vec::size()) {
        int64_t count = std::min<int64_t>(Vec::size(), I - j);
        Vec a = Vec::loadu(g.data() + j, count), b = Vec::loadu(u.data() + j, count);
        Vec act = activation == 0 ? a / (one + a.neg().exp_u20())
                                  : half * a * (one + (root * (a + cubic * a * a * a)).tanh());
        (act * b).store(g.data() + j, count);
      }
      vec::to_bf16(g.data(), gated + t * I, I);
    }
  });
}

// One call of the fused layers (cs_fused_layers): the new tokens' rows and positions, the
// attention tasks, the buffers a layer passes between its steps, and the steps.
struct Pass {
  const cs_model& m;
  const int64_t n, d, hd, half, group, width, rows, table;
  const float *cos, *sin;
  float* const* keys;
  bf16* const* values;
  const int64_t* capacities;
  const bf16* const* dense;
  const bool dense_amx;
  float* X;                                // (n, d) the residual stream: the features at the end
  std::vector<int64_t> row, position, first;  // per token its row and position; per row its first
  int64_t longest = 0;                     // positions the longest query sees
  std::vector<std::array<int64_t, 4>> tasks;  // attention: (row, kv head, first query, count)
  std::vector<bf16> normed, attended, h;   // (n, d), (n, heads·hd), a linear's output
  std::vector<float> q;                    // (n, heads, hd) rotated queries

  Pass(const cs_model& model, int64_t tokens, const float* cos_, const float* sin_, int64_t tables,
       int64_t positions, float* const* keys_, bf16* const* values_, const int64_t* capacities_,
       const int64_t* starts, const int64_t* sizes, int64_t rows_, const bf16* const* dense_,
       bool amx, float* features)
      : m(model), n(tokens), d(model.embed.d), hd(model.head_dim), half(hd / 2),
        group(model.kv_heads > 0 ? model.heads / model.kv_heads : 0),
        width((model.heads + 2 * model.kv_heads) * hd), rows(rows_), table(positions * hd),
        cos(cos_), sin(sin_), keys(keys_), values(values_), capacities(capacities_), dense(dense_),
        dense_amx(amx), X(features), row(tokens), position(tokens), first(rows_),
        normed(tokens * d), attended(tokens * model.heads * hd), q(tokens * model.heads * hd) {
    CHECK(m.layers > 0 && (m.k_norms == 2 || m.k_norms == 4), "norms: two or four a layer");
    CHECK(m.activation == 0 || m.activation == 1, "activation: 0 (SiLU) or 1 (gelu-tanh)");
    CHECK(m.kv_heads > 0 && m.heads % m.kv_heads == 0 && hd % 2 == 0, "heads: a multiple of kv_heads");
    CHECK(m.attention_cap >= 0, "attention_cap: 0 (none) or the cap");
    for (int64_t l = 0; l < m.layers; ++l)
      CHECK(0 <= m.rotary[l] && m.rotary[l] < tables && m.windows[l] >= 0, "rotary[l]: a table; windows[l] ≥ 0");
    for (int64_t r = 0, t = 0; r < rows; ++r) {
      CHECK(starts[r] >= 0 && sizes[r] >= 0 && capacities[r] % KEY_TILE == 0 && capacities[r] >= starts[r] + sizes[r],
            "each row's cache: room for its new positions");
      first[r] = t;
      for (int64_t i = 0; i < sizes[r]; ++i, ++t) {
        CHECK(t < n, "sizes: the rows' tokens add up to the ids");
        row[t] = r, position[t] = starts[r] + i;
        longest = std::max(longest, position[t] + 1);
      }
      if (r + 1 == rows) CHECK(t == n, "sizes: the rows' tokens add up to the ids");
    }
    CHECK(longest <= positions, "positions beyond the rotary tables");
    // a row's queries of one key/value head are its tokens × the group's heads, token-major (n
    // ascending), split so that every thread has two tasks or more (a one-token step: 3 heads,
    // 2 threads)
    const int64_t splits = (2 * parallel::threads + rows * m.kv_heads - 1) / (rows * m.kv_heads);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t queries = sizes[r] * group;
      const int64_t each = std::min(QUERIES, std::max<int64_t>(1, (queries + splits - 1) / splits));
      for (int64_t kv = 0; kv < m.kv_heads; ++kv)
        for (int64_t from = 0; from < queries; from += each)
          tasks.push_back({r, kv, from, std::min(each, queries - from)});
    }
  }

  // ids (n,) embedded (Rows: float32, or int8 with scales) × embed_scale, into X.
  void embed(const int64_t* ids) {
    const Rows table(m.embed);
    const float factor = static_cast<float>(m.embed_scale);
    for (int64_t t = 0; t < n; ++t) {
      CHECK(0 <= ids[t] && ids[t] < m.embed.count, "a token id beyond the embedding");
      float* x = X + t * d;
      const float* e = table.row(ids[t], x);  // dequantized in place, or the table's own
      if (e != x) std::copy_n(e, d, x);
      if (factor != 1.f)
        for (int64_t j = 0; j < d; ++j) x[j] *= factor;
    }
  }

  // linear i of the model on x (n, K): into h (n, N) bf16, on its kernel or on the prompt's copy
  const bf16* linear(const bf16* x, int64_t K, int64_t i) {
    const cs_linear& w = m.linears[i];
    h.resize(n * w.outputs);
    if (dense != nullptr)
      dense_mm(x, n, K, dense[i], w.outputs / 16, dense_amx, h.data());
    else
      matmul(x, n, K, w, h.data());
    return h.data();
  }

  // q, k, v of every token; rotary on q and k; k and v into the token's cache
  void qkv(int64_t l) {
    rms_norm(X, m.norms[m.k_norms * l], normed.data(), n, d, static_cast<float>(m.eps));
    CHECK(m.linears[4 * l].outputs == width, "q/k/v: (heads + 2·kv_heads)·head_dim outputs");
    const bf16* H = linear(normed.data(), d, 4 * l);
    const float* bias = m.biases == nullptr ? nullptr : m.biases[l];
    parallel_for(0, n, TOKENS_A_THREAD, [&](int64_t begin, int64_t end) {
      std::vector<float> in(hd);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t capacity = capacities[row[t]];
        const float *c = cos + m.rotary[l] * table + position[t] * hd;
        const float *s = sin + m.rotary[l] * table + position[t] * hd;
        for (int64_t head = 0; head < m.heads + 2 * m.kv_heads; ++head) {
          for (int64_t j = 0; j < hd; ++j) in[j] = blocks::from_bf16(H[t * width + head * hd + j]);
          if (bias)
            for (int64_t j = 0; j < hd; ++j) in[j] += bias[head * hd + j];
          if (head >= m.heads + m.kv_heads) {  // a value: no rotary, no norm
            const int64_t kv = l * m.kv_heads + head - m.heads - m.kv_heads;
            bf16* out = values[row[t]] + (kv * capacity + position[t]) * hd;
            for (int64_t j = 0; j < hd; ++j) out[j] = blocks::to_bf16(in[j]);
            continue;
          }
          if (m.qk_norms != nullptr) {  // each head's RMSNorm over its hd values
            const float* w = m.qk_norms[2 * l + (head < m.heads ? 0 : 1)];
            const float inverse = 1.f / std::sqrt(dot(in.data(), in.data(), hd) / hd + static_cast<float>(m.eps));
            for (int64_t j = 0; j < hd; ++j) in[j] = in[j] * inverse * w[j];
          }
          // a query, or a key (in its tile: element j at j·KEY_TILE)
          const int64_t kv = l * m.kv_heads + head - m.heads;
          float* out = head < m.heads ? &q[(t * m.heads + head) * hd]
                                      : keys[row[t]] + kv * hd * capacity + key_at(position[t], hd);
          const int64_t step = head < m.heads ? 1 : KEY_TILE;
          for (int64_t j = 0; j < half; ++j) {  // transformers' layout: pairs (j, j + hd/2)
            float a = in[j], b = in[j + half];
            out[j * step] = a * c[j] - b * s[j];
            out[(j + half) * step] = b * c[j + half] + a * s[j + half];
          }
        }
      }
    });
  }

  // a task is up to QUERIES queries of one row and one key/value head (its group's heads at
  // each of the row's tokens, in order): they read the same keys and values, once a pass
  // (tasks), and the next task of the same row and head finds them in the core's cache
  void attention(int64_t l) {
    const float scale = static_cast<float>(m.attention_scale), cap = static_cast<float>(m.attention_cap);
    parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(QUERIES * longest), queries(QUERIES * hd), out(QUERIES * hd);
      // place: the query's offset in q and in attended (token, head); lo, n: the positions it sees
      int64_t lo[QUERIES], seen[QUERIES], place[QUERIES];
      for (int64_t task = begin; task < end; ++task) {
        const auto [r, kv, from, count] = tasks[task];
        const int64_t offset = (l * m.kv_heads + kv) * capacities[r] * hd;
        for (int64_t i = 0; i < count; ++i) {  // the row's token (from + i) / group, at one head
          const int64_t t = first[r] + (from + i) / group, head = kv * group + (from + i) % group;
          place[i] = (t * m.heads + head) * hd;
          seen[i] = position[t] + 1;
          lo[i] = m.windows[l] > 0 ? std::max<int64_t>(0, seen[i] - m.windows[l]) : 0;
          for (int64_t e = 0; e < hd; ++e) queries[i * hd + e] = q[place[i] + e] * scale;
        }
        attend_some(count, queries.data(), keys[r] + offset, values[r] + offset, lo, seen, hd, cap,
                    scores.data(), longest, out.data());
        for (int64_t i = 0; i < count; ++i) vec::to_bf16(&out[i * hd], attended.data() + place[i], hd);
      }
    });
  }

  // a branch's output (linear i of `in`) added to the residual stream, normed first where the
  // family has norms after each branch (k_norms 4: its norm k_norms·l + which)
  void add_branch(const bf16* in, int64_t K, int64_t i, int64_t l, int64_t which) {
    CHECK(m.linears[i].outputs == d, "o, down: d outputs");
    const bf16* y = linear(in, K, i);
    const float residual = static_cast<float>(m.residual_scale);
    if (m.k_norms == 4)
      add_normed(X, y, n, d, m.norms[4 * l + which], static_cast<float>(m.eps), residual);
    else
      add_bf16(X, y, n, d, residual);
  }

  // MLP: down(act(gate) · up)
  void mlp(int64_t l) {
    rms_norm(X, m.norms[m.k_norms * l + m.k_norms / 2], normed.data(), n, d, static_cast<float>(m.eps));
    const int64_t I = m.linears[4 * l + 2].outputs / 2;
    std::vector<bf16> gated(n * I);
    gated_mlp(linear(normed.data(), d, 4 * l + 2), n, I, m.activation, gated.data());
    add_branch(gated.data(), I, 4 * l + 3, l, 3);
  }

  void final_norm() {  // in float32 (eps in double, as it was)
    for (int64_t t = 0; t < n; ++t) {
      float* x = X + t * d;
      const float inverse = 1.f / std::sqrt(dot(x, x, d) / d + m.eps);
      for (int64_t j = 0; j < d; ++j) x[j] = x[j] * inverse * m.final_norm[j];
    }
  }
};

// The Q8_0 LM head (kernels.Q8Head, which states the bound) in one call: x (n, d) float32 rounded
// to bf16 (denormals flushed), fed twice through the head's 4-bit blocks; or, on blocks.h's
// tiles, x quantized to int8 groups, fed once. The inputs x̃ and per position (‖x‖, ‖x − x̃‖,
// ‖S‖, 1) into `scales` (n, 4); the blocks' logits (n, N) bf16 returned.
std::vector<bf16> head_blocks(const float* X, int64_t n, int64_t d, const cs_linear& w,
                              std::vector<float>& scales) {
  const bool int8 = w.layout == CS_BLOCKS;  // else int4_mm's tiles, fed x̃ twice
  CHECK(w.inputs == (int8 ? d : 2 * d), "the head's blocks: two halves of x's d inputs");
  const Quantized quantized = int8 ? quantize(X, false, n, d) : Quantized{};
  std::vector<bf16> fed(int8 ? 0 : n * 2 * d);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = X + r * d;
    float xx = 0.f, dd = 0.f, ss = 0.f, group = 0.f;
    for (int64_t j = 0; j < d; ++j) {
      float v;
      if (int8) {
        v = quantized.d[(r * d + j) / 32] * quantized.q[r * d + j];
      } else {
        bf16 b = blocks::to_bf16(row[j]);
        v = blocks::from_bf16(b);
        if (std::fabs(v) < 0x1p-126f) v = 0.f, b = blocks::to_bf16(0.f);  // flushed
        fed[r * 2 * d + j] = fed[r * 2 * d + d + j] = b;
      }
      xx += row[j] * row[j], dd += (row[j] - v) * (row[j] - v), group += std::fabs(v);
      if (j % 32 == 31) ss += group * group, group = 0.f;
    }
    scales[r * 4 + 0] = std::sqrt(xx), scales[r * 4 + 1] = std::sqrt(dd);
    scales[r * 4 + 2] = std::sqrt(ss), scales[r * 4 + 3] = 1.f;
  }
  std::vector<bf16> approx(n * w.outputs);
  if (int8)
    blocks_matmul(quantized, n, w, false, approx.data());
  else
    int4_mm(fed.data(), n, w, approx.data());
  return approx;
}

// Per position, each logit's bound u·|a| + ‖x‖·T0 + ‖x − x̃‖·T1 + ‖S‖·T2 + T3 from terms (V, 4);
// then every legal logit whose upper end reaches the largest legal lower end is recomputed in
// float32 from its row of the table. legal: (n, V) bytes, or NULL (every token legal). O (n, V):
// the blocks' values, float32's where recomputed.
void q8_head(const float* X, int64_t n, const cs_linear& w, const float* T, const cs_rows& table,
             const uint8_t* legal, double roundoff, float* O) {
  const Rows rows(table);
  const int64_t d = table.d, V = table.count, stride = w.outputs;
  CHECK(stride >= V, "the head's blocks: at least V outputs");
  std::vector<float> scales(n * 4);  // ‖x‖, ‖x − x̃‖, ‖S‖, 1
  const std::vector<bf16> approx = head_blocks(X, n, d, w, scales);
  std::vector<float> scratch(d);  // a recomputed row, dequantized
  const float u = static_cast<float>(roundoff);
  std::vector<float> upper(V);
  for (int64_t r = 0; r < n; ++r) {
    const float* s = &scales[r * 4];
    const bf16* a = approx.data() + r * stride;
    const uint8_t* ok = legal != nullptr ? legal + r * V : nullptr;
    float* o = O + r * V;
    float best = -INFINITY;
    for (int64_t t = 0; t < V; ++t) {
      const float* c = T + t * 4;
      const float v = blocks::from_bf16(a[t]);
      const float bound = u * std::fabs(v) + s[0] * c[0] + s[1] * c[1] + s[2] * c[2] + s[3] * c[3];
      o[t] = v, upper[t] = v + bound;
      if (!ok || ok[t]) best = std::max(best, v - bound);
    }
    for (int64_t t = 0; t < V; ++t)
      if ((!ok || ok[t]) && upper[t] >= best) o[t] = dot(rows.row(t, scratch.data()), X + r * d, d);
  }
}

// Bitmasks (bit t of byte t / 8 set iff token t is legal; one buffer of V / 8 bytes per state)
// as (rows, V) bools, in one call: after a forward has streamed the weights through the caches,
// each numpy or torch call costs tens of microseconds, and the three a conversion took there
// were the largest part of a round's constraint work (git show 8fe3c79:docs/measurements.md).
// SPREAD[b]: byte b's 8 bits as 8 bools, lowest bit first (little-endian: the first byte of the word).
const std::array<uint64_t, 256> SPREAD = [] {
  std::array<uint64_t, 256> table{};
  for (int b = 0; b < 256; ++b)
    for (int i = 0; i < 8; ++i) table[b] |= static_cast<uint64_t>((b >> i) & 1) << (8 * i);
  return table;
}();

void unpack_row(const uint8_t* bits, int64_t V, uint8_t* dst) {
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

thread_local std::string last_error;

// The ABI's side of a call: 0, or 1 with the message kept for cs_last_error (an exception never
// crosses into the caller: it may be Python, through ctypes).
template <class F>
int32_t guarded(int32_t threads, const F& f) {
  try {
    parallel::Threads guard(threads);
    f();
    return 0;
  } catch (const std::bad_alloc&) {
    last_error = "out of memory";
  } catch (const std::exception& err) {
    last_error = err.what();
  }
  return 1;
}

}  // namespace

extern "C" {

const char* cs_last_error(void) { return last_error.c_str(); }

int32_t cs_abi_version(void) { return CS_ABI_VERSION; }

const char* cs_variant(void) { return CS_VARIANT; }

const char* cs_blocks_isa(void) { return blocks::isa(); }

int32_t cs_avx512_bf16(void) { return HAVE_AVX512_BF16; }

int32_t cs_amx_bf16(void) { return amx_bf16(); }

int32_t cs_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int32_t cs_fused_layers(const cs_model* model, const int64_t* ids, int64_t n, const float* cos,
                        const float* sin, int64_t tables, int64_t positions, float* const* keys,
                        uint16_t* const* values, const int64_t* capacities, const int64_t* starts,
                        const int64_t* sizes, int64_t rows, const uint16_t* const* dense,
                        int32_t dense_amx, int32_t threads, float* features) {
  return guarded(threads, [&] {
    Pass pass(*model, n, cos, sin, tables, positions, keys, values, capacities, starts, sizes, rows,
              dense, dense_amx != 0, features);
    pass.embed(ids);
    for (int64_t l = 0; l < model->layers; ++l) {
      pass.qkv(l);
      pass.attention(l);
      pass.add_branch(pass.attended.data(), model->heads * model->head_dim, 4 * l + 1, l, 1);
      pass.mlp(l);
    }
    pass.final_norm();
  });
}

int32_t cs_int4_mm(const uint16_t* x, int64_t n, const cs_linear* weight, int32_t threads,
                   uint16_t* out) {
  return guarded(threads, [&] { int4_mm(x, n, *weight, out); });
}

int32_t cs_dense_mm(const uint16_t* x, int64_t n, int64_t K, const uint16_t* tiles,
                    int64_t blocks, int32_t amx, int32_t threads, uint16_t* out) {
  return guarded(threads, [&] { dense_mm(x, n, K, tiles, blocks, amx != 0, out); });
}

int32_t cs_blocks_mm(const void* x, int32_t x_bf16, int64_t n, const cs_linear* weight,
                     int32_t reference, int32_t threads, uint16_t* out) {
  return guarded(threads, [&] {
    blocks_matmul(quantize(x, x_bf16 != 0, n, weight->inputs), n, *weight, reference != 0, out);
  });
}

int32_t cs_q8_head(const float* x, int64_t n, const cs_linear* blocks, const float* terms,
                   const cs_rows* table, const uint8_t* legal, double roundoff, int32_t threads,
                   float* logits) {
  return guarded(threads, [&] { q8_head(x, n, *blocks, terms, *table, legal, roundoff, logits); });
}

void cs_unpack_bits(const uint8_t* const* rows, int64_t n, int64_t V, uint8_t* out) {
  for (int64_t r = 0; r < n; ++r) unpack_row(rows[r], V, out + r * V);
}

// torch sums a bool tensor through int64, a fifth of a batch round's time on 64 rows after a forward.
void cs_count_legal(const uint8_t* masks, int64_t n, int64_t V, int64_t* counts) {
  for (int64_t r = 0; r < n; ++r) {
    uint32_t count = 0;  // bytes are 0 or 1: the compiler sums them in vectors
    for (int64_t t = 0; t < V; ++t) count += masks[r * V + t];
    counts[r] = count;
  }
}

}  // extern "C"
