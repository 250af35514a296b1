"""Acceptance rules for speculative verification: exact, LANTERN, GSD and Lumina-mGPT 2.0's SJD (all three lossy).

The budgeted rule, lossy within a TV budget per verification whatever the draft, builds on these and lives in
:mod:`vispec.decoding.budget`; :func:`vispec.decoding.rules.build_rule` builds every rule (this module imports
neither, so the imports point one way: acceptance <- budget <- rules).

A rule decides, for a draft ``x ~ q`` checked against the target ``p`` of its position, whether
``x`` is kept (with a uniform ``u``), and what the rejected position samples from instead. The
exact rule (speculative sampling; Leviathan et al. 2023, Chen et al. 2023) keeps ``x`` iff
``u q(x) < p(x)`` and resamples from ``max(0, p - q)``: the output is distributed exactly as
``p``. The relaxed rules accept more often and change the output distribution:

* **LANTERN** (Jang et al., ICLR 2025, arXiv 2410.03355; LANTERN++ arXiv 2502.06352). With
  ``N_1(x), N_2(x), ...`` the codebook entries nearest to ``x`` in the VQ latent space and
  ``c_j = Σ_{i <= j} p(N_i(x))`` (``j <= k``), ``J = max{j : c_j <= δ}`` for ``δ <= 1`` (a
  total-variation budget) or ``max{j : c_j <= (δ - 1) p(x)}`` for ``δ > 1`` (LANTERN++'s ratio
  ``λ = δ``: ``p̃(x) <= λ p(x)``). The relaxed probability ``p̃(x) = p(x) + c_J`` replaces ``p(x)``
  in the test. On rejection ``x`` and the absorbed neighbours ``N_1..N_J(x)`` are zeroed in ``p``
  before the residual ``max(0, p - q)``. (LANTERN's code zeroes ``k + 1`` neighbours whenever
  ``J >= 1``; zeroing exactly the absorbed ones keeps ``δ = 0`` and ``k = 0`` exact.)
* **GSD** (So et al., ICCV 2025, arXiv 2508.07747). The group ``G(x)``: tokens whose rank in the
  sorted processed logits lies in ``[r - H, r + H)`` around the draft's rank ``r`` (clamped to the
  vocabulary, where the public code wraps around), with ``|p(t) - p(x)| < p_thr`` and squared
  embedding distance ``||E_t - E_x||² < d_thr`` (``E``: the AR model's input token embeddings).
  ``x`` is kept iff ``u Σ_G q < Σ_G p``; a rejection resamples from ``max(0, p - q)``. A NaN embedding row
  marks a token with no latent (a unified vocabulary's end of row): its group is itself, and it joins no other.
* **Lumina-mGPT 2.0's SJD** (Alpha-VLLM/Lumina-mGPT-2.0, ``lumina_mgpt/generate_examples/sjds.py``,
  ``SpeculativeSampler``; :class:`LuminaRule`). SJD's test ``u < min(1, p(x) / max(q(x), 1e-7))``, but a
  rejection samples from ``p`` itself unless the residual of ``q`` clamped at 0.99 carries (almost) all
  the mass, so the rejected draft can be drawn again: the output leans towards the drafts.

Every rule also computes :meth:`AcceptanceRule.output_tv`: the total-variation distance between
the distribution one verification actually outputs (draft ``x ~ q``, accepted or resampled) and
``p``, in closed form: ``P(y) = a(y) + Σ_x w(x) R_x(y) / Z_x`` with ``a`` the accepted mass,
``w = q - a`` the rejected mass and ``R_x`` the residual after rejecting ``x``. It is exactly 0
for the exact rule, and at most ``δ``-ish for LANTERN (the paper's per-step bound).

All operations take dense probability rows ``p, q: [R, V]`` (one-hot ``q`` for initialised drafts) and
run batched in PyTorch. :func:`build_rule` builds every rule (LANTERN's neighbour tables come from a
per-codebook cache, :mod:`vispec.decoding.neighbors`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional, Union

import torch
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.kernels import verify
from vispec.kernels.philox import Stream
from vispec.kernels.target import Target
from vispec.kernels.verify import Drafts, SampleRequest
from vispec.sampling import SamplingConfig, warp_logits

RULES = ("exact", "budget", "lantern", "gsd", "lumina")


def spec_number(value: float) -> str:
    """A number as a spec writes it: integers as integers, others in the shortest form that parses back to the same
    float (``0.1``, ``0.123456789``, ``1e-07``), so ``parse(config.name) == config``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    text = f"{value:g}"
    return text if float(text) == value else repr(float(value))


@dataclass(frozen=True)
class AcceptanceConfig:
    """Which acceptance rule verification uses, with its parameters.

    Args:
        rule: ``"exact"`` (lossless, the default), ``"budget"`` (lossy within a TV budget per verification),
            ``"lantern"``, ``"gsd"`` or ``"lumina"`` (lossy, unbounded).
        budget_delta: the budget rule's TV budget ``δ`` in ``[0, 1]`` per verification (default 0.1; 0 is exact).
        budget_decay: window annealing, in ``(0, 1]``: window row ``j`` (the ``j``-th draft) gets ``δ decay^j``
            (COOL-SD's decreasing relaxation along the window; default 1, no decay).
        budget_end: image annealing, in ``[0, 1]``: the budget falls linearly along the image, from ``δ`` at the
            first token to ``δ end`` at the last (default 1, no decay). Both factors multiply.
        budget_ratio: ``λ >= 1`` also caps the relaxed target at ``λ p`` (no token's probability grows more than
            ``λ``-fold, LANTERN++'s closeness; default 0: no cap).
        budget_neighbors: ``k > 0`` restricts moves to codebook neighbours: mass reaches token ``y`` only from
            ``y``'s ``k`` nearest codebook entries (perceptual closeness; needs the VQ codebook). 0: any token of
            the target's support (default).
        lantern_k: neighbours per token (LANTERN's default 1000; 0 makes the rule exact).
        lantern_delta: TV budget ``δ <= 1``, or LANTERN++'s ratio ``λ = δ > 1`` (default 0.1).
        lantern_normalize: neighbours by L2-normalised codebook vectors (LANTERN uses raw weights).
        gsd_half_width: rank half-width ``H`` of the GSD group window (default 7).
        gsd_p_thr: probability closeness ``|p(t) - p(x)| < p_thr`` (default 0.15).
        gsd_d_thr: squared embedding distance bound (default 0.5).
        lumina_q_clamp: the clamp Lumina-mGPT 2.0 applies to ``q`` in the residual (default 0.99).
        lumina_reprocess: pass a rejected position's sampling weights through the target's warpers again
            (temperature, top-k, top-p), as Lumina-mGPT 2.0 does with its ``logits_processor`` (default on).
    """

    rule: str = "exact"
    budget_delta: float = 0.1
    budget_decay: float = 1.0
    budget_end: float = 1.0
    budget_ratio: float = 0.0
    budget_neighbors: int = 0
    lantern_k: int = 1000
    lantern_delta: float = 0.1
    lantern_normalize: bool = False
    gsd_half_width: int = 7
    gsd_p_thr: float = 0.15
    gsd_d_thr: float = 0.5
    lumina_q_clamp: float = 0.99
    lumina_reprocess: bool = True

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"acceptance rule must be one of {RULES}, got {self.rule!r}")
        check_int("lantern_k", self.lantern_k, minimum=0)
        check_number("budget_delta", self.budget_delta, minimum=0, maximum=1)
        check_number("budget_decay", self.budget_decay, minimum=0, maximum=1, exclusive_minimum=True)
        check_number("budget_end", self.budget_end, minimum=0, maximum=1)
        check_number("budget_ratio", self.budget_ratio, minimum=0)
        if 0 < self.budget_ratio < 1:
            raise ValueError(f"budget_ratio must be 0 (no cap) or at least 1, got {self.budget_ratio!r}")
        check_int("budget_neighbors", self.budget_neighbors, minimum=0)
        for name in ("lantern_delta", "gsd_p_thr", "gsd_d_thr"):
            check_number(name, getattr(self, name), minimum=0)
        check_int("gsd_half_width", self.gsd_half_width, minimum=1)
        check_number("lumina_q_clamp", self.lumina_q_clamp, minimum=0, maximum=1)
        if not isinstance(self.lumina_reprocess, bool):
            raise ValueError(f"lumina_reprocess must be True or False, got {self.lumina_reprocess!r}")

    @property
    def lossless(self) -> bool:
        """True for the exact rule (the relaxed rules are lossy even where they happen to be exact)."""
        return self.rule == "exact"

    @property
    def name(self) -> str:
        if self.rule == "budget":
            options = [f"delta={spec_number(self.budget_delta)}"] + [
                f"{key}={spec_number(getattr(self, 'budget_' + key))}" for key, default in
                (("decay", 1.0), ("end", 1.0), ("ratio", 0.0), ("neighbors", 0)) if getattr(self, "budget_" + key) != default]
            return "budget:" + ",".join(options)
        if self.rule == "lantern":
            return (f"lantern:k={self.lantern_k},delta={spec_number(self.lantern_delta)}"
                    + (",normalize=1" if self.lantern_normalize else ""))
        if self.rule == "gsd":
            return (f"gsd:half_width={self.gsd_half_width},p_thr={spec_number(self.gsd_p_thr)},"
                    f"d_thr={spec_number(self.gsd_d_thr)}")
        if self.rule == "lumina":
            options = ([f"q_clamp={spec_number(self.lumina_q_clamp)}"] if self.lumina_q_clamp != 0.99 else []) + \
                      ([] if self.lumina_reprocess else ["reprocess=0"])
            return "lumina" + (":" + ",".join(options) if options else "")
        return "exact"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, spec: Union[None, str, "AcceptanceConfig"]) -> "AcceptanceConfig":
        """``None``/``"exact"``, ``"budget:delta=0.1,decay=0.9,end=0.5,ratio=2,neighbors=50"``, ``"lantern"``,
        ``"lantern:k=50,delta=0.2,normalize=1"``, ``"gsd:half_width=5"``, ``"lumina"``, ``"lumina:reprocess=0"``."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"acceptance must be a name, an AcceptanceConfig or None, got {type(spec).__name__}")
        rule, _, options = spec.strip().partition(":")
        rule = rule.strip().lower()
        if rule not in RULES:
            raise ValueError(f"acceptance rule must be one of {RULES}, got {rule!r}")
        allowed = {f.name.removeprefix(f"{rule}_"): f for f in fields(cls) if f.name.startswith(f"{rule}_")}
        values: dict = {"rule": rule}
        for item in filter(None, (o.strip() for o in options.split(","))):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq or key not in allowed:
                raise ValueError(f"unknown option {item!r} for acceptance {rule!r}; expected key=value with key in {sorted(allowed)}")
            kind = allowed[key].type
            try:
                if "bool" in str(kind):
                    value = raw.strip().lower() in ("1", "true", "yes", "on")
                elif "int" in str(kind):
                    value = int(raw)
                else:
                    value = float(raw)
            except ValueError as error:
                raise ValueError(f"acceptance option {key}={raw!r} is not a number") from error
            values[f"{rule}_{key}"] = value
        try:
            return cls(**values)
        except ValueError as error:  # name the spec's key (delta), not the field (budget_delta)
            raise ValueError(f"acceptance {spec.strip()!r}: {str(error).replace(f'{rule}_', '')}") from None


class AcceptanceRule:
    """The exact rule, and the base of the relaxed ones, which override the probability-level :meth:`accept`,
    :meth:`residual_weights` and :meth:`output_tv`.

    Two levels: :meth:`accept`, :meth:`residual_weights` and :meth:`output_tv` define the rule on probability
    rows ``p, q [R, V]``; :meth:`accept_drafts` and :meth:`sample` run it on the dense probability rows of a
    :class:`~vispec.kernels.target.Target` (:meth:`Target.probabilities`) with the target's keyed noise.
    The exact rule needs neither: :func:`vispec.decoding.speculative.verify_window` sends it straight to the
    target's kernels (:meth:`Target.accept`, :meth:`Target.sample`).
    """

    config: AcceptanceConfig

    def __init__(self, config: AcceptanceConfig | None = None):
        self.config = config or AcceptanceConfig()

    @property
    def lossless(self) -> bool:
        return self.config.lossless

    # ---- on a verification's dense probability rows ----------------------------------------------

    def accept_drafts(self, target: Target, drafts: Drafts, draws: Tensor) -> Tensor:
        """``[T]`` bool: which rows keep their draft by :meth:`accept` on ``target``'s probability rows;
        uniforms keyed by (seed, position, ACCEPT, ``draws``)."""
        drafts = drafts.checked(target.num_rows, target.vocab, target.validate)
        rows = ((drafts.tokens >= 0) & (target.row_sample >= 0)).nonzero().squeeze(1)
        p = target.probabilities()
        accepted = torch.zeros(target.num_rows, dtype=torch.bool, device=target.device)
        accepted[rows] = self.accept(p[rows], drafts.tokens[rows], drafts.dense(rows, target.vocab, p.dtype),
                                     target.accept_uniforms(draws)[rows])
        return accepted

    def sample(self, target: Target, request: SampleRequest, drafts: Drafts) -> tuple[Tensor, Tensor]:
        """``(residual_tokens [T], fresh_tokens [T])``: rejected rows sample this rule's residual
        (:meth:`residual_weights` of the probability rows), fresh rows sample ``p`` (:meth:`Target.sample`)."""
        request = request.checked(target.num_rows, target.vocab, target.device, target.validate)
        drafts = drafts.checked(target.num_rows, target.vocab, target.validate)
        rows = (request.residual & (target.row_sample >= 0) & (drafts.tokens >= 0)).nonzero().squeeze(1)
        residual_tokens = torch.full((target.num_rows,), -1, dtype=torch.int64, device=target.device)
        if rows.numel():
            weights = self.rows_residual(target, rows, drafts)
            noise = (request.noise.residual[rows] if request.noise is not None else
                     target.race_noise(rows, torch.full_like(rows, int(Stream.RESIDUAL)), request.residual_draws[rows]))
            residual_tokens[rows] = verify.sample_from_weights(weights, noise)
        request.residual = torch.zeros_like(request.residual)
        return residual_tokens, target.sample(request)[1]

    def rows_residual(self, target: Target, rows: Tensor, drafts: Drafts) -> Tensor:
        """``[len(rows), V]`` what the given rejected rows of ``target`` sample from (:meth:`target_residual`)."""
        p = target.probabilities()
        return self.target_residual(target, p[rows], drafts.tokens[rows], drafts.dense(rows, target.vocab, p.dtype))

    def for_verification(self, target: Target, drafts: Drafts, slots: Tensor, num_tokens: Optional[int]) -> "AcceptanceRule":
        """The rule for one verification of ``target`` (``slots [T]``: each row's window row, ``num_tokens``: the
        image's length, None if unknown): itself, or a rule bound to the rows (the budgeted rule's per-row budgets)."""
        return self

    def measure_tv(self, target: Target, rows: Tensor, drafts: Drafts) -> Tensor:
        """``[len(rows)]`` :meth:`output_tv` of the given rows of a verification."""
        p = target.probabilities()
        return self.output_tv(p[rows], drafts.dense(rows, target.vocab, p.dtype))

    def target_residual(self, target: Target, p: Tensor, drafts: Tensor, q: Tensor) -> Tensor:
        """What rejected rows of ``target`` sample from: :meth:`residual_weights` (a rule may also use the
        target's sampling settings)."""
        return self.residual_weights(p, drafts, q)

    # ---- on probability rows ---------------------------------------------------------------------

    def accept(self, p: Tensor, drafts: Tensor, q: Tensor, u: Tensor) -> Tensor:
        """``[R]`` bool: keep draft ``drafts[r]`` (``u q(x) < p(x)``)."""
        at = drafts[:, None]
        return verify.speculative_test(u, q.gather(-1, at).squeeze(-1), p.gather(-1, at).squeeze(-1))

    def residual_weights(self, p: Tensor, drafts: Tensor, q: Tensor) -> Tensor:
        """``[R, V]`` unnormalised distribution a rejected row samples from: ``max(0, p - q)``."""
        return verify.residual_weights(p, q)

    def output_tv(self, p: Tensor, q: Tensor) -> Tensor:
        """``[R]`` TV between the verification's output distribution (draft ``x ~ q``) and ``p``: 0."""
        return torch.zeros(p.shape[0], dtype=torch.float64, device=p.device)


def _output_distribution(p: Tensor, q: Tensor, accepted_mass: Tensor, residual: Tensor, zeroed_mass: Tensor) -> Tensor:
    """``P(y) = a(y) + Σ_x w(x) R_x(y) / Z_x`` with ``R_x = R`` outside ``S_x = {x}``, zeroed on rejecting ``x``.

    ``residual R [R, V]``; ``zeroed_mass [R, V]``: ``R(S_x)`` for each ``x``. A rejected ``x`` whose residual has no
    mass left outputs token 0 (what the exponential race returns on all-zero weights). (LANTERN's larger sets
    ``S_x``, ``x`` and its absorbed neighbours, are summed sparsely in :meth:`LanternRule.output_tv`.)
    """
    p, q, residual = p.double(), q.double(), residual.double()
    rejected = q - accepted_mass
    total = residual.sum(-1, keepdim=True)
    left = total - zeroed_mass
    empty = left <= 0
    c = torch.where(empty, torch.zeros_like(rejected), rejected / left.clamp_min(1e-300))
    out = accepted_mass + residual * (c.sum(-1, keepdim=True) - c)  # Σ_{x : y ∉ S_x} c(x)
    out[:, 0] += (rejected * empty).sum(-1)
    return out


class LanternRule(AcceptanceRule):
    """LANTERN / LANTERN++ relaxed acceptance (module docstring); ``neighbors`` is ``[V, >= k]``."""

    def __init__(self, config: AcceptanceConfig, neighbors: Tensor):
        super().__init__(config)
        if neighbors.dim() != 2 or neighbors.shape[1] < config.lantern_k:
            raise ValueError(f"neighbors must be [vocab, >= {config.lantern_k}], got shape {tuple(neighbors.shape)}")
        self.neighbors = neighbors[:, : config.lantern_k].long()

    def _absorbed(self, p: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """For ``tokens [R, M]``: neighbour ids ``[R, M, k]``, absorbed flags ``[R, M, k]`` and mass ``c_J [R, M]``."""
        neighbors = self.neighbors.to(p.device)[tokens]
        if neighbors.shape[-1] == 0:
            empty = torch.zeros(*tokens.shape, 0, dtype=torch.bool, device=p.device)
            return neighbors, empty, torch.zeros(tokens.shape, dtype=p.dtype, device=p.device)
        mass = p.gather(-1, neighbors.flatten(1)).view(neighbors.shape).cumsum(-1)
        delta = self.config.lantern_delta
        budget = torch.full_like(mass[..., 0], delta) if delta <= 1 else (delta - 1) * p.gather(-1, tokens)
        absorbed = mass <= budget[..., None]  # c_j is nondecreasing: a prefix
        count = absorbed.sum(-1)
        moved = torch.where(count > 0, mass.gather(-1, (count - 1).clamp_min(0)[..., None]).squeeze(-1), torch.zeros_like(budget))
        return neighbors, absorbed, moved

    def relaxed_probability(self, p: Tensor, tokens: Tensor) -> Tensor:
        """``p̃(x) = p(x) + c_J(x)`` for ``tokens [R, M]``."""
        return p.gather(-1, tokens) + self._absorbed(p, tokens)[2]

    def accept(self, p: Tensor, drafts: Tensor, q: Tensor, u: Tensor) -> Tensor:
        at = drafts[:, None]
        p_tilde = self.relaxed_probability(p, at).squeeze(-1)
        return verify.speculative_test(u, q.gather(-1, at).squeeze(-1), p_tilde)

    def residual_weights(self, p: Tensor, drafts: Tensor, q: Tensor) -> Tensor:
        neighbors, absorbed, _ = self._absorbed(p, drafts[:, None])
        zeroed = p.scatter(-1, drafts[:, None], 0.0)
        zeroed = zeroed.scatter(-1, neighbors[:, 0], torch.where(absorbed[:, 0], torch.zeros_like(zeroed[:, :1]), zeroed.gather(-1, neighbors[:, 0])))
        return verify.residual_weights(zeroed, q)

    def output_tv(self, p: Tensor, q: Tensor) -> Tensor:
        """``[R]`` TV between one verification's output (draft ``x ~ q``) and ``p``: :func:`_output_distribution`'s
        ``P(y) = a(y) + Σ_x w(x) R_x(y) / Z_x`` with ``a = min(q, p + c_J)``, computed only where it is not ``q``.

        A draft ``x`` with ``q(x) <= p(x)``, or whose absorbed mass reaches ``q(x) - p(x)``, is always kept (``w(x) =
        0``): its neighbours matter only through ``c_J(x)``, and only until ``p(x) + c_j(x) >= q(x)``. So the
        neighbour masses are summed for the pairs ``(row, x)`` with ``q > p`` only, over prefixes of growing length
        (:meth:`_absorbed_prefix`), and the zeroed sets ``N_1..N_J(x)`` are read for the drafts a rejection can hit.
        The work follows the prefixes a verification reaches (about 3000 neighbour reads per row of tiny-c2i at
        ``k = 1000``), not ``V k`` per row, so a decode can measure every verified row."""
        p64, q64 = p.double(), q.double()
        rows, vocab = p64.shape
        residual = (p64 - q64).clamp_min(0.0)
        r, x = (q64 > p64).nonzero(as_tuple=True)  # drafts that may be rejected
        p_at, q_at = p64[r, x], q64[r, x]
        count, moved = self._absorbed_prefix(p64, r, x, p_at, q_at)
        accepted_mass = q64.index_put((r, x), torch.minimum(q_at, p_at + moved))
        rejected = q_at - accepted_mass[r, x]  # w(x)
        hit = (rejected > 0).nonzero().squeeze(1)
        r, x, count, rejected = r[hit], x[hit], count[hit], rejected[hit]
        longest = int(count.max()) if count.numel() else 0
        neighbors = self.neighbors.to(p.device)[x, :longest]  # [S, J_max]: the absorbed prefix N_1..N_J(x)
        absorbed = torch.arange(longest, device=p.device) < count[:, None]
        zeroed = residual[r, x] + (residual[r[:, None], neighbors] * absorbed).sum(-1)  # R(S_x)
        left = residual.sum(-1)[r] - zeroed
        empty = left <= 0
        c = torch.where(empty, torch.zeros_like(rejected), rejected / left.clamp_min(1e-300))
        share = torch.zeros(rows, dtype=torch.float64, device=p.device).index_add_(0, r, c)
        hits = torch.zeros(rows * vocab, dtype=torch.float64, device=p.device).index_add_(0, r * vocab + x, c)
        hits.index_add_(0, (r[:, None] * vocab + neighbors)[absorbed], c[:, None].expand_as(absorbed)[absorbed])
        out = accepted_mass + residual * (share[:, None] - hits.view(rows, vocab))
        out[:, 0] += torch.zeros(rows, dtype=torch.float64, device=p.device).index_add_(0, r, rejected * empty)
        return 0.5 * (out - p64).abs().sum(-1)

    def _absorbed_prefix(self, p: Tensor, r: Tensor, x: Tensor, p_at: Tensor, q_at: Tensor) -> tuple[Tensor, Tensor]:
        """For pairs ``(r, x)`` of rows of ``p`` and tokens (``p_at = p[r, x]``, ``q_at = q[r, x]``): ``(J, c_J)``, or
        a shorter absorbed prefix ``(j, c_j)`` with ``p(x) + c_j >= q(x)`` (the draft is then kept whatever ``J``).

        :meth:`_absorbed`'s cumulative masses, read over prefixes of 16, 64, 256, ... columns of the neighbour table
        (up to ``k``); a pair leaves once its prefix ends inside the table (``c_{j+1}`` over the budget) or reaches
        ``q(x)``. A few passes over the pairs still open, never one per row or token."""
        count = torch.zeros(r.shape, dtype=torch.long, device=p.device)
        moved = torch.zeros(r.shape, dtype=p.dtype, device=p.device)
        k = self.neighbors.shape[1]
        if k == 0 or r.numel() == 0:
            return count, moved
        table = self.neighbors.to(p.device)
        delta = self.config.lantern_delta
        budget = torch.full_like(p_at, delta) if delta <= 1 else (delta - 1) * p_at
        pending = torch.arange(r.numel(), device=p.device)
        length = min(k, 16)
        while True:
            mass = p[r[pending, None], table[x[pending], :length]].cumsum(-1)
            n = (mass <= budget[pending, None]).sum(-1)  # c_j is nondecreasing: a prefix
            c = torch.where(n > 0, mass.gather(-1, (n - 1).clamp_min(0)[:, None]).squeeze(-1), torch.zeros_like(mass[:, 0]))
            count[pending], moved[pending] = n, c
            if length == k:
                break
            pending = pending[(n == length) & (p_at[pending] + c < q_at[pending])]
            if pending.numel() == 0:
                break
            length = min(k, 4 * length)
        return count, moved


GSD_TABLE_MAX_VOCAB = 16384  # GSD's [V, V] embedding-closeness table (at most 256 MiB of bools); above: per pair
TV_CHUNK_ELEMENTS = 1 << 24  # elements per chunk of GSD's closeness table and its per-pair test


class GSDRule(AcceptanceRule):
    """Grouped speculative decoding's group-ratio acceptance (module docstring); ``embeddings [V, D]``."""

    def __init__(self, config: AcceptanceConfig, embeddings: Tensor):
        super().__init__(config)
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be [vocab, dim], got shape {tuple(embeddings.shape)}")
        self.embeddings = embeddings.detach().float()
        self._close: dict[torch.device, Tensor] = {}  # per device: the [V, V] embedding-distance test (close_tokens)

    def groups(self, p: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """For ``tokens [R, M]``: group members ``[R, M, 2H]`` and membership flags (the token itself is always in)."""
        vocab = p.shape[-1]
        width = self.config.gsd_half_width
        order = p.argsort(dim=-1, stable=True)  # ascending: the same order as the processed logits
        rank = order.argsort(dim=-1)
        r = rank.gather(-1, tokens)
        start = (r - width).clamp(0, max(vocab - 2 * width, 0))  # clamped window of 2H ranks around r
        span = torch.arange(min(2 * width, vocab), device=p.device)
        members = order.gather(-1, (start[..., None] + span).flatten(1)).view(*tokens.shape, span.numel())
        inside = ((start[..., None] + span) >= r[..., None] - width) & ((start[..., None] + span) < r[..., None] + width)
        close_p = (p.gather(-1, members.flatten(1)).view(members.shape) - p.gather(-1, tokens)[..., None]).abs() < self.config.gsd_p_thr
        close = self._close_direct(tokens[..., None].expand_as(members).reshape(-1), members.reshape(-1))
        member = inside & close_p & close.view(members.shape)
        member |= members == tokens[..., None]
        return members, member

    def _group_sums(self, p: Tensor, q: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        members, member = self.groups(p, tokens)
        flat = members.flatten(1)
        p_group = (p.gather(-1, flat).view(members.shape) * member).sum(-1)
        q_group = (q.to(p.dtype).gather(-1, flat).view(members.shape) * member).sum(-1)
        return p_group, q_group

    def accept(self, p: Tensor, drafts: Tensor, q: Tensor, u: Tensor) -> Tensor:
        p_group, q_group = self._group_sums(p, q, drafts[:, None])
        return verify.speculative_test(u, q_group.squeeze(-1), p_group.squeeze(-1))

    def all_group_sums(self, p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
        """``(Σ_G p, Σ_G q)`` ``[R, V]`` of every token's group: :meth:`_group_sums` of every token, from the sorted ranks.

        A token's group is itself and the tokens ``d`` ranks away (``-H <= d < H``, inside the vocabulary) that pass
        both closeness tests, which are symmetric in the pair: so the pairs ``(order[i], order[i + d])`` for
        ``d = 1..H`` cover every group, ``H`` passes over ``[R, V]`` tensors whatever ``R``; the embedding test of a pair
        is read from :meth:`close_tokens` (no ``[R, V, 2H, D]`` gather)."""
        width, vocab = self.config.gsd_half_width, p.shape[-1]
        order = p.argsort(dim=-1, stable=True)  # as groups()
        p_sorted, q_sorted = p.gather(-1, order), q.to(p.dtype).gather(-1, order)
        p_sum, q_sum = p_sorted.clone(), q_sorted.clone()
        for d in range(1, min(width, vocab - 1) + 1):
            joined = (((p_sorted[:, d:] - p_sorted[:, :-d]).abs() < self.config.gsd_p_thr)
                      & self.close_tokens(order[:, :-d], order[:, d:]))
            p_sum[:, d:] += p_sorted[:, :-d] * joined  # order[i + d]'s group holds order[i] (d ranks below)
            q_sum[:, d:] += q_sorted[:, :-d] * joined
            if d < width:  # order[i]'s group holds order[i + d] (d ranks above: d < H)
                p_sum[:, :-d] += p_sorted[:, d:] * joined
                q_sum[:, :-d] += q_sorted[:, d:] * joined
        return torch.empty_like(p_sum).scatter_(-1, order, p_sum), torch.empty_like(q_sum).scatter_(-1, order, q_sum)

    def close_tokens(self, a: Tensor, b: Tensor) -> Tensor:
        """``||E_b - E_a||² < d_thr`` elementwise for token ids ``a, b``: :meth:`groups`' embedding test, as it decides
        it (the float32 expression; NaN rows pass none). Up to :data:`GSD_TABLE_MAX_VOCAB` tokens it is read from a
        ``[V, V]`` table made once per device (:meth:`_close_table`); above, computed for the given pairs."""
        if self.embeddings.shape[0] <= GSD_TABLE_MAX_VOCAB:
            if a.device not in self._close:
                self._close[a.device] = self._close_table(a.device)
            return self._close[a.device][a, b]
        return self._close_direct(a.reshape(-1), b.reshape(-1)).view(a.shape)

    def _close_direct(self, a: Tensor, b: Tensor) -> Tensor:
        """The embedding test ``||E_b - E_a||² < d_thr`` in float32 for the pairs ``(a, b)`` (1-D), in chunks of
        :data:`TV_CHUNK_ELEMENTS`: the one expression :meth:`groups` decides membership with and :meth:`_close_table`
        reproduces."""
        emb = self.embeddings.to(a.device)
        close = torch.zeros(a.shape, dtype=torch.bool, device=a.device)
        step = max(1, TV_CHUNK_ELEMENTS // emb.shape[1])
        for lo in range(0, a.numel(), step):
            close[lo:lo + step] = ((emb[b[lo:lo + step]] - emb[a[lo:lo + step]]) ** 2).sum(-1) < self.config.gsd_d_thr
        return close

    def _close_table(self, device: torch.device) -> Tensor:
        """``[V, V]`` bool, :meth:`_close_direct` of every pair without its ``V² D`` work: the squared distances in
        float64 by the Gram matrix (``|a|² + |b|² - 2 a·b``, chunks of rows), then every pair whose float64 distance lies
        within the float32 expression's rounding of ``d_thr`` (``(D + 8) 2^-24`` relative, four times over, plus the
        Gram's own float64 error) is decided by :meth:`_close_direct` itself. The other pairs' float32 result
        cannot fall on the other side, so the table is the expression's."""
        emb = self.embeddings.to(device)
        vocab, dim = emb.shape
        threshold = self.config.gsd_d_thr
        finite = torch.isfinite(emb).all(-1)
        e64 = torch.where(finite[:, None], emb.double(), torch.zeros((), dtype=torch.float64, device=device))
        norms = (e64 * e64).sum(-1)
        close = torch.zeros(vocab, vocab, dtype=torch.bool, device=device)
        relative, absolute = 4 * (dim + 8) * 2.0 ** -24, 4 * (dim + 8) * 2.0 ** -52
        step = max(1, TV_CHUNK_ELEMENTS // vocab)
        for lo in range(0, vocab, step):
            rows = slice(lo, lo + step)
            sizes = norms[rows, None] + norms[None, :]
            dist = sizes - 2 * (e64[rows] @ e64.T)
            close[rows] = dist < threshold
            unsure = (dist - threshold).abs() <= relative * torch.maximum(dist.abs(), torch.full_like(dist, threshold)) + absolute * sizes
            a, b = unsure.nonzero(as_tuple=True)
            close[a + lo, b] = self._close_direct(a + lo, b)
        return close & finite[:, None] & finite[None, :]

    def output_tv(self, p: Tensor, q: Tensor) -> Tensor:
        p64, q64 = p.double(), q.double()
        p_group, q_group = self.all_group_sums(p64, q64)
        ratio = torch.where(q_group > 0, (p_group / q_group.clamp_min(1e-300)).clamp(max=1.0), torch.ones_like(q_group))
        accepted_mass = q64 * ratio
        residual = (p64 - q64).clamp_min(0.0)
        out = _output_distribution(p64, q64, accepted_mass, residual, torch.zeros_like(p64))
        # the exact residual never has mass at a rejected draft; GSD's can (x rejected although p(x) > q(x)):
        # _output_distribution assumed S_x = {x} is zeroed, so add back R(x)'s share for those x
        left = residual.sum(-1, keepdim=True)
        rejected = q64 - accepted_mass
        fix = torch.where(left > 0, rejected / left.clamp_min(1e-300), torch.zeros_like(left)) * residual
        out = out + fix
        return 0.5 * (out - p64).abs().sum(-1)


LUMINA_Q_FLOOR = 1e-7  # sampled_draft_probs.clamp(min=1e-7) in get_acc_criterion_mask
LUMINA_VALID_EPS = 1e-7  # get_reject_sampling_logits' eps: valid_mask = residual mass + eps > 1
LUMINA_MASS_FLOOR = 1e-10  # the residual's normaliser, clamp(min=1e-10)


class LuminaRule(AcceptanceRule):
    """Lumina-mGPT 2.0's SJD verification, a lossy rule (visual-ar spec §11.5).

    Reproduces ``SpeculativeSampler`` in ``lumina_mgpt/generate_examples/sjds.py`` of
    Alpha-VLLM/Lumina-mGPT-2.0 (checked at commit f44a4d7f15aaf35e097d422b5712468001489c6c):

    * acceptance, ``get_acc_criterion_mask``: ``u < min(1, p(x) / max(q(x), 1e-7))`` with ``q`` the stored
      draft distribution (one-hot for initialised drafts, as in SJD);
    * the rejected position's weights, ``get_reject_sampling_logits``:
      ``r = max(0, p - min(q, 0.99))`` normalised by ``max(Σ r, 1e-10)``, but replaced by ``p`` itself
      wherever ``valid_mask = Σ r + 1e-7 > 1`` is false. The clamped residual's mass is
      ``Σ (p - min(q, 0.99))_+``, below 1 unless ``p`` and ``q`` are (nearly) disjoint; for a one-hot draft ``x``
      it is ``1 - min(p(x), 0.99)``, so a rejected initialised draft is resampled from ``p``, ``x`` included,
      unless ``p(x) < 1e-7``. The weights do not depend on which draft was rejected;
    * ``reject_sampling_single_token``: the log of those weights goes through the sampler's
      ``logits_processor`` again, then softmax and a multinomial draw. ``renew_sampler._sample`` in
      ``jacobi_utils_static.py`` builds the sampler with ``_sample``'s ``logits_processor``: their
      ``create_logits_processor`` list (``MultiTokensVLLogitsProcessor`` for end-of-line / image tokens, image
      top-k, top-n-sigma) followed, under their transformers 4.46.2 (``requirements.txt``; warpers merged into
      the processor list by huggingface/transformers#32626), by the temperature warper. Here
      (``lumina_reprocess``) the weights' log goes through :func:`vispec.sampling.warp_logits` again
      (temperature, top-k, top-p); the position processors are not re-applied: vispec's only mask or force
      tokens, which leaves weights inside ``p``'s support unchanged. It changes nothing at temperature 1 and
      top-p 1 (the weights' support is within ``p``'s top-k);
    * ``__call__``: the first rejection ends the window; accepted drafts and the resampled token are committed,
      and the later outputs become the next drafts with their ``p`` as ``q`` (as in SJD; the verification
      here runs through the same :func:`vispec.decoding.speculative.verify_window` as every rule).

    Not modelled: the batch-wide minimum of accepted lengths (``prefix_matching_next_tokens``; vispec keeps
    per-sample lengths), top-n-sigma (not a vispec warper) and ``rand_times > 1`` (default 1).

    The output of one verification with draft ``x ~ q`` is ``P(y) = q(y) a(y) + (Σ_x q(x) (1 - a(x))) R(y)``
    with ``a`` the acceptance probability and ``R`` the normalised (re-warped) weights; :meth:`output_tv`
    returns ``TV(P, p)`` (``p(x) (1 - p(x))`` for a one-hot draft ``x`` without re-warping).
    """

    def accept(self, p: Tensor, drafts: Tensor, q: Tensor, u: Tensor) -> Tensor:
        at = drafts[:, None]
        p_at = p.gather(-1, at).squeeze(-1)
        q_at = q.to(p.dtype).gather(-1, at).squeeze(-1)
        return u.to(p.dtype) < (p_at / q_at.clamp_min(LUMINA_Q_FLOOR)).clamp(max=1.0)

    def residual_weights(self, p: Tensor, drafts: Optional[Tensor], q: Tensor) -> Tensor:
        """``[R, V]`` normalised: the clamped residual where its mass is (nearly) 1, else ``p`` (``drafts`` unused)."""
        delta = (p - q.to(p.dtype).clamp(max=self.config.lumina_q_clamp)).clamp_min(0.0)
        mass = delta.sum(-1, keepdim=True)
        valid = mass + LUMINA_VALID_EPS > 1.0
        return torch.where(valid, delta / mass.clamp_min(LUMINA_MASS_FLOOR), p)

    def rejection_distribution(self, p: Tensor, q: Tensor, sampling: Optional[SamplingConfig] = None) -> Tensor:
        """``[R, V]`` what a rejected row samples from: :meth:`residual_weights`, re-warped with ``sampling``
        (temperature, top-k, top-p) when ``lumina_reprocess`` is on, normalised."""
        weights = self.residual_weights(p, None, q)
        if self.config.lumina_reprocess and sampling is not None and not sampling.greedy:
            weights = warp_logits(weights.log(), sampling).softmax(dim=-1)
        return weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)

    def target_residual(self, target: Target, p: Tensor, drafts: Tensor, q: Tensor) -> Tensor:
        return self.rejection_distribution(p, q, target.sampling)

    def measure_tv(self, target: Target, rows: Tensor, drafts: Drafts) -> Tensor:
        p = target.probabilities()
        return self.output_tv(p[rows], drafts.dense(rows, target.vocab, p.dtype), target.sampling)

    def output_tv(self, p: Tensor, q: Tensor, sampling: Optional[SamplingConfig] = None) -> Tensor:
        """``[R]`` TV between one verification's output (draft ``x ~ q``) and ``p``; ``sampling``: the target's
        settings, for the re-warped rejection distribution (None: not re-warped)."""
        p64, q64 = p.double(), q.double()
        accepted_mass = q64 * (p64 / q64.clamp_min(LUMINA_Q_FLOOR)).clamp(max=1.0)
        rejected = (q64 - accepted_mass).sum(-1, keepdim=True)
        out = accepted_mass + rejected * self.rejection_distribution(p64, q64, sampling)
        return 0.5 * (out - p64).abs().sum(-1)


class TVTracker:
    """Per-sample mean and max of :meth:`AcceptanceRule.output_tv` over a decode (lossy rules only).

    Every pass measures every verified row of every sample: the window rows ``j < D_b`` that test a draft, whether or
    not the pass commits their output (a verification's TV is the rule's at that row's ``p`` and ``q``, fixed before
    the draft is tested). One batched :meth:`AcceptanceRule.measure_tv` call per pass covers them all: the budgeted
    rule reads the mass its relaxation moved (:meth:`vispec.decoding.budget.BudgetVerification.measure_tv`), the
    others compute their closed forms (LANTERN's reads only the neighbour prefixes a rejection can reach,
    :meth:`LanternRule.output_tv`; GSD's groups come from the sorted ranks, :meth:`GSDRule.all_group_sums`)."""

    def __init__(self, batch: int, device: torch.device):
        self.total = torch.zeros(batch, dtype=torch.float64, device=device)
        self.count = torch.zeros(batch, dtype=torch.float64, device=device)
        self.worst = torch.zeros(batch, dtype=torch.float64, device=device)
        self.budget: Optional[dict[str, Tensor]] = None  # the budgeted rule's sums (record_budget)

    @torch.compiler.disable
    def measure(self, target: Target, rule: AcceptanceRule, ids: Tensor, num_drafts: Tensor, width: int, drafts: Drafts) -> None:
        """Add the TV of every verified row: ``target`` row ``b * width + j`` is sample ``ids[b]``'s window row ``j``,
        verified when ``j < num_drafts[b]``. Eager inside a compiled step (:mod:`vispec.decoding.compiled` compiles
        static shapes): the closed forms' sizes follow the pass (rows verified, drafts a rejection can reach), and each
        size would be a graph of its own."""
        slot = torch.arange(width, device=num_drafts.device)
        verified = slot[None, :] < num_drafts[:, None]  # [B, W]
        rows = verified.reshape(-1).nonzero().squeeze(1)
        tv = torch.zeros(verified.numel(), dtype=torch.float64, device=num_drafts.device)
        tv[rows] = rule.measure_tv(target, rows, drafts).to(torch.float64)
        tv = tv.view(verified.shape)  # 0 on rows without a draft: neither a sum's term nor (TV >= 0) a new max
        self.total.index_add_(0, ids, tv.sum(1))
        self.count.index_add_(0, ids, verified.sum(1).to(torch.float64))
        self.worst.scatter_reduce_(0, ids, tv.amax(1), reduce="amax")

    def record_budget(self, ids: Tensor, decided: Tensor, moved: Tensor, budget: Tensor, binding: Tensor) -> None:
        """Add the budgeted rule's verifications that decided a token (``decided [B, W]``, rows of samples ``ids``):
        the mass each moved, its budget, and whether the budget was binding (:mod:`vispec.decoding.budget`)."""
        if self.budget is None:
            self.budget = {name: torch.zeros_like(self.total) for name in ("tv_bound", "tv_budget", "binding", "verifications")}
        for name, values in (("tv_bound", moved), ("tv_budget", budget), ("binding", binding), ("verifications", decided)):
            self.budget[name].index_add_(0, ids, (values.double() * decided).sum(1))

    def budget_result(self) -> dict[str, Tensor]:
        """Per sample: ``tv_bound`` (Σ of the moved mass, the TV budget used: its expectation bounds the joint
        distribution's TV from the exact one), ``tv_budget`` (Σ of the budgets: the worst case), ``budget_binding``
        (the share of verifications where the budget limited the move) and ``verifications``; empty for other rules."""
        if self.budget is None:
            return {}
        count = self.budget["verifications"]
        binding = torch.where(count > 0, self.budget["binding"] / count.clamp_min(1), torch.full_like(count, float("nan")))
        return {"tv_bound": self.budget["tv_bound"].cpu(), "tv_budget": self.budget["tv_budget"].cpu(),
                "budget_binding": binding.cpu(), "verifications": count.long().cpu()}

    def result(self) -> tuple[Tensor, Tensor]:
        """``(mean, max)`` per sample, NaN where nothing was measured. The mean is capped at the max: a mean never
        exceeds the largest of its terms, but the float sum can by rounding (the budgeted rule's rows all at δ = 0.1
        averaged 0.10000000000000002), and the cap keeps the mean within the budget as the max is."""
        mean = torch.where(self.count > 0, torch.minimum(self.total / self.count.clamp_min(1), self.worst),
                           torch.full_like(self.total, float("nan")))
        worst = torch.where(self.count > 0, self.worst, torch.full_like(self.worst, float("nan")))
        return mean.cpu(), worst.cpu()
