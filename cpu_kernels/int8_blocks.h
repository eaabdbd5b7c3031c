// x [M, K] quantized per block of 32 to int8 codes (scale max |x| / 127) with each block's exact sum, for the 8-bit
// products: int8_tiles.h (AVX-512 VNNI) and int8_code_tiles.h (AVX2) each quantize a block their own way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "line_aligned.h"
#include "run_items.h"

namespace jvllm {

struct Int8Blocks {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scales;  // [M, K / 32]
  std::vector<float> sums;    // [M, K / 32]

 protected:
  static constexpr int64_t kBlocksPerItem = 1 << 11;  // 256 KB of x

  // Sizes the arrays for x [m, k], then runs quantize(b) for every block b, kBlocksPerItem blocks an item, shared by
  // the caller and the helper threads.
  template <typename QuantizeBlock>
  void QuantizeBlocks(int64_t m, int64_t k, const QuantizeBlock& quantize) {
    GrowTo(codes, static_cast<size_t>(m * k));
    GrowTo(scales, static_cast<size_t>(m * k / 32));
    GrowTo(sums, static_cast<size_t>(m * k / 32));
    struct Items {
      int64_t total;
      const QuantizeBlock& quantize;
      int64_t num_items() const { return (total + kBlocksPerItem - 1) / kBlocksPerItem; }
      void Run(int64_t item) const {
        const int64_t end = std::min(total, (item + 1) * kBlocksPerItem);
        for (int64_t b = item * kBlocksPerItem; b < end; ++b) quantize(b);
      }
    };
    RunItems(Items{m * k / 32, quantize});
  }
};

}  // namespace jvllm
