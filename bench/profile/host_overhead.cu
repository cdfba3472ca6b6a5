// Host work per call of the C++ API: microseconds the host spends in one flashhopper::forward
// (checks, plan, parameter structs, TMA descriptors, launches) on tiny problems, beside an empty
// kernel's launch (the floor no library call goes below). The GPU is kept busy by a spinning
// kernel while the calls are issued, so the loop measures the host alone, never the GPU's pace.
//
//   ./build/bench/profile/host_overhead_cpp [calls per loop, default 200] [loops, default 9]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flashhopper/flashhopper.hpp"

namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

void check_status(const flashhopper::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, status.message.c_str());
  std::exit(1);
}

__global__ void empty_kernel() {}

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

struct Buffer {
  void* data = nullptr;
  explicit Buffer(size_t bytes) {
    check_cuda(cudaMalloc(&data, bytes), "cudaMalloc");
    check_cuda(cudaMemset(data, 0, bytes), "cudaMemset");
  }
  ~Buffer() { cudaFree(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Median microseconds per call of `call`, issued `calls` times while the GPU spins.
double host_us_per_call(const std::function<void()>& call, int calls, int loops, cudaStream_t stream) {
  call();  // first call: one-time work (the shared-memory opt-in, descriptor caches)
  check_cuda(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> samples;
  for (int loop = 0; loop < loops; ++loop) {
    spin_kernel<<<1, 1, 0, stream>>>(40'000'000LL);  // about 20 ms at 1.98 GHz
    check_cuda(cudaGetLastError(), "spin_kernel");
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) call();
    const auto stop = std::chrono::steady_clock::now();
    check_cuda(cudaStreamSynchronize(stream), "loop");
    samples.push_back(std::chrono::duration<double, std::micro>(stop - start).count() / calls);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashhopper;
  const int calls = argc > 1 ? std::atoi(argv[1]) : 200;
  const int loops = argc > 2 ? std::atoi(argv[2]) : 9;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || !fh_built_with_cuda()) {
    std::printf("SKIPPED: host_overhead_cpp needs an sm_90 GPU and a library built with its kernels\n");
    return 0;
  }
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  // A dense forward 1 x 8 x 1 x 128 and a one-token decode (GQA 4/1) against 8 cached keys, dense
  // and paged (pages of 16).
  const int d = 128, seq = 8, page_size = 16;
  Buffer q(seq * 4 * d * 2), k(page_size * d * 2), v(page_size * d * 2), out(seq * 4 * d * 2), lse(seq * 4 * 4);
  Buffer cache_seqlens(4), page_table(4);
  const int eight = seq, zero = 0;
  check_cuda(cudaMemcpy(cache_seqlens.data, &eight, 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  check_cuda(cudaMemcpy(page_table.data, &zero, 4, cudaMemcpyHostToDevice), "cudaMemcpy");

  ForwardParams dense = default_forward_params();
  dense.q = make_tensor(q.data, FH_DTYPE_BF16, {1, seq, 1, d});
  dense.k = make_tensor(k.data, FH_DTYPE_BF16, {1, seq, 1, d});
  dense.v = make_tensor(v.data, FH_DTYPE_BF16, {1, seq, 1, d});
  dense.out = make_tensor(out.data, FH_DTYPE_BF16, {1, seq, 1, d});
  dense.lse = make_tensor(lse.data, FH_DTYPE_FP32, {1, 1, seq});

  ForwardParams decode = default_forward_params();
  decode.q = make_tensor(q.data, FH_DTYPE_BF16, {1, 1, 4, d});
  decode.k = make_tensor(k.data, FH_DTYPE_BF16, {1, seq, 1, d});
  decode.v = make_tensor(v.data, FH_DTYPE_BF16, {1, seq, 1, d});
  decode.out = make_tensor(out.data, FH_DTYPE_BF16, {1, 1, 4, d});
  decode.lse = make_tensor(lse.data, FH_DTYPE_FP32, {1, 4, 1});
  decode.cache_seqlens = make_tensor(cache_seqlens.data, FH_DTYPE_INT32, {1});
  decode.num_splits = 0;

  ForwardParams paged = decode;
  paged.k = make_tensor(k.data, FH_DTYPE_BF16, {1, page_size, 1, d});
  paged.v = make_tensor(v.data, FH_DTYPE_BF16, {1, page_size, 1, d});
  paged.page_table = make_tensor(page_table.data, FH_DTYPE_INT32, {1, 1});

  struct Case {
    std::string name;
    std::function<void()> call;
  };
  std::vector<Case> cases;
  cases.push_back({"empty kernel launch (the floor)", [&] {
                     empty_kernel<<<1, 1, 0, stream>>>();
                     check_cuda(cudaGetLastError(), "empty_kernel");
                   }});
  std::vector<std::unique_ptr<Buffer>> workspaces;
  for (const auto& named : {std::pair<const char*, ForwardParams*>{"dense forward 1 x 8 x 1 x 128", &dense},
                             {"decode, dense cache (GQA 4/1, 8 keys)", &decode},
                             {"decode, paged cache (pages of 16)", &paged}}) {
    const char* name = named.first;
    ForwardParams* params = named.second;
    size_t bytes = 0;
    check_status(workspace_size(*params, &bytes), name);
    workspaces.push_back(std::make_unique<Buffer>(std::max<size_t>(bytes, 256)));
    void* workspace = workspaces.back()->data;
    cases.push_back({std::string(name) + ": check only", [params] { check_status(check(*params), "check"); }});
    cases.push_back({std::string(name) + ": workspace_size", [params] {
                       size_t b = 0;
                       check_status(workspace_size(*params, &b), "workspace_size");
                     }});
    cases.push_back({std::string(name) + ": forward", [params, workspace, bytes, stream] {
                       check_status(forward(*params, workspace, bytes, stream), "forward");
                     }});
  }

  std::printf("| C++ call (host work, GPU busy) | us per call |\n|---|---|\n");
  for (const Case& c : cases)
    std::printf("| %s | %.2f |\n", c.name.c_str(), host_us_per_call(c.call, calls, loops, stream));
  workspaces.clear();
  check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return 0;
}
