// The products of the 32-weight block formats (Q8_0, Q4_0, Q4_1, and the same interleaved by groups of 8 rows or
// grouped by code words for 16):
// compiled apart from the K-quants' so that the kernels' build runs both at once (format_products.h).

#include "format_products.h"

namespace jvllm {

JVLLM_FORMAT_PRODUCTS(, Q8_0)
JVLLM_FORMAT_PRODUCTS(, Q4_0)
JVLLM_FORMAT_PRODUCTS(, Q4_1)
#if defined(__AVX2__)
JVLLM_FORMAT_PRODUCTS(, Q4_0x8)
JVLLM_FORMAT_PRODUCTS(, Q4_1x8)
JVLLM_FORMAT_PRODUCTS(, Q8_0x8)
#endif
#if JVLLM_WORD_GROUPS
JVLLM_FORMAT_PRODUCTS(, Q4_0x16)
JVLLM_FORMAT_PRODUCTS(, Q4_1x16)
JVLLM_FORMAT_PRODUCTS(, Q8_0x16)
#endif

}  // namespace jvllm
