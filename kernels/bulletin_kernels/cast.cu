// Exact cast of a whole tensor to the served dtype (kernels.cuda.cast), for keyframes
// and the first version; diffs use the fused cast in diff.cu. The element-wise rules
// and their NumPy twin: kernels/bulletin_kernels/common.cuh, patcher/cast.py.

#include "common.cuh"

namespace bulletin {

template <typename Op>
__device__ __forceinline__ void cast_impl(const u32* __restrict__ src, u16* __restrict__ dst,
                                          u64 n) {
  // Element-wise grid-stride: adjacent threads touch adjacent elements, so loads and
  // stores coalesce whatever the alignment of either array.
  const u64 stride = static_cast<u64>(gridDim.x) * kBlock;
  for (u64 i = static_cast<u64>(blockIdx.x) * kBlock + threadIdx.x; i < n; i += stride) {
    dst[i] = Op::apply(src[i]);
  }
}

}  // namespace bulletin

using namespace bulletin;

extern "C" __global__ void __launch_bounds__(kBlock)
    cast_f32_bf16(const u32* __restrict__ src, u16* __restrict__ dst, u64 n) {
  cast_impl<CastF32ToBF16>(src, dst, n);
}

extern "C" __global__ void __launch_bounds__(kBlock)
    cast_f32_f16(const u32* __restrict__ src, u16* __restrict__ dst, u64 n) {
  cast_impl<CastF32ToF16>(src, dst, n);
}
