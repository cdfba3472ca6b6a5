// FlashHopper from an installed package, through its public C++ header only: the version, the
// kernel families the library has, and one forward call. On a machine without an H100/H200 (or,
// as here, with host memory) the call is refused with a message and nothing runs; an argument
// error is refused the same way everywhere. Exit code 0 when the library answered as documented.
#include <flashhopper/flashhopper.hpp>

#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  std::printf("flashhopper %s (fh_version %s), kernels: %s\n", flashhopper::version(), fh_version(),
              fh_built_with_cuda() ? "yes" : "no");
  std::vector<fh_kernel_family> families(size_t(fh_compiled_families(nullptr, 0)));
  fh_compiled_families(families.data(), int32_t(families.size()));
  for (const fh_kernel_family& f : families)
    std::printf("  %s %s d=%d dv=%d\n", f.backward ? "backward" : "forward", f.dtype == FH_DTYPE_BF16 ? "bf16" : "fp16",
                f.head_dim, f.head_dim_v);

  // q, k, v, out: [batch 1, 64 tokens, 2 heads, head dim 128] in bf16 (host memory).
  const int64_t batch = 1, seqlen = 64, heads = 2, head_dim = 128;
  std::vector<uint16_t> q(batch * seqlen * heads * head_dim, 0x3f80), k = q, v = q, out = q;  // 1.0 in bf16
  flashhopper::ForwardParams p = flashhopper::default_forward_params();
  p.q = flashhopper::make_tensor(q.data(), FH_DTYPE_BF16, {batch, seqlen, heads, head_dim});
  p.k = flashhopper::make_tensor(k.data(), FH_DTYPE_BF16, {batch, seqlen, heads, head_dim});
  p.v = flashhopper::make_tensor(v.data(), FH_DTYPE_BF16, {batch, seqlen, heads, head_dim});
  p.out = flashhopper::make_tensor(out.data(), FH_DTYPE_BF16, {batch, seqlen, heads, head_dim});
  p.causal = 1;

  const flashhopper::Status check = flashhopper::check(p);
  std::printf("check: %s\n", check.ok() ? "arguments valid" : check.message.c_str());
  const flashhopper::Status run = flashhopper::forward(p, nullptr, 0, nullptr);
  std::printf("forward on host memory: code %d, \"%s\"\n", int(run.code), run.message.c_str());

  flashhopper::ForwardParams bad = p;
  bad.k = flashhopper::make_tensor(k.data(), FH_DTYPE_BF16, {batch, seqlen, heads, 64});
  const flashhopper::Status refused = flashhopper::check(bad);
  std::printf("a k of head dim 64: \"%s\"\n", refused.message.c_str());
  return check.ok() && !run.ok() && !run.message.empty() && refused.code == FH_ERROR_INVALID_ARGUMENT ? 0 : 1;
}
