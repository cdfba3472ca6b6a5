"""Run by test_gpu.py's AOTInductor test in a process of its own (a crash stays there): a model
through torch.export -> aoti_compile_and_package (to argv[1]) -> aoti_load_package, then the
package against eager on the export's inputs and on new ones. argv[2] picks the model: "bf16"
(support.AttentionBlock) or "fp8" (flash_attn_func on float8_e4m3fn q, k, v with descales: the
C++ op's fp8 path). Prints "package == eager: <bool> <bool>" and exits 0 when both are bit-equal;
exits 3 ("skipped: ...") when this build has no fp8 kernels."""
import sys

import torch

from flashhopper import FlashHopperNotSupported, flash_attn_func, ops
from support import attention_block_and_input


class Fp8Attention(torch.nn.Module):
    def forward(self, q, k, v, q_descale, k_descale, v_descale):
        return flash_attn_func(q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def fp8_inputs(seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, 300, h, 128, device="cuda", generator=generator).to(torch.float8_e4m3fn)
               for h in (8, 2, 2))
    return (q, k, v, *(2 * torch.rand(2, 2, device="cuda", generator=generator) for _ in range(3)))


def main(package_path: str, kind: str) -> int:
    assert ops.NATIVE, "the C++ ops did not load: AOTInductor's runtime cannot call the Python ones"
    if kind == "fp8":
        model, inputs, new_inputs = Fp8Attention(), fp8_inputs(43), fp8_inputs(44)
    else:
        model, x = attention_block_and_input(43)
        inputs, new_inputs = (x,), (torch.randn_like(x),)
    with torch.no_grad():
        try:
            eager = model(*inputs)
        except FlashHopperNotSupported as error:
            print("skipped:", error, flush=True)
            return 3
        exported = torch.export.export(model, inputs)
        assert any(node.target is torch.ops.flashhopper.fwd.default for node in exported.graph.nodes)
        package = torch._inductor.aoti_compile_and_package(exported, package_path=package_path)
        loaded = torch._inductor.aoti_load_package(package)
        same = torch.equal(loaded(*inputs), eager)
        same_new = torch.equal(loaded(*new_inputs), model(*new_inputs))
    print("package == eager:", same, same_new, flush=True)
    return 0 if same and same_new else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bf16"))
