// SplitMix64, the data pipeline's random generator (sampler order, random tokens, MLM masks).
// Tiny, and its output is fixed by its definition, unlike std::shuffle's or
// std::uniform_int_distribution's, which differ between standard libraries: every rank and
// every machine must draw the same numbers.
#pragma once

#include <cstdint>

namespace gpt2 {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  // The seed of an independent stream `stream` (an epoch, a sample) under `seed`: one
  // SplitMix64 step of the seed, xor an odd multiple of the stream, so nearby seeds and
  // streams stay apart.
  static uint64_t stream_seed(uint64_t seed, uint64_t stream) {
    return SplitMix64(seed).next() ^ stream * 0xd1b54a32d192ed03ull;
  }

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), without modulo bias.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    while (true) {
      const uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }
  // Uniform in [0, 1), from the top 53 bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

}  // namespace gpt2
