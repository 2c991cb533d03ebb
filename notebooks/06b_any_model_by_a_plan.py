# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Workbench (Python, 1 thread per rank)
#     language: python
#     name: workbench
# ---

# %% [markdown]
# # 06b · Tensor and pipeline parallelism on a model you bring: a plan and a split
#
# Lesson 06 split our own GPT. Your model is more likely a Hugging Face `LlamaForCausalLM`, and
# PyTorch's answer for it is a *plan*: a dict from module names to how each is split, given to
# `parallelize_module(model, mesh, plan)` (torchtitan's `parallelize_llama` is one such dict).
# `workbench.parallel.tensor_parallel(model, plan=...)` takes the same kind of dict, swaps each
# named layer for its split twin in place, and leaves the model's own forward alone. Pipeline
# parallelism takes a *split*: the module names where a new stage begins.
#
# The model here is built from a small config (nothing is downloaded): hidden size 64, 4 query
# heads sharing 2 key/value heads (grouped-query attention), MLP width 128, 2 layers, vocabulary 128.

# %%
import copy
import re

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import workbench
from workbench import everyone
from workbench.parallel import tensor_plans
from workbench.parallel.pipeline import PipelineStage, Schedule1F1B, partition
from workbench.parallel.pipeline_split import causal_lm_loss
from workbench.parallel.tensor import full_state_dict, tensor_parallel

STEPS, B, T, V = 3, 8, 16, 128
ADAMW = dict(lr=1e-3, eps=1e-5, weight_decay=0.1)


def llama(kv_heads=2):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                                        intermediate_size=128, num_hidden_layers=2, vocab_size=V,
                                        max_position_embeddings=T, bos_token_id=0, eos_token_id=0))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
            for _ in range(STEPS)]


# %% [markdown]
# ## 1. The plan for Llama, written out
#
# Each attention's `q_proj`, `k_proj` and `v_proj` is column-parallel (rank `r` keeps its heads'
# rows), `o_proj` row-parallel (one all-reduce after it); the MLP's `gate_proj` and `up_proj`
# column-parallel, `down_proj` row-parallel; the embedding split by vocabulary and the head too,
# its logits all-gathered so that the model's own loss runs on them. The norms are `sequence`:
# whole on every rank here, split by sequence with `sequence_parallel=True`. `*` stands for one
# dotted part (a layer number). Llama's attention reshapes by `head_dim`, so it runs on its local
# heads with no change; with grouped-query attention each rank must hold whole key/value heads,
# so `t` must divide their number.

# %%
plan = {
    "model.embed_tokens": "vocab",
    "model.layers.*.input_layernorm": "sequence",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "sequence",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather",
}
assert plan == dict(tensor_plans.LLAMA_PLAN.layers)  # the shipped plan, plan="llama" (or detected)
matched = tensor_plans.match(llama(), tensor_plans.plan_for(llama(), plan))
print(f"{len(matched)} modules matched, for example:")
for name in list(matched)[:5]:
    print(f"  {name:36s} {matched[name].kind}")


# %% [markdown]
# ## 2. Run it: one process, ours, and PyTorch's `parallelize_module` on the same model
#
# Two ranks, every rank the whole batch, 3 AdamW steps. The same plan is translated into
# PyTorch's styles (`ColwiseParallel`, `RowwiseParallel`; the embedding `RowwiseParallel` with a
# replicated input, the head `ColwiseParallel` with replicated output), and DTensor does every
# message. All three start from the same weights.

# %%
def torch_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
              "vocab": RowwiseParallel(input_layouts=Replicate()),
              "colwise_gather": ColwiseParallel(output_layouts=Replicate())}
    return {name: styles[style] for name, style in plan.items() if style != "sequence"}


def train(model, params):
    opt = torch.optim.AdamW(params, **ADAMW)
    losses = []
    for x, y in batches():
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_tensor_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    single = llama()
    ours = tensor_parallel(copy.deepcopy(single), plan=plan)
    theirs = parallelize_module(copy.deepcopy(single), init_device_mesh("cpu", (dist.get_world_size(),)), torch_plan())
    sizes = {name: sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in m.parameters())
             for name, m in (("one process", single), ("ours, t=2", ours), ("DTensor, t=2", theirs))}
    out = {"losses": {name: train(m, m.parameters())
                      for name, m in (("one process", single), ("ours, t=2", ours), ("DTensor, t=2", theirs))},
           "parameters per rank": sizes}
    full, ref = full_state_dict(ours), single.state_dict()
    out["param diff"] = max((full[k] - ref[k]).abs().max().item() for k in ref)
    out["same names"] = sorted(full) == sorted(ref)
    try:
        tensor_parallel(llama(kv_heads=1), plan="llama")
        out["gqa error"] = ""
    except ValueError as e:
        out["gqa error"] = str(e)
    return everyone(out)


tp = workbench.launch(run_tensor_parallel, world_size=2)[0][0]
losses = tp["losses"]
print(f"{'step':>4} " + " ".join(f"{name:>14}" for name in losses))
for i in range(STEPS):
    print(f"{i:>4} " + " ".join(f"{losses[name][i]:>14.4f}" for name in losses))
print("parameters per rank:", tp["parameters per rank"])
print("t = 2 with one key/value head:", tp["gqa error"])

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2), layout="constrained")
for (name, values), style in zip(losses.items(), ("-", "--", ":")):
    ax1.plot(range(STEPS), values, style, marker="o", label=name)
ax1.set_xlabel("AdamW step")
ax1.set_ylabel("loss")
ax1.set_xticks(range(STEPS))
ax1.legend()
ax1.set_title("the same losses, three ways")
sizes = tp["parameters per rank"]
ax2.bar(list(sizes), [n / 1000 for n in sizes.values()], color=["#999999", "#4c72b0", "#dd8452"])
ax2.set_ylabel("parameters per rank (thousands)")
_ = ax2.set_title("what one rank holds")

# %% [markdown]
# Each rank of both tensor-parallel runs holds about half of the weights (the norms stay whole
# on every rank), and the three columns of losses agree. `full_state_dict(model)` all-gathers the
# shards back under the single model's names, the way a checkpoint would store them.
#
# ## 3. Pipeline stages by a split
#
# `partition(model, 2)` cuts between the layers: the embedding on stage 0, the final norm and
# head on stage 1, and on every stage what its blocks need and the hidden states do not carry
# (the rotary `cos`/`sin` tables from the model's own `rotary_emb`, and the causal mask). A split
# such as `["model.layers.1"]` names where a stage begins; the stages keep the model's names.

# %%
for k, stage in enumerate(partition(llama(), 2, ["model.layers.1"])):
    parts = {re.sub(r"(layers\.\d+)\..*", r"\1", n.rsplit(".", 1)[0]) for n, _ in stage.named_parameters()}
    print(f"stage {k}: {', '.join(sorted(parts))}")


def run_pipeline():
    rank = dist.get_rank()
    single = llama()
    stage = partition(copy.deepcopy(single), 2)[rank]
    schedule = Schedule1F1B(PipelineStage(stage, rank, 2), 4, loss_fn=causal_lm_loss)
    train(single, single.parameters())
    opt = torch.optim.AdamW(stage.parameters(), **ADAMW)
    for x, y in batches():
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
        opt.step()
        opt.zero_grad()
    ref = dict(single.named_parameters())
    return everyone(max((p - ref[n]).abs().max().item() for n, p in stage.named_parameters()))


pipe = workbench.launch(run_pipeline, world_size=2)[0]
print("largest |parameter - one process| after 3 steps, 1F1B over 2 stages:", "within 1e-5" if max(pipe) <= 1e-5
      else max(pipe))

# %% [markdown]
# ## Check
#
# * ours with the Llama plan: the loss of each step within 1e-5 of one process and of PyTorch's
#   `parallelize_module` with the same plan, and every parameter after 3 steps within 1e-5;
# * `t = 2` with one key/value head is refused with a `ValueError` that names the fix;
# * the two pipeline stages' parameters after 3 AdamW steps within 1e-5 of one process.

# %%
for name in ("ours, t=2", "DTensor, t=2"):
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses[name], losses["one process"])), losses
assert tp["param diff"] <= 1e-5 and tp["same names"], tp
assert "t=2 does not divide" in tp["gqa error"], tp["gqa error"]
assert sizes["ours, t=2"] < 0.6 * sizes["one process"], sizes
assert max(pipe) <= 1e-5, pipe
print("check passed: the plan and the split train Llama like one process, and like DTensor")
