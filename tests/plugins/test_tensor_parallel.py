"""Tensor parallelism over 2 real processes (gloo): the GPT split in two computes what the whole
one computes, trains like it, holds half of each split weight per rank, and bad setups are refused."""
from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.distributed import load_ranks, run_two_ranks

MESHES = ("1d", "3d")
STEPS = 3

SCRIPT = """
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel

from tests.helpers.distributed import save
from plugins.recompute import apply_recompute
from plugins.tensor_parallel import apply_tensor_parallel
from plugins.transforms import ModelContext
from runner.core.errors import ConfigError
from runner.models import GPTDecoder, MLPClassifier

torch.set_num_threads(1)
dist.init_process_group("gloo")
meshes = {"1d": init_device_mesh("cpu", (2,)),
          "3d": init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))["tp"]}


def full(tensor):
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def run(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    loss = model.loss(logits, targets)
    loss.backward()
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    return {"logits": full(logits), "loss": full(loss), "attn": full(model.blocks[0].attn(x)),
            "grads": {name: full(p.grad) for name, p in model.named_parameters()}}


for mesh_name, mesh in meshes.items():
    torch.manual_seed(0)  # the same model and batches in both ranks, as a data-parallel rank sees them
    reference = GPTDecoder()
    model = copy.deepcopy(reference)
    names = apply_tensor_parallel(model, mesh)
    tokens = torch.randint(64, (STEPS + 1, 4, 17))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    record = {"names": names, "split": run(model, batches[0]), "whole": run(reference, batches[0]),
              "bytes": {f"{name}.{p_name}": (p.to_local().nbytes, reference.get_parameter(f"{name}.{p_name}").nbytes)
                        for name in names for p_name, p in model.get_submodule(name).named_parameters()}}
    for net in (model, reference):
        # Not Adam: the key bias's true gradient is 0 (softmax ignores a per-query constant), and
        # Adam would scale the float rounding left in it, different in each split, to full steps.
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for batch in batches[1:]:
            optimizer.zero_grad()
            net.loss(net(batch[0]), batch[1]).backward()
            optimizer.step()
    record["trained"] = [{name: full(p) for name, p in net.named_parameters()} for net in (model, reference)]
    save(mesh_name, record)

# The plan's order: tensor parallelism, then recompute wraps the split blocks, which still
# compute (and recompute in backward) what the whole model computes.
torch.manual_seed(0)
wrapped = GPTDecoder()
whole = copy.deepcopy(wrapped)
wrapped_names = apply_tensor_parallel(wrapped, meshes["1d"])
recomputed = apply_recompute(wrapped, ModelContext(wrapped), [], False)
save("recompute", {"names": wrapped_names, "recomputed": recomputed, "split": run(wrapped, batches[0]),
                   "whole": run(whole, batches[0])})


class NoSuchModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def tensor_parallel_plan(self):
        return {"fc": ColwiseParallel(), "blocks.*.fc": ColwiseParallel()}


refusals = {}
for case, make in {"no_hook": MLPClassifier, "heads": lambda: GPTDecoder(d_model=48, n_heads=3),
                   "hidden": lambda: GPTDecoder(d_model=63, n_heads=3), "no_match": NoSuchModule}.items():
    model = make()
    try:
        apply_tensor_parallel(model, meshes["3d"])
    except ConfigError as error:
        refusals[case] = (str(error), not any(isinstance(p, DTensor) for p in model.parameters()))
save("refusals", refusals)
""".replace("STEPS", repr(STEPS))

SPLIT = {f"blocks.{i}.{name}" for i in range(2)
         for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.0", "mlp.2")}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Both meshes and the refusals in one 2-process launch (starting the processes is the slow part)."""
    tmp_path = tmp_path_factory.mktemp("tensor_parallel")
    run_two_ranks(SCRIPT, tmp_path)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_split_model_computes_and_trains_like_the_whole_one(mesh, run_dir):
    for record in load_ranks(run_dir, mesh):
        assert record["names"] == sorted(SPLIT)
        split, whole = record["split"], record["whole"]
        for key in ("attn", "logits", "loss"):
            torch.testing.assert_close(split[key], whole[key], atol=1e-5, rtol=0, msg=key)
        assert split["grads"].keys() == whole["grads"].keys()
        for name, grad in whole["grads"].items():  # split weights gathered, replicated ones as they are
            torch.testing.assert_close(split["grads"][name], grad, atol=1e-5, rtol=0, msg=name)
        trained, reference = record["trained"]
        for name, param in reference.items():
            torch.testing.assert_close(trained[name], param, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_each_rank_holds_half_of_each_split_weight(mesh, run_dir):
    for record in load_ranks(run_dir, mesh):
        for name, (local, whole) in record["bytes"].items():
            # RowwiseParallel keeps the bias whole (replicated): it is added to the all-reduced sum.
            replicated = name.endswith(("proj.bias", "mlp.2.bias"))
            assert local == (whole if replicated else whole // 2), name
        assert {name.rpartition(".")[0] for name in record["bytes"]} == SPLIT


@pytest.mark.slow
@pytest.mark.parametrize("case, message", [
    ("no_hook", r"^strategy\.sharding\.mp_degree=2: .*MLPClassifier has no tensor_parallel_plan\(\) method"),
    ("heads", r"^strategy\.sharding\.mp_degree=2: blocks\.0\.attn has 3 attention heads .*not divisible by 2"),
    ("hidden", r"^strategy\.sharding\.mp_degree=2: blocks\.0\.attn\.q \(ColwiseParallel\) splits 63 output "
               r"features, not divisible by 2"),
    ("no_match", r"^strategy\.sharding\.mp_degree: NoSuchModule\.tensor_parallel_plan\(\) entry 'blocks\.\*\.fc' "
                 r"matches no module$"),
])
def test_refusals_leave_the_model_untouched(case, message, run_dir):
    for refusals in load_ranks(run_dir, "refusals"):
        text, untouched = refusals[case]
        assert "\n" not in text and re.search(message, text), text
        assert untouched, case  # checked before anything is split


@pytest.mark.slow
def test_recompute_after_tensor_parallelism_wraps_the_split_blocks(run_dir):
    for record in load_ranks(run_dir, "recompute"):
        assert record["names"] == sorted(SPLIT) and record["recomputed"] == ["blocks.0", "blocks.1"]
        split, whole = record["split"], record["whole"]
        torch.testing.assert_close(split["logits"], whole["logits"], atol=1e-5, rtol=0)
        grads = {name.replace("._checkpoint_wrapped_module", ""): grad for name, grad in split["grads"].items()}
        assert grads.keys() == whole["grads"].keys()
        for name, grad in whole["grads"].items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=name)
