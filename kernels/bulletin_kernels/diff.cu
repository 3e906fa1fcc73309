// Trainer side: fused cast + compare + compact (kernels.cuda.diff_cast).
//
// Two passes over tiles of 8192 element positions (kTileGroups groups of eight; the
// Python side's TILE_ELEMENTS), one block per tile:
//
//   pass 1 (diff_mark_*) streams `cur` and `kept` once with 8-element vector loads,
//     casts, compares, and writes a change bitmask (1 bit per element) and the number
//     of changes of each tile;
//   host: inclusive scan of the tile counts (tiny) and one 8-byte copy of the total;
//   pass 2 (diff_emit_*) reads the bitmask, and only at changed positions `cur` and
//     `kept`; writes ascending indices and wrapping deltas, stores the new bits into
//     `kept`, and sums the fingerprint change H(i, new) - H(i, old).
//
// Element positions are shifted by `shift` (< 8) so that "virtual" position
// v = i + shift puts every group of eight (v = 8g .. 8g+7) on a 16-byte boundary of
// `kept` (8 bytes for 1-byte elements): tensors are often views at arbitrary element
// offsets. Bit v of the mask is element v - shift; bits for v < shift or v >= n + shift
// are never set. `cur` may be misaligned differently: then `cur_vec` is 0 and `cur` is
// read element by element (still coalesced), see kernels/bulletin_kernels/cuda.py.

#include "common.cuh"

namespace bulletin {

constexpr int kItems = 4;                        // groups of eight per thread in pass 1
constexpr int kTileGroups = kBlock * kItems;     // 1024 groups = 1 KiB of mask per tile
constexpr int kTileWords = kTileGroups / 4;      // 256 words: one per thread in pass 2
static_assert(kTileWords == kBlock, "pass 2 maps one mask word to one thread");
static_assert(kTileGroups * 8 == 8192, "kernels/bulletin_kernels/cuda.py sizes grids and masks with TILE_ELEMENTS");

// How many groups a thread loads before comparing any: up to 192 bytes in flight per
// thread covers DRAM latency at the occupancy these kernels get (about 40 registers),
// without spilling for the 8-byte types. The first knob to turn when tuning on a GPU.
template <typename S, typename D>
struct Batch {
  static constexpr int value =
      sizeof(S) + sizeof(D) <= 6 ? 4 : (sizeof(S) + sizeof(D) <= 8 ? 2 : 1);
};

// Change bits of tiles that lie wholly inside the tensor (all but at most two): every
// group is eight elements, vector-aligned in `kept` (and in `cur` when kCurVec).
template <bool kCurVec, typename S, typename D, typename Op>
__device__ __forceinline__ u32 mark_interior(const S* __restrict__ cur, const D* __restrict__ kept,
                                             u64 first, u32 shift, u8* __restrict__ mask) {
  constexpr int kBatch = Batch<S, D>::value;
  u32 count = 0;
#pragma unroll
  for (int b = 0; b < kItems; b += kBatch) {
    Vec8<D> kv[kBatch];
    Vec8<S> cv[kBatch];
    // Issue every load of the batch before any compare, so that they overlap.
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const u64 i0 = (first + static_cast<u64>(b + s) * kBlock) * 8 - shift;
      kv[s] = load8(kept + i0);
      if (kCurVec) {
        cv[s] = load8(cur + i0);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) cv[s].v[j] = cur[i0 + j];
      }
    }
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      u32 m = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        m |= static_cast<u32>(static_cast<D>(Op::apply(cv[s].v[j])) != kv[s].v[j]) << j;
      }
      mask[first + static_cast<u64>(b + s) * kBlock] = static_cast<u8>(m);
      count += __popc(m);
    }
  }
  return count;
}

// Change bits of the first and the last tile, element by element: their groups may hold
// positions before the first element (v < shift) or past the last (v >= n + shift).
// Groups past the end still get a zero byte, so pass 2 reads whole words unchecked.
template <typename S, typename D, typename Op>
__device__ __forceinline__ u32 mark_edge(const S* __restrict__ cur, const D* __restrict__ kept,
                                         u64 first, u32 shift, u64 nv, u8* __restrict__ mask) {
  u32 count = 0;
  for (int step = 0; step < kItems; ++step) {
    const u64 g = first + static_cast<u64>(step) * kBlock;
    u32 m = 0;
    for (int j = 0; j < 8; ++j) {
      const u64 v = g * 8 + j;
      if (v >= shift && v < nv) {
        const u64 i = v - shift;
        m |= static_cast<u32>(static_cast<D>(Op::apply(cur[i])) != kept[i]) << j;
      }
    }
    mask[g] = static_cast<u8>(m);
    count += __popc(m);
  }
  return count;
}

template <typename S, typename D, typename Op>
__device__ __forceinline__ void diff_mark(const S* __restrict__ cur, const D* __restrict__ kept,
                                          u64 n, u32 shift, int cur_vec, u8* __restrict__ mask,
                                          u32* __restrict__ counts) {
  const u64 nv = n + shift;
  const u64 tile = blockIdx.x;
  const u64 tile_v0 = tile * kTileGroups * 8;
  const u64 first = tile * kTileGroups + threadIdx.x;
  // Block-uniform branches: no divergence, and the interior path carries no edge logic
  // (nor its registers).
  u32 count;
  if (tile_v0 >= shift && tile_v0 + kTileGroups * 8 <= nv) {
    count = cur_vec ? mark_interior<true, S, D, Op>(cur, kept, first, shift, mask)
                    : mark_interior<false, S, D, Op>(cur, kept, first, shift, mask);
  } else {
    count = mark_edge<S, D, Op>(cur, kept, first, shift, nv, mask);
  }
  const u64 total = block_sum(count);
  if (threadIdx.x == 0) counts[tile] = static_cast<u32>(total);
}

template <typename S, typename D, typename Op>
__device__ __forceinline__ void diff_emit(const S* __restrict__ cur, D* __restrict__ kept,
                                          u32 shift, const u32* __restrict__ mask,
                                          const u32* __restrict__ counts,
                                          const i64* __restrict__ inclusive,
                                          i64* __restrict__ out_index, D* __restrict__ out_delta,
                                          u64* __restrict__ fp_change) {
  __shared__ u32 warp_totals[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const u64 tile = blockIdx.x;
  const u64 word_index = tile * kTileWords + threadIdx.x;
  const u32 word = mask[word_index];

  // Where this warp's changes start in the output: the tile's offset from the scan plus
  // the changes of the warps before it in the tile.
  u32 warp_count = __popc(word);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    warp_count += __shfl_down_sync(kFullMask, warp_count, offset);
  }
  if (lane == 0) warp_totals[warp] = warp_count;
  __syncthreads();
  u64 base = static_cast<u64>(inclusive[tile]) - counts[tile];
  for (int w = 0; w < warp; ++w) base += warp_totals[w];

  // Walk this warp's non-zero words in order; for each, lane l handles bit l, so the
  // 32 candidate elements are adjacent (coalesced reads) and the outputs of one word are
  // adjacent too (coalesced writes). The loop bound comes from a ballot: warp-uniform.
  const u64 warp_first_word = tile * kTileWords + static_cast<u64>(warp) * 32;
  const u32 lanes_below = (1u << lane) - 1u;
  u64 fp = 0;
  u32 pending = __ballot_sync(kFullMask, word != 0);
  while (pending != 0) {
    const int src = __ffs(static_cast<int>(pending)) - 1;
    pending &= pending - 1;
    const u32 bits = __shfl_sync(kFullMask, word, src);
    if ((bits >> lane) & 1u) {
      const u64 v = (warp_first_word + src) * 32 + lane;
      const u64 i = v - shift;
      const u64 slot = base + __popc(bits & lanes_below);
      const D old = kept[i];
      const D now = static_cast<D>(Op::apply(cur[i]));
      kept[i] = now;
      out_index[slot] = static_cast<i64>(i);
      out_delta[slot] = static_cast<D>(now - old);
      fp += element_hash(i, now) - element_hash(i, old);
    }
    base += __popc(bits);
  }
  block_add(fp, fp_change);
}

}  // namespace bulletin

using namespace bulletin;

#define BULLETIN_DIFF_KERNELS(SUFFIX, S, D, OP)                                              \
  extern "C" __global__ void __launch_bounds__(kBlock)                                       \
      diff_mark_##SUFFIX(const S* __restrict__ cur, const D* __restrict__ kept, u64 n,       \
                         u32 shift, int cur_vec, u8* __restrict__ mask,                      \
                         u32* __restrict__ counts) {                                         \
    diff_mark<S, D, OP>(cur, kept, n, shift, cur_vec, mask, counts);                         \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(kBlock)                                       \
      diff_emit_##SUFFIX(const S* __restrict__ cur, D* __restrict__ kept, u32 shift,         \
                         const u32* __restrict__ mask, const u32* __restrict__ counts,       \
                         const i64* __restrict__ inclusive, i64* __restrict__ out_index,     \
                         D* __restrict__ out_delta, u64* __restrict__ fp_change) {           \
    diff_emit<S, D, OP>(cur, kept, shift, mask, counts, inclusive, out_index, out_delta,     \
                        fp_change);                                                          \
  }

BULLETIN_DIFF_KERNELS(u8, u8, u8, CastIdentity)
BULLETIN_DIFF_KERNELS(u16, u16, u16, CastIdentity)
BULLETIN_DIFF_KERNELS(u32, u32, u32, CastIdentity)
BULLETIN_DIFF_KERNELS(u64, u64, u64, CastIdentity)
BULLETIN_DIFF_KERNELS(f32_bf16, u32, u16, CastF32ToBF16)
BULLETIN_DIFF_KERNELS(f32_f16, u32, u16, CastF32ToF16)
