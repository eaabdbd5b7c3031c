// The products of the K-quant formats Q4_K and Q5_K: one of the units the kernels' build compiles side by side
// (format_products.h).

#include "format_products.h"

namespace jvllm {

JVLLM_FORMAT_PRODUCTS(, Q4_K)
JVLLM_FORMAT_PRODUCTS(, Q5_K)

}  // namespace jvllm
