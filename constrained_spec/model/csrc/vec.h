// A vector of floats for the fused layers' loops: the operations they use of ATen's
// at::vec::Vectorized<float>, with its lane width per build (16 under AVX-512 F/BW/DQ/VL, 8
// under AVX2 with FMA, else ATen's generic fallback: 8 floats in an array, lane by lane) and the
// same instructions per operation, so that the fused layers compute what they computed when
// they were built against torch's headers on the same CPU flags (and still no result depends on
// the split across threads or on the vector width beyond that). One exception: tanh (Gemma's
// soft-cap and GeGLU), where ATen calls Sleef's tanhf (1 ulp); ours is computed in double and
// rounded once, so its bits may differ from Sleef's where Sleef's are not the nearest float.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "blocks.h"  // from_bf16, to_bf16: torch's BFloat16 conversions (round to nearest even)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define VEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_AVX2 1
#endif

namespace vec {

// tanh of each lane of a vector of N floats, through doubles: expm1(2|x|) after Cody and Waite's
// reduction 2|x| = k·ln2 + r (|r| ≤ ln2/2), a Taylor polynomial for expm1(r) (degree 13: error
// under 2⁻⁵³ on that range), tanh|x| = e/(e + 2), the sign put back. Relative error about 1e-15
// before the rounding to float: the nearest float but for ties closer than that. Like Sleef's
// tanhf (whose bits torch's Vectorized<float>::tanh gives), |x| > 8.664339742 gives ±1 exactly.
// (GCC's vector extensions: the same code for 8 and 16 lanes, split into the registers there are.)
typedef float f8 __attribute__((vector_size(32)));
typedef double d8 __attribute__((vector_size(64)));
typedef int64_t i8 __attribute__((vector_size(64)));
typedef float f16 __attribute__((vector_size(64)));
typedef double d16 __attribute__((vector_size(128)));
typedef int64_t i16 __attribute__((vector_size(128)));

template <class F, class D, class I>  // N floats, doubles, int64s
inline void tanh_lanes(const float* in, float* out) {
  F x;
  std::memcpy(&x, in, sizeof x);
  const D a = __builtin_convertvector(x, D), y = 2 * (a < 0 ? -a : a);
  const D shift = D{} + 0x1.8p52;  // adding it rounds to an integer (|y/ln2| < 2⁵¹)
  const D k = (y * 1.4426950408889634 + shift) - shift;
  const D r = (y - k * 0x1.62e42fee00000p-1) - k * 0x1.a39ef35793c76p-33;  // ln2, hi + lo
  D p = D{} + 1.0 / 6227020800;  // 1/13!
  const double coefficients[] = {1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880,
                                 1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24,
                                 1.0 / 6, 0.5, 1.0};
  for (double c : coefficients) p = p * r + c;
  p = p * r;  // expm1(r)
  const D two_k = (D)((__builtin_convertvector(k, I) + 1023) << 52);  // 2^k
  const D e = two_k * p + (two_k - 1);  // expm1(y) = 2^k·expm1(r) + 2^k − 1
  const I sign = (I)a & (I{} + INT64_MIN);
  const D t = (D)((I)(e / (e + 2)) | sign);  // tanh|x| ≥ 0, then x's sign (−0 stays −0)
  F result = __builtin_convertvector(t, F);
  const F saturated = x < 0 ? F{} - 1 : F{} + 1;
  result = (x > 8.664339742f) | (x < -8.664339742f) ? saturated : result;
  result = x != x ? x : result;  // NaN
  std::memcpy(out, &result, sizeof result);
}

#if defined(VEC_AVX512)

struct Vec {
  __m512 v;
  static constexpr int64_t size() { return 16; }
  Vec() : v(_mm512_setzero_ps()) {}
  Vec(__m512 value) : v(value) {}
  Vec(float value) : v(_mm512_set1_ps(value)) {}
  static Vec loadu(const float* p) { return _mm512_loadu_ps(p); }
  static Vec loadu(const float* p, int64_t count) {  // lanes count.. zero
    if (count == size()) return loadu(p);
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1ULL << count) - 1), p);
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(float* p, int64_t count) const {
    if (count == size())
      store(p);
    else if (count > 0)
      _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1ULL << count) - 1), v);
  }
  static Vec set(const Vec& a, const Vec& b, int64_t count) {  // b's lanes below count, a's after
    if (count >= size()) return b;
    return _mm512_mask_blend_ps(static_cast<__mmask16>((1ULL << count) - 1), a.v, b.v);
  }
  Vec neg() const { return _mm512_xor_ps(_mm512_set1_ps(-0.f), v); }
  Vec exp_u20() const;
  Vec tanh() const {
    alignas(64) float lanes[16];
    tanh_lanes<f16, d16, i16>(reinterpret_cast<const float*>(&v), lanes);
    return _mm512_load_ps(lanes);
  }
};

inline Vec operator+(const Vec& a, const Vec& b) { return _mm512_add_ps(a.v, b.v); }
inline Vec operator-(const Vec& a, const Vec& b) { return _mm512_sub_ps(a.v, b.v); }
inline Vec operator*(const Vec& a, const Vec& b) { return _mm512_mul_ps(a.v, b.v); }
inline Vec operator/(const Vec& a, const Vec& b) { return _mm512_div_ps(a.v, b.v); }
inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }

// ATen's exp_u20 (aten/src/ATen/cpu/vec/vec512/vec512_float.h, Vectorized<float>::exp_u20:
// a degree-5 polynomial after exp(x) = 2^n·exp(r), 20 ulp), re-implemented instruction for
// instruction so that its bits are torch's.
inline Vec Vec::exp_u20() const {
  const __m512 f1 = _mm512_set1_ps(0.999999701f), f2 = _mm512_set1_ps(0.499991506f);
  const __m512 f3 = _mm512_set1_ps(0.166676521f), f4 = _mm512_set1_ps(0.0418978221f);
  const __m512 f5 = _mm512_set1_ps(0.00828929059f);
  const __m512 log2e = _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b));
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  const __m512 ln2 = _mm512_castsi512_ps(_mm512_set1_epi32(0x3f317218));
  const __m512 low = _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50));  // ln(FLT_MIN)
  const __m512 high = _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218));  // ln(FLT_MAX)
  const __mmask16 underflow = _mm512_cmp_ps_mask(v, low, _CMP_LT_OS);
  __m512 x = _mm512_max_ps(_mm512_min_ps(v, high), low);
  __m512 fx = _mm512_fmadd_ps(x, log2e, half);  // n = floor(x·log2(e) + 0.5)
  fx = _mm512_cvtepi32_ps(_mm512_cvt_roundps_epi32(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
  const __m512 r = _mm512_fnmadd_ps(fx, ln2, x);
  __m512 p = _mm512_fmadd_ps(r, f5, f4);
  p = _mm512_fmadd_ps(r, p, f3);
  p = _mm512_fmadd_ps(r, p, f2);
  p = _mm512_fmadd_ps(r, p, f1);
  p = _mm512_fmadd_ps(r, p, one);
  __m512i n = _mm512_cvtps_epi32(_mm512_sub_ps(fx, one));  // 2^(n − 1)
  n = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  const __m512 scale = _mm512_mask_blend_ps(underflow, _mm512_castsi512_ps(n), _mm512_setzero_ps());
  return _mm512_mul_ps(_mm512_mul_ps(p, scale), two);
}

inline Vec load_bf16(const uint16_t* p) {  // 16 bf16 values as floats
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// ATen's float → bf16 on 16 lanes (vec512_bfloat16.h, cvtfp32_bf16): round to nearest even,
// NaN to 0xffff.
inline __m256i to_bf16x16(__m512 a) {
  const __m512i u = _mm512_castps_si512(a);
  __m512i t = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(0x7fff)), u), 16);
  t = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), t);
  return _mm512_cvtusepi32_epi16(t);
}

constexpr int64_t BF16_CHUNK = 32;  // ATen's Vectorized<BFloat16>::size(): converted together

inline void to_bf16_chunk(const float* src, uint16_t* dst) {
  for (int64_t h = 0; h < 2; ++h)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * h), to_bf16x16(_mm512_loadu_ps(src + 16 * h)));
}

#elif defined(VEC_AVX2)

struct Vec {
  __m256 v;
  static constexpr int64_t size() { return 8; }
  Vec() : v(_mm256_setzero_ps()) {}
  Vec(__m256 value) : v(value) {}
  Vec(float value) : v(_mm256_set1_ps(value)) {}
  static __m256i mask(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec loadu(const float* p) { return _mm256_loadu_ps(p); }
  static Vec loadu(const float* p, int64_t count) {  // lanes count.. zero
    if (count >= size()) return loadu(p);
    return _mm256_maskload_ps(p, mask(count));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(float* p, int64_t count) const {
    if (count >= size())
      store(p);
    else if (count > 0)
      _mm256_maskstore_ps(p, mask(count), v);
  }
  static Vec set(const Vec& a, const Vec& b, int64_t count) {  // b's lanes below count, a's after
    if (count >= size()) return b;
    return _mm256_blendv_ps(a.v, b.v, _mm256_castsi256_ps(mask(count)));
  }
  Vec neg() const { return _mm256_xor_ps(_mm256_set1_ps(-0.f), v); }
  Vec exp_u20() const;
  Vec tanh() const {
    alignas(32) float lanes[8];
    tanh_lanes<f8, d8, i8>(reinterpret_cast<const float*>(&v), lanes);
    return _mm256_load_ps(lanes);
  }
};

inline Vec operator+(const Vec& a, const Vec& b) { return _mm256_add_ps(a.v, b.v); }
inline Vec operator-(const Vec& a, const Vec& b) { return _mm256_sub_ps(a.v, b.v); }
inline Vec operator*(const Vec& a, const Vec& b) { return _mm256_mul_ps(a.v, b.v); }
inline Vec operator/(const Vec& a, const Vec& b) { return _mm256_div_ps(a.v, b.v); }
inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }

// ATen's exp_u20 for AVX2 (aten/src/ATen/cpu/vec/vec256/vec256_float.h,
// Vectorized<float>::exp_u20), re-implemented instruction for instruction.
inline Vec Vec::exp_u20() const {
  const __m256 f1 = _mm256_set1_ps(0.999999701f), f2 = _mm256_set1_ps(0.499991506f);
  const __m256 f3 = _mm256_set1_ps(0.166676521f), f4 = _mm256_set1_ps(0.0418978221f);
  const __m256 f5 = _mm256_set1_ps(0.00828929059f);
  const __m256 log2e = _mm256_castsi256_ps(_mm256_set1_epi32(0x3fb8aa3b));
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f);
  const __m256 ln2 = _mm256_castsi256_ps(_mm256_set1_epi32(0x3f317218));
  const __m256 low = _mm256_castsi256_ps(_mm256_set1_epi32(0xc2aeac50));  // ln(FLT_MIN)
  const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32(0x42b17218));  // ln(FLT_MAX)
  const __m256 underflow = _mm256_cmp_ps(v, low, _CMP_LT_OS);
  __m256 x = _mm256_max_ps(_mm256_min_ps(v, high), low);
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, half));  // n
  const __m256 r = _mm256_fnmadd_ps(fx, ln2, x);
  __m256 p = _mm256_fmadd_ps(r, f5, f4);
  p = _mm256_fmadd_ps(r, p, f3);
  p = _mm256_fmadd_ps(r, p, f2);
  p = _mm256_fmadd_ps(r, p, f1);
  p = _mm256_fmadd_ps(r, p, one);
  __m256i n = _mm256_cvtps_epi32(_mm256_sub_ps(fx, one));  // 2^(n − 1)
  n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  const __m256 scale = _mm256_blendv_ps(_mm256_castsi256_ps(n), _mm256_setzero_ps(), underflow);
  return _mm256_mul_ps(_mm256_mul_ps(p, scale), two);
}

inline Vec load_bf16(const uint16_t* p) {  // 8 bf16 values as floats
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// ATen's float → bf16 on 8 lanes (vec256_bfloat16.h, cvtfp32_bf16): round to nearest even,
// NaN to 0xffff.
inline __m256i to_bf16x8(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  __m256i t = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(t, _mm256_set1_epi32(0x7fff)), u), 16);
  const __m256 ordered = _mm256_cmp_ps(a, a, _CMP_ORD_Q);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), t, _mm256_castps_si256(ordered));
}

constexpr int64_t BF16_CHUNK = 16;  // ATen's Vectorized<BFloat16>::size(): converted together

inline void to_bf16_chunk(const float* src, uint16_t* dst) {
  const __m256i lo = to_bf16x8(_mm256_loadu_ps(src)), hi = to_bf16x8(_mm256_loadu_ps(src + 8));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}

#else

// ATen's generic Vectorized<float> (vec_base.h): 32 bytes of floats, each operation lane by lane
// (exp_u20 and tanh are std::exp and std::tanh there), fmadd a·b + c.
struct Vec {
  float v[8];
  static constexpr int64_t size() { return 8; }
  Vec() : v{} {}
  Vec(float value) {
    for (float& lane : v) lane = value;
  }
  static Vec loadu(const float* p, int64_t count = size()) {  // lanes count.. zero
    Vec out;
    std::memcpy(out.v, p, std::min<int64_t>(count, size()) * sizeof(float));
    return out;
  }
  void store(float* p, int64_t count = size()) const {
    std::memcpy(p, v, std::min<int64_t>(count, size()) * sizeof(float));
  }
  static Vec set(const Vec& a, const Vec& b, int64_t count) {  // b's lanes below count, a's after
    Vec out;
    for (int64_t i = 0; i < size(); ++i) out.v[i] = i < count ? b.v[i] : a.v[i];
    return out;
  }
  template <class F>
  Vec map(F f) const {
    Vec out;
    for (int64_t i = 0; i < size(); ++i) out.v[i] = f(v[i]);
    return out;
  }
  Vec neg() const {
    return map([](float x) { return -x; });
  }
  Vec exp_u20() const {
    return map([](float x) { return std::exp(x); });
  }
  Vec tanh() const {
    return map([](float x) { return std::tanh(x); });
  }
};

#define VEC_LANEWISE(op)                                                 \
  inline Vec operator op(const Vec& a, const Vec& b) {                   \
    Vec out;                                                             \
    for (int64_t i = 0; i < Vec::size(); ++i) out.v[i] = a.v[i] op b.v[i]; \
    return out;                                                          \
  }
VEC_LANEWISE(+)
VEC_LANEWISE(-)
VEC_LANEWISE(*)
VEC_LANEWISE(/)
#undef VEC_LANEWISE

inline Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return a * b + c; }

inline Vec load_bf16(const uint16_t* p) {
  Vec out;
  for (int64_t i = 0; i < Vec::size(); ++i) out.v[i] = blocks::from_bf16(p[i]);
  return out;
}

constexpr int64_t BF16_CHUNK = 0;  // no vector conversion: every value through to_bf16

inline void to_bf16_chunk(const float*, uint16_t*) {}

#endif

// count ≤ Vec::size() bf16 values as floats, the lanes after them zero.
inline Vec load_bf16(const uint16_t* p, int64_t count) {
  if (count == Vec::size()) return load_bf16(p);
  float part[Vec::size()] = {0.f};
  for (int64_t i = 0; i < count; ++i) part[i] = blocks::from_bf16(p[i]);
  return Vec::loadu(part);
}

// at::vec::convert(const float*, BFloat16*, n): whole chunks vectorized, the rest one at a time
// (torch's BFloat16(float): NaN to 0x7FC0).
inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  if (BF16_CHUNK > 0)
    for (; i + BF16_CHUNK <= n; i += BF16_CHUNK) to_bf16_chunk(src + i, dst + i);
  for (; i < n; ++i) dst[i] = blocks::to_bf16(src[i]);
}

inline void from_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = blocks::from_bf16(src[i]);
}

}  // namespace vec
