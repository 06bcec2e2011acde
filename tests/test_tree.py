"""Draft-tree construction: masks are ancestor closures, growth keeps the best-scored nodes."""

import itertools
import math

import torch

from specdec.spec.tree import ancestor_masks, chain_tree, grow_tree, single_node_tree, topk_of


def brute_masks(parents):
    B, T = parents.shape
    out = torch.zeros(B, T, dtype=torch.int64)
    for b, i in itertools.product(range(B), range(T)):
        m, j = 0, i
        while j >= 0:
            m |= 1 << j
            j = int(parents[b, j])
        out[b, i] = m if m < 2**63 else m - 2**64
    return out


def test_ancestor_masks_random_trees():
    g = torch.Generator().manual_seed(0)
    for T in (1, 2, 7, 64):
        parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)])
                               for _ in range(3)]).int()
        assert torch.equal(ancestor_masks(parents, T), brute_masks(parents))


def test_chain_and_single_node():
    root = torch.tensor([5, 6])
    t = chain_tree(root, torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert t.tokens[1].tolist() == [6, 4, 5, 6] and t.depth[0].tolist() == [0, 1, 2, 3]
    assert torch.equal(t.mask, brute_masks(t.parents))
    s = single_node_tree(root)
    assert s.num_nodes == 1 and s.mask.tolist() == [[1], [1]]


def test_grow_tree_matches_brute_force_best_paths():
    """With a fixed conditional distribution per (depth, token), the kept nodes are the globally
    best-scoring ones reachable by frontier expansion, closed under ancestors."""
    V, topk, steps, n = 12, 3, 3, 8
    g = torch.Generator().manual_seed(1)
    table = torch.log_softmax(torch.randn(steps + 1, V, V, generator=g) * 3, dim=-1)  # [depth, tok, V]
    root = torch.tensor([4, 7])
    first = table[0, root]  # [B, V]
    calls = []

    def expand(r, tokens, parent_slot):
        calls.append(r)
        return topk_of(table[r + 1][tokens], topk)  # best children of [B, k, V]

    tree = grow_tree(root, topk_of(first, topk), expand, topk=topk, steps=steps, num_draft_tokens=n)
    assert calls == [0, 1]
    assert tree.tokens.shape == (2, n + 1)
    assert torch.equal(tree.mask, brute_masks(tree.parents))
    for b in range(2):
        par, tok, dep = tree.parents[b].tolist(), tree.tokens[b].tolist(), tree.depth[b].tolist()
        assert all(p < i for i, p in enumerate(par) if i > 0)  # topological
        # node scores recomputed from the table along each path
        def score(i):
            s, j = 0.0, i
            while j > 0:
                s += float(table[dep[j] - 1, tok[par[j]], tok[j]])
                j = par[j]
            return s
        kept = sorted(score(i) for i in range(1, n + 1))
        # Every depth-1 candidate not kept must score no better than the worst kept node.
        top1 = first[b].topk(topk)
        kept_d1 = {tok[i] for i in range(1, n + 1) if dep[i] == 1}
        for s, t in zip(top1.values.tolist(), top1.indices.tolist()):
            if t not in kept_d1:
                assert s <= kept[0] + 1e-5
        assert all(math.isfinite(x) for x in kept)


def test_grow_chain_is_greedy_path():
    V = 10
    g = torch.Generator().manual_seed(2)
    table = torch.log_softmax(torch.randn(V, V, generator=g), -1)
    root = torch.tensor([3])
    tree = grow_tree(root, topk_of(table[root], 1), lambda r, t, p: topk_of(table[t], 1), topk=1, steps=4,
                     num_draft_tokens=4)
    want, cur = [], 3
    for _ in range(4):
        cur = int(table[cur].argmax())
        want.append(cur)
    assert tree.tokens[0, 1:].tolist() == want
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3]
