// Just enough of CUDA to run Bulletin's kernel sources on the CPU, for tests.
//
// Each block runs on its own set of kBlock std::threads (blocks run one after another,
// so a function-level `static` is exactly per-block shared memory). __syncthreads is a
// block barrier; the warp primitives (__shfl_*_sync, __ballot_sync) exchange values
// through per-warp slots between two warp barriers, which also checks that all 32 lanes
// reach every one of them, as full-mask *_sync calls require (a kernel that breaks that
// rule deadlocks here instead of silently working). Built with -fsanitize=undefined, so
// misaligned vector loads and out-of-bounds local arrays are reported.

#ifndef BULLETIN_CUDA_EMULATOR_HPP
#define BULLETIN_CUDA_EMULATOR_HPP

#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct EmuDim3 {
  unsigned x = 0, y = 1, z = 1;
};

inline thread_local EmuDim3 threadIdx;
inline thread_local EmuDim3 blockIdx;
inline EmuDim3 blockDim;
inline EmuDim3 gridDim;

namespace emu {

struct Warp {
  std::barrier<> arrive{32};
  unsigned long long slots[32];
};

inline std::barrier<>* block_barrier = nullptr;
inline Warp* warps = nullptr;

inline void require_full(unsigned mask) {
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "emulator: only full-warp masks are supported\n");
    std::abort();
  }
}

template <typename T>
T exchange(T value, int src) {
  static_assert(sizeof(T) <= 8, "warp exchange of at most 8 bytes");
  Warp& w = warps[threadIdx.x / 32];
  const int lane = static_cast<int>(threadIdx.x & 31);
  unsigned long long raw = 0;
  std::memcpy(&raw, &value, sizeof(T));
  w.slots[lane] = raw;
  w.arrive.arrive_and_wait();
  raw = w.slots[src];
  w.arrive.arrive_and_wait();
  T out;
  std::memcpy(&out, &raw, sizeof(T));
  return out;
}

template <typename F>
void launch(unsigned grid, unsigned block, F body) {
  if (block % 32 != 0) std::abort();
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> bar(block);
    std::unique_ptr<Warp[]> block_warps(new Warp[block / 32]);
    block_barrier = &bar;
    warps = block_warps.get();
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
      threads.emplace_back([&body, b, t] {
        blockIdx.x = b;
        threadIdx.x = t;
        body();
      });
    }
    for (auto& thread : threads) thread.join();
  }
}

template <typename... A, std::size_t... I>
void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <typename... A>
void launch_kernel(void (*kernel)(A...), unsigned grid, void** args) {
  launch(grid, 256, [kernel, args] { call(kernel, args, std::index_sequence_for<A...>{}); });
}

}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

template <typename T>
T __shfl_sync(unsigned mask, T value, int src) {
  emu::require_full(mask);
  return emu::exchange(value, src & 31);
}

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
  emu::require_full(mask);
  const unsigned lane = threadIdx.x & 31;
  const unsigned src = lane + delta;  // out of range: the lane keeps its own value
  return emu::exchange(value, static_cast<int>(src < 32 ? src : lane));
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  emu::require_full(mask);
  emu::Warp& w = emu::warps[threadIdx.x / 32];
  w.slots[threadIdx.x & 31] = predicate ? 1u : 0u;
  w.arrive.arrive_and_wait();
  unsigned all = 0;
  for (unsigned lane = 0; lane < 32; ++lane) all |= static_cast<unsigned>(w.slots[lane]) << lane;
  w.arrive.arrive_and_wait();
  return all;
}

// The lanes whose `value` equals this lane's (CUDA's __match_any_sync, sm_70+).
template <typename T>
unsigned __match_any_sync(unsigned mask, T value) {
  static_assert(sizeof(T) <= 8, "match of at most 8 bytes");
  emu::require_full(mask);
  emu::Warp& w = emu::warps[threadIdx.x / 32];
  unsigned long long raw = 0;
  std::memcpy(&raw, &value, sizeof(T));
  w.slots[threadIdx.x & 31] = raw;
  w.arrive.arrive_and_wait();
  unsigned same = 0;
  for (unsigned lane = 0; lane < 32; ++lane) same |= static_cast<unsigned>(w.slots[lane] == raw) << lane;
  w.arrive.arrive_and_wait();
  return same;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }

inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}

#define BULLETIN_EMU_EXPORT(KERNEL) \
  extern "C" void emu_##KERNEL(unsigned grid, void** args) { emu::launch_kernel(&KERNEL, grid, args); }

#endif  // BULLETIN_CUDA_EMULATOR_HPP
