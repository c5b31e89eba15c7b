// GGUF tensor blocks straight into the 4-bit kernels' layouts, at load (no torch: a plain C ABI,
// pointers and sizes in, outputs allocated by the caller; each call a range of whole tiles of
// rows, which the caller runs on its threads in parallel). It computes what kernels.Int4Linear's
// Python path computes from the same blocks, bit for bit (tests/test_repack.py compares every
// type and layout): the file's block types, decoded as model/files.py decodes them, then
//
//   * a 4-bit affine group (Q4_0, Q4_1, Q4_K: w = d·q + m, q in 0..15), when every row of the
//     weight is one: q, scale d and zero m + 8d (one copy of the input);
//   * otherwise each group as two 4-bit halves of a byte u = 16·hi + lo (two copies of the input):
//     affine groups (Q5 ones, or Q4 beside them) u = q, scales 16d and d, zeros 128d and 8d + m;
//     Q8_0 groups u = q + 128, zeros 0 and 8d; the other types (Q6_K, F16, BF16, F32) first
//     re-quantized to Q8_0 as kernels.quantize_q8_0 does (d = fp16(max|w|/127), q = w·(1/d)
//     rounded half to even, clamped to ±127).
//
// A row is given by a pointer to its blocks and its ggml type, so the caller's row order (a
// llama file's q/k un-permutation, partial rotary's order, several tensors stacked into one
// linear, a head's zero padding) costs nothing here. Float results follow IEEE single precision
// operation by operation, as numpy and torch compute them: build without -ffast-math and without
// contracting a·b + c into a fused multiply-add (-ffp-contract=off; the pragmas below say it to
// GCC and clang too).

#include "abi.h"  // CS_API: the functions below are exported, the rest hidden

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

constexpr int64_t GROUP = 32;  // inputs under one scale
constexpr int64_t TILE_ROWS = 16;  // rows of one tile of our AVX-512 BF16 / AMX kernels
constexpr int64_t BLOCK_ROWS = 8;  // rows of one tile of csrc/blocks.h's kernels

// ggml's type ids (gguf.GGMLQuantizationType)
enum Type : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};
// Or-ed into a row's type: its values re-quantized to Q8_0 even where they are Q8_0 blocks (a
// head whose rows are padded is quantized from its float rows, kernels._padded_q8_0).
constexpr int32_t REQUANTIZE = 0x100;

float f32_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_f16(uint16_t h) {  // exact
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: mantissa·2⁻²⁴
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return f32_of_bits(sign | 0x7F800000u | (mantissa << 13));
  return f32_of_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// x rounded to the nearest integer, ties to even (torch.round), for |x| < 2²²: x + 1.5·2²³ lies
// where floats are the integers, so the sum rounds x's fraction away (to even: 1.5·2²³ is even).
float round_even(float x) {
  constexpr float magic = 12582912.0f;
  return (x + magic) - magic;
}

uint16_t to_f16(float f) {  // round to nearest even, as torch's Half (overflow to infinity)
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7E00;  // NaN
  if (magnitude >= 0x477FF000u) return sign | 0x7C00;  // rounds to 65520 or more: infinity
  if (magnitude < 0x38800000u) {  // below 2⁻¹⁴: a subnormal half, mantissa·2⁻²⁴ (exact scaling)
    return sign | static_cast<uint16_t>(round_even(f32_of_bits(magnitude) * 16777216.0f));
  }
  const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

float from_bf16(uint16_t b) { return f32_of_bits(static_cast<uint32_t>(b) << 16); }

uint16_t to_bf16(float f) {  // round to nearest even, as torch's BFloat16
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float read_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return from_f16(h);
}

int64_t block_bytes(int32_t type) {  // bytes per block of block_values(type) values
  switch (type) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

int64_t block_values(int32_t type) {
  switch (type) {
    case F32: case F16: case BF16: return 1;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 32;
  }
}

bool affine(int32_t type) {  // w = d·q + m per group of 32 (files.AFFINE_BITS)
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q4_K ||
         type == Q5_K;
}

// Q4_K and Q5_K's 6-bit scale and min of sub-block j (gguf's Q4_K.get_scale_min)
void scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// An affine row's groups: q (k values in 0..31), d and m (k/32), as files.affine_groups reads them.
void affine_groups(const uint8_t* row, int32_t type, int64_t k, uint8_t* q, float* d, float* m) {
  const int64_t values = block_values(type), bytes = block_bytes(type);
  for (int64_t b = 0; b < k / values; ++b) {
    const uint8_t* block = row + b * bytes;
    uint8_t* qb = q + b * values;
    if (values == 32) {  // Q4_0, Q4_1, Q5_0, Q5_1: element j low nibble, j + 16 high
      const bool has_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
      const uint8_t* nibbles = block + bytes - 16;
      uint32_t high = 0;
      if (five) std::memcpy(&high, block + (has_min ? 4 : 2), 4);  // bit j: element j's fifth
      for (int j = 0; j < 16; ++j) {
        qb[j] = nibbles[j] & 15;
        qb[j + 16] = nibbles[j] >> 4;
      }
      if (five)
        for (int j = 0; j < 32; ++j) qb[j] |= static_cast<uint8_t>(((high >> j) & 1u) << 4);
      d[b] = read_f16(block);
      m[b] = has_min ? read_f16(block + 2) : (five ? -16.0f : -8.0f) * d[b];
      continue;
    }
    // Q4_K, Q5_K: 8 sub-blocks of 32; sub-blocks 2c and 2c + 1 are the low and high nibbles of
    // the c-th 32 bytes of qs; Q5_K's fifth bit of sub-block i, element j: bit i of qh[j]
    const float d0 = read_f16(block), dmin = read_f16(block + 2);
    const uint8_t* qs = block + bytes - 128;
    const uint8_t* qh = block + 16;
    for (int i = 0; i < 8; ++i) {
      int sc, mn;
      scale_min(block + 4, i, &sc, &mn);
      d[b * 8 + i] = d0 * static_cast<float>(sc);
      m[b * 8 + i] = -dmin * static_cast<float>(mn);
      for (int j = 0; j < 32; ++j) {
        uint8_t v = (qs[32 * (i / 2) + j] >> (4 * (i % 2))) & 15;
        if (type == Q5_K) v |= static_cast<uint8_t>(((qh[j] >> i) & 1) << 4);
        qb[32 * i + j] = v;
      }
    }
  }
}

// A Q6_K block's 256 values q − 32 in −32..31: element 128h + 32t + j has nibble t/2 of
// ql[64h + 32(t%2) + j] and bits 2t, 2t + 1 of qh[32h + j] (gguf's Q6_K.dequantize_blocks).
void q6_k_values(const uint8_t* __restrict__ block, int8_t* __restrict__ q) {
  const uint8_t *ql = block, *qh = block + 128;
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < 4; ++t) {
      const uint8_t *low = ql + 64 * h + 32 * (t % 2), *high = qh + 32 * h;
      for (int j = 0; j < 32; ++j) {
        const int v = ((low[j] >> (4 * (t / 2))) & 15) | (((high[j] >> (2 * t)) & 3) << 4);
        q[128 * h + 32 * t + j] = static_cast<int8_t>(v - 32);
      }
    }
  }
}

// Any row's k values in float32 exactly as gguf dequantizes them (files._float).
void float_values(const uint8_t* row, int32_t type, int64_t k, float* out) {
  switch (type) {
    case F32:
      std::memcpy(out, row, 4 * k);
      return;
    case F16:
      for (int64_t i = 0; i < k; ++i) out[i] = read_f16(row + 2 * i);
      return;
    case BF16:
      for (int64_t i = 0; i < k; ++i) {
        uint16_t h;
        std::memcpy(&h, row + 2 * i, 2);
        out[i] = f32_of_bits(static_cast<uint32_t>(h) << 16);
      }
      return;
    case Q8_0:
      for (int64_t b = 0; b < k / 32; ++b) {
        const float d = read_f16(row + 34 * b);
        const int8_t* q = reinterpret_cast<const int8_t*>(row + 34 * b + 2);
        for (int j = 0; j < 32; ++j) out[32 * b + j] = d * static_cast<float>(q[j]);
      }
      return;
    case Q6_K:
      for (int64_t b = 0; b < k / 256; ++b) {
        const uint8_t* block = row + 210 * b;
        int8_t q[256];
        q6_k_values(block, q);
        const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
        const float d = read_f16(block + 208);
        for (int s = 0; s < 16; ++s) {  // w = (d·sc)·q per sub-block of 16
          const float ds = d * static_cast<float>(sc[s]);
          for (int j = 0; j < 16; ++j)
            out[256 * b + 16 * s + j] = ds * static_cast<float>(q[16 * s + j]);
        }
      }
      return;
    default: {  // the affine types: gguf computes d·(q − 8) (Q4_0), d·(q − 16) (Q5_0),
      std::vector<uint8_t> q(k);  // d·q + m (Q4_1, Q5_1) and (d·sc)·q − dmin·mn (K-quants)
      std::vector<float> d(k / 32), m(k / 32);
      affine_groups(row, type, k, q.data(), d.data(), m.data());
      for (int64_t i = 0; i < k; ++i) {
        const float dg = d[i / 32];
        if (type == Q4_0 || type == Q5_0) {
          out[i] = dg * static_cast<float>(static_cast<int>(q[i]) - (type == Q4_0 ? 8 : 16));
        } else {
          out[i] = dg * static_cast<float>(q[i]) + m[i / 32];  // m = −dmin·mn: a − b as a + (−b)
        }
      }
    }
  }
}

// Q8_0 of 32 float values, as kernels.quantize_q8_0: d = fp16(max|w|/127), q = round(w·(1/d))
// clamped to ±127, written as q + bias (128: the kernels' byte u; 0: q as a signed byte).
// (NaN weights are not matched: no file of ours holds them.)
float quantize_group(const float* __restrict__ w, uint8_t* __restrict__ q, int bias) {
  uint32_t top = 0;  // max |w| as bits: non-negative floats order as their bit patterns do
  for (int j = 0; j < 32; ++j) {
    uint32_t a;
    std::memcpy(&a, w + j, 4);
    a &= 0x7FFFFFFFu;
    top = a > top ? a : top;
  }
  const float d = from_f16(to_f16(f32_of_bits(top) / 127.0f));
  const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < 32; ++j) {  // |w·(1/d)| < 256 for finite w, whatever d's rounding
    const int v = static_cast<int>(round_even(w[j] * inverse));  // an integer: exact
    q[j] = static_cast<uint8_t>(std::min(std::max(v, -127), 127) + bias);
  }
  return d;
}

// One row as the kernels take it (kernels.Int4Linear's q, scale, zero): copies == 1, q in 0..15
// (q[i]), scale d[g], zero zl[g]; copies == 2, the byte u = 16·hi + lo (q[i]), the low half's scale
// d[g] (the high half's is 16·d[g]) and the zeros zh[g] (high) and zl[g] (low).
struct Row {
  std::vector<uint8_t> q;
  std::vector<float> d, zh, zl, values;  // values: a re-quantized row's floats

  explicit Row(int64_t k) : q(k), d(k / GROUP), zh(k / GROUP), zl(k / GROUP) {}

  // Row src of `type` (or-ed with REQUANTIZE), k values; 8-bit rows always run as two copies.
  void decode(const uint8_t* src, int32_t type, int64_t k) {
    const int64_t groups = k / GROUP;
    const bool requantize = (type & REQUANTIZE) != 0;
    type &= ~REQUANTIZE;
    if (affine(type) && !requantize) {
      affine_groups(src, type, k, q.data(), d.data(), zl.data());  // zl holds m until here
      for (int64_t g = 0; g < groups; ++g) {
        zh[g] = 128.0f * d[g];
        zl[g] = zl[g] + 8.0f * d[g];
      }
      return;
    }
    if (type == Q8_0 && !requantize) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = src + 34 * g;
        d[g] = read_f16(block);
        for (int j = 0; j < 32; ++j) q[32 * g + j] = block[2 + j] ^ 0x80;  // q + 128
      }
    } else {
      values.resize(k);
      float_values(src, type, k, values.data());
      for (int64_t g = 0; g < groups; ++g)
        d[g] = quantize_group(values.data() + 32 * g, q.data() + 32 * g, 128);
    }
    for (int64_t g = 0; g < groups; ++g) {
      zh[g] = 0.0f;
      zl[g] = 8.0f * d[g];
    }
  }

  // The kernels' nibbles of the row, copies·k of them: q (one copy), or the high halves of u
  // then its low halves (two).
  void nibbles(int64_t k, int copies, uint8_t* out) const {
    if (copies == 1) {
      std::memcpy(out, q.data(), k);
      return;
    }
    for (int64_t i = 0; i < k; ++i) out[i] = q[i] >> 4;
    for (int64_t i = 0; i < k; ++i) out[k + i] = q[i] & 15;
  }

  // Group g's bf16 scale s̃ = bf16(scale) and offset õ = bf16(zero − 8·scale) as the kernels
  // hold them (Int4Linear's scale_rows, offset_rows): `high` the high halves' (scale 16d, zero
  // zh), else the low ones' (d, zl) or the one copy's.
  void scale(int64_t g, bool high, float* s, float* offset) const {
    const float scale = high ? 16.0f * d[g] : d[g], zero = high ? zh[g] : zl[g];
    *s = from_bf16(to_bf16(scale));
    *offset = from_bf16(to_bf16(zero - 8.0f * scale));
  }

  // Each nibble value v's weight v·s̃ + õ in float32 (Int4Linear.dequantized).
  void weights(int64_t g, bool high, float* table) const {
    float s, offset;
    scale(g, high, &s, &offset);
    for (int v = 0; v < 16; ++v) table[v] = static_cast<float>(v) * s + offset;
  }
};

bool known(int32_t type) { return block_bytes(type & ~REQUANTIZE) > 0; }

bool rows_known(int64_t rows, const int32_t* types) {
  for (int64_t r = 0; r < rows; ++r)
    if (!known(types[r])) return false;
  return true;
}

}  // namespace

extern "C" {

// The version of this interface: the Python side checks it matches what it expects.
CS_API int32_t cs_repack_version() { return 1; }

// Our AVX-512 BF16 / AMX kernels' layout (kernels._tile_pack): tiles (rows/16, copies·k/8, 16)
// int32, lane j of tile (b, c) row 16b + j's inputs 8c..8c+7, input 8c + 2m + h in bits
// 4m + 16h; scales (rows/16, copies·k/32, 2, 16) bf16: each group's 16 scales, then 16 zeros.
// Returns 0, or −1 for a type it does not read.
CS_API int32_t cs_tiles(int64_t rows, int64_t k, const uint8_t* const* src, const int32_t* types,
                 int32_t copies, int32_t* tiles, uint16_t* scales) {
  if (!rows_known(rows, types)) return -1;
  const int64_t width = copies * k, columns = width / 8, groups = width / GROUP;
  const int64_t g1 = k / GROUP;  // groups of one copy
  Row row(k);
  std::vector<uint8_t> nibbles(width);
  for (int64_t b = 0; b < rows / TILE_ROWS; ++b) {
    for (int64_t j = 0; j < TILE_ROWS; ++j) {
      const int64_t r = b * TILE_ROWS + j;
      row.decode(src[r], types[r], k);
      row.nibbles(k, copies, nibbles.data());
      int32_t* lane = tiles + b * columns * TILE_ROWS + j;
      for (int64_t c = 0; c < columns; ++c) {
        const uint8_t* n = nibbles.data() + 8 * c;
        const uint32_t word = n[0] | n[2] << 4 | n[4] << 8 | n[6] << 12 | n[1] << 16 |
                              n[3] << 20 | n[5] << 24 | static_cast<uint32_t>(n[7]) << 28;
        lane[c * TILE_ROWS] = static_cast<int32_t>(word);
      }
      uint16_t* s = scales + b * groups * 2 * TILE_ROWS + j;
      for (int64_t g = 0; g < groups; ++g) {
        const bool high = copies == 2 && g < g1;
        const int64_t own = copies == 2 && !high ? g - g1 : g;  // the row's group
        s[(2 * g) * TILE_ROWS] = to_bf16(high ? 16.0f * row.d[own] : row.d[own]);
        s[(2 * g + 1) * TILE_ROWS] = to_bf16(high ? row.zh[own] : row.zl[own]);
      }
    }
  }
  return 0;
}

// csrc/blocks.h's layout (kernels._blocks_pack), `bits` 4 (copies 1), 5 or 8 (copies 2) and
// `high` whether the high halves' zeros are kept (copies 2): tiles (rows/8, k·bits/32, 8) int32,
// scales (rows/8, k/32, planes, 8) bf16, the planes (scale, zero), (scale, high zero, low zero)
// or (scale, low zero). facts[0]: the largest high half of any row (5-bit tiles hold only 0 and
// 1), facts[1]: 1 where a high zero is not 0 (else the 8-bit tiles drop them): kernels.
// _blocks_form's choice, which the caller checks against the one it asked for. Returns 0, or −1
// for a type it does not read or a form it does not lay.
CS_API int32_t cs_blocks(int64_t rows, int64_t k, const uint8_t* const* src, const int32_t* types,
                  int32_t copies, int32_t bits, int32_t high, int32_t* tiles, uint16_t* scales,
                  int32_t* facts) {
  if (!rows_known(rows, types)) return -1;
  if (!((copies == 1 && bits == 4) || (copies == 2 && (bits == 5 || bits == 8)))) return -1;
  const int64_t groups = k / GROUP, vectors = bits;  // a group's 32 inputs in `bits` vectors
  const int planes = copies == 1 ? 2 : (high ? 3 : 2);
  int32_t top = 0, zeros = 0;
  Row row(k);
  for (int64_t t = 0; t < rows / BLOCK_ROWS; ++t) {
    for (int64_t lane = 0; lane < BLOCK_ROWS; ++lane) {
      const int64_t r = t * BLOCK_ROWS + lane;
      row.decode(src[r], types[r], k);
      const uint8_t* q = row.q.data();
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* qg = q + GROUP * g;
        int32_t* lanes = tiles + ((t * groups + g) * vectors) * BLOCK_ROWS + lane;
        uint8_t* v = reinterpret_cast<uint8_t*>(lanes);
        for (int c = 0; c < vectors; ++c) {  // vector c's lane: 4 bytes
          uint8_t* out = v + 4 * BLOCK_ROWS * c;
          for (int j = 0; j < 4; ++j) {
            if (bits == 8) {
              out[j] = qg[4 * c + j] ^ 0x80;  // u − 128 as a signed byte
            } else if (c < 4) {
              out[j] = (qg[8 * c + j] & 15) | ((qg[8 * c + 4 + j] & 15) << 4);
            } else {  // bit 2c' + half of byte j: input 8c' + 4·half + j's fifth bit
              uint8_t plane = 0;
              for (int v2 = 0; v2 < 8; ++v2)
                plane |= static_cast<uint8_t>(((qg[8 * (v2 / 2) + 4 * (v2 % 2) + j] >> 4) & 1)
                                              << v2);
              out[j] = plane;
            }
          }
        }
        if (copies == 2)
          for (int i = 0; i < 32; ++i) top = std::max<int32_t>(top, qg[i] >> 4);
        uint16_t* s = scales + ((t * groups + g) * planes) * BLOCK_ROWS + lane;
        const uint16_t zh = to_bf16(row.zh[g]);
        if (copies == 2 && (zh & 0x7FFF)) zeros = 1;
        s[0] = to_bf16(row.d[g]);
        if (planes == 3) s[BLOCK_ROWS] = zh;
        s[(planes - 1) * BLOCK_ROWS] = to_bf16(row.zl[g]);
      }
    }
  }
  facts[0] = top;
  facts[1] = zeros;
  return 0;
}

// The prompts' bf16 copy of the weights (kernels.Int4Linear.dequantized_bf16): each weight
// q·s̃ + õ with s̃ the kernels' bf16 scale and õ = bf16(zero − 8·scale), in bf16 arithmetic for one
// copy, in float32 for two (the halves summed, 0 + hi + lo, then rounded once). `tiled`: in AMX B
// tiles (rows/16, k/32, 16, 32), element (b, g, p, 2j + t) the weight of row 16b + j, input
// 32g + 2p + t (Int4Linear.use_prefill's layout for our dense kernels); else (rows, k).
CS_API int32_t cs_dense(int64_t rows, int64_t k, const uint8_t* const* src, const int32_t* types,
                 int32_t copies, int32_t tiled, uint16_t* out) {
  if (!rows_known(rows, types)) return -1;
  Row row(k);
  std::vector<uint16_t> dense(k);
  for (int64_t r = 0; r < rows; ++r) {
    row.decode(src[r], types[r], k);
    for (int64_t g = 0; g < k / GROUP; ++g) {
      const uint8_t* q = row.q.data() + GROUP * g;
      uint16_t* w = dense.data() + GROUP * g;
      if (copies == 1) {  // torch's bf16 arithmetic: rounded after q·s̃, and again after + õ
        float s, offset;
        uint16_t table[16];
        row.scale(g, false, &s, &offset);
        for (int v = 0; v < 16; ++v)
          table[v] = to_bf16(from_bf16(to_bf16(static_cast<float>(v) * s)) + offset);
        for (int i = 0; i < GROUP; ++i) w[i] = table[q[i]];
      } else {  // the halves in float32, 0 + hi + lo (Python's sum), rounded once
        float low[16], high[16];
        row.weights(g, true, high);
        row.weights(g, false, low);
        for (int i = 0; i < GROUP; ++i) w[i] = to_bf16((0.0f + high[q[i] >> 4]) + low[q[i] & 15]);
      }
    }
    if (!tiled) {
      std::memcpy(out + r * k, dense.data(), 2 * k);
      continue;
    }
    // pair p = inputs 2p, 2p + 1: tile (r/16, p/16), k-pair p%16, output r%16 (4 bytes each)
    uint32_t* pairs = reinterpret_cast<uint32_t*>(out);
    const int64_t base = (r / TILE_ROWS) * (k / GROUP) * 256 + r % TILE_ROWS;
    for (int64_t p = 0; p < k / 2; ++p) {
      uint32_t pair;
      std::memcpy(&pair, dense.data() + 2 * p, 4);
      pairs[base + (p / 16) * 256 + (p % 16) * 16] = pair;
    }
  }
  return 0;
}

// The weights the kernels' scales give (kernels.Int4Linear.dequantized in float32): (rows,
// copies·k), each half q·s̃ + õ, s̃ the bf16 scale and õ = bf16(zero − 8·scale); two copies as
// the high halves (scale 16d) then the low ones.
CS_API int32_t cs_dequantized(int64_t rows, int64_t k, const uint8_t* const* src, const int32_t* types,
                       int32_t copies, float* out) {
  if (!rows_known(rows, types)) return -1;
  Row row(k);
  for (int64_t r = 0; r < rows; ++r) {
    row.decode(src[r], types[r], k);
    float* o = out + r * copies * k;
    for (int64_t g = 0; g < k / GROUP; ++g) {
      float low[16], high[16];
      row.weights(g, false, low);
      if (copies == 2) row.weights(g, true, high);
      const uint8_t* q = row.q.data() + GROUP * g;
      for (int i = 0; i < GROUP; ++i) {
        if (copies == 1) {
          o[GROUP * g + i] = low[q[i]];
        } else {
          o[GROUP * g + i] = high[q[i] >> 4];
          o[k + GROUP * g + i] = low[q[i] & 15];
        }
      }
    }
  }
  return 0;
}

// What kernels.Q8Head's bound terms are norms of, per head row (its screen's rows: two halves
// of Q8_0 blocks): w = hi + lo (the weights the screen's bf16 scales give), spread = |hi| + |lo|,
// error = w − the row's float32 values (the file's, as gguf dequantizes them: the same row read
// without REQUANTIZE); each (rows, k) float32, each value the one torch's ops give.
CS_API int32_t cs_head_parts(int64_t rows, int64_t k, const uint8_t* const* src, const int32_t* types,
                      float* w, float* spread, float* error) {
  if (!rows_known(rows, types)) return -1;
  Row row(k);
  std::vector<float> exact(k);
  for (int64_t r = 0; r < rows; ++r) {
    row.decode(src[r], types[r], k);
    float_values(src[r], types[r] & ~REQUANTIZE, k, exact.data());
    float *wr = w + r * k, *sr = spread + r * k, *er = error + r * k;
    for (int64_t g = 0; g < k / GROUP; ++g) {
      float low[16], high[16];
      row.weights(g, true, high);
      row.weights(g, false, low);
      for (int i = 0; i < GROUP; ++i) {
        const int64_t c = GROUP * g + i;
        const float hi = high[row.q[c] >> 4], lo = low[row.q[c] & 15];
        wr[c] = hi + lo;
        sr[c] = std::fabs(hi) + std::fabs(lo);
        er[c] = wr[c] - exact[c];
      }
    }
  }
  return 0;
}

// A table's rows (the token embedding, the LM head's) as kernels.BlockRows holds Q8_0 ones:
// q (rows, k) int8 and d (rows, k/32) fp16, straight from Q8_0 blocks.
CS_API int32_t cs_q8_0_rows(int64_t rows, int64_t k, const uint8_t* const* src, const int32_t* types,
                     int8_t* q, uint16_t* d) {
  for (int64_t r = 0; r < rows; ++r)
    if (types[r] != Q8_0) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < k / 32; ++g) {
      const uint8_t* block = src[r] + 34 * g;
      std::memcpy(d + r * (k / 32) + g, block, 2);
      std::memcpy(q + r * k + 32 * g, block + 2, 32);
    }
  }
  return 0;
}

// Q6_K rows as kernels.BlockRows holds them (kernels.split_q6_k): q (rows, k) int8 in −32..31 and
// scales (rows, k/16) float32, d·sc (exact).
CS_API int32_t cs_q6_k_rows(int64_t rows, int64_t k, const uint8_t* const* src, const int32_t* types,
                     int8_t* q, float* scales) {
  for (int64_t r = 0; r < rows; ++r)
    if (types[r] != Q6_K) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < k / 256; ++b) {
      const uint8_t* block = src[r] + 210 * b;
      q6_k_values(block, q + r * k + 256 * b);
      const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
      const float d = read_f16(block + 208);
      for (int s = 0; s < 16; ++s)
        scales[r * (k / 16) + 16 * b + s] = d * static_cast<float>(sc[s]);
    }
  }
  return 0;
}

// Rows of any type in float32, exactly as gguf dequantizes them (files._float), into out (rows, k).
CS_API int32_t cs_float_rows(int64_t rows, int64_t k, const uint8_t* const* src, const int32_t* types,
                      float* out) {
  if (!rows_known(rows, types)) return -1;
  for (int64_t r = 0; r < rows; ++r) float_values(src[r], types[r] & ~REQUANTIZE, k, out + r * k);
  return 0;
}

// Rows of any type as kernels.quantize_q8_0 quantizes their float32 values (files._float):
// q (rows, k) int8, d (rows, k/32) float32 holding fp16 values. Q8_0 rows are re-quantized too.
CS_API int32_t cs_q8_0_quantize(int64_t rows, int64_t k, const uint8_t* const* src,
                         const int32_t* types, int8_t* q, float* d) {
  if (!rows_known(rows, types)) return -1;
  std::vector<float> values(k);
  for (int64_t r = 0; r < rows; ++r) {
    float_values(src[r], types[r] & ~REQUANTIZE, k, values.data());
    uint8_t* row = reinterpret_cast<uint8_t*>(q + r * k);
    for (int64_t g = 0; g < k / 32; ++g)
      d[r * (k / 32) + g] = quantize_group(values.data() + 32 * g, row + 32 * g, 0);
  }
  return 0;
}

}  // extern "C"
