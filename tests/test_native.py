"""dturbo's native direct convolution (dturbo.native, DirectConv2d): exact against PyTorch's convolution, with
one or several input channels and fused with a bias map, a leaky ReLU and a max-pooling; the layers it refuses;
and a machine without a compiler (PyTorch's kernels run instead, nothing fails)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from dturbo import kernels, native

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


@needs_native
@pytest.mark.parametrize("n,cin,ch,k,pad,h,w", [
    (5, 1, 6, 7, 3, 28, 28),    # alexnet-small's conv1
    (3, 1, 3, 7, 3, 28, 28),    # ... cut to 3 channels (two output rows a block)
    (2, 1, 7, 5, 2, 40, 33),    # a row wider than one register block (32 or 64 columns), 7 channels
    (4, 1, 2, 3, 0, 13, 9),     # no padding
    (1, 1, 1, 1, 0, 8, 8),      # 1x1
    (2, 1, 4, 5, 4, 6, 5),      # padding wider than the image is allowed where the output exists
    (3, 3, 8, 5, 2, 13, 13),    # alexnet-small's conv2 cut to 3 -> 8 channels (odd rows: a last single row)
    (2, 5, 19, 3, 1, 11, 70),   # several input channels, channels and columns in several blocks
    (2, 16, 32, 3, 1, 6, 6),    # conv4's shape: computed flat (rows end to end), 3 vectors for 36 outputs
    (3, 8, 17, 3, 1, 6, 6),     # ... cut to 8 -> 17 channels (a remainder channel block)
    (2, 4, 5, 5, 2, 7, 3),      # flat with a kernel wider than the image
    (2, 3, 6, 3, 0, 9, 5),      # flat without padding (rows of 3 outputs in a stride of 5)
    (1, 2, 3, 3, 1, 3, 12),     # flat over 2 vectors
])
def test_direct_conv_equals_torch(n: int, cin: int, ch: int, k: int, pad: int, h: int, w: int) -> None:
    gen = torch.Generator().manual_seed(ch * 100 + k)
    conv = torch.nn.Conv2d(cin, ch, k, padding=pad)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        conv.bias.copy_(torch.randn(ch, generator=gen))
    x = torch.randn(n, cin, h, w, generator=gen)
    direct = kernels.conv_as("direct", conv)
    assert isinstance(direct, kernels.DirectConv2d) and direct.weight is conv.weight
    with torch.no_grad():
        ref, out = conv(x), direct(x)
    assert out.shape == ref.shape and out.is_contiguous()
    # the same sums in another order: float32 rounding of sums of cin*k*k terms of size ~|x||w|
    assert torch.allclose(out, ref, rtol=0, atol=1e-5 * cin * k * k)


@needs_native
def test_direct_conv_without_bias_channels_last_input_and_any_thread_count() -> None:
    gen = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(1, 5, 7, padding=3, bias=False)
    x = torch.randn(9, 1, 28, 28, generator=gen)
    direct = kernels.conv_as("direct", conv)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = direct(x)
            torch.set_num_threads(2)
            two = direct(x.contiguous(memory_format=torch.channels_last))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each image is computed whole by one thread: bit for bit
    assert torch.allclose(one, conv(x).detach(), rtol=0, atol=1e-4)


@needs_native
def test_direct_conv_leaves_other_dtypes_to_torch_and_checks_its_input() -> None:
    conv = kernels.conv_as("direct", torch.nn.Conv2d(1, 2, 3, padding=1)).double()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias, padding=1))
    with pytest.raises(RuntimeError, match=r"\(C, C_in, K, K\) with x's C_in = 2"):
        native.conv_direct(torch.randn(2, 2, 8, 8), torch.randn(3, 1, 3, 3), torch.zeros(3), 1)
    with pytest.raises(RuntimeError, match="kernel larger than the padded input"):
        native.conv_direct(torch.randn(2, 1, 4, 4), torch.randn(3, 1, 7, 7), torch.zeros(3), 1)
    with pytest.raises(RuntimeError, match=r"bias map must be float32 \(C, H_out, W_out\) = \(3, 8, 8\)"):
        native.conv_direct(torch.randn(2, 1, 8, 8), torch.randn(3, 1, 3, 3), torch.zeros(3), 1,
                           bias_map=torch.zeros(3, 6, 6))


@pytest.mark.parametrize("conv", [
    torch.nn.Conv2d(2, 4, 3, stride=2),             # stride
    torch.nn.Conv2d(1, 4, 3, dilation=2),           # dilation
    torch.nn.Conv2d(1, 4, (3, 5), padding=1),       # not square
    torch.nn.Conv2d(1, 4, 3, padding=(1, 0)),       # uneven padding
    torch.nn.Conv2d(1, 4, 3, padding="same"),       # padding given as a word
    torch.nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect"),
    torch.nn.Conv2d(4, 4, 3, padding=1, groups=2),  # groups
])
def test_the_direct_kernel_refuses_what_it_cannot_compute(conv: torch.nn.Conv2d) -> None:
    assert not kernels.direct_supported(conv)
    with pytest.raises(ValueError, match="direct conv kernel cannot run"):
        kernels.conv_as("direct", conv)
    _, kind, times = kernels.choose_conv_kernel(conv, torch.randn(2, conv.in_channels, 9, 9))
    assert "direct" not in times and kind in ("default", "native")


def test_without_a_build_pytorch_s_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_build", lambda: "no C++ compiler (test)")
    conv = torch.nn.Conv2d(1, 3, 7, padding=3)
    assert not native.available() and native.unavailable_reason() == "no C++ compiler (test)"
    assert not kernels.direct_supported(conv)
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        kernels.conv_as("direct", conv)
    with pytest.raises(RuntimeError, match="not available: no C\\+\\+ compiler"):
        native.conv_direct(torch.randn(1, 1, 8, 8), conv.weight, conv.bias, 3)
    _, kind, times = kernels.choose_conv_kernel(conv, torch.randn(4, 1, 28, 28))
    assert set(times) == {"default", "native"} and kind != "direct"


def test_the_build_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.DISABLE_ENV, "1")
    assert native._build.__wrapped__() == f"disabled by {native.DISABLE_ENV}"


@needs_native
@pytest.mark.parametrize("cin,k,hw,pool,with_map", [
    (1, 7, 28, (3, 2), False), (1, 7, 28, (2, 2), False), (1, 7, 28, (3, 1), True), (1, 7, 28, None, False),
    (1, 3, 40, (5, 3), False),  # a wider window, a row in several register blocks
    (3, 5, 13, (3, 2), True),   # alexnet-small's conv2 block after export: bias map, leaky ReLU, pooling
    (3, 5, 13, None, True),
    (8, 3, 6, (3, 2), True),    # alexnet-small's conv4 block (computed flat) with a bias map
    (4, 3, 6, None, False),     # conv3's, no pooling
    (2, 3, 7, (2, 1), True),    # flat, a window at every position
])
def test_fused_bias_map_activation_and_pooling_equal_the_layers(cin: int, k: int, hw: int,
                                                                pool: tuple[int, int] | None, with_map: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    conv, act = torch.nn.Conv2d(cin, 4, k, padding=k // 2), torch.nn.LeakyReLU(0.1)
    mp = None if pool is None else torch.nn.MaxPool2d(*pool)
    bias_map = torch.randn(1, 4, hw, hw, generator=gen).contiguous(memory_format=torch.channels_last) \
        if with_map else None
    x = torch.randn(6, cin, hw, hw, generator=gen)
    x[0, 0, hw // 2, hw // 2] = float("nan")  # NaN spreads through the convolution and wins every max, as in torch
    fused = kernels.fuse_direct(conv, act, mp, bias_map)
    assert fused.weight is conv.weight and "leaky_relu(0.1)" in repr(fused)
    assert ("bias_map" in repr(fused)) == with_map
    with torch.no_grad():
        y = conv(x)
        y = act(y if bias_map is None else y + bias_map)
        ref = y if mp is None else mp(y)
        out = fused(x)
    assert out.shape == ref.shape
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()
    ok = ~ref.isnan()
    assert torch.allclose(out[ok], ref[ok], rtol=0, atol=1e-5 * cin * k * k)
    with pytest.raises(ValueError, match="computes the layers after it too"):
        kernels.conv_as("default", fused)
    assert kernels.conv_as("direct", fused) is fused


def test_only_a_bias_map_a_leaky_relu_and_a_plain_square_max_pooling_are_fused() -> None:
    conv, act = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.LeakyReLU(0.1)
    strided = torch.nn.Conv2d(2, 4, 3, padding=1, stride=2)
    assert not kernels.fusable(conv, torch.nn.ReLU(), None)  # only the leaky ReLU is in the kernel
    assert not kernels.fusable(strided, act, None)
    assert not kernels.fusable(conv, act, None, torch.zeros(3, 8, 8))  # a map for another channel count
    assert not kernels.fusable(conv, act, None, torch.zeros(4, 8))
    assert kernels.fusable(conv, act, None, torch.zeros(1, 4, 8, 8)) == native.available()
    for pool in (torch.nn.MaxPool2d(3, 2, padding=1), torch.nn.MaxPool2d((3, 2), 2), torch.nn.MaxPool2d(3, (2, 1)),
                 torch.nn.MaxPool2d(3, 2, ceil_mode=True), torch.nn.AvgPool2d(2)):
        assert not kernels.fusable(conv, act, pool)
        with pytest.raises(ValueError, match="cannot fuse"):
            kernels.fuse_direct(conv, act, pool)  # type: ignore[arg-type]
    assert kernels.fusable(conv, act, torch.nn.MaxPool2d(3, 2)) == native.available()


def test_the_automatic_choice_times_the_direct_kernel_only_for_thin_layers() -> None:
    wide = torch.nn.Conv2d(96, 128, 3, padding=1)
    assert not kernels.direct_worth_timing(wide)
    assert kernels.direct_worth_timing(torch.nn.Conv2d(16, 32, 3, padding=1)) == native.available()
    _, _, times = kernels.choose_conv_kernel(wide, torch.randn(1, 96, 4, 4))
    assert "direct" not in times


def test_an_unknown_or_unrunnable_target_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.TARGET_ENV, "avx1024")
    reason = native._build.__wrapped__()
    assert reason is not None and "DTURBO_NATIVE_TARGET='avx1024'" in reason and "targets: avx512, avx2" in reason


# The same checks in a fresh process built for each narrower target this CPU runs: the vector width (16 or 8
# floats, or the compiler's own) changes the register blocks, the pairs of rows and the remainders.
_OTHER_TARGET_CHECK = """
import torch, torch.nn.functional as F
from dturbo import native
assert native.available(), native.unavailable_reason()
gen = torch.Generator().manual_seed(0)
for n, cin, ch, k, pad, h, w, pool in [(3, 1, 3, 7, 3, 28, 28, (3, 2)), (2, 1, 7, 5, 2, 40, 33, None),
                                       (4, 1, 2, 3, 0, 13, 9, (2, 2)), (3, 3, 8, 5, 2, 13, 13, (3, 2)),
                                       (2, 5, 19, 3, 1, 11, 70, None), (2, 16, 32, 3, 1, 6, 6, (3, 2))]:
    x, wt = torch.randn(n, cin, h, w, generator=gen), torch.randn(ch, cin, k, k, generator=gen)
    b, m = torch.randn(ch, generator=gen), torch.randn(ch, h + 2 * pad - k + 1, w + 2 * pad - k + 1, generator=gen)
    ref = F.leaky_relu(F.conv2d(x, wt, b, padding=pad) + m, 0.1)
    ref = ref if pool is None else F.max_pool2d(ref, *pool)
    out = native.conv_direct(x, wt, b, pad, bias_map=m, slope=0.1, pool=pool)
    assert torch.allclose(out, ref, rtol=0, atol=1e-5 * cin * k * k), (cin, ch, k, (out - ref).abs().max())
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("target", [t for t in native.TARGETS if t != "avx512"])
def test_the_kernel_built_for_a_narrower_target_equals_torch(target: str) -> None:
    import os
    import subprocess
    import sys

    needs, _ = native.TARGETS[target]
    if not needs <= native._cpu_flags():
        pytest.skip(f"this CPU cannot run {target}")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    env = {**os.environ, native.TARGET_ENV: target}
    env.pop(native.DISABLE_ENV, None)
    done = subprocess.run([sys.executable, "-c", _OTHER_TARGET_CHECK], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
