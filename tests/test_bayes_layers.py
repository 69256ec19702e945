"""Bayesian layers: local reparameterisation, support masks, KL (docs/algorithm.md §3, 6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dturbo.algorithms.dturbo import vbi
from dturbo.nn import BayesConv2d, BayesLinear, build_model
from dturbo.nn.bayes import SAMPLINGS
from dturbo.nn.shapes import grid_shape


@pytest.mark.parametrize("sigma_mode", ["layer", "weight"])
def test_local_reparameterisation_matches_weight_sampling(sigma_mode):
    """Pre-activation samples have the mean and variance of sampling the weights themselves."""
    torch.manual_seed(0)
    layer = BayesLinear(5, 3, sigma_mode=sigma_mode, sigma_init=0.2)
    with torch.no_grad():
        layer.mask[0, 1] = 0
    x = torch.randn(1, 5)
    n = 40000
    layer.train()
    g = torch.Generator().manual_seed(1)
    layer.generator = g
    out = layer(x.expand(n, 5))
    w = layer.weight_mu * layer.mask
    sigma2 = (layer.sigma**2).expand_as(w) * layer.mask
    mean = (x @ w.T + layer.bias).detach()
    var = ((x**2) @ sigma2.T).detach()
    tol = 4 * float(var.max().sqrt()) / n**0.5 + 1e-6
    torch.testing.assert_close(out.mean(0, keepdim=True).detach(), mean, atol=tol, rtol=0)
    torch.testing.assert_close(out.var(0, keepdim=True).detach(), var, rtol=0.05, atol=1e-7)


def test_eval_uses_mean_weights_and_mask():
    layer = BayesConv2d(2, 4, 3, padding=1)
    with torch.no_grad():
        layer.mask.zero_()
    layer.eval()
    x = torch.randn(2, 2, 5, 5)
    out = layer(x)
    assert torch.allclose(out, layer.bias.view(1, -1, 1, 1).expand_as(out))


def test_weights_off_support_get_no_update():
    torch.manual_seed(0)
    layer = BayesLinear(6, 4)
    with torch.no_grad():
        layer.mask[:, :3] = 0
        layer.weight_mu.mul_(layer.mask)
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    for _ in range(5):
        loss = layer(torch.randn(8, 6)).pow(2).sum() + layer.kl()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.all(layer.weight_mu[:, :3] == 0)
    assert torch.all(layer.weight_mu[:, 3:] != 0)


def test_kl_matches_closed_form_on_support():
    torch.manual_seed(0)
    layer = BayesLinear(7, 5, sigma_init=0.05)
    with torch.no_grad():
        layer.prior_std.uniform_(0.1, 1.0)
        layer.mask.bernoulli_(0.5)
    mu = layer.weight_mu.detach().double().numpy()
    ref = vbi.gaussian_kl(mu, float(layer.sigma.detach()), layer.prior_std.double().numpy())
    expected = (ref * layer.mask.numpy()).sum()
    assert np.isclose(float(layer.kl().detach()), expected, rtol=1e-5)


def test_grid_shapes_follow_the_gemm():
    assert grid_shape(BayesLinear(30, 20)) == (20, 30)
    assert grid_shape(BayesConv2d(3, 8, 5)) == (8, 3 * 25)
    assert grid_shape(BayesConv2d(8, 8, 3, groups=8)) == (8, 9)


@pytest.mark.parametrize("name,shape", [("alexnet-small", (1, 28, 28)), ("alexnet-small", (3, 32, 32)),
                                        ("lenet5", (1, 28, 28)), ("mlp", (784,))])
def test_models_build_and_seed(name, shape):
    a = build_model(name, shape, 10, seed=3)
    b = build_model(name, shape, 10, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert a(torch.randn(2, *shape)).shape == (2, 10)
    if name == "alexnet-small":
        assert a.dense1.in_features == (576 if shape[0] == 3 else 256)


def test_conv_model_rejects_flat_input():
    with pytest.raises(ValueError, match="image input"):
        build_model("lenet5", (784,), 10)


def _channel_layer(sigma_mode: str = "layer", groups: int = 1) -> BayesConv2d:
    torch.manual_seed(0)
    layer = BayesConv2d(4, 6, 3, padding=1, groups=groups, sigma_mode=sigma_mode, sigma_init=0.3)
    with torch.no_grad():
        layer.mask[1] = 0  # a whole output channel off the support
        layer.mask[4, :, 0] = 0  # part of another
    layer.sampling = SAMPLINGS["channel"]
    layer.generator = torch.Generator().manual_seed(1)
    return layer.train()


def _mean_and_variance(layer: BayesConv2d, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-activations' mean and variance under q, computed with the full layer, channel by channel apart."""
    w = layer.weight_mu * layer.mask
    s2 = (layer.sigma**2).expand_as(w) * layer.mask
    mean = torch.nn.functional.conv2d(x, w, layer.bias, padding=1, groups=layer.groups)
    return mean.detach(), torch.nn.functional.conv2d(x * x, s2, padding=1, groups=layer.groups).detach()


def test_support_sampling_is_the_local_trick_on_the_channels_on_the_support():
    """sampling = "support": the same draw as an independent computation of the local reparameterisation on the
    channels with support (the same noise, from the same generator), the bias elsewhere; gradients included."""
    layer = _channel_layer("weight")
    layer.sampling = SAMPLINGS["support"]
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    out = layer(x)
    rows = torch.tensor([0, 2, 3, 4, 5])
    xr = x.detach().clone().requires_grad_(True)
    w = (layer.weight_mu * layer.mask)[rows]
    s2 = (layer.sigma**2 * layer.mask)[rows]
    noise = torch.randn((2, 5, 5, 5), generator=torch.Generator().manual_seed(1))
    mean = torch.nn.functional.conv2d(xr, w, layer.bias[rows], padding=1)
    var = torch.nn.functional.conv2d(xr * xr, s2, padding=1)
    expected = mean + torch.sqrt(var.clamp_min(1e-16)) * noise
    torch.testing.assert_close(out[:, rows], expected)
    assert torch.equal(out[:, 1], layer.bias[1].detach().expand(2, 5, 5))
    g = torch.randn_like(out)
    out.backward(g)
    (expected * g[:, rows]).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)  # the variance path's gradient reaches the input


@pytest.mark.parametrize("kind", ["conv", "unbatched conv", "dense"])
@pytest.mark.parametrize("sigma_mode", ["layer", "weight"])
def test_support_sampling_reads_only_the_input_channels_its_support_reads(kind, sigma_mode):
    """An input channel (a dense layer's feature) with no weight on the support is not read: the draw, the
    gradients of the input, mu and sigma equal the full local reparameterisation's with the same noise, and the
    unread channel's input gradient is exactly zero."""
    torch.manual_seed(0)
    if kind == "dense":
        layer = BayesLinear(5, 4, sigma_mode=sigma_mode, sigma_init=0.3)
        x = torch.randn(3, 5)
    else:
        layer = BayesConv2d(4, 6, 3, padding=1, sigma_mode=sigma_mode, sigma_init=0.3)
        x = torch.randn(4, 5, 5) if kind == "unbatched conv" else torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        layer.mask[:, 2] = 0  # input channel 2 unread
        layer.mask[1, 0] = 0  # and part of another, still read
    axis = layer.channel_axis(x)
    assert layer.columns_on_support().tolist() == [0, 1, 3] + ([4] if kind == "dense" else [])

    def draw(sampling: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        layer.zero_grad()
        layer.sampling, layer.generator = SAMPLINGS[sampling], torch.Generator().manual_seed(1)
        xr = x.clone().requires_grad_(True)
        out = layer(xr)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [xr.grad, layer.weight_mu.grad, layer.sigma_param.grad]

    read, op = [], layer._op
    layer._op = lambda x, w, b: read.append(x.shape[axis]) or op(x, w, b)
    out, grads = draw("support")
    assert read == [len(layer.columns_on_support())] * 2  # the mean and the variance paths read the support's only
    ref, ref_grads = draw("local")
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)
    assert torch.all(grads[0].select(axis, 2) == 0)


@pytest.mark.parametrize("sigma_mode", ["layer", "weight"])
def test_channel_sampling_draws_one_normal_per_channel_and_skips_channels_off_the_support(sigma_mode):
    layer = _channel_layer(sigma_mode)
    x = torch.randn(3, 4, 5, 5)
    mean, var = _mean_and_variance(layer, x)
    outs = torch.stack([layer(x).detach() for _ in range(4000)])
    # a channel without support is its bias, exactly; the others have q's mean and variance at every position
    assert torch.equal(outs[:, :, 1], layer.bias[1].detach().expand_as(outs[:, :, 1]))
    on = [0, 2, 3, 4, 5]
    z = (outs[:, :, on] - mean[:, on]) / var[:, on].sqrt()
    torch.testing.assert_close(z.mean(0), torch.zeros_like(z[0]), atol=0.08, rtol=0)
    torch.testing.assert_close(z.std(0), torch.ones_like(z[0]), atol=0.06, rtol=0)
    # one draw per sample and channel: the standardised noise is the same at every position
    torch.testing.assert_close(z, z[..., :1, :1].expand_as(z), atol=1e-4, rtol=1e-4)


def test_channel_sampling_sends_no_gradient_through_the_variance_to_the_input():
    layer = _channel_layer()
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    g = torch.randn(2, 6, 5, 5)
    (layer(x) * g).sum().backward()
    w = (layer.weight_mu * layer.mask).detach()
    xr = x.detach().clone().requires_grad_(True)
    (torch.nn.functional.conv2d(xr, w, padding=1) * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)  # the mean path's alone
    assert layer.sigma_param.grad is not None and layer.sigma_param.grad != 0  # sigma still learns
    assert torch.all(layer.weight_mu.grad[1] == 0) and layer.bias.grad[1] == g[:, 1].sum()


@pytest.mark.parametrize(("sigma_mode", "rows"), [("weight", "two kinds"), ("layer", "two kinds"),
                                                   ("layer", "one kind"), ("layer", "all apart")])
def test_detached_sampling_is_support_sampling_with_the_variance_path_s_input_held_constant(sigma_mode, rows):
    """sampling = "detached": the same draws as "support" (the same generator), one per pre-activation; its input
    gradient is the mean path's alone, and sigma still learns. With one sigma per layer the variance is computed
    once per distinct row of the mask: rows of two kinds (whole and one partial), of one kind, all apart."""
    layer = _channel_layer(sigma_mode)
    with torch.no_grad():
        if rows == "one kind":
            layer.mask[4] = 1
        elif rows == "all apart":
            for r in (0, 2, 3, 5):
                layer.mask[r, r % 4, 1, 1] = 0  # a weight of its own off the support
    view = layer.support_view()
    if rows == "all apart":
        assert view.distinct[1] is None and view.distinct[0] is view.mask
    else:
        assert view.distinct[0].shape[0] == (1 if rows == "one kind" else 2)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    layer.sampling = SAMPLINGS["detached"]
    out = layer(x)
    layer.sampling, layer.generator = SAMPLINGS["support"], torch.Generator().manual_seed(1)
    torch.testing.assert_close(out, layer(x))
    z = (out - _mean_and_variance(layer, x)[0])[:, 0]
    assert torch.unique(z.detach().round(decimals=4)).numel() > 10  # not one draw per channel
    g = torch.randn_like(out)
    (out * g).sum().backward()
    w = (layer.weight_mu * layer.mask).detach()
    xr = x.detach().clone().requires_grad_(True)
    (torch.nn.functional.conv2d(xr, w, padding=1) * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    assert layer.sigma_param.grad is not None and torch.any(layer.sigma_param.grad != 0)


def test_channel_sampling_of_grouped_unbatched_and_dense_layers_has_q_s_moments():
    depthwise = _channel_layer(groups=2)
    x = torch.randn(4, 5, 5)  # unbatched
    mean, var = _mean_and_variance(depthwise, x[None])
    outs = torch.stack([depthwise(x).detach() for _ in range(4000)])
    assert outs.shape[1:] == (6, 5, 5)
    on = var[0] > 0
    z = ((outs - mean[0]) / var[0].clamp_min(1e-30).sqrt())[:, on]
    assert abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05
    dense = BayesLinear(5, 3, sigma_init=0.2)
    dense.sampling, dense.generator = SAMPLINGS["channel"], torch.Generator().manual_seed(0)
    y = torch.stack([dense(torch.ones(2, 5)).detach() for _ in range(4000)])
    assert float((y[:, 0] - y[:, 1]).abs().max()) > 0  # a dense layer's units draw apart, sample by sample


def test_alexnet_small_takes_its_layer_widths():
    """model.widths: a narrower alexnet-small (a pruned run's exported architecture, trained dense)."""
    model = build_model("alexnet-small", (1, 28, 28), 10, widths=(3, 8, 16, 16, 119, 83))
    shapes = {n: tuple(m.weight_mu.shape) for n, m in model.named_modules() if hasattr(m, "weight_mu")}
    assert shapes == {"conv1": (3, 1, 7, 7), "conv2": (8, 3, 5, 5), "conv3": (16, 8, 3, 3), "conv4": (16, 16, 3, 3),
                      "dense1": (119, 16 * 2 * 2), "dense2": (83, 119), "dense3": (10, 83)}
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    full = build_model("alexnet-small", (1, 28, 28), 10)
    assert tuple(full.conv4.weight_mu.shape) == (64, 32, 3, 3) and tuple(full.dense2.weight_mu.shape) == (84, 120)
