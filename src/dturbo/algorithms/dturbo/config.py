"""D-Turbo-VBI's config section ``[dturbo]`` and its sub-sections (docs/configuration.md), owned by the method
(:data:`dturbo.algorithms.dturbo.SPEC`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ...config import Probability, Section, ValuesCode


class PriorConfig(Section):
    """Hyperparameters of the hierarchical prior for one layer kind (docs/algorithm.md §2)."""

    a: float = Field(1.0, gt=0)
    b: float = Field(1.0, gt=0, description="used as given only with scale = 'absolute'")
    a_bar: float = Field(1.0, gt=0)
    b_bar: float = Field(0.01, gt=0, description="used as given only with scale = 'absolute'")
    scale: Literal["matched", "absolute"] = "matched"
    r: float = Field(100.0, gt=1, description="active / inactive prior variance ratio (scale = 'matched')")
    layer_scale: float | None = Field(None, gt=0, description="s_l; None: the layer's initial weight std")
    p01_row: Probability = Field(0.288, gt=0, lt=1)
    p11_row: Probability = Field(0.49, gt=0, lt=1)
    p01_col: Probability = Field(0.288, gt=0, lt=1)
    p11_col: Probability = Field(0.49, gt=0, lt=1)
    start: Probability | None = Field(None, gt=0, lt=1, description="P(active) start factor on first row/column")
    tie_rows: bool | Literal["without_batchnorm"] = Field(
        False, description="the p01_row -> 0, p11_row -> 1 limit: each grid row (an output unit or conv channel) is "
                           "one support variable, so rows are kept or pruned whole; the column chain couples rows. "
                           "'without_batchnorm': in the layers BatchNorm does not follow"
    )


def _dense_prior() -> PriorConfig:
    return PriorConfig(p01_row=0.3, p11_row=0.48, p01_col=0.3, p11_col=0.48)


class PriorsConfig(Section):
    conv: PriorConfig = Field(default_factory=PriorConfig)
    dense: PriorConfig = Field(default_factory=_dense_prior)


class SpmpConfig(Section):
    max_iter: int = Field(50, ge=1)
    tol: float = Field(1e-6, gt=0)
    damping: float = Field(0.0, ge=0, lt=1)


class SparsityConfig(Section):
    """How the support is decided (docs/algorithm.md §11; docs/sparsity.md).

    mode = "prior": the literal algorithm; pi_tilde >= threshold decides, r is the only knob.
    mode = "target": the MRF prior gets an external field (a prior log-odds of activity, part of
    Module B) calibrated each round so that the support size follows a schedule from dense to
    ``target_density`` (cubic ramp over ``ramp_rounds`` after ``warmup_rounds``). Unset, the two are paced by
    local training (``warmup_steps``, ``ramp_steps``; :func:`dturbo.algorithms.dturbo.sparsity.pruning_schedule`,
    docs/sparsity.md §2, docs/models.md#tune-for-a-new-dataset).
    """

    mode: Literal["prior", "target"] = "target"
    target_density: Probability = Field(0.15, gt=0, le=1, description="the final fraction of the weights kept")
    warmup_rounds: int | None = Field(None, ge=0, description=(
        "dense rounds before the ramp; unset (the default): enough rounds for the mean client to train "
        "warmup_steps local steps, at most (rounds - 1) // 2"))
    ramp_rounds: int | None = Field(None, ge=1, description=(
        "rounds of the cubic ramp to target_density; unset (the default): enough rounds for ramp_steps local steps, "
        "ending at the latest one round before the last"))
    warmup_steps: int = Field(64, ge=0, description=(
        "local steps of the mean client before the first pruning, when warmup_rounds is unset: the support is "
        "chosen on a model that has trained, not on its initial magnitudes"))
    ramp_steps: int = Field(500, ge=1, description="local steps of the mean client over the ramp, when ramp_rounds "
                                                   "is unset")
    scope: Literal["global", "layer"] = "global"
    budget: Literal["weights", "flops"] = Field("weights", description=(
        "what target_density counts: the fraction of weights kept, or of multiply-adds for one sample (the "
        "shared field then weighs each weight by the multiply-adds it does: costly layers are thinned hardest)"))
    cost_power: float = Field(1.0, gt=0, le=1, description=(
        "budget 'flops': the shared field weighs a weight by (its multiply-adds / the shared layers' mean) to this "
        "power; 1 charges the cost in full, below 1 spares the costly layers"))
    min_layer_density: Probability = Field(0.02, ge=0, le=1)
    distribution: Literal["auto", "evidence", "erk"] = Field("auto", description=(
        "scope 'global': how target_density spreads over the layers; evidence: one shared field, the layers' "
        "evidences compete; erk: each layer its own target by the Erdos-Renyi-kernel rule (density proportional to "
        "the sum of its weight's dimensions over its size); auto: erk for the layers BatchNorm follows (their scale "
        "is arbitrary, so their evidence cannot be weighed against other layers'), evidence for the others"))
    layer_targets: dict[str, Probability] = Field(
        default_factory=dict,
        description="final density of layers, each calibrated alone on the same schedule, by name (e.g. "
                    "{conv1 = 0.34}), position (first, last), position among a kind (first_conv, last_conv, "
                    "first_dense, last_dense) or kind (conv, dense); the more specific wins; the other layers "
                    "share what is left of target_density (scope 'global') or each take target_density (scope "
                    "'layer')",
    )


class TransmissionConfig(Section):
    """What D-Turbo-VBI's messages carry, and at how many bits per value (docs/communication.md)."""

    up_bits: int = Field(4, ge=1, le=16, description=(
        "16: mu_t on S as float16 (the paper); 1..12: the update mu_t - mu received on S, on 2**bits levels per "
        "layer, unbiased stochastic rounding"))
    down_bits: int = Field(8, ge=1, le=16, description=(
        "16: cluster-coded float16 mu_G (the paper); 1..12: the support's cluster-coded positions, then mu_G on S "
        "on 2**bits levels per layer, unbiased stochastic rounding"))
    prior_std: Literal["sent", "rebuilt"] = Field("rebuilt", description=(
        "sent: sigma_prior on S travels (prior_std_dtype); rebuilt: clients compute it by E4-E5 with pi~ = 1 on S "
        "from mu_G and sigma_G, and nothing is sent"))
    positions: Literal["full", "delta"] = Field("delta", description=(
        "full: every downlink carries each layer's support whole (implicit in the cluster-coded mu_G with down_bits "
        "= 16); delta: a client's downlink carries it as the positions that flipped since the support that client "
        "last received, or whole when that is smaller or the client holds none (docs/communication.md)"))
    down_mu: Literal["values", "update"] = Field("values", description=(
        "values: mu_G on S (down_bits); update: mu_G - the weights the client holds from its last downlink, on S, on "
        "2**down_bits levels per layer (stochastic rounding), so the rounding error of one downlink is sent again in "
        "the next; needs positions = 'delta' (the server knows what each client holds) and down_bits < 16 "
        "(docs/communication.md)"))
    up_quantizer: Literal["max", "norm", "sign"] = Field("max", description=(
        "the levels of the quantised update up (up_bits < 16): max, 2**bits levels over the layer's largest value, "
        "none at 0; norm, QSGD's s = 2**(bits - 1) - 1 levels of the layer's norm, 0 among them (up_bits >= 2): "
        "most values of an update round to 0 and range-code to under a bit each; sign (up_bits = 1), each value's "
        "sign times the layer's mean magnitude, what it rounds off kept by the client and added to its next upload "
        "(error feedback) (docs/communication.md)"))
    down_quantizer: Literal["max", "clipped", "sign", "settled_sign", "ternary", "settled_ternary"] = Field(
        "max", description=(
            "the levels of mu_G down (down_bits < 16): max, 2**bits levels over the layer's largest value; clipped, "
            "over at most 3 root mean squares, larger values on the end levels; sign, the update's signs times the "
            "layer's mean magnitude, 1 bit a value; settled_sign, clipped while the sparsity ramp runs, sign from "
            "the round after the support reaches its target density; ternary, STC's sparse ternary update, the "
            "down_share of its values largest in magnitude as their signs times their mean magnitude, the rest 0; "
            "settled_ternary, clipped while the ramp runs, ternary after (all but max need down_mu = 'update', "
            "which sends what they round off or leave out again; a client that holds no weights gets them on the "
            "max levels)"))
    down_rounding: Literal["stochastic", "nearest"] = Field("stochastic", description=(
        "the rounding of the downlink's clipped levels (clipped, and settled_sign / settled_ternary while the ramp "
        "runs): stochastic, unbiased, on 2**down_bits levels; nearest, each value to its nearest of 2**down_bits - 1 "
        "levels, 0 among them: deterministic, half the error, and the small values on one symbol that range-codes "
        "cheaply (the update downlink sends what it rounds off again)"))
    down_share: float = Field(0.1, gt=0, le=1, description=(
        "down_quantizer = 'ternary' / 'settled_ternary': the share of a layer's update values sent each round"))
    biases: Literal["float16", "as_mu"] = Field("float16", description=(
        "float16: each layer's biases travel as float16 values both ways; as_mu: as mu does, on its scheme in "
        "their own field: up as the update from the biases received (up_bits < 16), down as the update from the "
        "biases the client holds (down_mu = 'update') or as values on down_bits levels (down_bits < 16)"))
    values_code: ValuesCode = Field("range", description=(
        "how quantised values (up_bits / down_bits < 16; float16 values are sent as they are) are written: fixed, "
        "bits bits each; range, range-coded under "
        "a discretised Gaussian or Laplace fitted per layer (lossless: the same values, fewer bits; "
        "dturbo.coding.values, docs/communication.md)"))

    @model_validator(mode="after")
    def _bits(self) -> TransmissionConfig:
        for key in ("up_bits", "down_bits"):
            if 12 < getattr(self, key) < 16:
                raise ValueError(f"{key} must be 16 (float16) or 1..12 (quantised), got {getattr(self, key)}")
        if self.up_quantizer == "norm" and self.up_bits == 1:
            raise ValueError("up_quantizer = 'norm' needs up_bits of at least 2 (1 bit holds no level 0)")
        if self.up_quantizer == "sign" and self.up_bits != 1:
            raise ValueError(f"up_quantizer = 'sign' needs up_bits = 1 (one bit is the sign), got {self.up_bits}")
        if self.down_quantizer == "settled_sign" and self.down_bits == 1:
            raise ValueError("down_quantizer = 'settled_sign' needs down_bits of at least 2 (the ramp's clipped "
                             "levels; 1 bit is the sign itself)")
        if self.biases == "as_mu" and self.up_quantizer == "sign":
            raise ValueError("biases = 'as_mu' needs up_quantizer 'max' or 'norm' (the signs' error feedback covers "
                             "the weights' grids only)")
        if self.down_rounding == "nearest":
            if self.down_quantizer not in ("clipped", "settled_sign", "settled_ternary"):
                raise ValueError("down_rounding = 'nearest' rounds the clipped levels: it needs down_quantizer "
                                 f"'clipped', 'settled_sign' or 'settled_ternary', got '{self.down_quantizer}'")
            if self.down_bits < (3 if self.down_quantizer == "settled_ternary" else 2):
                raise ValueError(f"down_rounding = 'nearest' with down_quantizer = '{self.down_quantizer}' needs "
                                 "more down_bits (its 2**down_bits - 1 levels must outnumber the later scheme's)")
        if self.down_quantizer != "max" and self.down_mu != "update":
            raise ValueError(f"down_quantizer = '{self.down_quantizer}' needs down_mu = 'update' (the next downlink "
                             f"sends what it rounds off)")
        if self.down_mu == "update" and (self.positions != "delta" or self.down_bits == 16):
            raise ValueError("down_mu = 'update' needs positions = 'delta' (the server must know which weights each "
                             f"client holds) and down_bits in 1..12; got positions = '{self.positions}', down_bits = "
                             f"{self.down_bits}")
        return self


class DturboConfig(Section):
    sigma_mode: Literal["layer", "weight", "client"] = "layer"
    sigma_init_ratio: float = Field(0.02, gt=0, description="the initial sigma as a fraction of the layer's initial "
                                                               "weight std")
    beta: float = Field(0.01, ge=0, description=(
        "KL weight of E6 (a tempered posterior; the paper's is 1), chosen on validation; "
        "docs/models.md#tune-for-a-new-dataset"))
    sampling: Literal["local", "support", "detached", "channel"] = Field("detached", description=(
        "how local training samples each layer's pre-activations: local, an independent draw for each (the local "
        "reparameterisation trick, the paper's); support, the same on the conv output channels with weights on the "
        "support only (cheaper); detached, that with no gradient into the input through the variance (cheaper still; "
        "benchmarks/results/sampling.md); channel, that with one draw per sample and conv channel (dturbo.nn.bayes)"))
    gamma_update: Literal["exact", "paper"] = "exact"
    support_threshold: Probability = Field(0.5, gt=0, lt=1)
    global_model: Literal["trained", "cut"] = Field("trained", description=(
        "the model a round ends with (evaluated, checkpointed, exported): trained, the round's aggregate on the "
        "support its clients trained, the decided support applying from the next round's training on; cut (the "
        "paper's), mu_G on the support the server decides from the round's aggregate (weights leaving it at 0 before "
        "any client trains without them)"))
    dead_units: Literal["kept", "cut"] = Field("kept", description=(
        "the weights joined to a unit that carries nothing: those reading a conv channel or neuron whose own weights "
        "are all off the support (it outputs a constant), and those of a unit the next layer does not read. kept "
        "(the paper's): they stay on the support; cut: they leave it when the support is decided, so no message "
        "carries them (between layers joined by channel-wise ops only, the links export compacts; the model's "
        "graph must be one torch.fx captures)"))
    prior_std_dtype: Literal["float16", "float32", "log8"] = Field(
        "log8", description="how sigma_prior on S is sent with transmission.prior_std = 'sent': float16/32, or 8-bit "
                            "log-scale levels"
    )
    transmission: TransmissionConfig = Field(default_factory=TransmissionConfig)
    sparsity: SparsityConfig = Field(default_factory=SparsityConfig)
    spmp: SpmpConfig = Field(default_factory=SpmpConfig)
    prior: PriorsConfig = Field(default_factory=PriorsConfig)


def describe(d: DturboConfig) -> str:
    """A run's label: its target, whole channels or units, and its bits."""
    sp, tr = d.sparsity, d.transmission
    ties = {k: getattr(d.prior, k).tie_rows for k in ("conv", "dense")}
    extra = "".join((", whole conv channels" if k == "conv" else ", whole dense units")
                    + (" without BatchNorm" if tie == "without_batchnorm" else "") for k, tie in ties.items() if tie)
    bits = "float16" if tr.up_bits == 16 and tr.down_bits == 16 else \
        f"{tr.up_bits}-bit up, {tr.down_bits}-bit down".replace("16-bit", "float16")
    what = f"{sp.target_density:.0%} target" if sp.mode == "target" else "prior"
    return f"D-Turbo-VBI ({what}{extra}, {bits})"
