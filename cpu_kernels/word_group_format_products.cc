// The products of the 32-weight block formats grouped by code words for 16 rows (AVX-512 builds): one of the units
// the kernels' build compiles side by side (format_products.h).

#include "format_products.h"

namespace jvllm {

#if JVLLM_WORD_GROUPS
JVLLM_FORMAT_PRODUCTS(, Q4_0x16)
JVLLM_FORMAT_PRODUCTS(, Q4_1x16)
JVLLM_FORMAT_PRODUCTS(, Q8_0x16)
#endif

}  // namespace jvllm
