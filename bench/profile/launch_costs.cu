// Host cost of the CUDA calls one FlashHopper launch is made of, each timed alone while the GPU
// spins (so the loop measures the host): the driver lookup CUTLASS's default wrapper makes before
// every TMA descriptor, the descriptor's encoding, and launches of kernels with no parameters and
// with 1024, 1792 and 3072 bytes of them (a dense forward's and a general one's sizes since 11329f2),
// through <<<>>> and through cudaLaunchKernelEx with a cluster attribute, as launch_common.cuh
// does. What they cost explains the gap between host_overhead_cpp's calls and its empty launch.
// A loop stays short enough (200 calls) that its launches never fill the stream's queue, where a
// launch would wait for the GPU and the loop time the kernels instead.
//   ./build/bench/profile/launch_costs [calls per loop, default 200] [loops, default 7]
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {

template <int kBytes>
struct Parameters {
  unsigned char bytes[kBytes];
};

__global__ void empty_kernel() {}

template <int kBytes>
__global__ void parameter_kernel(const __grid_constant__ Parameters<kBytes> p) {
  if (p.bytes[kBytes - 1] == 1) asm volatile("trap;");  // reads the parameters; never taken
}

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

void check(int err, const char* what) {
  if (err == 0) return;
  std::fprintf(stderr, "%s failed: %d\n", what, err);
  std::exit(1);
}

// Median microseconds per call of `call` over `loops` loops of `count` calls; a call reports
// failure by returning nonzero, and any failure ends the program (after the loop: no check in it
// costs more than the comparison).
double median_us(const std::function<int()>& call, int count, int loops, cudaStream_t stream, const char* what) {
  std::vector<double> samples;
  for (int loop = 0; loop < loops; ++loop) {
    spin_kernel<<<1, 1, 0, stream>>>(40'000'000LL);
    check(cudaGetLastError(), "spin_kernel");
    int failures = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int n = 0; n < count; ++n) failures += call() != 0;
    const auto stop = std::chrono::steady_clock::now();
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    check(failures, what);
    samples.push_back(std::chrono::duration<double, std::micro>(stop - start).count() / count);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int count = argc > 1 ? std::atoi(argv[1]) : 200;
  const int loops = argc > 2 ? std::atoi(argv[2]) : 7;
  int devices = 0;
  if (count < 1 || loops < 1) {
    std::fprintf(stderr, "usage: launch_costs [calls per loop >= 1] [loops >= 1]\n");
    return 2;
  }
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: launch_costs needs a CUDA GPU\n");
    return 0;
  }
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  void* buffer = nullptr;
  check(cudaMalloc(&buffer, 1 << 24), "cudaMalloc");

  void* function = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found),
        "cudaGetDriverEntryPointByVersion");
  check(found != cudaDriverEntryPointSuccess, "cuTensorMapEncodeTiled lookup");
  const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  // Q of a [4, 1024, 8, 128] bf16 tensor, a 128 x 64 box, 128-byte swizzle: as a forward's.
  CUtensorMap map;
  const cuuint64_t dims[4] = {128, 1024, 8, 4};
  const cuuint64_t strides[3] = {128 * 8 * 2, 128 * 2, 128 * 8 * 1024 * 2};
  const cuuint32_t box[4] = {64, 128, 1, 1}, element_strides[4] = {1, 1, 1, 1};

  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1);
  config.blockDim = dim3(32);
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  const Parameters<1024> small{};
  const Parameters<1792> dense{};
  const Parameters<3072> general{};
  int device = 0;

  struct Row {
    const char* name;
    std::function<int()> call;
  };
  const Row rows[] = {
      {"cudaGetDevice", [&] { return int(cudaGetDevice(&device)); }},
      {"cudaGetDriverEntryPointByVersion(\"cuTensorMapEncodeTiled\")",
       [&] {
         void* f = nullptr;
         cudaDriverEntryPointQueryResult q{};
         return int(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
       }},
      {"cuTensorMapEncodeTiled (4-D bf16, 128-byte swizzle)",
       [&] {
         return int(encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, buffer, dims, strides, box, element_strides,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
       }},
      {"empty kernel, <<<>>>", [&] { empty_kernel<<<1, 32, 0, stream>>>(); return int(cudaGetLastError()); }},
      {"1024-byte parameters, <<<>>>",
       [&] { parameter_kernel<1024><<<1, 32, 0, stream>>>(small); return int(cudaGetLastError()); }},
      {"1792-byte parameters, cudaLaunchKernelEx + cluster",
       [&] { return int(cudaLaunchKernelEx(&config, parameter_kernel<1792>, dense)); }},
      {"3072-byte parameters, cudaLaunchKernelEx + cluster",
       [&] { return int(cudaLaunchKernelEx(&config, parameter_kernel<3072>, general)); }},
      {"3072-byte parameters, <<<>>>",
       [&] { parameter_kernel<3072><<<1, 32, 0, stream>>>(general); return int(cudaGetLastError()); }},
  };
  std::printf("| call (host work, GPU busy) | us per call (median of %d loops of %d) |\n|---|---|\n", loops, count);
  for (const Row& row : rows)
    std::printf("| %s | %.3f |\n", row.name, median_us(row.call, count, loops, stream, row.name));
  check(cudaFree(buffer), "cudaFree");
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return 0;
}
