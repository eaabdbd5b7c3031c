// The products of the K-quant formats (Q4_K, Q5_K, Q6_K): compiled apart from the 32-weight blocks' so that the
// kernels' build runs both at once (format_products.h).

#include "format_products.h"

namespace jvllm {

JVLLM_FORMAT_PRODUCTS(, Q4_K)
JVLLM_FORMAT_PRODUCTS(, Q5_K)
JVLLM_FORMAT_PRODUCTS(, Q6_K)

}  // namespace jvllm
