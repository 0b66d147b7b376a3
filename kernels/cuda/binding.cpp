// torch binding of the CUDA strided copy: rl3d.ops.cuda_ext hands it [batch, row, col] blocks
// planned by rl3d.ops.views, together with the current CUDA stream as an integer handle.

#include <torch/extension.h>

#include <vector>

#include "strided_copy.h"

namespace {

int element_kind(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return rl3d::kFloat32;
    case at::kHalf: return rl3d::kFloat16;
    case at::kBFloat16: return rl3d::kBFloat16;
    default: return rl3d::kRawBits;
  }
}

void strided_copy(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& sizes,
                  const std::vector<int64_t>& src_strides, const std::vector<int64_t>& dst_strides,
                  int64_t stream) {
  TORCH_CHECK(src.is_cuda() && dst.is_cuda(), "rl3d strided_copy: tensors must be on CUDA");
  TORCH_CHECK(sizes.size() == 3 && src_strides.size() == 3 && dst_strides.size() == 3,
              "rl3d strided_copy: sizes and strides must have 3 entries");
  const int src_kind = element_kind(src.scalar_type());
  const int dst_kind = element_kind(dst.scalar_type());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() || (src_kind != rl3d::kRawBits && dst_kind != rl3d::kRawBits),
              "rl3d strided_copy: casts only between float32, float16 and bfloat16, got ", src.scalar_type(),
              " -> ", dst.scalar_type());
  rl3d::CopyBlock block{};
  block.src = src.data_ptr();
  block.dst = dst.data_ptr();
  for (int d = 0; d < 3; ++d) {
    block.sizes[d] = sizes[d];
    block.src_strides[d] = src_strides[d];
    block.dst_strides[d] = dst_strides[d];
  }
  block.src_kind = src_kind;
  block.dst_kind = dst_kind;
  block.src_element_size = static_cast<int>(src.element_size());
  block.dst_element_size = static_cast<int>(dst.element_size());
  const int code = rl3d::launch_strided_copy(block, reinterpret_cast<void*>(stream));
  TORCH_CHECK(code == 0, "rl3d strided_copy: ", rl3d::launch_error_string(code));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("strided_copy", &strided_copy, "dst[b, i, j] = cast(src[b, i, j]) over one [batch, row, col] block",
        pybind11::arg("src"), pybind11::arg("dst"), pybind11::arg("sizes"), pybind11::arg("src_strides"),
        pybind11::arg("dst_strides"), pybind11::arg("stream"));
}
