// Full fingerprint of a tensor's bits (kernels.cuda.fingerprint); the normative
// definition and the NumPy twin are in patcher/fingerprint.py.
//
// Grid-stride over groups of eight elements with vector loads. `head` (< 8) elements
// before the first aligned group and the < 8 elements after the last one are hashed one
// by one; kernels/bulletin_kernels/cuda.py computes `head` from the array's address. Each block adds its
// sum with one 64-bit atomicAdd, which is exact mod 2**64 in any order.

#include "common.cuh"

namespace bulletin {

template <typename T>
__device__ __forceinline__ void fingerprint_impl(const T* __restrict__ bits, u64 n, u64 head,
                                                 u64* __restrict__ out) {
  const u64 tid = static_cast<u64>(blockIdx.x) * kBlock + threadIdx.x;
  const u64 stride = static_cast<u64>(gridDim.x) * kBlock;
  const u64 body_groups = (n - head) / 8;
  const u64 tail = head + body_groups * 8;
  u64 acc = 0;
  if (tid < head) acc += element_hash(tid, bits[tid]);
  if (tid < n - tail) acc += element_hash(tail + tid, bits[tail + tid]);
  for (u64 g = tid; g < body_groups; g += stride) {
    const u64 i0 = head + g * 8;
    const Vec8<T> v = load8(bits + i0);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc += element_hash(i0 + j, v.v[j]);
  }
  block_add(acc, out);
}

}  // namespace bulletin

using namespace bulletin;

#define BULLETIN_FINGERPRINT_KERNEL(SUFFIX, T)                                              \
  extern "C" __global__ void __launch_bounds__(kBlock)                                      \
      fingerprint_##SUFFIX(const T* __restrict__ bits, u64 n, u64 head,                     \
                           u64* __restrict__ out) {                                         \
    fingerprint_impl<T>(bits, n, head, out);                                                \
  }

BULLETIN_FINGERPRINT_KERNEL(u8, u8)
BULLETIN_FINGERPRINT_KERNEL(u16, u16)
BULLETIN_FINGERPRINT_KERNEL(u32, u32)
BULLETIN_FINGERPRINT_KERNEL(u64, u64)
