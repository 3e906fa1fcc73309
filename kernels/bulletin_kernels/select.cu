// Rollout side of the context codec: rank -> index over the base's exponent classes
// (kernels.cuda.select_ranks; the definition is patcher.context.select_ranks).
//
// The context codec codes, per entry [start, stop) and per class of the base value
// (its exponent field, clipped to a window of at most 16 classes), the ranks of the
// changed elements among that class's elements. Decoding turns each (class, rank) back
// into a flat index, which needs per-class prefix counts of the base: an O(n) read of
// the tensor, which is what these kernels do. Tiles of kTile elements, one block each:
//
//   pass 1 (class_counts_*) counts each class in each tile -> counts[class][tile];
//   host: exclusive prefix sums over tiles per class (offsets[class][tile], tiny), the
//     rank checks, and where each tile's queries of each class begin (bounds[class][tile],
//     a binary search of the class's ranks for each tile's offset);
//   pass 2 (select_*) re-reads its tile, sorts its positions by class in shared memory
//     (a stable counting sort: within a class, element order), and for each of its
//     queries writes index = start + tile start + position of the
//     (rank - offsets[class][tile])-th element of the class in the tile.
//
// apply_ranks_* is pass 2 fused with the scatter of apply.cu: bits[index] += delta[q],
// and the fingerprint change sum of H(index, new) - H(index, old) (one atomicAdd a block).
//
// Queries come in class-major order (classes non-decreasing, ranks strictly increasing
// within a class: the entropy decoder's order), checked on the host side before pass 2,
// as is every rank < its class's count; the output keeps the queries' order.
//
// Element e of a tile is read by thread e % kBlock in round e / kBlock, so loads are
// coalesced (base views may start at any element: no vector loads here).

#include "common.cuh"

namespace bulletin {

constexpr int kMaxClasses = 16;
constexpr int kRounds = 8;                 // elements per thread per tile
constexpr int kTile = kBlock * kRounds;    // 2048: the Python side's SELECT_TILE_ELEMENTS
constexpr u32 kNoClass = kMaxClasses;      // past the end of the range

// clip(((b >> shift) & mask) - lo, 0, classes - 1), as patcher.context.element_classes.
template <typename T>
__device__ __forceinline__ u32 class_of(T b, u32 shift, u64 mask, i64 lo, u32 classes) {
  const i64 e = static_cast<i64>((static_cast<u64>(b) >> shift) & mask) - lo;
  const i64 top = static_cast<i64>(classes) - 1;
  return static_cast<u32>(e < 0 ? 0 : (e > top ? top : e));
}

template <typename T>
__device__ __forceinline__ void counts_impl(const T* __restrict__ base, u64 start, u64 n, u32 shift, u64 mask,
                                            i64 lo, u32 classes, u64 tiles, u32* __restrict__ counts) {
  __shared__ u64 partial[kWarps][4];
  const u32 tid = threadIdx.x;
  const u64 first = static_cast<u64>(blockIdx.x) * kTile;
  // Four words of four 16-bit counters: a warp's count of a class is at most 256.
  u64 acc[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < kRounds; ++j) {
    const u64 e = first + static_cast<u64>(j) * kBlock + tid;
    if (e < n) {
      const u32 c = class_of(base[start + e], shift, mask, lo, classes);
#pragma unroll
      for (int w = 0; w < 4; ++w) acc[w] += (c >> 2) == static_cast<u32>(w) ? 1ull << (16 * (c & 3u)) : 0ull;
    }
  }
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const u64 s = warp_sum(acc[w]);
    if ((tid & 31) == 0) partial[tid >> 5][w] = s;
  }
  __syncthreads();
  if (tid < classes) {
    u32 total = 0;
    for (int w = 0; w < kWarps; ++w) total += static_cast<u32>((partial[w][tid >> 2] >> (16 * (tid & 3u))) & 0xffffu);
    counts[static_cast<u64>(tid) * tiles + blockIdx.x] = total;
  }
}

// What pass 2 does with each resolved query q (flat index i): write i down, or apply.
struct EmitIndex {
  i64* out;
  __device__ __forceinline__ void operator()(i64 q, u64 i) { out[q] = static_cast<i64>(i); }
  __device__ __forceinline__ void finish() {}
};

// bits[i] += delta[q] (wrapping) and the block's fingerprint change, as apply.cu does.
// Each block writes only elements of its own tile, after it has read the tile's
// classes; pass 1 read every tile before any block of pass 2 ran.
template <typename T>
struct EmitApply {
  T* bits;
  const T* delta;
  u64* fp_change;
  u64 acc;
  __device__ __forceinline__ void operator()(i64 q, u64 i) {
    const T old = bits[i];
    const T now = static_cast<T>(old + delta[q]);
    bits[i] = now;
    acc += element_hash(i, now) - element_hash(i, old);
  }
  __device__ __forceinline__ void finish() { block_add(acc, fp_change); }
};

// `base` is not __restrict__: the fused apply writes the same memory through `emit`.
template <typename T, typename Emit>
__device__ __forceinline__ void select_impl(const T* base, u64 start, u64 n, u32 shift, u64 mask, i64 lo,
                                            u32 classes, u64 tiles, const i64* __restrict__ offsets,
                                            const i64* __restrict__ bounds, const i64* __restrict__ ranks,
                                            Emit emit) {
  // before[(j * kWarps + w) * kMaxClasses + c]: elements of class c in rounds < j, then
  // in warps < w of round j (first the counts of round j's warp w, then their scan).
  __shared__ u16 before[kRounds * kWarps * kMaxClasses];
  __shared__ u16 sorted[kTile];  // tile positions, by class, in element order within one
  __shared__ u32 total[kMaxClasses];
  __shared__ u32 class_start[kMaxClasses];
  __shared__ i64 tile_rank[kMaxClasses];
  __shared__ i64 q_begin[kMaxClasses];
  __shared__ i64 q_end[kMaxClasses];
  const u32 tid = threadIdx.x;
  const u32 lane = tid & 31u;
  const u32 warp = tid >> 5;
  const u64 first = static_cast<u64>(blockIdx.x) * kTile;
  for (u32 k = tid; k < kRounds * kWarps * kMaxClasses; k += kBlock) before[k] = 0;
  __syncthreads();
  u32 cls[kRounds];
  u32 rank[kRounds];
  const u32 lower_lanes = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < kRounds; ++j) {
    const u64 e = first + static_cast<u64>(j) * kBlock + tid;
    cls[j] = e < n ? class_of(base[start + e], shift, mask, lo, classes) : kNoClass;
    const u32 same = __match_any_sync(kFullMask, cls[j]);
    rank[j] = static_cast<u32>(__popc(same & lower_lanes));
    if (cls[j] != kNoClass && rank[j] == 0) {
      before[(j * kWarps + warp) * kMaxClasses + cls[j]] = static_cast<u16>(__popc(same));
    }
  }
  __syncthreads();
  if (tid < classes) {
    u32 run = 0;
    for (int cell = 0; cell < kRounds * kWarps; ++cell) {
      const u32 count = before[cell * kMaxClasses + tid];
      before[cell * kMaxClasses + tid] = static_cast<u16>(run);
      run += count;
    }
    total[tid] = run;
  }
  __syncthreads();
  if (tid == 0) {
    u32 acc = 0;
    for (u32 k = 0; k < classes; ++k) {
      class_start[k] = acc;
      acc += total[k];
    }
  }
  if (tid < classes) {
    const u64 at = static_cast<u64>(tid) * (tiles + 1) + blockIdx.x;
    tile_rank[tid] = offsets[at];
    q_begin[tid] = bounds[at];
    q_end[tid] = bounds[at + 1];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kRounds; ++j) {
    if (cls[j] != kNoClass) {
      const u32 at = class_start[cls[j]] + before[(j * kWarps + warp) * kMaxClasses + cls[j]] + rank[j];
      sorted[at] = static_cast<u16>(j * kBlock + tid);
    }
  }
  __syncthreads();
  for (u32 k = 0; k < classes; ++k) {
    for (i64 q = q_begin[k] + tid; q < q_end[k]; q += kBlock) {
      const u32 local = static_cast<u32>(ranks[q] - tile_rank[k]);
      emit(q, start + first + sorted[class_start[k] + local]);
    }
  }
  emit.finish();
}

}  // namespace bulletin

using namespace bulletin;

#define BULLETIN_SELECT_KERNELS(SUFFIX, T)                                                              \
  extern "C" __global__ void __launch_bounds__(kBlock)                                                  \
      class_counts_##SUFFIX(const T* __restrict__ base, u64 start, u64 n, u32 shift, u64 mask, i64 lo, \
                            u32 classes, u64 tiles, u32* __restrict__ counts) {                         \
    counts_impl<T>(base, start, n, shift, mask, lo, classes, tiles, counts);                            \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(kBlock)                                                  \
      select_##SUFFIX(const T* __restrict__ base, u64 start, u64 n, u32 shift, u64 mask, i64 lo,       \
                      u32 classes, u64 tiles, const i64* __restrict__ offsets,                          \
                      const i64* __restrict__ bounds, const i64* __restrict__ ranks,                    \
                      i64* __restrict__ out) {                                                          \
    EmitIndex emit = {out};                                                                             \
    select_impl<T>(base, start, n, shift, mask, lo, classes, tiles, offsets, bounds, ranks, emit);      \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(kBlock)                                                  \
      apply_ranks_##SUFFIX(T* bits, u64 start, u64 n, u32 shift, u64 mask, i64 lo, u32 classes,         \
                           u64 tiles, const i64* __restrict__ offsets, const i64* __restrict__ bounds,  \
                           const i64* __restrict__ ranks, const T* __restrict__ delta,                  \
                           u64* __restrict__ fp_change) {                                               \
    EmitApply<T> emit = {bits, delta, fp_change, 0};                                                    \
    select_impl<T>(bits, start, n, shift, mask, lo, classes, tiles, offsets, bounds, ranks, emit);      \
  }

BULLETIN_SELECT_KERNELS(u8, u8)
BULLETIN_SELECT_KERNELS(u16, u16)
BULLETIN_SELECT_KERNELS(u32, u32)
BULLETIN_SELECT_KERNELS(u64, u64)
