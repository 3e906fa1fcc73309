// Device helpers shared by Bulletin's kernels.
//
// Every kernel source is self-contained apart from this header and uses no other header
// at all: kernels/bulletin_kernels/cuda.py pastes this file in place of its #include line and hands the
// text to NVRTC (through CuPy), which has no host standard headers, while
// scripts/check_kernels.py compiles the same text with nvcc. Hence the plain
// `unsigned long long` family instead of <cstdint>, and integer-only casts instead of
// cuda_bf16.h.
//
// Conventions: every kernel is launched with blockDim.x == kBlock; element counts and
// element indices are 64-bit (tensors of more than 2**31 elements are ordinary).

#ifndef BULLETIN_COMMON_CUH
#define BULLETIN_COMMON_CUH

namespace bulletin {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;
constexpr u32 kFullMask = 0xffffffffu;

// -- fingerprints (normative definition: patcher/fingerprint.py, docs/FORMAT.md) ------

constexpr u64 kIndexMul = 0x9E3779B97F4A7C15ull;
constexpr u64 kMix1 = 0xBF58476D1CE4E5B9ull;
constexpr u64 kMix2 = 0x94D049BB133111EBull;

// H(i, b) = splitmix64 finaliser of (i * K) ^ b, all mod 2**64.
__device__ __forceinline__ u64 element_hash(u64 i, u64 b) {
  u64 x = (i * kIndexMul) ^ b;
  x ^= x >> 30;
  x *= kMix1;
  x ^= x >> 27;
  x *= kMix2;
  x ^= x >> 31;
  return x;
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_down_sync(kFullMask, v, offset);
  }
  return v;
}

// Sum (mod 2**64) over the block; the result is valid in thread 0 only. Every thread of
// the block must call it, at most once per kernel (it owns one static shared array).
__device__ __forceinline__ u64 block_sum(u64 v) {
  __shared__ u64 partial[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  u64 total = 0;
  if (warp == 0) {
    total = warp_sum(lane < kWarps ? partial[lane] : 0ull);
  }
  return total;
}

// Adds a block's sum into *out. Unsigned wrap-around makes the atomic sum exactly the
// sum mod 2**64, independent of the order in which blocks land.
__device__ __forceinline__ void block_add(u64 v, u64* out) {
  const u64 total = block_sum(v);
  if (threadIdx.x == 0 && total != 0) atomicAdd(out, total);
}

// -- exact casts on bits (the NumPy twin is patcher/cast.py) -------------------------

// F32 -> BF16, round to nearest even; every NaN becomes 0xFFFF (torch's vectorised CPU
// answer). Adding 0x7FFF plus the lowest kept bit rounds ties to even in one step.
__device__ __forceinline__ u16 f32_to_bf16(u32 x) {
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
  return static_cast<u16>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// F32 -> F16, round to nearest even, subnormals kept, overflow to infinity; a NaN keeps
// its sign and top ten payload bits and becomes quiet (what F16C vcvtps2ph does).
__device__ __forceinline__ u16 f32_to_f16(u32 x) {
  const u32 sign = (x >> 16) & 0x8000u;
  const u32 a = x & 0x7fffffffu;
  u32 h;
  if (a > 0x7f800000u) {
    h = 0x7e00u | ((a >> 13) & 0x3ffu);
  } else if (a >= 0x477ff000u) {
    h = 0x7c00u;  // at or past the midpoint above 65504, or infinity
  } else if (a >= 0x38800000u) {
    const u32 r = a - 0x38000000u;  // rebias the exponent from 127 to 15
    h = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  } else {
    const u32 e = a >> 23;
    if (e < 102u) {
      h = 0;  // below 2**-25: rounds to zero (2**-25 itself ties to even, zero)
    } else {
      const u32 s = 126u - e;  // 14..24: value in units of 2**-24 is m >> s
      const u32 m = (a & 0x7fffffu) | 0x800000u;
      h = (m + (1u << (s - 1u)) - 1u + ((m >> s) & 1u)) >> s;
    }
  }
  return static_cast<u16>(sign | h);
}

struct CastIdentity {
  template <typename T>
  static __device__ __forceinline__ T apply(T x) {
    return x;
  }
};

struct CastF32ToBF16 {
  static __device__ __forceinline__ u16 apply(u32 x) { return f32_to_bf16(x); }
};

struct CastF32ToF16 {
  static __device__ __forceinline__ u16 apply(u32 x) { return f32_to_f16(x); }
};

// -- vectorised loads -----------------------------------------------------------------

// Eight consecutive elements, aligned so that one load moves 8 or 16 bytes (two or four
// 16-byte loads for 4- and 8-byte elements). Callers guarantee the alignment.
template <typename T>
struct alignas(sizeof(T) * 8 < 16 ? sizeof(T) * 8 : 16) Vec8 {
  T v[8];
};

template <typename T>
__device__ __forceinline__ Vec8<T> load8(const T* p) {
  return *reinterpret_cast<const Vec8<T>*>(p);
}

}  // namespace bulletin

#endif  // BULLETIN_COMMON_CUH
