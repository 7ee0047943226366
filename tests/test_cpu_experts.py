"""vLLM CPU's packed expert stacks are read back in transformers' layout (no engine: the kernel's packing alone)."""

import pytest
import torch

from distrl.workers.rollout.cpu_experts import unpacked

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize(("isa", "dtype"), [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)])
def test_unpacking_undoes_the_kernels_packing_of_every_expert(isa, dtype):
    from vllm._custom_ops import cpu_prepack_moe_weight

    # Three experts of [64, 320]: 20,480 positions each, more than one base-256 digit holds.
    stack = torch.randn(3, 64, 320, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed = cpu_prepack_moe_weight(stack, isa)
    assert not torch.equal(packed, stack)  # the kernel's layout is another
    assert torch.equal(unpacked(packed, isa), stack)
