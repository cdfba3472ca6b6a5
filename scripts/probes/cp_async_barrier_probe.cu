// Does compute-sanitizer's synccheck accept cp.async completion tracked by an mbarrier?
// A two-stage producer/consumer pipeline in the paged-KV gather's pattern: 128 producer threads
// cp.async a stage into shared memory, then
//   mode 0 (the gather's): one thread arms the stage's full barrier (count 1) with expect_tx,
//          every thread cp.async.mbarrier.arrive (the counting form), a named barrier, and the one
//          thread completes the transaction;
//   mode 1: the full barrier counts the 128 threads, each arrives with the .noinc form.
// 128 consumer threads wait on the full barrier, sum the stage and release it. The exit code says
// whether the sums are right; run it under `compute-sanitizer --tool synccheck` to see its verdict.
//   nvcc -arch=sm_90a -o probe cp_async_barrier_probe.cu && ./probe 0 8
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

constexpr int kThreads = 128, kStages = 2, kStageInts = kThreads * 4;  // 16 bytes a thread

__device__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ void wait_parity(unsigned bar, unsigned parity) {
  asm volatile(
      "{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }" ::"r"(bar),
      "r"(parity));
}

__global__ void probe(const int* in, long long* out, int iterations, int mode) {
  __shared__ alignas(16) int stage[kStages][kStageInts];
  __shared__ alignas(8) unsigned long long full[kStages], empty[kStages];
  const int t = threadIdx.x % kThreads;
  const bool producer = threadIdx.x < kThreads;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&full[s])), "r"(mode == 0 ? 1 : kThreads));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&empty[s])), "r"(kThreads));
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  long long sum = 0;
  for (int i = 0; i < iterations; ++i) {
    const int s = i % kStages;
    const unsigned parity = (i / kStages) & 1, full_bar = smem_addr(&full[s]), empty_bar = smem_addr(&empty[s]);
    if (producer) {
      wait_parity(empty_bar, parity ^ 1);
      if (mode == 0 && t == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full_bar), "r"(kStageInts * 4));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(&stage[s][4 * t])),
                   "l"(in + i * kStageInts + 4 * t));
      if (mode == 0) {
        asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(full_bar));
        asm volatile("bar.sync 1, %0;" ::"r"(kThreads));
        if (t == 0) asm volatile("mbarrier.complete_tx.shared::cta.b64 [%0], %1;" ::"r"(full_bar), "r"(kStageInts * 4));
      } else {
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full_bar));
      }
    } else {
      wait_parity(full_bar, parity);
      for (int j = 0; j < 4; ++j) sum += stage[s][(4 * t + 4 * j) % kStageInts + j];
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty_bar));
    }
  }
  if (!producer) out[t] = sum;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0, iterations = argc > 2 ? atoi(argv[2]) : 8;
  const int n = iterations * kStageInts;
  int *in = nullptr, *host = static_cast<int*>(malloc(n * sizeof(int)));
  long long *out = nullptr, result[kThreads];
  for (int i = 0; i < n; ++i) host[i] = (i * 7919) % 1000 - 500;
  if (cudaMalloc(&in, n * sizeof(int)) != cudaSuccess || cudaMalloc(&out, sizeof(result)) != cudaSuccess ||
      cudaMemcpy(in, host, n * sizeof(int), cudaMemcpyHostToDevice) != cudaSuccess) {
    fprintf(stderr, "allocation failed\n");
    return 2;
  }
  probe<<<1, 2 * kThreads>>>(in, out, iterations, mode);
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(result, out, sizeof(result), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    fprintf(stderr, "kernel: %s\n", cudaGetErrorString(err));
    return 2;
  }
  int wrong = 0;
  for (int t = 0; t < kThreads; ++t) {
    long long expected = 0;
    for (int i = 0; i < iterations; ++i)
      for (int j = 0; j < 4; ++j) expected += host[i * kStageInts + (4 * t + 4 * j) % kStageInts + j];
    wrong += expected != result[t];
  }
  printf("mode %d, %d iterations: %d of %d sums wrong\n", mode, iterations, wrong, kThreads);
  return wrong ? 1 : 0;
}
