// CUDA strided copy with a fused dtype cast: the one kernel behind every resharding op.
//
// rl3d.ops.views reduces pack/unpack, gather_to_layout and strided copies to [batch, row, col]
// blocks with arbitrary element strides; this file runs one block. Rows of a warp or more go to a
// row-tiled kernel (one tile = a slice of one row, threads walk its columns); short rows go to an
// element-wise kernel. Where columns are contiguous and aligned, each thread moves 16-byte
// vectors (the widest load a thread can issue), which is what reaching copy bandwidth takes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "strided_copy.h"

namespace rl3d {
namespace {

constexpr int kThreads = 256;
constexpr int kColsPerThread = 8;
constexpr int kTileCols = kThreads * kColsPerThread;
constexpr int64_t kMaxBlocks = 1 << 20;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename Dst>
__device__ __forceinline__ Dst from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename Src, typename Dst>
struct Cast {
  // Through fp32, like torch: exact for the widening half, one round-to-nearest-even for the rest.
  __device__ __forceinline__ static Dst apply(Src x) { return from_float<Dst>(to_float(x)); }
};
template <typename T>
struct Cast<T, T> {
  __device__ __forceinline__ static T apply(T x) { return x; }
};

struct Block {
  int64_t batches, rows, cols;  // cols in vectors of N elements where N > 1
  int64_t src_batch, src_row, src_col;
  int64_t dst_batch, dst_row, dst_col;
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Vector {
  T lanes[N];
};

// N > 1: columns are contiguous on both sides and a "column" is a vector of N elements.
template <typename Src, typename Dst, int N>
__global__ void row_tiled_copy(const Src* __restrict__ src, Dst* __restrict__ dst, Block b, int64_t col_tiles,
                               int64_t num_tiles) {
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t col_tile = tile % col_tiles;
    const int64_t line = tile / col_tiles;  // batch * rows + row
    const int64_t row = line % b.rows;
    const int64_t batch = line / b.rows;
    const Src* src_row = src + batch * b.src_batch + row * b.src_row;
    Dst* dst_row = dst + batch * b.dst_batch + row * b.dst_row;
    const int64_t col_end = min(b.cols, (col_tile + 1) * kTileCols);
    for (int64_t col = col_tile * kTileCols + threadIdx.x; col < col_end; col += kThreads) {
      if constexpr (N == 1) {
        dst_row[col * b.dst_col] = Cast<Src, Dst>::apply(src_row[col * b.src_col]);
      } else {
        const Vector<Src, N> in = reinterpret_cast<const Vector<Src, N>*>(src_row)[col];
        Vector<Dst, N> out;
#pragma unroll
        for (int lane = 0; lane < N; ++lane) out.lanes[lane] = Cast<Src, Dst>::apply(in.lanes[lane]);
        reinterpret_cast<Vector<Dst, N>*>(dst_row)[col] = out;
      }
    }
  }
}

template <typename Src, typename Dst>
__global__ void elementwise_copy(const Src* __restrict__ src, Dst* __restrict__ dst, Block b, int64_t numel) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < numel; i += int64_t(gridDim.x) * kThreads) {
    const int64_t col = i % b.cols;
    const int64_t row = (i / b.cols) % b.rows;
    const int64_t batch = i / (b.cols * b.rows);
    dst[batch * b.dst_batch + row * b.dst_row + col * b.dst_col] =
        Cast<Src, Dst>::apply(src[batch * b.src_batch + row * b.src_row + col * b.src_col]);
  }
}

int64_t capped_grid(int64_t needed) { return needed < kMaxBlocks ? needed : kMaxBlocks; }

template <typename Src, typename Dst, int N>
cudaError_t launch_rows(const CopyBlock& c, const Block& b, cudaStream_t stream) {
  const int64_t col_tiles = (b.cols + kTileCols - 1) / kTileCols;
  const int64_t num_tiles = col_tiles * b.rows * b.batches;
  row_tiled_copy<Src, Dst, N><<<capped_grid(num_tiles), kThreads, 0, stream>>>(
      static_cast<const Src*>(c.src), static_cast<Dst*>(c.dst), b, col_tiles, num_tiles);
  return cudaGetLastError();
}

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Whether N-element vectors tile every row on both sides: unit column strides, N | cols, and
// every row start aligned to a whole vector.
bool vectorizable(const CopyBlock& c, int64_t n) {
  if (c.src_strides[2] != 1 || c.dst_strides[2] != 1 || c.sizes[2] % n != 0) return false;
  if (!aligned(c.src, n * c.src_element_size) || !aligned(c.dst, n * c.dst_element_size)) return false;
  for (int d = 0; d < 2; ++d) {
    if (c.sizes[d] != 1 && (c.src_strides[d] % n != 0 || c.dst_strides[d] % n != 0)) return false;
  }
  return true;
}

template <typename Src, typename Dst>
cudaError_t launch_typed(const CopyBlock& c, cudaStream_t stream) {
  const Block b{c.sizes[0],       c.sizes[1],       c.sizes[2],       c.src_strides[0], c.src_strides[1],
                c.src_strides[2], c.dst_strides[0], c.dst_strides[1], c.dst_strides[2]};
  // 16-byte accesses on the wider side: 4 x fp32 -> 4 x bf16, 8 x bf16 -> 8 x bf16, ...
  constexpr int N = 16 / (sizeof(Src) > sizeof(Dst) ? sizeof(Src) : sizeof(Dst));
  if (N > 1 && vectorizable(c, N)) {
    Block vectors = b;  // row and batch strides stay in elements: they locate each row's start
    vectors.cols = b.cols / N;
    return launch_rows<Src, Dst, N>(c, vectors, stream);
  }
  if (b.cols >= 32) return launch_rows<Src, Dst, 1>(c, b, stream);
  const int64_t numel = b.batches * b.rows * b.cols;
  elementwise_copy<Src, Dst><<<capped_grid((numel + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const Src*>(c.src), static_cast<Dst*>(c.dst), b, numel);
  return cudaGetLastError();
}

cudaError_t launch_raw(const CopyBlock& c, cudaStream_t stream) {
  switch (c.src_element_size) {
    case 1: return launch_typed<uint8_t, uint8_t>(c, stream);
    case 2: return launch_typed<uint16_t, uint16_t>(c, stream);
    case 4: return launch_typed<uint32_t, uint32_t>(c, stream);
    case 8: return launch_typed<uint64_t, uint64_t>(c, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename Src>
cudaError_t launch_from(const CopyBlock& c, cudaStream_t stream) {
  switch (c.dst_kind) {
    case kFloat32: return launch_typed<Src, float>(c, stream);
    case kFloat16: return launch_typed<Src, __half>(c, stream);
    case kBFloat16: return launch_typed<Src, __nv_bfloat16>(c, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int launch_strided_copy(const CopyBlock& c, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  if (c.sizes[0] * c.sizes[1] * c.sizes[2] == 0) return 0;
  if (c.src_kind == c.dst_kind && c.src_element_size == c.dst_element_size) return launch_raw(c, stream);
  switch (c.src_kind) {
    case kFloat32: return launch_from<float>(c, stream);
    case kFloat16: return launch_from<__half>(c, stream);
    case kBFloat16: return launch_from<__nv_bfloat16>(c, stream);
    default: return cudaErrorInvalidValue;
  }
}

const char* launch_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace rl3d
