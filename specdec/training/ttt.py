"""EAGLE-3 training-time test (TTT): the unrolled draft forward, its attention mask and its loss.

Notation: a sequence t_0 .. t_{L-1}; f_j the target's captured features at position j (the
residual stream entering the three target layers); p_j the target's next-token distribution at
position j (it predicts t_{j+1}). Row j of the unroll is the draft chain anchored at position j:

    step 0:   hidden = fc(f_j),                     token t_{j+1},   RoPE position j
    step i:   hidden = draft output of step i-1,    token t_{j+1+i}, RoPE position j + i
              (row j, pre-norm, not detached)
    step i predicts t_{j+2+i}; its teacher is p_{j+1+i} restricted to the draft vocabulary and
    renormalised (so a target token outside the draft vocabulary still teaches through the rest
    of its distribution).

This is exactly what :class:`specdec.spec.eagle3.Eagle3Drafter` computes at inference: the root
is row seq_len - 1 of the draft KV (step 0), and a depth-d tree node sits at position
seq_len - 1 + d with its parent's hidden state. (SpecForge keeps position j at every step; we
train with the positions the engine uses.)

Attention at step i, row j (:func:`ttt_mask`): the step-0 keys of rows j' <= j (the draft KV of the
real sequence, as the engine keeps it) and row j's own keys of steps 1 .. i (its path in the draft
tree). :func:`ttt_attention` evaluates this mask compactly: one causal [T, T] block against step 0
plus one diagonal column per later step, never the dense [T, (i + 1) T] matrix that
:func:`ttt_attention_ref` (the plain reference the tests compare against) builds.

Rows: the loss and the metrics count row j at step i when its prediction is an answer token that
exists, i.e. prompt_len <= j + 2 + i <= L - 1 and j + 2 >= prompt_len (the chain starts in the
answer, as at inference). Loss = sum_i decay^i * mean over those rows of the soft cross-entropy.
Per-step acceptance = top-1 agreement of the draft (mapped to target ids) with the target's argmax
at position j + 1 + i; chain acceptance at step i = steps 0 .. i all agree (the teacher-forced
estimate of "a chain accepts more than i tokens", exact when the data is the target's greedy output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels_triton.rope import rope_ref


# ----------------------------------------------------------------------------------------------
# Attention under the TTT mask
# ----------------------------------------------------------------------------------------------

def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Dense boolean mask [T, (step + 1) * T]: may the query of row j at ``step`` see key column
    s * T + j' (the key of row j' written at step s)? True iff s == 0 and j' <= j (causal over the
    real sequence), or 1 <= s <= step and j' == j (the row's own earlier draft steps and itself)."""
    j = torch.arange(T, device=device)
    causal = j[None, :] <= j[:, None]  # [T, T]
    diag = torch.eye(T, dtype=torch.bool, device=device)  # [T, T]
    return torch.cat([causal] + [diag] * step, dim=1)


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Attention of step len(ks) - 1 under :func:`ttt_mask`, differentiable.

    q: [B, T, HQ, D]; ks, vs: one [B, T, HKV, D] per step 0 .. i (RoPE applied to q and ks).
    Returns [B, T, HQ, D]. Scores and softmax in fp32; the row's own keys of steps 1 .. i are
    stacked and scored in one batched product (one [G, D] x [D, i] per row and KV head), so a step
    costs the same number of kernels at every depth.
    """
    B, T, HQ, D = q.shape
    HKV = ks[0].shape[2]
    G = HQ // HKV  # query heads per KV head (GQA)
    scale = 1.0 / math.sqrt(D)
    qh = q.view(B, T, HKV, G, D).permute(0, 2, 3, 1, 4)  # [B, HKV, G, T, D]
    k0 = ks[0].permute(0, 2, 1, 3)[:, :, None]  # [B, HKV, 1, T, D]
    v0 = vs[0].permute(0, 2, 1, 3)[:, :, None]  # [B, HKV, 1, T, D]
    s0 = (qh @ k0.transpose(-1, -2)).float() * scale  # [B, HKV, G, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    if len(ks) == 1:
        return (s0.softmax(-1).to(v0.dtype) @ v0).permute(0, 3, 1, 2, 4).reshape(B, T, HQ, D)
    # Row j's own keys of steps 1..i: [B, T, HKV, i, D], one score per (row, head, step).
    kd = torch.stack(ks[1:], dim=3)
    vd = torch.stack(vs[1:], dim=3)
    sd = torch.einsum("bhgtd,bthsd->bhgts", qh, kd).float() * scale  # [B, HKV, G, T, i]
    p = torch.cat([s0, sd], dim=-1).softmax(-1).to(v0.dtype)  # [B, HKV, G, T, T + i]
    o = p[..., :T] @ v0  # [B, HKV, G, T, T] @ [B, HKV, 1, T, D] -> [B, HKV, G, T, D]
    o = o + torch.einsum("bhgts,bthsd->bhgtd", p[..., T:], vd)
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, D)


def ttt_attention_ref(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Plain reference: keys of every step concatenated [B, (i + 1) T, ...], dense :func:`ttt_mask`."""
    B, T, HQ, D = q.shape
    G = HQ // ks[0].shape[2]
    k = torch.cat(ks, dim=1).repeat_interleave(G, dim=2).float()  # [B, (i+1)T, HQ, D]
    v = torch.cat(vs, dim=1).repeat_interleave(G, dim=2).float()
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) / math.sqrt(D)  # [B, HQ, T, (i+1)T]
    s = s.masked_fill(~ttt_mask(T, len(ks) - 1, q.device), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# The draft layer (training form of Eagle3Head.forward, same weights)
# ----------------------------------------------------------------------------------------------

def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm for training: fp32 statistics and one rounding to x's dtype at the end (the kernels
    round the normalised row before the weight multiply: the two differ by at most one bf16 rounding;
    in fp32, as on the CPU tests, they agree)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def draft_layer(head, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """One TTT step of the draft layer; appends this step's keys/values to ``ks``/``vs``.

    emb, hidden: [B, T, H]; positions: [T] RoPE positions of the rows. Returns the pre-norm output
    hidden [B, T, H] (the next step's ``hidden``).
    """
    c = head.config
    B, T, _ = hidden.shape
    HQ, HKV, D, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    w = head.w
    e = _norm(emb, w("midlayer.input_layernorm.weight"), eps)
    h = _norm(hidden, w("midlayer.hidden_norm.weight"), eps)
    x = torch.cat([e, h], dim=-1)  # [B, T, 2H]
    q = (x @ w("midlayer.self_attn.q_proj.weight").t()).reshape(B * T, HQ, D)
    k = (x @ w("midlayer.self_attn.k_proj.weight").t()).reshape(B * T, HKV, D)
    v = (x @ w("midlayer.self_attn.v_proj.weight").t()).view(B, T, HKV, D)
    q, k = rope_ref(q, k, positions.repeat(B), head.rope_cos, head.rope_sin)
    ks.append(k.view(B, T, HKV, D))
    vs.append(v)
    o = ttt_attention(q.view(B, T, HQ, D), ks, vs)  # [B, T, HQ, D]
    a = o.reshape(B, T, HQ * D) @ w("midlayer.self_attn.o_proj.weight").t()
    residual = a + hidden
    x = _norm(residual, w("midlayer.post_attention_layernorm.weight"), eps)
    gate = x @ w("midlayer.mlp.gate_proj.weight").t()
    up = x @ w("midlayer.mlp.up_proj.weight").t()
    return residual + (F.silu(gate) * up) @ w("midlayer.mlp.down_proj.weight").t()


def draft_logits(head, hidden: torch.Tensor) -> torch.Tensor:
    """[N, H] pre-norm draft hidden -> [N, draft_vocab] logits."""
    c = head.config
    return _norm(hidden, head.w("norm.weight"), c.rms_norm_eps) @ head.w("lm_head.weight").t()


def soft_ce(head, hidden: torch.Tensor, teacher_hidden: torch.Tensor,
            vocab_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' soft cross-entropy against the target and the draft's top-1.

    hidden: [N, H] pre-norm draft hidden (differentiable); teacher_hidden: [N, H] the target's
    final-normed hidden at the predicted position; vocab_weight: [Vd, H]. Returns (loss [N] =
    -sum p log softmax(z), with p the target's distribution restricted to the draft vocabulary and
    renormalised; draft argmax [N] in draft ids)."""
    z = draft_logits(head, hidden).float()  # [N, Vd]
    p = (teacher_hidden @ vocab_weight.t()).float().softmax(-1).detach()  # [N, Vd]
    return z.logsumexp(-1) - (p * z).sum(-1), z.argmax(-1)


_COMPILED: dict = {}


def ttt_functions(compile: bool = False):
    """(draft_layer, soft_ce), or their ``torch.compile`` forms (``train.compile``: the elementwise
    work of a step (norms, RoPE, dtype casts, the loss) fused into few kernels; shapes dynamic, so one
    compile per unroll depth serves every padded batch). Compiled once per process."""
    if not compile:
        return draft_layer, soft_ce
    if not _COMPILED:
        # One graph per unroll depth (the list of earlier keys grows) and per size-1 batch dimension
        # (torch specialises 1): more than dynamo's default 8 per function, after which it would fall
        # back to eager for the rest (seen on a GPU).
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 64))
        _COMPILED["layer"] = torch.compile(draft_layer, dynamic=True)
        _COMPILED["ce"] = torch.compile(soft_ce, dynamic=True)
    return _COMPILED["layer"], _COMPILED["ce"]


# ----------------------------------------------------------------------------------------------
# Unroll + loss
# ----------------------------------------------------------------------------------------------

@dataclass
class TTTOut:
    loss: torch.Tensor  # scalar, sum_i decay^i * loss_i (differentiable)
    step_loss: torch.Tensor  # [S] mean soft cross-entropy per step (detached; 0 where no rows)
    rows: torch.Tensor  # [S] rows counted per step
    correct: torch.Tensor  # [S] rows whose top-1 draft token equals the target's argmax
    chain_correct: torch.Tensor  # [S] rows whose steps 0 .. i all agree


def row_mask(lengths: torch.Tensor, prompt_lens: torch.Tensor, T: int, step: int) -> torch.Tensor:
    """[B, T] bool: rows counted at ``step`` (see the module docstring)."""
    j = torch.arange(T, device=lengths.device)[None, :]  # [1, T]
    return (j + 2 >= prompt_lens[:, None]) & (j + 2 + step <= lengths[:, None] - 1)


def ttt_unroll(head, embed: torch.Tensor, vocab_weight: torch.Tensor, tokens: torch.Tensor,
               features: torch.Tensor, teacher_hidden: torch.Tensor, target_argmax: torch.Tensor,
               lengths: torch.Tensor, prompt_lens: torch.Tensor, *, steps: int,
               decay: float = 0.8, compile: bool = False) -> TTTOut:
    """The unrolled TTT forward and loss over a padded batch.

    Args:
        head: Eagle3Head (its weights, vocabulary and RoPE tables are used; it is not run).
        embed: [V, H] the target's token embedding (frozen).
        vocab_weight: [Vd, H] the target's output-projection rows of the draft vocabulary, in draft
            id order: teacher logits = teacher_hidden @ vocab_weight^T.
        tokens: [B, T] int64, sequences padded with any id; features: [B, T, 3H];
        teacher_hidden: [B, T, H] the target's final-normed hidden state at each position;
        target_argmax: [B, T] the target's greedy next token at each position;
        lengths, prompt_lens: [B] int64.
        compile: run the layer and the loss through :func:`ttt_functions`' compiled forms.
    """
    layer, ce = ttt_functions(compile)
    B, T = tokens.shape
    dev = tokens.device
    toks = F.pad(tokens, (0, steps + 1))  # [B, T + steps + 1]: step i reads t_{j+1+i}
    th = teacher_hidden.reshape(B * T, -1)
    am = target_argmax.reshape(B * T)
    hidden = head.fuse(features)  # [B, T, H]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    loss = torch.zeros((), device=dev)
    step_loss = torch.zeros(steps, device=dev)
    rows = torch.zeros(steps, dtype=torch.long, device=dev)
    correct = torch.zeros(steps, dtype=torch.long, device=dev)
    chain_correct = torch.zeros(steps, dtype=torch.long, device=dev)
    chain = torch.ones(B * T, dtype=torch.bool, device=dev)
    for i in range(steps):
        emb = embed[toks[:, 1 + i:1 + i + T]]  # [B, T, H]
        pos = torch.arange(T, device=dev) + i
        hidden = layer(head, emb.to(hidden.dtype), hidden, pos, ks, vs)  # [B, T, H]
        mask = row_mask(lengths, prompt_lens, T, i).reshape(-1)  # [B * T]
        idx = mask.nonzero().squeeze(1)  # [N]
        if idx.numel() == 0:
            chain &= False
            continue
        t_pos = idx + 1 + i  # the target position j + 1 + i in the flat [B * T] layout
        row_loss, top = ce(head, hidden.reshape(B * T, -1)[idx], th[t_pos], vocab_weight)  # [N], [N]
        with torch.no_grad():
            hit = head.to_target_ids(top) == am[t_pos]  # [N]
            ok = torch.zeros(B * T, dtype=torch.bool, device=dev)
            ok[idx] = hit
            chain &= ok
            rows[i] = idx.numel()
            correct[i] = hit.sum()
            chain_correct[i] = chain[idx].sum()
        li = row_loss.mean()
        loss = loss + decay ** i * li
        step_loss[i] = li.detach()
    return TTTOut(loss, step_loss, rows, correct, chain_correct)
