// The products of the block formats are compiled in translation units of their own (blocks32_products.cc: Q8_0,
// Q4_0, Q4_1; interleaved_format_products.cc and word_group_format_products.cc: the same in their 8- and 16-row
// layouts; kquant_products.cc: Q4_K, Q5_K; q6k_products.cc: Q6_K), which the kernels' build runs side by side:
// instantiating every format's paths is most of the build (~4-8 s a format on the 2-core VM). A unit that calls
// them includes this header, which declares them instead of instantiating them again.
#pragma once

#include <cstdint>

#include "block_formats.h"
#include "product_paths.h"

// `prefix` empty: the explicit instantiations (in the units above); `extern`: their declarations.
#define JVLLM_FORMAT_PRODUCTS(prefix, Fmt)                                                             \
  prefix template void RunProduct<Fmt>(Shapes, const float*, const uint8_t*, float*, const RowPaths&); \
  prefix template void RunGatedProduct<Fmt>(Shapes, const float*, const uint8_t*, const uint8_t*, float*, \
                                            const RowPaths&);

namespace jvllm {

JVLLM_FORMAT_PRODUCTS(extern, Q8_0)
JVLLM_FORMAT_PRODUCTS(extern, Q4_0)
JVLLM_FORMAT_PRODUCTS(extern, Q4_1)
JVLLM_FORMAT_PRODUCTS(extern, Q4_K)
JVLLM_FORMAT_PRODUCTS(extern, Q5_K)
JVLLM_FORMAT_PRODUCTS(extern, Q6_K)
#if defined(__AVX2__)
JVLLM_FORMAT_PRODUCTS(extern, Q4_0x8)
JVLLM_FORMAT_PRODUCTS(extern, Q4_1x8)
JVLLM_FORMAT_PRODUCTS(extern, Q8_0x8)
#endif
#if JVLLM_WORD_GROUPS
JVLLM_FORMAT_PRODUCTS(extern, Q4_0x16)
JVLLM_FORMAT_PRODUCTS(extern, Q4_1x16)
JVLLM_FORMAT_PRODUCTS(extern, Q8_0x16)
#endif

}  // namespace jvllm
