// Plain-pointer entry point of the CUDA strided copy, so that strided_copy.cu builds with nvcc
// alone (no torch headers) and only binding.cpp sees torch.
#pragma once

#include <cstdint>

namespace rl3d {

// How an element is read and written. kRawBits copies bytes unchanged and needs equal types.
enum ElementKind : int { kRawBits = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

struct CopyBlock {
  const void* src;
  void* dst;
  int64_t sizes[3];        // [batch, row, col]
  int64_t src_strides[3];  // in elements
  int64_t dst_strides[3];
  int src_kind;
  int dst_kind;
  int src_element_size;
  int dst_element_size;
};

// Launches dst[b, i, j] = cast(src[b, i, j]) on `stream` (a cudaStream_t). Returns 0 or a CUDA
// error code; `launch_error_string` turns a code into a message.
int launch_strided_copy(const CopyBlock& block, void* stream);
const char* launch_error_string(int code);

}  // namespace rl3d
