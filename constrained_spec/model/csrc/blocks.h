// Weight blocks times int8-quantized activations, in plain C++ (no torch: the kernel tests build
// this header alone, for ARM too, and run it under qemu): a scalar reference, AVX2 (x86 since
// Haswell) and NEON with dot products (ARMv8.2: Apple M1 on, Graviton 2 on). Every variant computes
// the same integer sums and the same float32 operations in the same order, so all of them give
// the same bits (tests/csrc_test.cpp checks it on every ISA it can run).
//
// The numbers. Activations: each row's inputs in groups of 32, x ≈ d·q with d = max|x|/127 and q
// the nearest integer in −127..127 (llama.cpp's Q8 activations; the rounding ties to even), and
// the group's Σq. Weights: w = (q − bias)·s + Σ zeros per row and group of 32 inputs, s and the
// zeros bf16 (kernels.Int4Linear's scales), q a 4-bit nibble (Q4 blocks: bias 8, one zero), a
// 5-bit value (Q5 blocks: two 4-bit halves hi·16 + lo, bias 136, their two zeros kept apart) or a
// signed byte (Q8_0 and other types as two halves, hi·16 + lo − 128: bias 8, one zero or two). Per row,
// output and group: the integer a = Σ q·qx − bias·Σqx (exact), then in float32
//     acc = fma(s·d, a, acc), then acc = fma(z, d·Σqx, acc) for each zero,
// the groups in order. So a token's outputs depend on its own inputs only, whatever the rows
// beside it (a verify pass computes what one-token steps would).
//
// Layout: tiles of 8 output rows, each 32-bit lane one row, a group of 32 inputs in `bits` vectors
// of 8 lanes: (N/8, K·bits/32, 8). Nibbles, in a group's first 4 vectors: lane i of vector c holds
// row 8b + i's inputs 8c..8c+7 of the group, input 8c + j in the low nibble of byte j, 8c + 4 + j in
// its high nibble (j < 4); unpacked, they are 8 vectors of bytes, v = 2c (low) and 2c + 1 (high).
// 5-bit: a fifth vector holds their fifth bits: bit v of byte j of lane i is vector v's. 8-bit:
// 8 vectors, lane i of vector c row 8b + i's inputs 4c..4c+3, one signed byte each. Scales
// (N/8, K/32, 1 + zeros, 8) bf16: group g's 8 scales, then each zero's 8 values.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BLOCKS_AVX2 1
#endif
#if defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define BLOCKS_NEON 1
#endif

namespace blocks {

constexpr int64_t GROUP = 32;  // inputs under one scale (and one activation scale)
constexpr int64_t LANES = 8;   // output rows a tile holds

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline void store(float* out, float v) { *out = v; }
inline void store(uint16_t* out, float v) { *out = to_bf16(v); }

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return from_bf16(v); }

// Quantized activations: n rows of K inputs (K a multiple of 32).
struct Acts {
  const int8_t* q;      // (n, K)
  const float* d;       // (n, K/32) the groups' scales
  const int32_t* sum;   // (n, K/32) Σq
  const float* dsum;    // (n, K/32) d·Σq, rounded once
  int64_t K;
};

// One row of K inputs (float32, or bf16 bits) into q, d, sum, dsum (its K/32 groups).
template <typename In>
void quantize_row(const In* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* dsum) {
  for (int64_t g = 0; g < K / GROUP; ++g) {
    float v[GROUP], top = 0.f;
    for (int64_t k = 0; k < GROUP; ++k) v[k] = to_float(x[g * GROUP + k]);
    for (int64_t k = 0; k < GROUP; ++k) top = std::max(top, std::fabs(v[k]));
    const float inverse = top > 0.f ? 127.f / top : 0.f;
    int32_t s = 0;
    for (int64_t k = 0; k < GROUP; ++k) {
      const int32_t r = static_cast<int32_t>(std::nearbyint(v[k] * inverse));  // ties to even
      q[g * GROUP + k] = static_cast<int8_t>(r);
      s += r;
    }
    d[g] = top / 127.f;
    sum[g] = s;
    dsum[g] = d[g] * static_cast<float>(s);
  }
}

// --- the scalar reference: one output at a time ---------------------------------------------------

// Weight q of row `row` (within its tile), input k, in the layout of BITS.
template <int BITS>
int32_t weight(const uint32_t* tile, int64_t k, int64_t row) {
  const uint32_t* group = tile + (k / GROUP) * BITS * LANES;
  const int64_t c = k % GROUP / 8, j = k % 8;
  if (BITS == 8) return static_cast<int8_t>((group[(k % GROUP / 4) * LANES + row] >> (8 * (k % 4))) & 255);
  const int32_t nibble = (group[c * LANES + row] >> (8 * (j % 4) + 4 * (j / 4))) & 15;
  if (BITS == 4) return nibble;
  const int32_t plane = (group[4 * LANES + row] >> (8 * (j % 4))) & 255;
  return nibble | ((plane >> (2 * c + j / 4)) & 1) << 4;
}

constexpr int32_t bias(int bits) { return bits == 5 ? 136 : 8; }

template <int BITS, typename Out>
void columns_scalar(const uint32_t* tiles, const uint16_t* scales, int zeros, const Acts& x,
                    int64_t n, int64_t b0, int64_t b1, Out* out, int64_t out_stride) {
  const int64_t K = x.K, groups = K / GROUP, lanes_per_tile = K * BITS / 32;
  for (int64_t b = b0; b < b1; ++b) {
    const uint32_t* tile = tiles + b * lanes_per_tile * LANES;
    const uint16_t* sc = scales + b * groups * (1 + zeros) * LANES;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < LANES; ++i) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t a = 0;
          for (int64_t k = g * GROUP; k < (g + 1) * GROUP; ++k) a += weight<BITS>(tile, k, i) * x.q[r * K + k];
          a -= bias(BITS) * x.sum[r * groups + g];
          const uint16_t* s = sc + g * (1 + zeros) * LANES;
          acc = std::fma(from_bf16(s[i]) * x.d[r * groups + g], static_cast<float>(a), acc);
          for (int z = 1; z <= zeros; ++z)
            acc = std::fma(from_bf16(s[z * LANES + i]), x.dsum[r * groups + g], acc);
        }
        store(out + r * out_stride + b * LANES + i, acc);
      }
  }
}

// --- AVX2: rows R at a time through a tile, each group's weights unpacked once for all R ----------

#if defined(BLOCKS_AVX2)
namespace avx2 {

inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 → float32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256i bcast4(const int8_t* p) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(uint16_t* out, __m256 v) {  // round to nearest even, as to_bf16 (finite values)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}

// Each group's loop asks for its tile's bytes (and scales) this many groups ahead: on a Zen 1 core
// a one-token pass, its multiplies waiting on memory, read 4-bit tiles at 14.7 GB/s on the hardware
// prefetchers alone, 15.9 with 4 groups asked ahead (0.5 KB a tile: the pair's two streams), and
// 8-bit ones at 16.2 against 21.2 GB/s 8 groups ahead (2 KB); passes of 4 rows, bound by the
// multiplies, ran the same. A prefetch does not fault: one past the weight's end is dropped.
constexpr int64_t AHEAD_UNSIGNED = 4, AHEAD_8 = 8;

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(static_cast<const char*>(p) + line, _MM_HINT_T0);
}

// The group's epilogue for R rows: int32 sums a[r] of Σ q·qx (8 lanes: the tile's rows).
template <int R, int ZEROS, int BIAS>
inline void add_group(const __m256i* a, const uint16_t* sc, const Acts& x, int64_t r0, int64_t g,
                      __m256* acc) {
  const int64_t groups = x.K / GROUP;
  const __m256 s = bf16x8(sc);
  __m256 z[ZEROS];
  for (int k = 0; k < ZEROS; ++k) z[k] = bf16x8(sc + (1 + k) * LANES);
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * groups + g;
    const __m256i shifted = _mm256_sub_epi32(a[r], _mm256_set1_epi32(BIAS * x.sum[at]));
    const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(x.d[at]));
    acc[r] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(shifted), acc[r]);
    const __m256 ds = _mm256_set1_ps(x.dsum[at]);
    for (int k = 0; k < ZEROS; ++k) acc[r] = _mm256_fmadd_ps(z[k], ds, acc[r]);
  }
}

// Unpacked vector v's fifth bits (5-bit layout), at bit 4 of each byte: a 16-bit shift moves no
// bit 4 across a byte boundary for shifts up to 4 left or 3 right.
inline __m256i fifth_bits(__m256i plane, int v) {
  const __m256i shifted = v <= 4 ? _mm256_sll_epi16(plane, _mm_cvtsi32_si128(4 - v))
                                 : _mm256_srl_epi16(plane, _mm_cvtsi32_si128(v - 4));
  return _mm256_and_si256(shifted, _mm256_set1_epi8(0x10));
}

// 4-bit and 5-bit: vpmaddubsw multiplies a weight (unsigned) by an activation byte (signed) and
// adds pairs: ≤ 15·127·2 = 3810 (4-bit), so all 8 products of a group add in 16 bits (≤ 30480)
// before one vpmaddwd; ≤ 31·127·2 = 7874 (5-bit): 4 at a time (≤ 31496), two vpmaddwd a group.
// T tiles side by side (consecutive in memory): each activation broadcast serves T of them.
template <int R, int T, int BITS, typename Out>
void tile_unsigned(const uint32_t* tile, const uint16_t* sc, const Acts& x, int64_t r0, Out* out,
                   int64_t out_stride) {
  constexpr int ZEROS = BITS == 4 ? 1 : 2;
  const int64_t K = x.K, groups = K / GROUP;
  const int64_t tile_lanes = groups * BITS * LANES, tile_scales = groups * (1 + ZEROS) * LANES;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[T][R];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int t = 0; t < T; ++t) {
      prefetch(tile + t * tile_lanes + (g + AHEAD_UNSIGNED) * BITS * LANES, BITS * LANES * 4);
      prefetch(sc + t * tile_scales + (g + AHEAD_UNSIGNED) * (1 + ZEROS) * LANES, 1);
    }
    __m256i p[T][R], a[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) p[t][r] = a[t][r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i lo[T], hi[T];
      for (int t = 0; t < T; ++t) {
        const uint32_t* group = tile + t * tile_lanes + g * BITS * LANES;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * LANES));
        lo[t] = _mm256_and_si256(v, nibble), hi[t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        if constexpr (BITS == 5) {
          const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 4 * LANES));
          lo[t] = _mm256_or_si256(lo[t], fifth_bits(plane, 2 * c));
          hi[t] = _mm256_or_si256(hi[t], fifth_bits(plane, 2 * c + 1));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + (r0 + r) * K + g * GROUP + c * 8;
        const __m256i x0 = bcast4(xq), x1 = bcast4(xq + 4);
        for (int t = 0; t < T; ++t) {
          p[t][r] = _mm256_add_epi16(p[t][r], _mm256_maddubs_epi16(lo[t], x0));
          p[t][r] = _mm256_add_epi16(p[t][r], _mm256_maddubs_epi16(hi[t], x1));
        }
      }
      for (int t = 0; t < T; ++t)  // keep each vector's work together: left alone, gcc hoists
        for (int r = 0; r < R; ++r) __asm__("" : "+x"(p[t][r]));  // every product of the group
      if (BITS == 5 && c % 2 == 1)                                  // first, spilling them
        for (int t = 0; t < T; ++t)
          for (int r = 0; r < R; ++r) {
            a[t][r] = _mm256_add_epi32(a[t][r], _mm256_madd_epi16(p[t][r], ones));
            p[t][r] = _mm256_setzero_si256();
          }
    }
    for (int t = 0; t < T; ++t) {
      if constexpr (BITS == 4)
        for (int r = 0; r < R; ++r) a[t][r] = _mm256_madd_epi16(p[t][r], ones);
      add_group<R, ZEROS, bias(BITS)>(a[t], sc + t * tile_scales + g * (1 + ZEROS) * LANES, x, r0, g, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) store8(out + r * out_stride + t * LANES, acc[t][r]);
}

// 8-bit: the weight's magnitude (unsigned) times the activation given the weight's sign
// (vpsignb), pairs ≤ 2·128·127 = 32512: each product pair widened to 32 bits at once.
template <int R, int ZEROS, typename Out>
void tile8(const uint32_t* tile, const uint16_t* sc, const Acts& x, int64_t r0, Out* out,
           int64_t out_stride) {
  const int64_t K = x.K, groups = K / GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch(tile + (g + AHEAD_8) * 8 * LANES, 8 * LANES * 4);
    prefetch(sc + (g + AHEAD_8) * (1 + ZEROS) * LANES, 1);
    __m256i a[R];
    for (auto& v : a) v = _mm256_setzero_si256();
    for (int64_t c = 0; c < 8; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (g * 8 + c) * LANES));
      const __m256i magnitude = _mm256_abs_epi8(w);
      for (int r = 0; r < R; ++r) {
        const __m256i xs = _mm256_sign_epi8(bcast4(x.q + (r0 + r) * K + g * GROUP + c * 4), w);
        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xs), ones));
      }
    }
    add_group<R, ZEROS, 8>(a, sc + g * (1 + ZEROS) * LANES, x, r0, g, acc);
  }
  for (int r = 0; r < R; ++r) store8(out + r * out_stride, acc[r]);
}

// Every row through tile columns [b0, b1): 4-bit, two tiles at a time (a broadcast serves both)
// and up to 3 rows, or one tile and up to 8 (the columns stay in L1 for the next rows); 5- and
// 8-bit, one tile and up to 4 rows. On a Zen 1 core (AVX2 on 128-bit units) one 4-bit row ran at
// 22 GMAC/s this way, 17.5 a tile at a time; 3 rows and more at 29 (4 rows of two tiles spill
// registers: 24.5); two 8-bit tiles ran slower than one (12.8 against 16.7 GMAC/s on 4 rows), and
// 8 rows of a 5- or 8-bit tile spill (19 and 14.7 against 23 and 16.7 on 4).
template <int BITS, int ZEROS, typename Out>
void columns(const uint32_t* tiles, const uint16_t* scales, const Acts& x, int64_t n, int64_t b0,
             int64_t b1, Out* out, int64_t out_stride) {
  const int64_t groups = x.K / GROUP, lanes = x.K * BITS / 32;
  constexpr int64_t ROWS = BITS == 4 ? 8 : 4;  // one tile: more rows spill 5- and 8-bit sums
  for (int64_t b = b0; b < b1;) {
    const uint32_t* tile = tiles + b * lanes * LANES;
    const uint16_t* sc = scales + b * groups * (1 + ZEROS) * LANES;
    const bool pair = BITS == 4 && b + 1 < b1;
    for (int64_t r = 0; r < n;) {
      Out* o = out + r * out_stride + b * LANES;
#define TILE(R, T)                                                            \
  if constexpr (BITS == 8) tile8<R, ZEROS>(tile, sc, x, r, o, out_stride);    \
  else tile_unsigned<R, T, BITS>(tile, sc, x, r, o, out_stride);              \
  r += R;
      if (pair) {
        switch (std::min<int64_t>(n - r, 3)) {
          case 4: { TILE(4, 2) break; }
          case 3: { TILE(3, 2) break; }
          case 2: { TILE(2, 2) break; }
          default: { TILE(1, 2) }
        }
        continue;
      }
      switch (std::min<int64_t>(n - r, ROWS)) {
        case 8: { TILE(8, 1) break; }
        case 7: { TILE(7, 1) break; }
        case 6: { TILE(6, 1) break; }
        case 5: { TILE(5, 1) break; }
        case 4: { TILE(4, 1) break; }
        case 3: { TILE(3, 1) break; }
        case 2: { TILE(2, 1) break; }
        default: { TILE(1, 1) }
      }
#undef TILE
    }
    b += pair ? 2 : 1;
  }
}

}  // namespace avx2
#endif

// --- NEON with dot products: sdot sums 4 signed byte products a lane, in 32 bits ------------------

#if defined(BLOCKS_NEON)
namespace neon {

inline float32x4_t bf16x4(const uint16_t* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

inline int8x16_t bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

inline void store4(float* out, float32x4_t v) { vst1q_f32(out, v); }
inline void store4(uint16_t* out, float32x4_t v) {
  float f[4];
  vst1q_f32(f, v);
  for (int i = 0; i < 4; ++i) out[i] = to_bf16(f[i]);
}

// One tile (8 output rows as two halves of 4 lanes) for R activation rows: each weight vector is
// loaded and unpacked once for all R (32 vector registers: R = 4 keeps the sums and accumulators
// in them).
template <int R, int BITS, int ZEROS, typename Out>
void tile(const uint32_t* t, const uint16_t* sc, const Acts& x, int64_t r0, Out* out, int64_t out_stride) {
  const int64_t K = x.K, groups = K / GROUP;
  float32x4_t acc[R][2];
  for (auto& row : acc) row[0] = row[1] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < groups; ++g) {
    int32x4_t a[R][2];
    for (auto& row : a) row[0] = row[1] = vdupq_n_s32(0);
    const int8_t* xq = x.q + r0 * K + g * GROUP;
    const uint32_t* group = t + g * BITS * LANES;
    for (int h = 0; h < 2; ++h) {
      if constexpr (BITS == 8) {
        for (int64_t c = 0; c < 8; ++c) {
          const int8x16_t w = vld1q_s8(reinterpret_cast<const int8_t*>(group + c * LANES + 4 * h));
          for (int r = 0; r < R; ++r) a[r][h] = vdotq_s32(a[r][h], w, bcast4(xq + r * K + c * 4));
        }
      } else {
        const uint8x16_t plane = BITS == 5 ? vld1q_u8(reinterpret_cast<const uint8_t*>(group + 4 * LANES + 4 * h))
                                           : vdupq_n_u8(0);
        for (int c = 0; c < 4; ++c) {  // q ≤ 31: sdot's signed bytes take it as it is
          const uint8x16_t v = vld1q_u8(reinterpret_cast<const uint8_t*>(group + c * LANES + 4 * h));
          const uint8x16_t lo = vorrq_u8(vandq_u8(v, vdupq_n_u8(15)),
                                         vshlq_n_u8(vandq_u8(vshlq_u8(plane, vdupq_n_s8(-2 * c)), vdupq_n_u8(1)), 4));
          const uint8x16_t hi = vorrq_u8(vshrq_n_u8(v, 4),
                                         vshlq_n_u8(vandq_u8(vshlq_u8(plane, vdupq_n_s8(-2 * c - 1)), vdupq_n_u8(1)), 4));
          for (int r = 0; r < R; ++r) {
            a[r][h] = vdotq_s32(a[r][h], vreinterpretq_s8_u8(lo), bcast4(xq + r * K + c * 8));
            a[r][h] = vdotq_s32(a[r][h], vreinterpretq_s8_u8(hi), bcast4(xq + r * K + c * 8 + 4));
          }
        }
      }
    }
    const uint16_t* s = sc + g * (1 + ZEROS) * LANES;
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * groups + g;
      for (int h = 0; h < 2; ++h) {
        const int32x4_t shifted = vsubq_s32(a[r][h], vdupq_n_s32(bias(BITS) * x.sum[at]));
        const float32x4_t sd = vmulq_f32(bf16x4(s + 4 * h), vdupq_n_f32(x.d[at]));
        acc[r][h] = vfmaq_f32(acc[r][h], sd, vcvtq_f32_s32(shifted));
        for (int k = 1; k <= ZEROS; ++k)
          acc[r][h] = vfmaq_f32(acc[r][h], bf16x4(s + k * LANES + 4 * h), vdupq_n_f32(x.dsum[at]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    store4(out + r * out_stride, acc[r][0]);
    store4(out + r * out_stride + 4, acc[r][1]);
  }
}

template <int BITS, int ZEROS, typename Out>
void columns(const uint32_t* tiles, const uint16_t* scales, const Acts& x, int64_t n, int64_t b0,
             int64_t b1, Out* out, int64_t out_stride) {
  const int64_t groups = x.K / GROUP, lanes = x.K * BITS / 32;
  for (int64_t b = b0; b < b1; ++b) {
    const uint32_t* t = tiles + b * lanes * LANES;
    const uint16_t* sc = scales + b * groups * (1 + ZEROS) * LANES;
    for (int64_t r = 0; r < n;) {
      Out* o = out + r * out_stride + b * LANES;
      switch (std::min<int64_t>(n - r, 4)) {
        case 4: tile<4, BITS, ZEROS>(t, sc, x, r, o, out_stride), r += 4; break;
        case 3: tile<3, BITS, ZEROS>(t, sc, x, r, o, out_stride), r += 3; break;
        case 2: tile<2, BITS, ZEROS>(t, sc, x, r, o, out_stride), r += 2; break;
        default: tile<1, BITS, ZEROS>(t, sc, x, r, o, out_stride), r += 1;
      }
    }
  }
}

}  // namespace neon
#endif

// The fastest variant compiled in: "avx2", "neon" or "scalar".
inline const char* isa() {
#if defined(BLOCKS_AVX2)
  return "avx2";
#elif defined(BLOCKS_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

// Rows (n, K) of x through tile columns [b0, b1) of a weight of `bits` (4 with one zero, 5 with two,
// 8 with one or two): out[r·out_stride + 8b + i], on the fastest variant compiled in (or the
// reference).
template <typename Out>
void columns(int bits, int zeros, const uint32_t* tiles, const uint16_t* scales, const Acts& x,
             int64_t n, int64_t b0, int64_t b1, Out* out, int64_t out_stride, bool reference = false) {
  if (reference) {
    if (bits == 4) return columns_scalar<4>(tiles, scales, zeros, x, n, b0, b1, out, out_stride);
    if (bits == 5) return columns_scalar<5>(tiles, scales, zeros, x, n, b0, b1, out, out_stride);
    return columns_scalar<8>(tiles, scales, zeros, x, n, b0, b1, out, out_stride);
  }
#if defined(BLOCKS_AVX2)
  namespace v = avx2;
#elif defined(BLOCKS_NEON)
  namespace v = neon;
#endif
#if defined(BLOCKS_AVX2) || defined(BLOCKS_NEON)
  if (bits == 4 && zeros == 1) return v::columns<4, 1>(tiles, scales, x, n, b0, b1, out, out_stride);
  if (bits == 5 && zeros == 2) return v::columns<5, 2>(tiles, scales, x, n, b0, b1, out, out_stride);
  if (bits == 8 && zeros == 1) return v::columns<8, 1>(tiles, scales, x, n, b0, b1, out, out_stride);
  if (bits == 8 && zeros == 2) return v::columns<8, 2>(tiles, scales, x, n, b0, b1, out, out_stride);
#endif
  columns(bits, zeros, tiles, scales, x, n, b0, b1, out, out_stride, true);
}

}  // namespace blocks
