// csrc/blocks.h without torch: every variant compiled in against the scalar reference, bit for bit,
// on seeded random weights and activations (the same on every machine: a fixed LCG), for each
// layout, number of zeros, output type and row count. Prints "<isa> <cases> <checksum>": the
// checksum of every output, which must agree across instruction sets (tests/test_kernels.py runs
// it natively and, where a cross-compiler and qemu are at hand, for ARM).
#include <cstdio>
#include <vector>

#include "../../constrained_spec/model/csrc/blocks.h"

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;
uint32_t next() {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<uint32_t>(state >> 32);
}
float uniform() { return static_cast<float>(next() >> 8) / 16777216.f * 2.f - 1.f; }  // [−1, 1)

uint64_t checksum = 1469598103934665603ull;
template <typename T>
void mix(const std::vector<T>& values) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(values.data());
  for (size_t i = 0; i < values.size() * sizeof(T); ++i) checksum = (checksum ^ bytes[i]) * 1099511628211ull;
}

template <typename Out>
bool run(int bits, int zeros, int64_t n, int64_t tiles, int64_t K) {
  const int64_t groups = K / blocks::GROUP, lanes = K * bits / 32;
  std::vector<uint32_t> weights(tiles * lanes * blocks::LANES);
  for (auto& w : weights) w = next();
  std::vector<uint16_t> scales(tiles * groups * (1 + zeros) * blocks::LANES);
  for (auto& s : scales) s = blocks::to_bf16(uniform() * 0.05f);
  std::vector<float> x(n * K);
  for (auto& v : x) v = uniform() * (next() % 7 == 0 ? 8.f : 1.f);  // some large inputs
  if (n > 1)
    for (int64_t k = 0; k < blocks::GROUP; ++k) x[K + k] = 0.f;  // a group of zeros (d = 0)
  std::vector<int8_t> q(n * K);
  std::vector<float> d(n * groups), dsum(n * groups);
  std::vector<int32_t> sum(n * groups);
  for (int64_t r = 0; r < n; ++r)
    blocks::quantize_row(&x[r * K], K, &q[r * K], &d[r * groups], &sum[r * groups], &dsum[r * groups]);
  const blocks::Acts acts{q.data(), d.data(), sum.data(), dsum.data(), K};
  const int64_t N = tiles * blocks::LANES;
  std::vector<Out> fast(n * N), reference(n * N);
  blocks::columns(bits, zeros, weights.data(), scales.data(), acts, n, 0, tiles, fast.data(), N);
  blocks::columns(bits, zeros, weights.data(), scales.data(), acts, n, 0, tiles, reference.data(), N, true);
  mix(q);
  mix(reference);
  for (int64_t i = 0; i < n * N; ++i)
    if (std::memcmp(&fast[i], &reference[i], sizeof(Out)) != 0) {
      std::printf("MISMATCH bits %d zeros %d rows %lld output %lld\n", bits, zeros, static_cast<long long>(n),
                  static_cast<long long>(i));
      return false;
    }
  return true;
}

}  // namespace

int main() {
  int cases = 0;
  for (int layout = 0; layout < 4; ++layout) {  // 4-bit, 5-bit, 8-bit with one zero and two
    const int bits = layout == 0 ? 4 : layout == 1 ? 5 : 8, zeros = layout == 0 || layout == 2 ? 1 : 2;
    for (int64_t n = 1; n <= 9; ++n)
      for (int64_t K : {32, 96, 576}) {
        if (!run<float>(bits, zeros, n, 3, K) || !run<uint16_t>(bits, zeros, n, 2, K)) return 1;
        cases += 2;
      }
  }
  std::printf("%s %d %016llx\n", blocks::isa(), cases, static_cast<unsigned long long>(checksum));
  return 0;
}
