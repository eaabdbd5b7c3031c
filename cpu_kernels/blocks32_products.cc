// The products of the 32-weight block formats as stored (Q8_0, Q4_0, Q4_1): one of the units the kernels' build
// compiles side by side (format_products.h).

#include "format_products.h"

namespace jvllm {

JVLLM_FORMAT_PRODUCTS(, Q8_0)
JVLLM_FORMAT_PRODUCTS(, Q4_0)
JVLLM_FORMAT_PRODUCTS(, Q4_1)

}  // namespace jvllm
