"""Which tokens a non-causal primal layer samples, and the weights W_{e|X}, W_{r|X} built from them (plain torch).

docs/method.md, "Sampling" and "Non-causal layer" step 3: p slots spread evenly over the *valid* tokens of each
sequence, so left and right padding give the same rows. A slot holds one token (rules ``"even"``, ``"legacy"``,
``"jitter"``) or the mean of the tokens of its interval (``"segment_mean"``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import SAMPLING_RULES


def _interval_bounds(lengths: torch.Tensor, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks [start_j, end_j) of the interval of slot j: (B, 1) lengths -> 2 x (B, p).

    start_j = floor(j L / p), end_j = max(floor((j + 1) L / p), start_j + 1). For L >= p the p intervals partition
    the L valid tokens into runs of floor(L/p) or ceil(L/p); for L < p each interval is the one token of rank
    start_j, which is where the ``"even"`` rule puts slot j.
    """
    j = torch.arange(num_samples, device=lengths.device)
    start = (j * lengths) // num_samples
    end = torch.maximum(((j + 1) * lengths) // num_samples, start + 1)
    return start, end


def single_token_rule(rule: str, training: bool) -> str:
    """The one-token rule a layer with sampling `rule` follows where its intervals hold at most one token (inputs
    shorter than p) or, for ``"jitter"``, at inference."""
    if rule not in SAMPLING_RULES:
        raise ValueError(f"sampling rule {rule!r} is not allowed: use one of {list(SAMPLING_RULES)}.")
    if rule == "legacy" or (rule == "jitter" and training):
        return rule
    return "even"


def _sample_ranks(lengths: torch.Tensor, num_samples: int, rule: str) -> torch.Tensor:
    """Rank among a sequence's valid tokens of the token each of the p slots holds: (B, 1) lengths -> (B, p).

    docs/method.md, "Sampling". L >= p (both rules): slot j holds rank floor(j (L - 1) / (p - 1)), p evenly spaced
    tokens from the first to the last. L < p: ``"even"`` gives slot j rank floor(j L / p), so token r holds slots
    ceil(r p / L) .. ceil((r + 1) p / L) - 1, i.e. floor(p/L) or ceil(p/L) slots each; ``"legacy"`` (hf_primal 0.1)
    keeps the L >= p formula, which gives the last token one slot and every other about p / L. ``"jitter"`` (the
    training-time draw of that rule) gives slot j a uniformly drawn rank of its interval (`_interval_bounds`; for
    L < p that is the ``"even"`` rank). Integer arithmetic keeps the rules exact and identical on every device.
    """
    if rule not in ("even", "legacy", "jitter"):
        raise ValueError(
            f"single-token sampling rule {rule!r} is not allowed: use one of ['even', 'legacy', 'jitter']."
        )
    if rule == "jitter":
        start, end = _interval_bounds(lengths, num_samples)
        draw = torch.rand(start.shape, device=lengths.device)
        return torch.minimum(start + (draw * (end - start)).long(), end - 1)
    if num_samples == 1:
        return torch.zeros_like(lengths)
    j = torch.arange(num_samples, device=lengths.device)
    spread = (j * (lengths - 1).clamp(min=0)) // (num_samples - 1)
    if rule == "legacy":
        return spread
    return torch.where(lengths < num_samples, (j * lengths) // num_samples, spread)


def sample_token_indices(valid: torch.Tensor, num_samples: int, rule: str = "even") -> torch.Tensor:
    """Positions of the p sampled tokens among the valid tokens of each sequence (`_sample_ranks` picks them).

    The rule depends only on each token's rank among the valid ones, so left and right padding give the same
    tokens.

    Args:
        valid: (B, N) bool, True at real tokens.
        num_samples: p >= 1.
        rule: ``"even"``, ``"legacy"`` or ``"jitter"`` (a fresh draw per call; see `single_token_rule`).
    Returns:
        (B, p) int64 positions into the N axis (0 where a sequence has no valid token).
    """
    length = valid.shape[1]
    ranks = _sample_ranks(valid.sum(dim=1, keepdim=True), num_samples, rule)
    running = valid.long().cumsum(dim=1)
    # The position of the token of rank r is the first position where the running count reaches r + 1.
    idx = torch.searchsorted(running, ranks + 1)
    return idx.clamp(max=length - 1)


def _even_positions(length: int, num_samples: int, device: torch.device, rule: str = "even") -> torch.Tensor:
    """`sample_token_indices` for a batch without padding: one (p,) index shared by every sequence."""
    lengths = torch.full((1, 1), length, dtype=torch.long, device=device)
    return _sample_ranks(lengths, num_samples, rule)[0]


def segment_means(x: torch.Tensor, valid: Optional[torch.Tensor], num_samples: int) -> torch.Tensor:
    """(B, N, C) -> (B, p, C): row j is the mean of the valid tokens of ranks [start_j, end_j) (`_interval_bounds`).

    For L >= p every valid token belongs to exactly one run, the run of rank r being floor(((r + 1) p - 1) / L), so
    the p sums are one scatter-add over the N tokens (its backward one gather; fp32 or wider); a sequence with
    L < p takes its one token per slot by a gather, as the ``"even"`` rule does.
    """
    batch, length, width = x.shape
    device = x.device
    if valid is None:
        lengths = torch.full((batch, 1), length, dtype=torch.long, device=device)
        ranks = torch.arange(length, device=device).expand(batch, length)
        keep = torch.ones(batch, length, dtype=torch.bool, device=device)
    else:
        lengths = valid.sum(dim=1, keepdim=True)
        ranks = valid.long().cumsum(dim=1) - 1
        keep = valid
    long_enough = lengths >= num_samples  # (B, 1)
    run = ((ranks + 1) * num_samples - 1) // lengths.clamp(min=1)
    rows = run + num_samples * torch.arange(batch, device=device)[:, None]
    rows = torch.where(keep & long_enough, rows, torch.full_like(rows, batch * num_samples))  # the rest: a spare row
    wide = torch.promote_types(x.dtype, torch.float32)
    sums = x.new_zeros(batch * num_samples + 1, width, dtype=wide).index_add(
        0, rows.reshape(-1), x.reshape(-1, width).to(wide))
    start, end = _interval_bounds(lengths, num_samples)
    means = (sums[:-1].view(batch, num_samples, width) / (end - start)[:, :, None].to(wide)).to(x.dtype)
    # Both branches are always computed: a data-dependent early return would break torch.compile graphs, and the
    # (B, p) gather costs little next to the scatter-add.
    counts = keep.long().cumsum(dim=1)
    single = torch.searchsorted(counts, start + 1).clamp(max=length - 1)  # the token of rank start_j
    tokens = torch.gather(x, 1, single[:, :, None].expand(-1, -1, width))
    return torch.where(long_enough[:, :, None], means, tokens)


def _sample_tokens(
    x: torch.Tensor, valid: Optional[torch.Tensor], num_samples: int, rule: str = "even", training: bool = False
) -> torch.Tensor:
    """(B, N, C) -> (B, p, C) sampled rows of the layer input under sampling `rule` (`training` draws ``"jitter"``)."""
    length = x.shape[1]
    if valid is None and num_samples == length:
        # Every token, in order (e.g. ViT with p = N), under every rule: no copy, no scatter in backward.
        return x
    if rule == "segment_mean":
        return segment_means(x, valid, num_samples)
    rule = single_token_rule(rule, training)
    if valid is None and rule != "jitter":
        # One index for the whole batch: index_select is cheaper than a per-sequence gather and its backward.
        return x.index_select(1, _even_positions(length, num_samples, x.device, rule))
    if valid is None:
        valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    idx = sample_token_indices(valid, num_samples, rule)
    return torch.gather(x, 1, idx[:, :, None].expand(-1, -1, x.shape[-1]))


def num_sampled_tokens(max_tokens: int, low_rank: int, rank_multi: int) -> int:
    """p = min(N_max, s * m) (docs/method.md, "Non-causal layer" step 3)."""
    return max(1, min(int(max_tokens), low_rank * rank_multi))


def sampled_weights(
    x: torch.Tensor,
    valid: Optional[torch.Tensor],
    we: torch.Tensor,
    wr: torch.Tensor,
    rule: str,
    dtype: torch.dtype,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W_{e|X} = X_s^T W_e and W_{r|X} = X_s^T W_r per sequence and head: (B, N, C) -> 2 x (B, H, d, s) views.

    `we`, `wr` are the layer's (H, p, s) weights, `rule` its sampling rule, `dtype` the dtype of the result;
    `training` draws the ``"jitter"`` rule's positions afresh (at inference it samples as ``"even"``).

    One contraction with [W_e | W_r] serves both. When the sequences are shorter than p, sampled tokens repeat:
    summing the weight rows of the slots that hold each token first and contracting over the N tokens instead
    of the p sampled rows is the same sum at N / p of the cost (a ~60-token MiniLM batch with p = 300: ~5x
    less), without the (B, p, C) gather. Every sampling rule gives slots in token order (non-decreasing
    positions), so the slots of token n are a contiguous range [start_n, end_n) and their sum is a difference
    of prefix sums of the weight rows (fp32 or wider): two row gathers instead of a (B, p, H * 2s) scatter.
    """
    batch, length, width = x.shape
    heads, p, s = we.shape
    dim = width // heads
    w = torch.cat([we, wr], dim=-1).to(dtype)  # (H, p, 2s)
    if length < p:
        # Every sequence is shorter than p: each interval holds one token, so every rule is a one-token rule.
        rule = single_token_rule(rule, training=False)
        wide = torch.promote_types(dtype, torch.float32)
        rows = w.transpose(0, 1).reshape(p, heads * 2 * s).to(wide)  # slot-major: row j is slot j of every head
        prefix = torch.cat([rows.new_zeros(1, rows.shape[1]), rows.cumsum(dim=0)])  # (p + 1, H * 2s)
        tokens = x.reshape(batch, length, heads, dim).to(dtype)
        positions = torch.arange(length, device=x.device)
        if valid is None:  # one index for the whole batch
            idx = _even_positions(length, p, x.device, rule)
            start = torch.searchsorted(idx, positions)
            end = torch.searchsorted(idx, positions, right=True)
            per_token = (prefix[end] - prefix[start]).to(dtype).view(length, heads, 2 * s)
            both = torch.einsum("bnhd,nhs->bhds", tokens, per_token)
        else:
            idx = sample_token_indices(valid, p, rule)  # (B, p), sorted along p
            positions = positions.expand(batch, length).contiguous()
            start = torch.searchsorted(idx, positions)
            end = torch.searchsorted(idx, positions, right=True)
            per_token = (prefix[end] - prefix[start]).to(dtype).view(batch, length, heads, 2 * s)
            both = torch.einsum("bnhd,bnhs->bhds", tokens, per_token)
    else:
        sampled = _sample_tokens(x, valid, p, rule, training).reshape(batch, p, heads, dim).to(dtype)
        # Contracting over p keeps the weights (H, p, 2s): no per-sequence copy of W_e, W_r.
        both = torch.einsum("bphd,hps->bhds", sampled, w)  # (B, H, d, 2s)
    return both[..., :s], both[..., s:]
