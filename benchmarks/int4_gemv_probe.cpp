// A probe, not part of the package: a 4-bit weight-only matrix-vector product of our own with
// AVX-512 BF16 dot products, against torch's _weight_int4pack_mm_for_cpu (benchmarks/
// int4_gemv_probe.py runs both; docs/measurements.md, "round 3"). Weights are repacked 16 output
// rows × one input pair per 16 bytes; a nibble q becomes the bf16 number 128 + q by OR-ing 0x4300
// into its 16-bit lane, so vdpbf16ps sums (128 + q)·x in float32 and the group's epilogue takes
// 136·Σx away (w = (q − 8)·scale + zero). Scales stay float32; the output is not rounded.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
using at::Tensor;

// packed (N/16, K/2, 16) uint8: byte i of (b, j) = q[16b+i, 2j] | q[16b+i, 2j+1] << 4
// sz (N/16, K/32, 2, 16) float: scale, zero of rows 16b..16b+15, group g;  w = (q-8)*s + z
// x (K) bf16 -> y (N) float
Tensor gemv(const Tensor& x, const Tensor& packed, const Tensor& sz) {
  const int64_t K = x.size(0), blocks = packed.size(0), N = blocks * 16, groups = K / 32;
  Tensor y = at::empty({N}, at::kFloat);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> X(groups);
  const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
  for (int64_t g = 0; g < groups; ++g) { float s = 0; for (int k = 0; k < 32; ++k) s += float(xb[g*32+k]); X[g] = s; }
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const float* SZ = sz.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const __m512i low = _mm512_set1_epi32(0xF), bias = _mm512_set1_epi32(0x43004300);
    for (int64_t b = b0; b < b1; ++b) {
      __m512 out = _mm512_setzero_ps();
      const uint8_t* pb = P + b * (K / 2) * 16;
      const float* szb = SZ + b * groups * 32;
      for (int64_t g = 0; g < groups; ++g) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t j = 0; j < 16; ++j) {
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + (g * 16 + j) * 16)));
          __m512i w = _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(v, low), _mm512_slli_epi32(_mm512_srli_epi32(v, 4), 16)), bias);
          a = _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)_mm512_set1_epi32(xp[g * 16 + j]));
        }
        __m512 s = _mm512_loadu_ps(szb + g * 32), z = _mm512_loadu_ps(szb + g * 32 + 16);
        __m512 Xg = _mm512_set1_ps(X[g]);
        out = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(_mm512_set1_ps(136.f), Xg, a), out);
        out = _mm512_fmadd_ps(z, Xg, out);
      }
      _mm512_storeu_ps(Y + b * 16, out);
    }
  });
  return y;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv", &gemv); }
