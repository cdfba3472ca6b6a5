"""Run by test_gpu.py's AOTInductor test in a process of its own (a crash stays there):
support.AttentionBlock through torch.export -> aoti_compile_and_package (to argv[1]) ->
aoti_load_package, then the package against eager on the export's input and on a new one.
Prints "package == eager: <bool> <bool>" and exits 0 when both are bit-equal."""
import sys

import torch

from flashhopper import ops
from support import attention_block_and_input


def main(package_path: str) -> int:
    assert ops.NATIVE, "the C++ ops did not load: AOTInductor's runtime cannot call the Python ones"
    block, x = attention_block_and_input(43)
    with torch.no_grad():
        eager = block(x)
        exported = torch.export.export(block, (x,))
        assert any(node.target is torch.ops.flashhopper.fwd.default for node in exported.graph.nodes)
        package = torch._inductor.aoti_compile_and_package(exported, package_path=package_path)
        loaded = torch._inductor.aoti_load_package(package)
        same = torch.equal(loaded(x), eager)
        x2 = torch.randn_like(x)
        same_new = torch.equal(loaded(x2), block(x2))
    print("package == eager:", same, same_new, flush=True)
    return 0 if same and same_new else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
