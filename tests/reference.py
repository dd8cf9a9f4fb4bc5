"""Independent, loop-by-loop re-computation of the method in docs/method.md (non-causal layer, causal layer, KSVD loss).

Deliberately naive (Python loops over sequences, heads and positions) so that it shares no code and no
vectorisation tricks with hf_primal.modeling.primal.
"""

import torch


def _normalize(v):
    return v / max(float(v.norm()), 1e-12)


def reference_sample_ranks(L, p, rule="even"):
    """Rank among the L valid tokens of the token each of the p slots holds (docs/method.md, "Sampling").

    Written from the statement of each rule, not from hf_primal's formula: when L >= p (either rule), and always
    for "legacy", slot j holds floor(j (L - 1) / (p - 1)); for "even" with L < p the slots are dealt out in order,
    token r taking ceil((r + 1) p / L) - ceil(r p / L) consecutive slots.
    """
    if p == 1:
        return [0]
    if L >= p or rule == "legacy":
        return [(j * (L - 1)) // (p - 1) for j in range(p)]
    assert rule == "even", rule
    ranks = []
    for r in range(L):
        ranks += [r] * (-(-(r + 1) * p // L) - (-(-r * p // L)))
    assert len(ranks) == p
    return ranks


def reference_slot_runs(L, p):
    """The valid-token ranks each slot averages under the "segment_mean" rule, written from its statement: for L >= p
    the L tokens are dealt into p consecutive runs in order, run j taking the ranks from floor(j L / p) up to (not
    including) floor((j + 1) L / p); for L < p slot j holds the one token the "even" rule gives it."""
    if L < p:
        return [[rank] for rank in reference_sample_ranks(L, p, "even")]
    return [list(range((j * L) // p, ((j + 1) * L) // p)) for j in range(p)]


def _slot_rows(x_b, positions, p, rule):
    """(p, C) rows of one sequence's layer input under `rule` (positions: its valid positions, in order)."""
    L = len(positions)
    if rule == "jitter":  # in eval mode (the only deterministic one) it samples as "even"
        rule = "even"
    if rule == "segment_mean":
        return torch.stack([torch.stack([x_b[positions[r]] for r in run]).double().mean(0)
                            for run in reference_slot_runs(L, p)])
    return torch.stack([x_b[positions[rank]] for rank in reference_sample_ranks(L, p, rule)]).double()


@torch.no_grad()
def reference_noncausal(x, q, k, valid, We, Wr, head_map_w, head_map_b, rule="even"):
    """x (B,N,C), q/k (B,H,N,d), valid (B,N) bool, We/Wr (H,p,s) -> y (B,H,N,d), e, r (sampling `rule`; "jitter" as
    in eval mode: random in training, it samples as "even" at inference)."""
    B, H, N, d = q.shape
    p, s = We.shape[1], We.shape[2]
    y = torch.zeros(B, H, N, d, dtype=torch.float64)
    e_all = torch.zeros(B, H, N, s, dtype=torch.float64)
    r_all = torch.zeros(B, H, N, s, dtype=torch.float64)
    for b in range(B):
        positions = [n for n in range(N) if bool(valid[b, n])]
        L = len(positions)
        if L == 0:
            continue
        rows = _slot_rows(x[b], positions, p, rule)  # (p, C)
        for h in range(H):
            Xs = rows[:, h * d:(h + 1) * d]  # (p, d)
            WeX = Xs.T @ We[h].double()  # (d, s)
            WrX = Xs.T @ Wr[h].double()
            for n in positions:
                e = _normalize(q[b, h, n].double()) @ WeX
                r = _normalize(k[b, h, n].double()) @ WrX
                e_all[b, h, n], r_all[b, h, n] = e, r
                y[b, h, n] = torch.cat([e, r]) @ head_map_w.double().T + head_map_b.double()
    return y, e_all, r_all


@torch.no_grad()
def reference_causal(q, k, valid, We, Wr, head_map_w, head_map_b, gammas=None):
    """q/k (B,H,N,d), valid (B,N), We/Wr (H,d,s) -> y (B,H,N,d), e, r.

    gammas: None (each earlier valid token weighs the same: the prefix mean) or H per-head decays, under which token
    j weighs gamma_h ** (number of valid tokens after j up to n) in the feature of token n."""
    B, H, N, d = q.shape
    s = We.shape[2]
    y = torch.zeros(B, H, N, d, dtype=torch.float64)
    e_all = torch.zeros(B, H, N, s, dtype=torch.float64)
    r_all = torch.zeros(B, H, N, s, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                if not bool(valid[b, n]):
                    continue
                seen = [j for j in range(n + 1) if bool(valid[b, j])]
                weights = [1.0 if gammas is None else float(gammas[h]) ** sum(1 for i in seen if i > j) for j in seen]
                q_mean = sum(w * q[b, h, j].double() for w, j in zip(weights, seen)) / sum(weights)
                k_mean = sum(w * k[b, h, j].double() for w, j in zip(weights, seen)) / sum(weights)
                e = _normalize(q_mean) @ We[h].double()
                r = _normalize(k_mean) @ Wr[h].double()
                e_all[b, h, n], r_all[b, h, n] = e, r
                y[b, h, n] = torch.cat([e, r]) @ head_map_w.double().T + head_map_b.double()
    return y, e_all, r_all


@torch.no_grad()
def reference_layer_J(e, r, valid, Lambda, We, Wr):
    """Per-sequence and batch J of one layer (docs/method.md, "The KSVD loss", code semantics)."""
    B, H, N, s = e.shape
    lam = Lambda.double()
    trace = sum(float(torch.trace(We[h].double().T @ Wr[h].double())) for h in range(H)) / H
    per_seq = []
    tot_e = tot_r = tot_n = 0.0
    for b in range(B):
        se = sr = 0.0
        n_valid = 0
        for h in range(H):
            for n in range(N):
                if bool(valid[b, n]):
                    se += 0.5 * float(((lam[h] * e[b, h, n]) ** 2).sum())
                    sr += 0.5 * float(((lam[h] * r[b, h, n]) ** 2).sum())
                    n_valid += 1
        per_seq.append(se / n_valid + sr / n_valid - trace)
        tot_e, tot_r, tot_n = tot_e + se, tot_r + sr, tot_n + n_valid
    return per_seq, tot_e / tot_n + tot_r / tot_n - trace


@torch.no_grad()
def reference_kep_svgp(x, q, k, valid, We, Wr, theta, m_u, tril, log_diag, out_w, out_b, eps, covariance,
                       rule="even"):
    """KEP-SVGP layer, token by token (docs/method.md, "KEP-SVGP"; the authors' layer for "reference").

    Per head h and valid token n: z = e + r (the primal scores), v_a = z_a exp(2 theta_a), mean f_j = sum_a v_a
    m_u[a, j]; "reference": noise_j = sum_{a, i} v_a L[a, i, j] eps[i] with L[a, i, j] = exp(log_diag[a, i]) if
    i == j, tril[a, i, j] if i > j, else 0; "consistent": noise_j = sum_{a, i} v_a L_j[a, i] eps[j, i] with L_j[a, i]
    = exp(log_diag[j, a]) if a == i, tril[j, a, i] if a > i, else 0. y = out(f + noise); zero at padding.
    `eps` (B, H, N, s) or (B, H, N, s, s); None: the posterior mean.
    """
    B, H, N, d = q.shape
    s = We.shape[2]
    _, e_all, r_all = reference_noncausal(x, q, k, valid, We, Wr, torch.zeros(d, 2 * s), torch.zeros(d), rule)
    y = torch.zeros(B, H, N, d, dtype=torch.float64)

    def entry(h, first, second, third):
        # The factor entry, read as the authors' L[a, i, j] (reference) or L_j[a, i] stored [j, a, i] (consistent).
        if covariance == "reference":
            a, i, j = first, second, third
            return (float(log_diag[h, a, i].double().exp()) if i == j else float(tril[h, a, i, j]) if i > j else 0.0)
        j, a, i = first, second, third
        return float(log_diag[h, j, a].double().exp()) if a == i else float(tril[h, j, a, i]) if a > i else 0.0

    for b in range(B):
        for h in range(H):
            for n in range(N):
                if not bool(valid[b, n]):
                    continue
                v = [float(e_all[b, h, n, a] + r_all[b, h, n, a]) * float((2 * theta[h, a].double()).exp())
                     for a in range(s)]
                f = [sum(v[a] * float(m_u[h, a, j]) for a in range(s)) for j in range(s)]
                if eps is not None:
                    for j in range(s):
                        if covariance == "reference":
                            f[j] += sum(v[a] * entry(h, a, i, j) * float(eps[b, h, n, i])
                                        for a in range(s) for i in range(s))
                        else:
                            f[j] += sum(v[a] * entry(h, j, a, i) * float(eps[b, h, n, j, i])
                                        for a in range(s) for i in range(s))
                y[b, h, n] = torch.tensor(f, dtype=torch.float64) @ out_w.double().T + out_b.double()
    return y, e_all, r_all


def reference_kep_kl(theta, m_u, tril, log_diag):
    """The KL term of the authors' code, written term by term from its statement (reference reading):
    1/2 sum_{h,a,i,j} exp(4 theta[h,a]) L[h,a,i,j]^2 + 1/2 sum_{h,a,j} exp(4 theta[h,a]) m_u[h,a,j]^2
    - sum log_diag - 2 s sum theta - s^2 H / 2."""
    H, s = theta.shape
    total = 0.0
    for h in range(H):
        for a in range(s):
            w = float((4 * theta[h, a].double()).exp())
            for i in range(s):
                for j in range(s):
                    value = (float(log_diag[h, a, i].double().exp()) if i == j
                             else float(tril[h, a, i, j]) if i > j else 0.0)
                    total += 0.5 * w * value ** 2
            for j in range(s):
                total += 0.5 * w * float(m_u[h, a, j]) ** 2
    return total - float(log_diag.double().sum()) - 2 * s * float(theta.double().sum()) - 0.5 * s * s * H


def reference_gammas(heads, mixing="decay"):
    """Per-head decays of docs/method.md, "Causal layer": gamma_h = 1 - 2^-b_h, b_h evenly spaced from 1 to 10 over
    the heads (1 for one head) under "decay"; None (the prefix mean) under "prefix_mean"."""
    if mixing == "prefix_mean":
        return None
    exponents = [1.0] if heads == 1 else [1 + 9 * h / (heads - 1) for h in range(heads)]
    return [1 - 2.0 ** -b for b in exponents]
