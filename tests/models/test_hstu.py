"""HSTU's blocks (dynarec.models.hstu) against TorchEasyRec's PyTorch reference semantics,
computed here another way: masks from the rules each kind of token follows, the STU layer as
loops over rows, heads and queries, buckets and periods by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from dynarec.models.hstu import (
    ContextualProjection,
    FusionMTLTower,
    HSTUPositionalEncoder,
    HSTUTransducer,
    L2NormPostprocessor,
    SimpleActionEncoder,
    STULayer,
    STUStack,
    TimestampLayerNormPostprocessor,
    assemble_rows,
    hstu_valid_mask,
    take_candidates,
)


def _mask_by_rules(c: int, u: int, t: int, n: int) -> torch.Tensor:
    """Who sees whom: contextual tokens the contexts and the whole history; a history token the
    contexts and the history up to itself; a candidate the contexts, the history and itself."""
    length = c + u + t
    want = torch.zeros(n, n, dtype=torch.bool)
    for i in range(length):
        for j in range(length):
            if i < c:
                want[i, j] = j < c + u
            elif i < c + u:
                want[i, j] = j <= i
            else:
                want[i, j] = j < c + u or j == i
    return want


@pytest.mark.parametrize("c, u, t", [(2, 3, 2), (0, 3, 2), (2, 0, 3), (1, 4, 0), (3, 1, 1)])
def test_the_mask_follows_each_kind_of_token_rule(c, u, t):
    n = c + u + t + 2  # and padding
    lengths, targets = torch.tensor([c + u + t]), torch.tensor([t])
    got = hstu_valid_mask(lengths, targets, c, n)[0]
    want = _mask_by_rules(c, u, t, n)
    assert torch.equal(got, want), (got.int(), want.int())


def test_the_mask_is_per_row_and_max_attn_len_keeps_recent_keys():
    lengths, targets = torch.tensor([7, 4]), torch.tensor([2, 1])
    got = hstu_valid_mask(lengths, targets, 2, 8)
    assert torch.equal(got[0], _mask_by_rules(2, 3, 2, 8))
    assert torch.equal(got[1], _mask_by_rules(2, 1, 1, 8))
    # ids: contexts 0, history 1, 2, 3, candidates 4; a key at most 1 id back (and itself)
    near = hstu_valid_mask(torch.tensor([7]), torch.tensor([2]), 2, 7, max_attn_len=1)[0]
    assert near[3].tolist() == [False, False, True, True, False, False, False]  # history id 2: ids 1, 2
    assert near[5].tolist() == [False, False, False, False, True, True, False]  # candidate id 4: id 3, itself
    assert near[0].tolist() == [True, True, True, True, True, False, False]  # contexts: as without it


def _stu_by_loops(layer: STULayer, x: torch.Tensor, lengths, targets, c) -> torch.Tensor:
    """The STU layer, one row, head and query at a time (no dropout)."""
    b, n, d = x.shape
    h, dh, da = layer.num_heads, layer.hidden_dim, layer.attention_dim
    out = torch.zeros_like(x)
    for r in range(b):
        length = int(lengths[r])
        allowed = _mask_by_rules(c, length - c - int(targets[r]), int(targets[r]), n)
        for i in range(length):
            xi = F.layer_norm(x[r], (d,), layer.input_norm_weight, layer.input_norm_bias, 1e-6)
            uvqk = xi @ layer.uvqk_weight + layer.uvqk_bias
            u, v, q, k = torch.split(uvqk, [h * dh, h * dh, h * da, h * da], dim=-1)
            attn = []
            for head in range(h):
                acc = torch.zeros(dh)
                for j in range(length):
                    if allowed[i, j]:
                        qk = q[i, head * da : (head + 1) * da] @ k[j, head * da : (head + 1) * da]
                        acc += F.silu(layer.alpha * qk) / layer.scaling_seqlen * v[j, head * dh : (head + 1) * dh]
                attn.append(acc)
            if layer.use_group_norm:
                normed = torch.cat(
                    [
                        (a - a.mean()) / torch.sqrt(a.var(unbiased=False) + 1e-6) * layer.output_norm_weight[g]
                        + layer.output_norm_bias[g]
                        for g, a in enumerate(attn)
                    ]
                )
            else:
                a = torch.cat(attn)
                normed = (a - a.mean()) / torch.sqrt(a.var(unbiased=False) + 1e-6) * layer.output_norm_weight
                normed = normed + layer.output_norm_bias
            ui = F.silu(u[i])
            y = torch.cat([ui, torch.cat(attn), ui * normed])
            out[r, i] = x[r, i] + y @ layer.output_weight
    return out


@pytest.mark.parametrize("group_norm", [True, False])
def test_the_stu_layer_equals_its_loops(group_norm):
    torch.manual_seed(0)
    layer = STULayer(8, num_heads=2, hidden_dim=3, attention_dim=4, scaling_seqlen=16, use_group_norm=group_norm)
    with torch.no_grad():
        layer.uvqk_bias.normal_()
        layer.output_norm_weight.uniform_(0.5, 1.5)
        layer.output_norm_bias.normal_()
        layer.input_norm_weight.uniform_(0.5, 1.5)
    layer.eval()
    lengths, targets, c = torch.tensor([7, 5]), torch.tensor([2, 1]), 2
    x = torch.randn(2, 8, 8)
    got = layer(x, hstu_valid_mask(lengths, targets, c, 8))
    want = _stu_by_loops(layer, x, lengths, targets, c)
    for r, length in enumerate(lengths.tolist()):  # padding positions are never read
        torch.testing.assert_close(got[r, :length], want[r, :length], rtol=1e-5, atol=1e-6)


def test_a_stack_applies_its_layers_in_turn_and_padding_changes_no_valid_token():
    torch.manual_seed(1)
    stack = STUStack(
        [STULayer(8, 2, 4, 4, scaling_seqlen=32, output_dropout_ratio=0.0, use_group_norm=True) for _ in range(2)]
    )
    lengths, targets = torch.tensor([6]), torch.tensor([2])
    x = torch.randn(1, 6, 8)
    got = stack(x, hstu_valid_mask(lengths, targets, 1, 6))
    want = stack[1](stack[0](x, hstu_valid_mask(lengths, targets, 1, 6)), hstu_valid_mask(lengths, targets, 1, 6))
    torch.testing.assert_close(got, want)
    padded = torch.cat([x, 100 * torch.randn(1, 3, 8)], dim=1)
    got_padded = stack(padded, hstu_valid_mask(lengths, targets, 1, 9))
    torch.testing.assert_close(got_padded[:, :6], got, rtol=1e-5, atol=1e-5)


def test_positions_count_back_from_the_newest_history_token_and_times_bucket_by_age():
    enc = HSTUPositionalEncoder(4, num_position_buckets=8, num_contexts=2, num_time_buckets=4, use_time_encoding=True)
    # row: 2 contexts (time 0), history at 100, 200, 300 s, 2 candidates queried at 400 s; padding
    ts = torch.tensor([[0.0, 0.0, 100.0, 200.0, 300.0, 400.0, 400.0, 0.0]])
    pos, time = enc.buckets(torch.tensor([7]), torch.tensor([2]), ts)
    assert pos[0, :7].tolist() == [0, 1, 5, 4, 3, 2, 2]  # contexts 0..c-1; oldest c+U .. newest c+1; candidates c
    ages = [400.0, 400.0, 300.0, 200.0, 100.0, 1e-6, 1e-6]
    want = [int(min(max(math.sqrt(a / 60.0) / 4, 0.0), 1.0) * 4) for a in ages]
    assert time[0, :7].tolist() == want == [2, 2, 2, 1, 1, 0, 0]
    few = HSTUPositionalEncoder(4, num_position_buckets=4, num_contexts=2, num_time_buckets=4, use_time_encoding=True)
    assert few.buckets(torch.tensor([7]), torch.tensor([2]), ts)[0][0, :7].tolist() == [0, 1, 3, 3, 3, 2, 2]
    later = ts.clone()
    later[0, 5:7] = 60.0 * 64 + 400  # candidates queried later: ages past the last bucket's
    assert enc.buckets(torch.tensor([7]), torch.tensor([2]), later)[1][0, 2].item() == 4  # sqrt(69)/4 > 1: clamped
    x = torch.randn(1, 8, 4)
    out = enc(x, torch.tensor([7]), torch.tensor([2]), ts)
    torch.testing.assert_close(
        out[0, 3], x[0, 3] * 2.0 + enc.position_embeddings[4] + enc.time_embeddings[1]
    )  # sqrt(D) = 2


def test_rows_are_assembled_and_their_candidates_taken_back():
    c = torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]]])  # [B, c=2, 1]
    hist = torch.tensor([[[10.0], [11.0], [12.0]], [[20.0], [0.0], [0.0]]])  # U = 3, 1
    cand = torch.tensor([[[30.0], [0.0]], [[40.0], [41.0]]])  # T = 1, 2
    tokens, lengths = assemble_rows(c, hist, torch.tensor([3, 1]), cand, torch.tensor([1, 2]))
    assert lengths.tolist() == [6, 5]
    assert tokens[..., 0].tolist() == [[1, 2, 10, 11, 12, 30], [3, 4, 20, 40, 41, 0]]
    back = take_candidates(tokens, lengths, torch.tensor([1, 2]), 2)
    assert back[..., 0].tolist() == [[30, 0], [40, 41]]


def test_contextual_tokens_and_actions():
    proj = ContextualProjection(3, 2, 4)
    x = torch.randn(5, 6)
    got = proj(x)
    for i in range(3):
        torch.testing.assert_close(got[:, i], x[:, 2 * i : 2 * i + 2] @ proj.weight[i] + proj.bias[i, 0])
    enc = SimpleActionEncoder(2, [1, 2, 4])
    out = enc(torch.tensor([5, 0, 2]))  # bits 1 and 4; none; 2
    e = enc.action_embeddings
    torch.testing.assert_close(out[0], torch.cat([e[0], torch.zeros(2), e[2]]))
    torch.testing.assert_close(out[1], torch.zeros(6))
    torch.testing.assert_close(out[2], torch.cat([torch.zeros(2), e[1], torch.zeros(2)]))
    assert enc.targets((2, 3)).shape == (2, 3, 6)


def test_the_timestamp_postprocessor_adds_time_of_day_and_week():
    post = TimestampLayerNormPostprocessor(4, [3600, 86400], [24, 7])
    feats = post.time_features(torch.tensor([90000.0]))  # hour 25 -> 1 of 24; day 1 -> 1 of 7
    a, b = 1 / 24 * 2 * 3.14, 1 / 7 * 2 * 3.14
    torch.testing.assert_close(feats[0], torch.tensor([math.cos(a), math.sin(a), math.cos(b), math.sin(b)]))
    x = torch.randn(3, 4)
    t = torch.tensor([0.0, 3600.0, 90000.0])
    want = post.norm(post.linear(torch.cat([x, post.time_features(t)], -1)))
    torch.testing.assert_close(post(x, t), want)
    y = L2NormPostprocessor()(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    torch.testing.assert_close(y, torch.tensor([[0.6, 0.8], [0.0, 0.0]]))


def _transducer(seed: int = 0, contexts: int = 2) -> HSTUTransducer:
    torch.manual_seed(seed)
    dim = 8
    model = HSTUTransducer(
        dim=dim,
        history_dim=4,
        candidate_dim=6,
        content_hidden_dim=16,
        positional=HSTUPositionalEncoder(dim, 32, contexts, num_time_buckets=16, use_time_encoding=True),
        stack=STUStack([STULayer(dim, 2, 4, 4, scaling_seqlen=64, use_group_norm=True) for _ in range(2)]),
        postprocessor=TimestampLayerNormPostprocessor(dim, [3600, 86400], [24, 7]),
        num_contexts=contexts,
        contextual_dim=3,
        action_encoder=SimpleActionEncoder(2, [1, 2, 4]),
        action_hidden_dim=12,
    )
    return model.eval()


def _user(u: int, t: int, seed: int, lu: int = 0, lt: int = 0):
    """One row's inputs, padded to ``lu`` history and ``lt`` candidate positions."""
    g = torch.Generator().manual_seed(seed)
    lu, lt = max(lu, u), max(lt, t)
    hist = torch.zeros(lu, 4)
    hist[:u] = torch.randn(u, 4, generator=g)
    ts = torch.zeros(lu)
    ts[:u] = torch.sort(torch.rand(u, generator=g) * 1e6 + 1.6e9).values
    actions = torch.zeros(lu, dtype=torch.int64)
    actions[:u] = torch.randint(0, 8, (u,), generator=g)
    cand = torch.zeros(lt, 6)
    cand[:t] = torch.randn(t, 6, generator=g)
    query = torch.zeros(lt)
    query[:t] = 1.601e9 + 7200.0
    ctx = torch.randn(6, generator=g)
    return dict(
        history=hist, history_lengths=torch.tensor(u), history_timestamps=ts, candidates=cand,
        num_targets=torch.tensor(t), candidate_timestamps=query, history_actions=actions, contextual=ctx,
    )  # fmt: skip


def _batch(*rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def test_a_candidate_sees_the_history_and_no_other_candidate():
    model = _transducer()
    base = _user(5, 3, 0)
    out = model(**_batch(base))[0]
    other = dict(base, candidates=base["candidates"].clone())
    other["candidates"][1] += 1.0  # another candidate 1
    changed = model(**_batch(other))[0]
    torch.testing.assert_close(changed[[0, 2]], out[[0, 2]])
    assert not torch.allclose(changed[1], out[1])
    older = dict(base, history=base["history"].clone())
    older["history"][0] += 1.0  # the oldest history token
    assert not torch.allclose(model(**_batch(older))[0], out)


def test_a_row_encodes_alike_alone_and_padded_beside_a_longer_one():
    model = _transducer(1)
    short, long = _user(3, 2, 1), _user(7, 4, 2)
    alone = model(**_batch(short))[0]
    together = model(**_batch(_user(3, 2, 1, lu=7, lt=4), long))
    torch.testing.assert_close(together[0, :2], alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(together[0, 2:], torch.zeros(2, 8))  # past its candidates
    torch.testing.assert_close(together[1], model(**_batch(long))[0], rtol=1e-5, atol=1e-5)
    no_contexts = _transducer(1, contexts=0)
    assert no_contexts(**_batch(short)).shape == (1, 2, 8)


def test_the_transducer_is_its_modules_composed_in_order():
    model = _transducer(3)
    row = _user(4, 2, 3)
    got = model(**_batch(row))[0]
    content = model.content_mlp(torch.cat([row["history"], row["candidates"][:, :4]]))
    actions = torch.cat([model.action_encoder(row["history_actions"]), model.action_encoder.targets((2,))])
    tokens = content + model.action_mlp(actions)
    contexts = model.contexts(row["contextual"][None])[0]
    x = torch.cat([contexts, tokens])[None]  # [ctx | history | candidates]
    ts = torch.cat([torch.zeros(2), row["history_timestamps"], row["candidate_timestamps"]])[None]
    lengths, targets = torch.tensor([8]), torch.tensor([2])
    x = model.positional(x, lengths, targets, ts)
    x = model.stack(x, hstu_valid_mask(lengths, targets, 2, 8))
    want = model.postprocessor(x[0, 6:], row["candidate_timestamps"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_fusion_tower_scores_every_task_from_user_times_item():
    torch.manual_seed(0)
    tower = FusionMTLTower(4, [1, 2, 1], hidden_units=(8,), activation="silu", layer_norm=True)
    user, item = torch.randn(5, 4), torch.randn(5, 4)
    logits = tower(user, item)
    assert [t.shape for t in logits] == [(5, 1), (5, 2), (5, 1)]
    linear, norm = tower.mlp[0], tower.mlp[1]
    hidden = F.silu(F.layer_norm(linear(user * item), (8,), norm.weight, norm.bias, norm.eps))
    torch.testing.assert_close(torch.cat(logits, -1), tower.out(hidden))
    assert torch.equal(tower.out.bias, torch.zeros(4))  # Xavier weights, zero biases
    with pytest.raises(ValueError, match="activation 'tanh'"):
        FusionMTLTower(4, [1], hidden_units=(8,), activation="tanh")


def test_semi_local_attention_keeps_a_global_prefix_and_a_local_window():
    from dynarec.models.hstu import semi_local_mask

    # 2 contexts, 5 history tokens, 2 candidates; k1 = 2, k2 = max(3, 2) = 3
    got = semi_local_mask(torch.tensor([9]), torch.tensor([2]), 2, 10, sla_k1=2, sla_k2=3)[0]
    want = {
        0: {0},
        1: {0, 1},
        2: {0, 1, 2},
        3: {0, 1, 2, 3},
        4: {0, 1, 2, 3, 4},
        5: {0, 1, 2, 4, 5},  # the prefix [0, 3) and the window [4, 6)
        6: {0, 1, 2, 5, 6},
        7: set(range(7)),  # a candidate: the whole history, not itself
        8: set(range(7)),
    }
    for p in range(10):
        assert {j for j in range(10) if got[p, j]} == want.get(p, set()), p


def test_truncation_keeps_the_contexts_the_newest_history_and_every_candidate():
    from dynarec.models.hstu import truncate_history

    x = torch.tensor([[10.0, 0, 1, 2, 3, 4, 50, 51], [20.0, 7, 60, 0, 0, 0, 0, 0]])[..., None]
    ts = x.squeeze(-1) * 100
    out, lengths, (ts_out,) = truncate_history(x, torch.tensor([8, 3]), torch.tensor([2, 1]), 1, 2, ts)
    assert lengths.tolist() == [5, 3]
    assert out[..., 0].tolist() == [[10, 3, 4, 50, 51], [20, 7, 60, 0, 0]]
    assert ts_out.tolist() == (out[..., 0] * 100).tolist()
