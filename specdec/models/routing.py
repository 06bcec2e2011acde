"""Expert routing of a random-weight MoE target: ``target.routing``, kind router | uniform | zipf.

  router   (the default, and the only kind for real checkpoints, dense targets, tensor parallelism and
           engine.exact) no steering: the model's own router picks. With random weights ("random router")
           that is NOT independent uniform routing within a request: a sequence's hidden states are
           dominated by its context, so a request's tokens pick nearly the same experts. Measured at the
           Qwen3-30B-A3B shape scaled to 12 layers (128 experts, top-8), served through specdec.run after a
           200-token prompt: a 17-token tree verify at batch 1 read 12.5 distinct experts per layer (85.3
           if its tokens routed independently), the 199-token prefill 40; across requests it is about
           uniform (8 requests' decode tokens, one each, read 49.1 against 51.6 independent). On an H100
           the served tree16 step at batch 1 took 7.2 ms, where a profile whose rows routed nearly
           independently (66.9 experts per layer) took 14.5 ms. So the random router understates what a small
           batch's verify reads, uniform overstates it against a trained router, and zipf lies between.
  uniform  steered: every token's K experts drawn uniformly and independently of its neighbours (the
           model below at skew 0 and keep 0: no popularity, no working set). The upper bound of the experts
           a verify reads at a small batch.
  zipf     steered: a stated model of a trained router, which is skewed (some experts are picked far
           more often than others) and whose request's consecutive tokens share experts. Both shrink the
           distinct experts a batch reads, which is what an MoE verify of B x (k + 1) tokens pays for.
           ``{kind: zipf, skew: s, reuse: r, seed}``:

  popularity   the expert of popularity rank i (1-based) has weight i^-s; each MoE layer ranks its
               experts by its own fixed random permutation.
  working set  each request holds K experts per layer, drawn from the popularity without replacement
               (Gumbel-top-K), keyed by the request: the first KV page of its row, the one per-request
               value a forward sees (the engine keeps no request id on the device). So a request routes by
               where the engine placed it: two runs that page it differently (plain and speculative, or
               after a preemption) route it differently, with the same statistics; the outputs of a
               random-weight target carry no meaning either way.
  a token      keeps each expert of its request's working set with probability ``keep`` and fills the
               rest of its K from the popularity without replacement.
  reuse r      what ``reuse`` means, measurably: the mean fraction of a token's K experts that the
               request's previous token also selected. ``keep`` is solved at build time (bisection over
               the selection below, on a fixed sample of requests) so that consecutive tokens reuse r of
               their experts. Popular experts recur by chance alone, so the smallest r a skew allows is
               that chance overlap (keep = 0; ``reuse: null`` takes it); r = 1 routes every token of a
               request to its working set. Kind uniform is skew 0 at the chance overlap (K / E).

Every draw is a hash of (seed, request, position, token id): a token routes the same way in a prefill
chunk, a decode step or a verify tree, whatever else the forward holds, and a tree's siblings (different
tokens at one position) route apart. A token's previous token is the one before it at position p - 1 in
the request; overlap beyond consecutive tokens is the same as between them (the working set does not
drift), which the reuse test measures on a tiny model.

How the fused kernel is made to route so (kernels_triton/moe.py, ``steer``): each MoE layer's kernel adds
M to the router logits of the experts selected for each token, before the softmax. M = MARGIN x the
largest logit std max_e ||g * w_e|| (g: the layer's RMSNorm weight, w_e: expert e's router row; a normed
row has RMS 1 before it), so the selected experts win the top-K whatever the router's own logits; their
routing weights come from the router's own logits (the margin is common to them). The experts compute on
the layer's normed input, unchanged. All layers take one selection per forward, each through its own
expert permutation (so the distinct experts per layer are the same in every layer).

Cost (the steered kinds, uniform and zipf): per forward a few dozen small launches on [N, E] (hashing, two
top-Ks) and one gather of the per-layer expert ids [L_moe, N, K]; in each MoE layer K compares per logit,
inside the router kernel. Graph-capturable (fixed shapes, constants on the device), no host sync. Real
checkpoints and dense targets refuse any kind but router, as do tensor parallelism (the shard's forward does
not steer) and engine.exact (a request's routing follows its KV placement, which differs between a plain and
a speculative run).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError

KINDS = ("router", "uniform", "zipf")  # router: no steering; uniform, zipf: steered
KEYS = ("kind", "skew", "reuse", "seed")
P31 = 2**31 - 1  # hashes live in [0, 2^31 - 1): a product with a multiplier < 2^31 fits int64
MARGIN = 16.0  # logit gain of a selected expert, in units of the largest logit std (the spread of E logits ~ 6)
BIG = 1.0e4  # a kept working-set expert's lead in the selection score over any drawn one
# The sample keep is solved on: CALIBRATE_REQUESTS requests of CALIBRATE_TOKENS consecutive tokens
# (~2,000 token pairs: the measured reuse is within ~0.005 of its expectation at K = 8).
CALIBRATE_REQUESTS = 128
CALIBRATE_TOKENS = 17


@dataclass(frozen=True)
class RoutingConfig:
    """``target.routing``: kind router | uniform | zipf; skew s >= 0 (zipf: weight of rank i is i^-s); reuse r
    in [chance, 1] or None (zipf: the chance overlap); seed of the hashes and permutations (uniform, zipf)."""

    kind: str = "router"
    skew: float = 0.0
    reuse: float | None = None
    seed: int = 0

    @classmethod
    def of(cls, conf) -> "RoutingConfig":
        """From a ``target.routing`` mapping (None: router); unknown keys and bad values are named."""
        if conf is None:
            return cls()
        d = dict(conf)
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ConfigError(f"target.routing: unknown keys {unknown}; valid: {', '.join(KEYS)}")
        kind = str(d.get("kind") or "router")
        if kind not in KINDS:
            raise ConfigError(f"target.routing.kind={kind!r}; valid: {', '.join(KINDS)}")
        try:
            skew = float(d.get("skew") or 0.0)
            reuse = None if d.get("reuse") is None else float(d["reuse"])
            seed = int(d.get("seed") or 0)
        except (TypeError, ValueError):
            raise ConfigError(f"target.routing: skew and reuse must be numbers, seed an integer; got {d}") from None
        if not (skew >= 0 and math.isfinite(skew)):
            raise ConfigError(f"target.routing.skew={skew}: must be a finite number >= 0")
        if reuse is not None and not 0 <= reuse <= 1:
            raise ConfigError(f"target.routing.reuse={reuse}: must be in [0, 1] (or null: the chance overlap)")
        # skew and reuse shape zipf only: set under another kind they would silently do nothing
        stray = [f"{k}={v}" for k, v, unset in (("skew", skew, skew == 0), ("reuse", reuse, reuse is None))
                 if not unset]
        if kind != "zipf" and stray:
            raise ConfigError(f"target.routing.kind={kind} with {', '.join(stray)}: skew and reuse are zipf's "
                              "(kind uniform is skew 0 at the chance reuse); set kind zipf or leave them at "
                              "skew 0, reuse null")
        return cls(kind, skew, reuse, seed)

    @property
    def steered(self) -> bool:
        """uniform and zipf steer the router (ExpertSteering); router leaves the model's own choice."""
        return self.kind != "router"

    def label(self) -> str:
        """"random router", "uniform", or "zipf s=1.2 reuse 0.5" (reuse "chance" when null)."""
        if self.kind == "router":
            return "random router"
        if self.kind == "uniform":
            return "uniform"
        return f"zipf s={self.skew:g} reuse {'chance' if self.reuse is None else f'{self.reuse:g}'}"


# -- hashing (int64 tensors in [0, P31); every op exact, so CPU and GPU draw the same) ---------------
def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x * 1103515245 + 12345) % P31
    x = x ^ (x >> 13)
    x = (x * 1664525 + 1013904223) % P31
    return x ^ (x >> 11)


def _hash(h: torch.Tensor, v) -> torch.Tensor:
    """h (a hash) combined with v (ints >= 0; the low 31 bits count)."""
    return _mix(h ^ (v & 0x7FFFFFFF))


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """Hashes -> float32 uniforms in (0, 1) from their top 24 bits (never 0 or 1)."""
    return (x >> 7).to(torch.float32) * (2.0 ** -24) + 2.0 ** -25


def _gumbel(x: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(_uniform(x)))


class Selector:
    """The selection model of the module docstring for E experts, K per token: ``ids(keys, positions,
    tokens)`` -> [N, K] experts of the base ranking (expert b has popularity rank b + 1). ``keep``: the
    probability a token keeps each expert of its request's working set."""

    def __init__(self, E: int, K: int, skew: float, seed: int, keep: float = 0.0, device=None):
        self.E, self.K, self.keep = int(E), int(K), float(keep)
        rank = torch.arange(1, self.E + 1, dtype=torch.float32, device=device)
        self.log_pop = -float(skew) * torch.log(rank)  # [E] unnormalised log weights (top-K ignores the sum)
        e = torch.arange(self.E, dtype=torch.int64, device=device)
        self.salt_ws = _mix(_mix(e + 1_000_003))  # [E] per-expert salts of the three draws
        self.salt_tok = _mix(_mix(e + 2_000_003))
        self.seed = _mix(torch.tensor(int(seed) % P31, dtype=torch.int64, device=device))

    def ids(self, keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """keys, positions, tokens: int64 [N] (request key, position, token id) -> int64 [N, K]."""
        h_req = _hash(self.seed, keys)  # [N]
        h_tok = _hash(_hash(h_req, positions), tokens)  # [N]
        r = _hash(h_tok[:, None], self.salt_tok)  # [N, E]
        score = self.log_pop + _gumbel(r)  # [N, E] the token's draw
        if self.keep > 0:
            ws = self.log_pop + _gumbel(_hash(h_req[:, None], self.salt_ws))  # [N, E] the request's draw
            member = torch.zeros_like(score).scatter_(1, ws.topk(self.K, dim=-1).indices, 1.0)  # [N, E] 0 / 1
            kept = (_uniform(_mix(r ^ 0x2545F491)) < self.keep).to(score.dtype) * member  # [N, E]
            score = score + BIG * kept
        return score.topk(self.K, dim=-1).indices  # [N, K]


def consecutive_reuse(ids: torch.Tensor) -> float:
    """Mean fraction of a token's experts the previous token also selected, over ids [R, T, K] (R
    requests of T consecutive tokens)."""
    R, T, K = ids.shape
    a, b = ids[:, 1:, :, None], ids[:, :-1, None, :]  # [R, T-1, K, 1], [R, T-1, 1, K]
    return (a == b).any(-1).float().mean().item()


def _sample(seed: int):
    """The calibration sample: keys, positions, token ids of CALIBRATE_REQUESTS requests x CALIBRATE_TOKENS
    consecutive positions (random token ids; keys apart from any a serving engine's pages take)."""
    R, T = CALIBRATE_REQUESTS, CALIBRATE_TOKENS
    keys = (torch.arange(R, dtype=torch.int64) + 7_000_000)[:, None].expand(R, T).reshape(-1)
    pos = (torch.arange(T, dtype=torch.int64) + 100)[None, :].expand(R, T).reshape(-1)
    tok = _mix(_mix(torch.arange(R * T, dtype=torch.int64) + int(seed) % P31)) % 100_000
    return keys, pos, tok


def measured_reuse(E: int, K: int, skew: float, seed: int, keep: float) -> float:
    """Consecutive-token reuse of the selection with ``keep`` on the calibration sample."""
    keys, pos, tok = _sample(seed)
    ids = Selector(E, K, skew, seed, keep).ids(keys, pos, tok)
    return consecutive_reuse(ids.view(CALIBRATE_REQUESTS, CALIBRATE_TOKENS, K))


@functools.lru_cache(maxsize=32)
def solve_keep(E: int, K: int, skew: float, reuse: float | None, seed: int) -> tuple[float, float, float]:
    """(keep, the reuse it gives, the chance reuse at keep = 0) for a target ``reuse`` (None: keep 0).
    The reuse grows with keep (a kept expert is the previous token's too, with probability keep); 16
    bisection steps on the fixed sample (keep to within 2e-5)."""
    chance = measured_reuse(E, K, skew, seed, 0.0)
    if reuse is None:
        return 0.0, chance, chance
    if reuse < chance - 0.01:
        raise ConfigError(f"target.routing.reuse={reuse:g}: below the chance overlap {chance:.3f} of consecutive "
                          f"tokens at skew {skew:g} ({K} of {E} experts); valid: {chance:.3f} .. 1, or null (chance)")
    lo, hi = 0.0, 1.0
    for _ in range(16):
        mid = (lo + hi) / 2
        if measured_reuse(E, K, skew, seed, mid) < reuse:
            lo = mid
        else:
            hi = mid
    keep = (lo + hi) / 2
    return keep, measured_reuse(E, K, skew, seed, keep), chance


class ExpertSteering:
    """The routing of ``config`` on ``model`` (a TransformerModel with MoE layers): ``selection(input_ids,
    positions, meta)`` -> the forward's experts per MoE layer [L_moe, N, K] int32, which each layer's kernel
    raises by ``margins[j]`` (module docstring)."""

    def __init__(self, model, config: RoutingConfig):
        c = model.config
        E, K = c.num_experts, c.num_experts_per_tok
        self.config = config
        # uniform: skew 0 and reuse None (RoutingConfig.of refuses others), so keep = 0 and no working set
        self.keep, self.reuse, self.chance = solve_keep(E, K, config.skew, config.reuse, config.seed)
        dev = model.device
        self.selector = Selector(E, K, config.skew, config.seed, self.keep, device=dev)
        gen = torch.Generator().manual_seed(int(config.seed))
        perms, margins = [], []
        with torch.no_grad():
            for layer in c.moe_layers:
                j = model.moe_slot[layer]
                W = model.router[j].detach().float()  # [E, H]
                g = model.mlp_norm[layer].detach().float()  # [H]
                margins.append(MARGIN * (W * g).norm(dim=-1).max().item())
                perms.append(torch.randperm(E, generator=gen).to(dev))  # base expert b -> this layer's perm[b]
        self.perm = torch.stack(perms).to(torch.int32)  # [L_moe, E]: MoE layer j routes base expert b to perm[j, b]
        self.margins = margins

    def base_ids(self, input_ids, positions, meta) -> torch.Tensor:
        """[N, K] int64: the base experts each token of the forward selects (before the layers' permutations)."""
        N = input_ids.shape[0]
        rows = meta.page_table.shape[0]
        tok_row = torch.searchsorted(meta.cu_q_lens[1:].to(torch.int64),
                                     torch.arange(N, device=input_ids.device), right=True).clamp_(max=rows - 1)  # [N]
        if meta.page_table.shape[1]:
            keys = meta.page_table[:, 0].to(torch.int64)[tok_row]  # [N] the row's first page: the request
        else:
            keys = tok_row
        return self.selector.ids(keys, positions.to(torch.int64), input_ids.to(torch.int64))  # [N, K]

    def selection(self, input_ids, positions, meta) -> torch.Tensor:
        """[L_moe, N, K] int32: the experts each token selects in each MoE layer (one gather)."""
        return self.perm[:, self.base_ids(input_ids, positions, meta)].contiguous()

    def describe(self) -> dict:
        return {"label": self.config.label(), "kind": self.config.kind, "skew": self.config.skew,
                "reuse": self.reuse, "reuse_asked": self.config.reuse, "keep": self.keep,
                "chance_reuse": self.chance, "seed": self.config.seed, "margin_logits": max(self.margins)}


def apply_routing_(model, target_conf, *, tp_size: int = 1, exact: bool = False) -> None:
    """Set ``model.routing`` from ``target_conf.routing`` (steered kinds: a random-weight MoE target only;
    router: None, the model untouched). Errors name what does not fit: a real checkpoint, a dense target, tensor
    parallelism, engine.exact."""
    config = RoutingConfig.of(target_conf.get("routing"))
    model.routing = None
    if not config.steered:
        return
    name = target_conf.get("name", "?")
    if not target_conf.get("random_weights"):
        raise ConfigError(f"target.routing.kind={config.kind} steers a random-weight target's router; target "
                          f"{name!r} has real weights (its router routes): drop target.routing or set its kind "
                          "to router")
    if not model.config.moe_layers:
        raise ConfigError(f"target.routing.kind={config.kind}: target {name!r} has no MoE layers")
    if tp_size > 1:
        raise ConfigError(f"target.routing.kind={config.kind} with tp.size={tp_size}: not implemented (the shard's "
                          "forward does not steer); run it at tp.size=1")
    if exact:
        raise ConfigError(f"target.routing.kind={config.kind} with engine.exact=true: steered routing keys a request "
                          "by where its KV is placed, so plain and speculative runs route it differently and exact "
                          "mode's identity cannot hold; use routing kind router or engine.exact=false")
    model.routing = ExpertSteering(model, config)


def routing_facts(target_conf, model) -> dict:
    """metrics.json's ``routing`` for a random-weight MoE target ({} otherwise: a dense target, or a real
    checkpoint's router): the label and, when steered, the solved keep, the reuse it gives and the chance reuse;
    under kind router {"label": "random router", "kind": "router"}."""
    if not getattr(model.config, "moe_layers", ()) or not target_conf.get("random_weights"):
        return {}
    steering = getattr(model, "routing", None)
    if steering is not None:
        return {"routing": steering.describe()}
    config = RoutingConfig.of(target_conf.get("routing"))
    return {"routing": {"label": config.label(), "kind": config.kind}}
