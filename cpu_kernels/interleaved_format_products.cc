// The products of the 32-weight block formats interleaved by groups of 8 rows (AVX2 builds): one of the units the
// kernels' build compiles side by side (format_products.h).

#include "format_products.h"

namespace jvllm {

#if defined(__AVX2__)
JVLLM_FORMAT_PRODUCTS(, Q4_0x8)
JVLLM_FORMAT_PRODUCTS(, Q4_1x8)
JVLLM_FORMAT_PRODUCTS(, Q8_0x8)
#endif

}  // namespace jvllm
