#include "api/accumulate.h"

#include <string>
#include <vector>

#include "api/check.h"
#include "reference/accumulate.h"
#ifdef SPARSEATTN_WITH_CUDA
#include "cuda/accumulate/ops.h"
#endif

namespace sparseattn::detail {

void accumulate(const AccumulateParams& params) {
  const Check check("accumulate");
  const TensorView& out = params.out;
  check.present(out, "out");
  check.floating(out, "out");
  check.inner_contiguous(out, "out");
  const std::vector<std::int64_t> shape = shape_of(out);
  for (std::size_t i = 0; i < params.terms.size(); ++i) {
    const std::string arg = "terms[" + std::to_string(i) + "]";
    check.tensor(params.terms[i], arg, out.dtype, out, "out");
    check.shape(params.terms[i], arg, shape);
  }
  if (params.cu_seqlens.present()) {
    check.tensor(params.cu_seqlens, "cu_seqlens", DType::int32, out, "out");
    check.require(params.cu_seqlens.rank == 1 && params.cu_seqlens.shape[0] >= 1, ErrorKind::shape, "cu_seqlens",
                  "expected shape [B+1], got " + params.cu_seqlens.shape_string());
    if (params.cu_seqlens.device == DeviceType::cpu) {
      const TensorView& cu = params.cu_seqlens;
      const std::int32_t last = static_cast<const std::int32_t*>(cu.data)[(cu.shape[0] - 1) * cu.stride[0]];
      check.require(0 <= last && last <= out.shape[0], ErrorKind::value, "cu_seqlens",
                    "last entry " + std::to_string(last) + " is outside the " + std::to_string(out.shape[0]) +
                        " rows of 'out'");
    }
  }
  switch (backend(check, out, "out", kCudaBuilt)) {
    case Backend::cpu: reference::accumulate(params); break;
    case Backend::cuda:
      check.require(params.terms.size() <= kMaxAccumulateTerms, ErrorKind::unsupported, "terms",
                    "at most " + std::to_string(kMaxAccumulateTerms) + " terms per call on CUDA");
      check.inner_contiguous(params.cu_seqlens, "cu_seqlens");
#ifdef SPARSEATTN_WITH_CUDA
      cuda::accumulate(params);
#endif
      break;
  }
}

}  // namespace sparseattn::detail
