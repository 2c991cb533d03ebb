"""Tensor parallelism by a plan and pipeline stages by a split, on models the user brings:
Hugging Face ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` built from small configs (nothing
downloaded), against one process.

One launch of 2 ranks runs every distributed case and returns numbers:

* ``tensor_parallel(model, plan=...)`` at t = 2 (GPT-2 by name, Llama detected, each also with
  sequence parallelism; every rank the whole batch): the loss of each of 3 AdamW steps within 1e-5 of one process, and
  ``full_state_dict`` (the single model's names and shapes, Conv1D weights transposed back)
  within 1e-5 after them. Our GPT under a hand-written partial plan (attention split, MLP left
  whole) trains like one process too.
* ``partition(model, 2)`` with the built-in split and ``Schedule1F1B`` (4 micro-batches): every
  stage's parameters after 3 AdamW steps within 1e-5 of one process (GPT-2's tied embedding
  summed between the stages).
* Bad plans raise a ``ValueError`` naming the module and the fix, before any message.

The checks that need no process group (stages chained in one process equal the model, split
and plan errors) run here directly.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.models import GPT, GPTConfig
from workbench.parallel import tensor_plans
from workbench.parallel.pipeline import PipelineStage, Schedule1F1B, partition
from workbench.parallel.pipeline_split import causal_lm_loss
from workbench.parallel.tensor import full_state_dict, tensor_parallel

transformers = pytest.importorskip("transformers")

ADAMW = dict(lr=1e-3, eps=1e-5, weight_decay=0.1)
STEPS, B, T, V = 3, 8, 16, 128


def gpt2(**overrides):
    torch.manual_seed(0)
    config = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=V, n_positions=T, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def llama(**overrides):
    torch.manual_seed(0)
    config = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  num_hidden_layers=2, vocab_size=V, max_position_embeddings=T, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides}))


def _batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
            for _ in range(STEPS)]


def _hf_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


# ------------------------------------------------------------------------------ ranks

def _tensor_case(build, plan, loss=_hf_loss, sequence_parallel=False) -> dict:
    ref = build()
    model = tensor_parallel(copy.deepcopy(ref), plan=plan, sequence_parallel=sequence_parallel)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    diffs = []
    for x, y in _batches():
        pair = []
        for m, o in ((ref, opt_ref), (model, opt)):
            with comm.counters() as c:
                value = loss(m, x, y)
                value.backward()
            o.step()
            o.zero_grad()
            pair.append(value.item())
        diffs.append(abs(pair[0] - pair[1]))
    full, single = full_state_dict(model), ref.state_dict()
    return {"loss_diff": max(diffs), "collectives": sorted(c.as_dict()), "keys_equal": sorted(full) == sorted(single),
            "shapes_equal": all(full[k].shape == single[k].shape for k in single),
            "param_diff": max((full[k] - single[k]).abs().max().item() for k in single),
            "smaller": sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in ref.parameters())}


def _pipeline_case(build) -> dict:
    rank = dist.get_rank()
    ref = build()
    model = copy.deepcopy(ref)
    stage = partition(model, 2)[rank]
    schedule = Schedule1F1B(PipelineStage(stage, rank, 2), 4, loss_fn=causal_lm_loss)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(stage.parameters(), **ADAMW)
    diffs = []
    for x, y in _batches():
        loss = _hf_loss(ref, x, y)
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        losses = []
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None, losses=losses)
        opt.step()
        opt.zero_grad()
        if rank == 1:
            diffs.append(abs(torch.stack(losses).mean().item() - loss.item()))
    single = dict(ref.named_parameters(remove_duplicate=False))
    mine = dict(stage.named_parameters())
    return {"loss_diff": max(diffs, default=0.0), "names_known": set(mine) <= set(single),
            "param_diff": max((p - single[n]).abs().max().item() for n, p in mine.items()),
            "tied": sorted(stage.shared_parameters)}


def _gpt_loss(model, x, y):
    return model(x % 65, y % 65)[1]


def _errors() -> dict:
    out = {}

    def catch(key, fn):
        try:
            fn()
            out[key] = ""
        except ValueError as e:
            out[key] = str(e)

    with comm.counters() as c:
        catch("glob", lambda: tensor_parallel(gpt2(), plan={"transformer.h.*.attn.c_atn": "colwise"}))
        catch("style", lambda: tensor_parallel(llama(), plan={"model.layers.*.mlp.up_proj": "diagonal"}))
        catch("type", lambda: tensor_parallel(llama(), plan={"model.layers.*.mlp": "colwise"}))
        catch("gqa", lambda: tensor_parallel(llama(num_key_value_heads=1), plan="llama"))
        catch("name", lambda: tensor_parallel(llama(), plan="mistral"))
        catch("sp", lambda: tensor_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)), plan={"0": "colwise"},
                                            sequence_parallel=True))
        sp = tensor_parallel(llama(), sequence_parallel=True)
        catch("sequence", lambda: sp(input_ids=torch.zeros(2, 5, dtype=torch.long)))
        catch("tie", lambda: tensor_parallel(gpt2(), plan={"transformer.wte": "vocab"}))
        catch("gpt sp", lambda: tensor_parallel(GPT(GPTConfig.preset("tiny", n_layer=1)), sequence_parallel=True,
                                                plan={"blocks.*.attn.c_proj": "rowwise"}))
    out["messages"] = c.total_calls
    return out


def _rank() -> dict:
    gpt_attention_only = {"blocks.*.attn.c_attn": tensor_plans.Style("colwise", chunks=3),
                          "blocks.*.attn.c_proj": "rowwise"}
    return {
        "tensor": {"gpt2": _tensor_case(gpt2, "gpt2"), "llama": _tensor_case(llama, None),
                   "gpt2 sp": _tensor_case(gpt2, "gpt2", sequence_parallel=True),
                   "llama sp": _tensor_case(llama, "llama", sequence_parallel=True),
                   "gpt partial plan": _tensor_case(lambda: GPT(GPTConfig.preset("tiny", n_layer=1)),
                                                    gpt_attention_only, _gpt_loss)},
        "pipeline": {"gpt2": _pipeline_case(gpt2), "llama": _pipeline_case(llama)},
        "errors": _errors(),
    }


@pytest.fixture(scope="module")
def world2():
    return workbench.launch(_rank, world_size=2, timeout=120)


# ------------------------------------------------------------------------------ tests

def test_tensor_parallel_by_plan_trains_like_one_process(world2):
    for res in world2:
        for case, r in res["tensor"].items():
            assert r["keys_equal"] and r["shapes_equal"] and r["smaller"], (case, r)
            assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (case, r)
            # sequence parallelism really splits: the row-parallel layers reduce-scatter
            assert ("reduce_scatter/native" in r["collectives"]) == case.endswith(" sp"), (case, r["collectives"])


def test_pipeline_by_split_trains_like_one_process(world2):
    for rank, res in enumerate(world2):
        for case, r in res["pipeline"].items():
            assert r["names_known"], (case, r)
            assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, case, r)
    assert world2[0]["pipeline"]["gpt2"]["tied"] == ["transformer.wte.weight"]
    assert world2[1]["pipeline"]["llama"]["tied"] == []


def test_bad_plans_name_the_module_and_the_fix_before_any_message(world2):
    e = world2[0]["errors"]
    assert "'transformer.h.*.attn.c_atn' matches no module" in e["glob"] and "transformer.h.*.attn.c_attn" in e["glob"]
    assert "'diagonal'" in e["style"] and "colwise" in e["style"]
    assert "model.layers.0.mlp" in e["type"] and "LlamaMLP" in e["type"]
    assert "t=2 does not divide" in e["gqa"] and "num_key_value_heads=1" in e["gqa"]
    assert "plan='mistral'" in e["name"] and "llama" in e["name"]
    assert "sequence_blocks" in e["sp"] and "sequence_parallel=False" in e["sp"]
    assert "T=5 is not divisible by t=2" in e["sequence"]
    assert "transformer.wte and lm_head share one weight" in e["tie"]
    assert "add 'wte': 'vocab'" in e["gpt sp"]
    assert e["messages"] == 0


def test_stages_chained_in_one_process_equal_the_model_and_keep_its_names():
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    for build, cut in ((gpt2, "transformer.h.1"), (llama, "model.layers.1")):
        model = build(n_layer=3) if build is gpt2 else build(num_hidden_layers=3)
        stages = partition(model, 2, [cut])
        h = x
        for stage in stages:
            h = stage(h)
        assert torch.allclose(h, model(x).logits, atol=1e-6)
        assert len(stages[0].get_submodule(cut.rsplit(".", 1)[0])) == 1  # the cut: one block, then two
        names = {n for s in stages for n, _ in s.named_parameters()}
        assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}
        assert torch.allclose(causal_lm_loss(h, x), model(input_ids=x, labels=x).loss, atol=1e-6)


def test_bad_splits_and_plans_list_what_exists():
    model = llama()
    with pytest.raises(ValueError, match=r"'model.layers.5' is not a block.*\['model.layers.1'\]"):
        partition(model, 2, ["model.layers.5"])
    with pytest.raises(ValueError, match="2 stages need 1 distinct boundaries"):
        partition(model, 2, [])
    with pytest.raises(ValueError, match="must return a list of 2 nn.Modules"):
        partition(model, 2, lambda m, n: [m])
    assert partition(model, 2, lambda m, n: [m.model, m.lm_head])[1] is model.lm_head
    with pytest.raises(ValueError, match=r"matches no module.*model\.layers\.\*\.self_attn\.q_proj"):
        tensor_plans.match(model, tensor_plans.plan_for(model, {"layers.*.q_proj": "colwise"}))
    assert tensor_plans.detect(gpt2()) == "gpt2" and tensor_plans.detect(GPT(GPTConfig.preset("tiny"))) == "gpt"
