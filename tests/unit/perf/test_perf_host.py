"""The host side of a step: thdpack's op counts recounted from its code, the stacks' ring structure,
and the step model taking the longer of host and device on a GPU and their sum on a CPU."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from thdpack.attention.merge import differentiable_attention
from thdpack.attention.ring import RingPass
from thdpack.cp.partition import shard
from thdpack.cp.topology import CpTopology
from thdpack.loss import StepLoss
from thdpack.models import ModelConfig, Transformer
from thdpack.perf.comm import Topology
from thdpack.perf.host import FLASH_TILE, MEGATRON_TE, THDPACK, THDPACK_CPU, Ops
from thdpack.perf.machine import MachineProfile, load_profile
from thdpack.perf.mesh import COMMS, MeshRun
from thdpack.perf.shape import ModelShape
from thdpack.perf.step import StepModel, TrainingSpec
from thdpack.thd.carriage import thd_meta
from thdpack.train.forward_backward import prepare_micro_batches

from support.host_counting import count, forward_backward_ops, qkv, thd_batch


def _model_ops(layers: int) -> tuple[int, int]:
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=48)
    cfg = replace(cfg, attention=replace(cfg.attention, backend="math"))
    model = Transformer(cfg, seed=0)
    thd = thd_batch([16])
    return forward_backward_ops(lambda: model(thd))


def test_thdpack_layer_and_micro_batch_ops_are_what_the_code_issues():
    one, two = Ops(*_model_ops(1)), Ops(*_model_ops(2))
    layer = two - one
    model_part = one - layer  # the math tile's own ops are the kernel's: not counted
    whole = THDPACK.attention - FLASH_TILE  # one more layer: one more attention call too
    assert layer - whole == THDPACK.layer == THDPACK_CPU.layer == Ops(33, 65)
    assert model_part == Ops(18, 21)  # embedding, rope_cos_sin, final norm, head


def _ring_ops(size: int, rank: int) -> tuple[int, int]:
    class Echo:  # the ring's peers, absent: hands back what is sent (no exchange ops)
        def __init__(self) -> None:
            self.rank, self.size = rank, size

        def send_recv(self, tensors):
            return type("Done", (), {"wait": lambda _: list(tensors)})()

    local = shard(thd_batch([8 * size, 4 * size]), size, rank)
    q, k, v = qkv(local["input_ids"].shape[0])
    ring = RingPass(Echo(), thd_meta(local), True, 0.3, "math")
    return forward_backward_ops(lambda: differentiable_attention(q, k, v, ring)[0])


def test_thdpack_ring_step_ops_are_what_the_code_issues():
    mean = {g: np.mean([_ring_ops(g, r) for r in range(g)], axis=0) for g in (2, 4)}
    per_step = (mean[4] - mean[2]) / 2
    fixed = mean[2] - 2 * per_step
    bookkeeping = THDPACK.ring_step - FLASH_TILE
    assert tuple(per_step) == (bookkeeping.forward, bookkeeping.backward) == (13.5, 6)
    assert tuple(fixed) == (THDPACK.ring.forward, THDPACK.ring.backward) == (-1.5, 6)


def test_thdpack_loss_and_batch_preparation_ops():
    topology = CpTopology(dp_size=1, cp_size=1, rank=0, gpus_per_node=1)

    def loss_ops(micro_batches: int) -> tuple[int, int, int]:
        labels = [torch.randint(0, 64, (32,)) for _ in range(micro_batches)]
        logits = [torch.randn(32, 64, requires_grad=True) for _ in range(micro_batches)]
        step_loss, losses = [], []
        begin = count(lambda: step_loss.append(StepLoss.begin(labels, topology=topology)))
        forward = count(lambda: losses.extend(step_loss[0](x, y, None) for x, y in zip(logits, labels, strict=True)))
        return begin, forward, count(lambda: [loss.backward() for loss in losses])

    (begin1, forward1, backward1), (begin2, forward2, backward2) = loss_ops(1), loss_ops(2)
    assert (begin2 - begin1, forward2 - forward1, backward2 - backward1) == (3, 12, 5)  # per micro-batch
    assert begin1 - 3 == 3  # per step, beside the all-reduce a topology with groups adds
    micro = [thd_batch([16, 8, 8])]
    topology = CpTopology(dp_size=1, cp_size=2, rank=0, gpus_per_node=2)
    prepare = count(lambda: prepare_micro_batches(micro, topology=topology, device=torch.device("cpu"),
                                                  reduction="token_mean"))  # fmt: skip
    assert THDPACK.micro_batch == Ops(prepare + 18 + 3 + 12, 21 + 5) == Ops(38, 26)


def test_cpu_adamw_issues_ten_ops_per_parameter():
    def ops(layers: int) -> tuple[int, int]:
        cfg = ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=48)
        model = Transformer(cfg, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):  # the first step creates the state
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            n = count(optimizer.step)
        return len(list(model.parameters())), n

    (p1, n1), (p2, n2) = ops(1), ops(2)
    per_parameter = (n2 - n1) / (p2 - p1)
    assert per_parameter == THDPACK_CPU.per_parameter == 10
    assert p2 - p1 == THDPACK.parameters_per_layer and p1 == THDPACK.parameters(1)
    assert n1 - per_parameter * p1 == 2  # AdamW's own, in THDPACK_CPU.step


def test_ring_exchanges_te_sends_gradients_with_kv_thdpack_apart():
    # one more rank: one more step, one more K/V exchange forward; backward TE one exchange, thdpack two
    for stack, backward_exchanges in ((MEGATRON_TE, 1), (THDPACK, 2)):
        more = Ops(*(np.array(stack.ring_ops(5)) - np.array(stack.ring_ops(4))))
        assert more.forward == pytest.approx(stack.ring_step.forward + stack.exchange)
        assert more.backward == pytest.approx(stack.ring_step.backward + backward_exchanges * stack.exchange)
    assert MEGATRON_TE.step_ops(12) == MEGATRON_TE.step + 148  # one grad copy per parameter tensor


def _profile(asynchronous: bool, op_s: float) -> MachineProfile:
    data = load_profile("h100_sxm").to_dict()
    flat = [[1, 1000.0], [1e6, 1000.0]]
    data.update(peak_flops=1000.0, matmul_efficiency=1.0, memory_bandwidth=1e9, collective_base_latency_s=0.0)
    data["attention"].update(tile=1, call_overhead_s=0.0, forward_causal=flat, forward_full=flat, backward=flat)
    data["host"] = {"op_s": op_s, "asynchronous": asynchronous}
    return MachineProfile.from_dict(data)


def _one_rank_run(tokens: float) -> MeshRun:
    return MeshRun(world=1, steps=1, rounds=1, group_step=[0], group_round=[0], group_first=[0], group_size=[1],
                   group_comm=[COMMS.index("whole")], entry_group=[0], entry_length=[4],
                   tokens=np.full((1, 1, 1), tokens))  # fmt: skip


@pytest.mark.parametrize("asynchronous", [True, False])
def test_host_and_device_take_the_longer_on_a_gpu_and_add_on_a_cpu(asynchronous):
    shape = ModelShape(layers=1, hidden=4, ffn=4, heads=1, kv_heads=1, head_dim=4, vocab=4, gated_mlp=False)
    stack = replace(THDPACK, step=0.0, per_parameter=0.0)
    spec = TrainingSpec(optimizer_bytes_per_param=0.0, overlap_dp=False, host=stack)
    op_s = 1e-3
    model = StepModel(_profile(asynchronous, op_s), shape, Topology(1, 1), spec)
    times = model.run(_one_rank_run(tokens=4.0))
    # device: 4 tokens x 3 x (layer 2 x (QKV 48 + out 16 + MLP 32) + head 2 x 16) FLOPs at 1000 FLOP/s;
    # attention: 4^2 / 2 pairs of 16 FLOPs forward, 2.5x backward
    linear = 4 * 3 * (2 * (48 + 16 + 32) + 2 * 16) / 1000.0
    attention = (16 * 8 + 2.5 * 16 * 8) / 1000.0
    host = op_s * (stack.micro_batch.total + stack.layer.total + stack.attention.total)
    device = linear + attention
    assert times.parts["linear"][0] == pytest.approx(linear) and times.parts["attention"][0] == pytest.approx(attention)
    expected = max(device, host) if asynchronous else device + host
    assert times.step[0] == pytest.approx(expected)
    assert times.parts["host"][0] == pytest.approx(expected - device)
    assert sum(p[0] for p in times.parts.values()) == pytest.approx(times.step[0])
