#include "sparseattn/create_mask.h"

#include <string>

#include "api/check.h"
#include "reference/reference.h"

namespace sparseattn {

void create_mask(const CreateMaskParams& params) {
  const detail::Check check("create_mask");
  const TensorView& bias = params.bias;
  check.present(bias, "bias");
  check.floating(bias, "bias");
  check.inner_contiguous(bias, "bias");
  check.require(bias.rank == 4, ErrorKind::shape, "bias", "expected 4 dimensions [B, H, T, S], got " + bias.shape_string());
  const std::int64_t batch = bias.shape[0], keys = bias.shape[3];
  check.tensor(params.mask, "mask", DType::boolean, bias, "bias");
  check.shape(params.mask, "mask", detail::shape_of(bias));
  if (params.key_padding_mask.present()) {
    check.tensor(params.key_padding_mask, "key_padding_mask", DType::boolean, bias, "bias");
    check.shape(params.key_padding_mask, "key_padding_mask", {batch, keys});
  }
  check.positive(params.keep, "keep");
  switch (detail::backend(check, bias, "bias", /*has_cuda_kernels=*/false)) {
    case detail::Backend::cpu: reference::create_mask(params); break;
    case detail::Backend::cuda: break;  // unreachable: backend() raised ErrorKind::unsupported
  }
}

}  // namespace sparseattn
