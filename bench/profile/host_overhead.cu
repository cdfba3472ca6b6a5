// Host work per call of the C++ API: microseconds the host spends in one flashhopper::forward
// (checks, plan, parameter structs, TMA descriptors, launches) on tiny problems, beside an empty
// kernel's launch (the floor no library call goes below). The GPU is kept busy by a spinning
// kernel while the calls are issued, so the loop measures the host alone, never the GPU's pace.
//
//   ./build/bench/profile/host_overhead_cpp [calls per loop, default 200] [loops, default 9]
// Each loop is a round over every call; the table gives the median, the fastest round and the
// median excess over the empty launch in the same round.
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

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Microseconds per call of each of `calls`, issued `count` times while the GPU spins, in `loops`
// rounds that take every call in turn (a host slowing down for a while slows every call alike):
// samples[i][round].
std::vector<std::vector<double>> host_us_per_call(const std::vector<std::function<void()>>& calls, int count,
                                                  int loops, cudaStream_t stream) {
  for (const auto& call : calls) call();  // first calls: one-time work (the shared-memory opt-in)
  check_cuda(cudaStreamSynchronize(stream), "warm-up");
  std::vector<std::vector<double>> samples(calls.size());
  for (int loop = 0; loop < loops; ++loop) {
    for (size_t i = 0; i < calls.size(); ++i) {
      spin_kernel<<<1, 1, 0, stream>>>(40'000'000LL);  // about 20 ms at 1.98 GHz
      check_cuda(cudaGetLastError(), "spin_kernel");
      const auto start = std::chrono::steady_clock::now();
      for (int n = 0; n < count; ++n) calls[i]();
      const auto stop = std::chrono::steady_clock::now();
      check_cuda(cudaStreamSynchronize(stream), "loop");
      samples[i].push_back(std::chrono::duration<double, std::micro>(stop - start).count() / count);
    }
  }
  return samples;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flashhopper;
  const int calls = argc > 1 ? std::atoi(argv[1]) : 200;
  const int loops = argc > 2 ? std::atoi(argv[2]) : 9;
  if (calls < 1 || loops < 1) {
    std::fprintf(stderr, "usage: host_overhead_cpp [calls per loop >= 1] [loops >= 1]\n");
    return 2;
  }
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

  std::vector<std::function<void()>> functions;
  for (const Case& c : cases) functions.push_back(c.call);
  const std::vector<std::vector<double>> samples = host_us_per_call(functions, calls, loops, stream);
  // The first case is the empty launch: each call's excess over it in the same round is the
  // library's own host work, comparable across machines whose launch costs differ.
  std::printf("| C++ call (host work, GPU busy) | us per call (median) | fastest round | over the empty launch |\n"
              "|---|---|---|---|\n");
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<double> excess;
    for (int loop = 0; loop < loops; ++loop) excess.push_back(samples[i][loop] - samples[0][loop]);
    std::printf("| %s | %.2f | %.2f | %.2f |\n", cases[i].name.c_str(), median(samples[i]),
                *std::min_element(samples[i].begin(), samples[i].end()), median(excess));
  }
  workspaces.clear();
  check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return 0;
}
