// tests/ops/test_cpu_adam_builds.py compiles this with each of the CPU Adam kernel's flag sets and compares the
// bytes it writes: kernels/cpu_adam_bf16.cpp's step over an odd length (the padded last vector), at shard offsets
// whose vectors cross 2^32 (the inner hash's carry), with a NaN gradient, the weights' copy and its extrapolation.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu_adam_bf16.h"

int main(int argc, char** argv) {
  using namespace toolkit_cpu_adam;
  if (argc != 2) return 2;
  const int64_t n = 100003;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> p(n), m(n, 0), v(n, 0), out(n);
  for (auto& x : p) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    x = static_cast<uint16_t>(bits >> 16);
  }
  std::vector<float> g(n);
  FILE* file = std::fopen(argv[1], "wb");
  if (file == nullptr) return 2;
  const int64_t offsets[] = {5000, (int64_t{1} << 32) - 37, 3 * (int64_t{1} << 32) - 5};
  for (int step = 1; step <= 6; ++step) {
    for (auto& x : g) x = normal(rng) * (step % 3 == 0 ? 1e-3f : 1.0f);
    g[17] = std::numeric_limits<float>::quiet_NaN();
    Bf16StepScalars s{};
    s.decay = 1.0f - 1e-3f * 0.1f;
    s.one_minus_beta1 = 0.1f;
    s.beta2 = 0.95f;
    s.one_minus_beta2 = 0.05f;
    s.bc2_sqrt = std::sqrt(1.0f - std::pow(0.95f, static_cast<float>(step)));
    s.eps = 1e-8f;
    s.neg_step_size = -1e-3f / (1.0f - std::pow(0.9f, static_cast<float>(step)));
    s.step_key = rounding_step_key(1234, step);
    s.offset = offsets[step % 3];
    s.extrapolate = step % 2 == 0;
    adamw_bf16_states(p.data(), g.data(), m.data(), v.data(), step == 1 ? nullptr : out.data(), n, s);
    for (const auto* a : {&p, &m, &v, &out}) std::fwrite(a->data(), sizeof(uint16_t), n, file);
  }
  return std::fclose(file) == 0 ? 0 : 2;
}
