// The products of the K-quant format Q6_K: one of the units the kernels' build compiles side by side
// (format_products.h).

#include "format_products.h"

namespace jvllm {

JVLLM_FORMAT_PRODUCTS(, Q6_K)

}  // namespace jvllm
