"""The CompLL CUDA kernels run on a GPU, against the CPU back end (marker `gpu`: needs a GPU).

    python -m pytest -m gpu tests/gpu

Every shipped spec the CUDA back end lowers (not those with a matrix view, PowerSGD-like, nor
onebit's per-row scales) is loaded with its CUDA library; the same gradients, steps and state go through the CPU and the GPU kernels:

  * payloads are wire data: a GPU rank and a CPU rank must understand each other, so a payload made
    on one device decodes on the other to exactly what it decodes to on its own device;
  * the GPU's decoded gradient equals the CPU's: exactly for most specs; where the two differ by
    the order of a floating-point reduction (a scale or threshold computed by a parallel sum),
    the elements within a small relative error of the scale, and a handful of elements at a
    selection boundary may flip (counted and bounded);
  * state (error-feedback residuals, RNG counters) evolves the same over several steps;
  * decode_add accumulates with alpha as on the CPU.

The default suite never collects these (pyproject.toml excludes the marker): there is no GPU on the
CI machine.
"""
import pytest
import torch

from hipress import compll

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SIZES = (1, 1000, (1 << 20) + 3)
STEPS = 3


def vector_specs():
    return compll.cuda_specs()


def on_cuda(state):
    # The kernels update state buffers in place on the gradient's device; scalars (RNG counter,
    # step) stay on the CPU by the ABI.
    for k, b in list(state.buffers.items()):
        state.buffers[k] = b.cuda()
    return state


@pytest.fixture(scope="module")
def factories():
    return {s: compll.load(s, name=f"gpu_{s}", register=False) for s in vector_specs()}


def mismatch(a, b, scale):
    """Elements differing by more than a few float ulps of the payload's magnitude."""
    return int(((a - b).abs() > 1e-5 * max(scale, 1e-30)).sum())


@pytest.mark.parametrize("spec", vector_specs())
def test_cuda_kernels_equal_cpu(factories, spec):
    c = factories[spec]()
    assert c._cuda is not None, f"{spec}: no CUDA library ({c._cuda_why})"
    for n in SIZES:
        cpu_state, gpu_state = c.new_state(n), on_cuda(c.new_state(n))
        for step in range(STEPS):
            g = torch.randn(n, generator=torch.Generator().manual_seed(100 * n + step))
            p_cpu = c.encode(g, cpu_state).clone()
            p_gpu = c.encode(g.cuda(), gpu_state).clone()
            torch.cuda.synchronize()
            d_cpu = c.decode(p_cpu, torch.zeros(n))
            d_gpu = c.decode(p_gpu, torch.zeros(n, device="cuda")).cpu()
            # wire format: each payload decodes the same on either device
            torch.testing.assert_close(c.decode(p_gpu.cpu(), torch.zeros(n)), d_gpu, rtol=0, atol=0)
            torch.testing.assert_close(c.decode(p_cpu.cuda(), torch.zeros(n, device="cuda")).cpu(), d_cpu,
                                       rtol=0, atol=0)
            scale = float(d_cpu.abs().max()) if n else 0.0
            bad = mismatch(d_cpu, d_gpu, scale)
            # a parallel reduction may move a scale or threshold by an ulp: at most a few boundary elements
            assert bad <= max(2, n // 10000), (spec, n, step, bad, (d_cpu - d_gpu).abs().max().item())
            assert list(cpu_state.scalars) == list(gpu_state.scalars), (spec, n, step)
            for k in cpu_state.buffers:
                got = gpu_state.buffers[k].cpu()
                off = mismatch(cpu_state.buffers[k], got, float(cpu_state.buffers[k].abs().max()) if n else 0.0)
                assert off <= max(2, n // 10000), (spec, n, step, k, off)
            # decode_add: acc + alpha * decoded, on the device
            acc = torch.ones(n, device="cuda")
            c.decode_add(p_gpu, acc, 0.5)
            torch.testing.assert_close(acc.cpu(), 1 + 0.5 * d_gpu, rtol=1e-6, atol=1e-6)
