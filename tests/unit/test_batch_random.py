"""`phalanx.BatchRandom` on one rank of a world: its draws are one device's rows, and what it
cannot make exact is one line.

The draws need no process group (only rank and world size), so these run in this process with
the World a rank of 3 would have. The k-rank training equal to one device is
tests/distributed/test_batch_random.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from phalanx.data_parallel.batch_random import BatchDropout
from phalanx.errors import UsageError
from phalanx.runtime.world import World


def world(rank: int, world_size: int) -> World:
    return World(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                 device=torch.device("cpu"), backend="gloo" if world_size > 1 else "none", timeout_s=10)


def test_a_rank_draws_one_devices_rows_of_the_global_batch():
    one = phalanx.BatchRandom(world=world(0, 1), seed=4)
    with one.batch(13):
        whole = (one.randn((13, 3), dtype=torch.float64), one.randint(0, 10, (13,)), one.rand((13, 2)))
    for rank, (start, stop) in enumerate(((0, 5), (5, 9), (9, 13))):  # 13 over 3: 5+4+4, shard_bounds' cut
        draws = phalanx.BatchRandom(world=world(rank, 3), seed=4)
        with draws.batch(13):
            assert draws.rows() == (start, stop)
            mine = (draws.randn_like(torch.zeros(stop - start, 3, dtype=torch.float64)),
                    draws.randint(0, 10, (stop - start,)), draws.rand((stop - start, 2)))
        for got, want in zip(mine, whole):
            assert torch.equal(got, want[start:stop])
        assert torch.equal(draws.generator.get_state(), one.generator.get_state())  # consumed alike


def test_draws_that_are_not_the_ranks_rows_are_refused_in_one_line():
    draws = phalanx.BatchRandom(world=world(1, 3), seed=0)
    with pytest.raises(UsageError, match=r"outside `with draws.batch"):
        draws.rand((4,))
    with draws.batch(13):
        with pytest.raises(UsageError, match=r"rank 1's share of the global batch of 13 is rows 5:9 \(4\)") as err:
            draws.randn((16, 4))  # a sequence-first (T, N) tensor, or tokens flattened into rows
        assert "\n" not in str(err.value) and "batch dim first" in str(err.value) and "accumulation" in str(err.value)
        with pytest.raises(UsageError, match="0-dim"):
            draws.rand(())
        with pytest.raises(UsageError, match="one global batch at a time"):
            with draws.batch(13):
                pass
    with pytest.raises(UsageError, match="global batch's size"):
        with draws.batch(-1):
            pass


def test_route_dropout_swaps_every_dropout_and_refuses_attention_dropout():
    draws = phalanx.BatchRandom(world=world(0, 1), seed=0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Sequential(nn.Dropout2d(0.2), nn.Dropout1d(0.3)))
    assert draws.route_dropout(model) == 3
    assert [type(m) for m in model.modules()].count(BatchDropout) == 3
    assert copy.deepcopy(model)[1].draws is draws  # a copied model (an EMA, a teacher) draws through the same
    with pytest.raises(UsageError, match=r"model.1 is a MultiheadAttention with dropout=0.1.*set model.1.dropout = 0.0"):
        draws.route_dropout(nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2, dropout=0.1)))
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
    with pytest.raises(UsageError, match=r"model.self_attn.dropout = 0.0"):
        draws.route_dropout(layer)
    layer.self_attn.dropout = 0.0  # the fix the line names: the layer's other three dropouts are routed
    assert draws.route_dropout(layer) == 3
    with pytest.raises(UsageError, match=r"AlphaDropout\(p=0.2\)"):
        draws.route_dropout(nn.Sequential(nn.AlphaDropout(0.2)))
    assert draws.route_dropout(nn.MultiheadAttention(4, 2)) == 0  # dropout 0: nothing drawn inside


def test_routed_dropout_keeps_a_mask_per_sample_or_channel_and_is_off_in_eval():
    draws = phalanx.BatchRandom(world=world(0, 1), seed=0)
    channel = BatchDropout(0.5, draws=draws, dims=2)
    x = torch.ones(6, 5, 3, 3, dtype=torch.float64)
    with draws.batch(6):
        y = channel(x)
    assert set(y.unique().tolist()) <= {0.0, 2.0}
    assert torch.equal(y, y[:, :, :1, :1].expand_as(y))  # one number per (sample, channel)
    with draws.batch(6), pytest.raises(UsageError, match="not batched"):
        channel(torch.ones(5, 3, 3))
    channel.eval()
    assert channel(x) is x  # eval needs no batch block: nothing is drawn
    plain = BatchDropout(1.0, draws=draws)
    with draws.batch(6):
        assert plain(x).abs().sum() == 0  # p = 1 drops everything, as torch's dropout does


def test_state_dict_resumes_the_same_draws():
    draws = phalanx.BatchRandom(world=world(0, 2), seed=9)
    with draws.batch(8):
        draws.rand((4, 3))
    saved = draws.state_dict()
    with draws.batch(8):
        after = draws.randn((4, 3))
    other = phalanx.BatchRandom(world=world(0, 2), seed=1)
    other.load_state_dict(saved)
    with other.batch(8):
        assert torch.equal(other.randn((4, 3)), after)


def test_it_is_a_checkpoint_extra_that_loads_back_weights_only(tmp_path):
    from phalanx.train.checkpoint_extras import extra_states, load_extras
    draws = phalanx.BatchRandom(world=world(1, 2), seed=5)
    with draws.batch(6):
        draws.randn((3, 2))
    torch.save(extra_states({"draws": draws}), tmp_path / "extras.pt")
    with draws.batch(6):
        after = draws.randn((3, 2))
    resumed = phalanx.BatchRandom(world=world(1, 2), seed=0)
    load_extras(torch.load(tmp_path / "extras.pt", weights_only=True), {"draws": resumed}, path=tmp_path)
    with resumed.batch(6):
        assert torch.equal(resumed.randn((3, 2)), after)


def test_a_half_precision_input_keeps_one_minus_p_of_its_entries():
    draws = phalanx.BatchRandom(world=world(0, 1), seed=0)
    dropout = BatchDropout(0.1, draws=draws)
    x = torch.ones(2_000_000, 1, dtype=torch.bfloat16)
    with draws.batch(x.shape[0]):
        kept = (dropout(x) != 0).double().mean().item()
    assert abs(kept - 0.9) < 6e-4  # 3 standard errors; bfloat16 uniforms kept 0.8981
