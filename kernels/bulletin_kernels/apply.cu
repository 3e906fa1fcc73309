// Rollout side: apply a patch in place (kernels.cuda.apply_delta).
//
// check_indices runs first and only reads: it flags any index outside [0, n) or not
// strictly above its predecessor, so that apply_* (launched only when the flag stayed
// clear) never writes outside the tensor and never touches one element twice (which is
// what makes its plain loads and stores race-free).
//
// apply_*: for each change k, old = bits[i], new = old + delta[k] (wrapping in the
// element's width), bits[i] = new, and the block sums H(i, new) - H(i, old); one 64-bit
// atomicAdd per block makes the total exact mod 2**64.

#include "common.cuh"

namespace bulletin {

template <typename T>
__device__ __forceinline__ void apply_impl(T* __restrict__ bits, const i64* __restrict__ index,
                                           const T* __restrict__ delta, u64 m,
                                           u64* __restrict__ fp_change) {
  const u64 stride = static_cast<u64>(gridDim.x) * kBlock;
  u64 acc = 0;
  for (u64 k = static_cast<u64>(blockIdx.x) * kBlock + threadIdx.x; k < m; k += stride) {
    const u64 i = static_cast<u64>(index[k]);
    const T old = bits[i];
    const T now = static_cast<T>(old + delta[k]);
    bits[i] = now;
    acc += element_hash(i, now) - element_hash(i, old);
  }
  block_add(acc, fp_change);
}

}  // namespace bulletin

using namespace bulletin;

// Sets *bad (a plain store of the same value from any number of threads is benign)
// when some index is out of [0, n) or the sequence is not strictly increasing.
extern "C" __global__ void __launch_bounds__(kBlock)
    check_indices(const i64* __restrict__ index, u64 m, i64 n, u32* __restrict__ bad) {
  const u64 stride = static_cast<u64>(gridDim.x) * kBlock;
  for (u64 k = static_cast<u64>(blockIdx.x) * kBlock + threadIdx.x; k < m; k += stride) {
    const i64 i = index[k];
    if (i < 0 || i >= n || (k > 0 && index[k - 1] >= i)) *bad = 1u;
  }
}

#define BULLETIN_APPLY_KERNEL(SUFFIX, T)                                                    \
  extern "C" __global__ void __launch_bounds__(kBlock)                                      \
      apply_##SUFFIX(T* __restrict__ bits, const i64* __restrict__ index,                   \
                     const T* __restrict__ delta, u64 m, u64* __restrict__ fp_change) {     \
    apply_impl<T>(bits, index, delta, m, fp_change);                                        \
  }

BULLETIN_APPLY_KERNEL(u8, u8)
BULLETIN_APPLY_KERNEL(u16, u16)
BULLETIN_APPLY_KERNEL(u32, u32)
BULLETIN_APPLY_KERNEL(u64, u64)
