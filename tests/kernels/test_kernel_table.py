"""The optimizer table of the fused update kernels (``dynarec.optim.kernel``): every code has its
case in each twin of the update, and every registered optimizer with kernels names a code. The
kernels themselves run each registered optimizer against its reference in test_cpu_kernels.py
(C++) and test_gpu_kernels.py (Triton); this file needs neither a compiler nor Triton."""

import re
from pathlib import Path

import pytest
import torch

from dynarec.optim import registered
from dynarec.optim.kernel import KernelArgs, KernelCode, WeightDecayCode, cpp_defines, update_rows

KERNELS = Path(__file__).resolve().parents[2] / "dynarec" / "kernels"


def test_every_registered_optimizer_with_kernels_names_a_code():
    with_kernels = [d for d in registered() if d.kernel is not None]
    assert with_kernels
    for d in with_kernels:
        args = d.kernel(d.spec(), 1)  # type: ignore[call-arg]
        assert isinstance(args, KernelArgs) and args.code in KernelCode, d.name
        assert args.weight_decay_mode in WeightDecayCode, d.name


@pytest.mark.parametrize("code", list(KernelCode), ids=lambda c: c.name)
def test_every_code_has_a_case_in_the_cpp_and_the_triton_update(code):
    cpp = (KERNELS / "cpu" / "ops.cpp").read_text()
    update = cpp[cpp.index("inline void update_row(") :]
    assert re.search(rf"case DYNAREC_KERNEL_{code.name}:", update), f"ops.cpp's update_row has no case for {code!r}"
    triton = (KERNELS / "gpu" / "update.py").read_text()
    assert f"_{code.name} = tl.constexpr(int(KernelCode.{code.name}))" in triton
    assert re.search(rf"if OPT == _{code.name}:", triton), f"the Triton _apply_update has no case for {code!r}"


@pytest.mark.parametrize("code", list(KernelCode), ids=lambda c: c.name)
def test_every_code_has_a_torch_case(code):
    weight, rows, grad = torch.zeros(3, 2), torch.tensor([1]), torch.ones(1, 2)
    states = {"momentum1": torch.zeros(3, 2), "momentum2": torch.zeros(3, 2)}
    if code == KernelCode.ROWWISE_ADAGRAD:
        states["momentum1"] = torch.zeros(3, 1)
    args = KernelArgs(code, eps=1e-8, beta1=0.9, beta2=0.99)
    update_rows(args, lr=0.1, weight=weight, states=states, rows=rows, grad=grad)
    assert bool((weight[1] < 0).all()) and not bool(weight[[0, 2]].any())
    with pytest.raises(ValueError):
        update_rows(KernelArgs(99), lr=0.1, weight=weight, states=states, rows=rows, grad=grad)  # type: ignore[arg-type]


def test_the_cpp_defines_name_every_code_once():
    defines = cpp_defines()
    assert len(defines) == len(set(defines)) == len(KernelCode) + len(WeightDecayCode)
    for code in KernelCode:
        assert f"-DDYNAREC_KERNEL_{code.name}={int(code)}" in defines
    for mode in WeightDecayCode:
        assert f"-DDYNAREC_WEIGHT_DECAY_{mode.name}={int(mode)}" in defines
