// bulk_copy.cuh: Hopper's bulk asynchronous copies, global memory to shared memory
// (cp.async.bulk: the copy engine moves a contiguous run of bytes, no tensor map), and
// the shared-memory barriers (mbarrier) that say when the bytes have landed.
//
// Why: a kernel that streams rows keeps bytes in flight without spending registers on
// them; one thread starts the copy of a whole row, the block waits on its barrier.
// sm_90 and later only: the host launches the kernels that use these where
// bulk_copy_supported() says so; older targets compile them to a trap.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace toolkit {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TOOLKIT_NO_BULK_COPY 1
#endif

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: a barrier that completes when `arrivals` threads arrived and the bytes they
// announced landed; then a fence so the copy engine sees it initialised.
__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals) {
#ifndef TOOLKIT_NO_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  __trap();
#endif
}

// One thread arrives and announces `bytes` still to land on the barrier, then starts copies of
// that many bytes in all (16-byte aligned addresses and sizes) that complete it.
__device__ __forceinline__ void barrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
#ifndef TOOLKIT_NO_BULK_COPY
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifndef TOOLKIT_NO_BULK_COPY
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
#else
  __trap();
#endif
}

// Every waiting thread: until the barrier's phase of this parity (0, 1, 0, ... by use) completed.
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
#ifndef TOOLKIT_NO_BULK_COPY
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
#else
  __trap();
#endif
}

// Host: whether the current GPU has bulk copies (compute capability 9.0 or later; cached per device).
inline bool bulk_copy_supported() {
  static int cached[64] = {0};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64) return false;
  if (cached[device] == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cached[device] = major >= 9 ? 2 : 1;
  }
  return cached[device] == 2;
}

}  // namespace toolkit
