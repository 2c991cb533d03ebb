"""workbench.parallel.mesh: the grid's layout (Megatron order; the same groups as torch's DeviceMesh
with the same named dimensions), and parallelize() against single-process training: the loss of
every step and the full state after 3 AdamW steps, for each pair of dimensions on 4 ranks (ZeRO 0,
1 and 3 over dp) and for dp = tp = pp = 2 on 8 ranks; Hugging Face GPT-2 and Llama (small configs)
through their plans and splits on 4 ranks.

Our GPT's parity runs in float64, so 3 AdamW steps stay within 1e-5 (in float32, Adam turns
rounding noise in near-zero gradients into updates of lr size); the Hugging Face models run in
float32 with AdamW's eps=1e-5 and lr=1e-3, as in tests/test_plans.py. Each world size runs its whole list of cases
inside ONE launch, and every rank returns its mismatches as readable strings.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench.models.gpt import GPT, GPTConfig
from workbench.parallel.mesh import Mesh, layout, parallelize
from workbench.parallel.pipeline_split import SPLITS
from workbench.apps.train import preload

CONFIG = GPTConfig(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=16)


def test_layout_is_megatron_order():
    """tp ranks adjacent, then dp, then pp: the groups read straight off arange(8).view(2, 2, 2)."""
    g = layout(dp=2, tp=2, pp=2)
    assert g["grid"][:, :, 0].tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # (pp, dp, cp=1, tp)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = layout(dp=3, tp=2, pp=1)          # uneven sizes: every rank once in each dimension's groups
    assert g["tp"] == [[0, 1], [2, 3], [4, 5]] and g["dp"] == [[0, 2, 4], [1, 3, 5]]
    assert g["pp"] == [[r] for r in range(6)]
    with pytest.raises(ValueError, match=r"tp=0 must be a whole number >= 1"):
        layout(dp=2, tp=0)
    # another order: tensor parallelism outermost-but-one, data parallelism adjacent (TP across nodes)
    g = layout(dp=2, tp=2, pp=2, order=("pp", "tp", "dp"))
    assert g["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]] and g["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 4], [2, 6], [1, 5], [3, 7]] and g["grid"][1, 0, 0, 1] == 6
    with pytest.raises(ValueError, match=r"order=\('pp', 'tp'\) must name 'pp', 'dp' and 'tp' once each"):
        layout(dp=2, order=("pp", "tp"))
    # context parallelism: cp just outside tp (Megatron's tp-cp-dp-pp); dp_cp averages the gradients
    g = layout(dp=2, tp=2, cp=2)
    assert g["grid"].shape == (1, 2, 2, 2) and g["order"] == ("pp", "dp", "cp", "tp")
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    g = layout(dp=2, cp=2, order=("pp", "tp", "dp"))  # an order without cp: it sits just outside tp
    assert g["order"] == ("pp", "cp", "tp", "dp") and g["dp"] == [[0, 1], [2, 3]] and g["cp"] == [[0, 2], [1, 3]]


def _batches(steps=3, b=8, t=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 65, (b, t), generator=g), torch.randint(0, 65, (b, t), generator=g))
            for _ in range(steps)]


def _reference(model, batches, lr):
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, model.state_dict()


def _parity_rank(cases) -> list[str]:
    """Every case on this rank: the mesh's coordinates and groups, then 3 steps against one process."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bad = []
    for dp, tp, pp, kwargs in cases:
        kwargs = dict(kwargs)
        cp = kwargs.pop("cp", 1)  # context parallelism (tests/test_context.py runs those cases)
        tag = f"dp={dp} tp={tp} pp={pp} cp={cp} {kwargs}"
        torch.manual_seed(0)
        model = GPT(CONFIG).double()
        batches = _batches()
        want_losses, want_state = _reference(model, batches, lr=1e-2)
        order = kwargs.pop("order", ("pp", "dp", "tp"))
        mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp, order=order)
        groups = layout(dp=dp, tp=tp, pp=pp, cp=cp, order=order)
        if mesh.rank_of(**mesh.coords) != rank:
            bad.append(f"{tag}: rank_of({mesh.coords}) = {mesh.rank_of(**mesh.coords)} on rank {rank}")
        for dim in ("dp", "tp", "pp", "cp", "dp_cp"):
            mine = dist.get_process_group_ranks(mesh.group(dim))
            if mine not in groups[dim] or rank not in mine:
                bad.append(f"{tag}: rank {rank}'s {dim} group is {mine}, layout says {groups[dim]}")
        if kwargs.pop("against_torch", False):  # PyTorch's DeviceMesh with the same named dimensions
            from torch.distributed.device_mesh import init_device_mesh

            names = ("pp", "dp", "tp") if cp == 1 else ("pp", "dp", "cp", "tp")
            theirs = init_device_mesh("cpu", tuple(mesh.size(d) for d in names), mesh_dim_names=names)
            for dim in names:
                a = dist.get_process_group_ranks(mesh.group(dim))
                b = dist.get_process_group_ranks(theirs.get_group(dim))
                if a != b:
                    bad.append(f"{tag}: rank {rank}'s {dim} group {a}, torch's DeviceMesh {b}")
            if list(theirs.get_coordinate()) != [mesh.coords[d] for d in names]:
                bad.append(f"{tag}: coords {mesh.coords}, torch's {theirs.get_coordinate()}")
        trained = parallelize(model, mesh, lr=1e-2, **kwargs)
        blocks = list(trained._stage_module.blocks.values()) if pp > 1 else list(trained._stage_module.blocks)
        k = min(kwargs.get("recompute_layers") or len(blocks), len(blocks))   # the first k of the stage's blocks
        want = [kwargs.get("recompute", "none")] * k + ["none"] * (len(blocks) - k)
        policies = [getattr(block, "_recompute_policy", "none") for block in blocks]
        if policies != want:
            bad.append(f"{tag}: this rank's blocks recompute {policies}, not {want}")
        for i, (x, y) in enumerate(batches):
            loss = float(trained.step(x, y))
            if abs(loss - want_losses[i]) > 1e-5:
                bad.append(f"{tag}: step {i} loss {loss:.8f}, one process {want_losses[i]:.8f}")
        state = trained.full_state_dict()
        if list(state) != list(want_state):
            bad.append(f"{tag}: full_state_dict keys {list(state)} != {list(want_state)}")
        for name, value in want_state.items():
            got = state.get(name)
            if got is None or got.shape != value.shape or not torch.allclose(got, value, rtol=0, atol=1e-5):
                diff = "missing" if got is None else (f"shape {tuple(got.shape)}" if got.shape != value.shape
                                                      else f"max diff {(got - value).abs().max():.2e}")
                bad.append(f"{tag}: {name} {diff}")
    assert world == dp * tp * pp * cp
    return bad


def _check(results):
    bad = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not bad, "\n".join(bad[:20])


def test_parity_pairs_4_ranks():
    """Each pair of dimensions on 4 ranks; ZeRO 0 (DDP), 1 (ShardedOptimizer) and 3 (FSDP) over
    dp; sequence parallelism and GPipe once each; the tied embedding across stages throughout;
    activation recomputation (full, full on the first block only, and selective) against one process
    that keeps everything;
    ZB-H1 under DDP, ZeRO-1, ZeRO-3 and tensor parallelism (with sequence parallelism: the W calls
    re-gather inputs, so every rank must issue them in the same order)."""
    cases = [(2, 2, 1, dict(zero_stage=z)) for z in (0, 1, 3)]
    cases[0][3]["against_torch"] = True
    cases += [(2, 1, 2, dict(zero_stage=z)) for z in (0, 1, 3)]
    cases += [(1, 2, 2, dict()), (1, 2, 2, dict(sequence_parallel=True, schedule="gpipe", n_microbatches=4)),
              (2, 2, 1, dict(zero_stage=2, sequence_parallel=True)),
              (2, 1, 2, dict(zero_stage=1, order=("dp", "pp", "tp"))), (2, 2, 1, dict(order=("tp", "dp", "pp")))]
    cases += [(2, 1, 2, dict(zero_stage=3, recompute="full")), (1, 2, 2, dict(recompute="full", schedule="gpipe")),
              (2, 2, 1, dict(zero_stage=1, recompute="full", recompute_layers=1)),   # the first of 2 blocks
              (2, 2, 1, dict(zero_stage=1, sequence_parallel=True, recompute="selective"))]
    # zero-bubble H1: backward split into B and W, under DDP, ZeRO-1, ZeRO-3 and tensor parallelism
    cases += [(2, 1, 2, dict(zero_stage=z, schedule="zb-h1")) for z in (0, 1, 3)]
    cases += [(1, 2, 2, dict(schedule="zb-h1", n_microbatches=4)),
              (1, 2, 2, dict(schedule="zb-h1", sequence_parallel=True, n_microbatches=4))]
    preload()
    _check(workbench.launch(_parity_rank, world_size=4, args=(cases,), timeout=240))


def test_parity_3d_8_ranks():
    """dp = tp = pp = 2: 1F1B over tensor-parallel stages, ZeRO 0, 1 and 3 across the replicas."""
    cases = [(2, 2, 2, dict(zero_stage=z)) for z in (0, 1, 3)]
    cases[0][3]["against_torch"] = True
    cases += [(2, 2, 2, dict(zero_stage=1, sequence_parallel=True, n_microbatches=4)),
              (2, 2, 2, dict(zero_stage=0, recompute="full"))]
    preload()
    _check(workbench.launch(_parity_rank, world_size=8, args=(cases,), timeout=300))


# ------------------------------------------------------------------ Hugging Face models on the mesh

HF_ADAMW = dict(lr=1e-3, eps=1e-5, weight_decay=0.1)  # float32 parity as in tests/test_plans.py


def _hugging_face(name: str, **overrides):
    """GPT-2 or Llama from a small config (issue 42's figures), nothing downloaded."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=128, n_positions=16, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))
    config = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  num_hidden_layers=2, vocab_size=128, max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides}))


def _hugging_face_rank(cases) -> list[str]:
    """Each (model, dp, tp, pp, kwargs) case: 3 AdamW steps of parallelize() against one process
    training the same model on the whole batch with Hugging Face's own loss; then bad input."""
    from workbench import comm

    bad = []
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g))
               for _ in range(3)]
    for name, dp, tp, pp, kwargs in cases:
        tag = f"{name} dp={dp} tp={tp} pp={pp} {kwargs}"
        model = _hugging_face(name)
        ref = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(ref.parameters(), **HF_ADAMW)
        want_losses = []
        for x, y in batches:
            loss = ref(input_ids=x, labels=y).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            want_losses.append(loss.item())
        trained = parallelize(model, Mesh(dp=dp, tp=tp, pp=pp), **kwargs, **HF_ADAMW)
        del model
        for i, (x, y) in enumerate(batches):
            loss = float(trained.step(x, y))
            if abs(loss - want_losses[i]) > 1e-5:
                bad.append(f"{tag}: step {i} loss {loss:.8f}, one process {want_losses[i]:.8f}")
        state, want = trained.full_state_dict(), ref.state_dict()
        if sorted(state) != sorted(want):
            bad.append(f"{tag}: full_state_dict keys {sorted(state)} != {sorted(want)}")
        for key, value in want.items():
            got = state.get(key)
            if got is None or got.shape != value.shape or not torch.allclose(got, value, rtol=0, atol=1e-5):
                diff = "missing" if got is None else (f"shape {tuple(got.shape)}" if got.shape != value.shape
                                                      else f"max diff {(got - value).abs().max():.2e}")
                bad.append(f"{tag}: {key} {diff}")
        if kwargs.get("recompute"):  # the split's blocks: the model's list, or a stage's dict of its own
            blocks = trained._stage_module.get_submodule(SPLITS[name].blocks)
            blocks = list(blocks.values() if isinstance(blocks, torch.nn.ModuleDict) else blocks)
            if not blocks or any(getattr(b, "_recompute_policy", None) != kwargs["recompute"] for b in blocks):
                bad.append(f"{tag}: this rank's blocks are not recomputed")

    def expect(fn, *words):
        try:
            fn()
        except ValueError as e:
            if not all(w in str(e) for w in words):
                bad.append(f"message {str(e)!r} lacks {words}")
        else:
            bad.append(f"no ValueError for {words}")

    pipeline, tensor = Mesh(dp=2, pp=2), Mesh(dp=2, tp=2)
    with comm.counters() as c:
        expect(lambda: parallelize(_hugging_face("llama"), pipeline, pp_split=["model.layers.5"]),
               "'model.layers.5' is not a block", "['model.layers.1']")
        expect(lambda: parallelize(_hugging_face("llama", num_hidden_layers=1), pipeline), "pp=2", "1 blocks")
        expect(lambda: parallelize(_hugging_face("llama", num_key_value_heads=1), tensor), "t=2 does not divide",
               "num_key_value_heads=1")
        expect(lambda: parallelize(_hugging_face("gpt2"), tensor, tp_plan={"transformer.h.*.mlp.c_fcc": "colwise"}),
               "'transformer.h.*.mlp.c_fcc' matches no module", "transformer.h.*.mlp.c_fc")
        expect(lambda: parallelize(_hugging_face("gpt2"), pipeline, zero_stage=2), "zero_stage=2", "tied",
               "tie_word_embeddings=False")
        expect(lambda: parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)), pipeline), "pp=2", "pp_split=callable")
    if c.total_calls:
        bad.append(f"bad input sent {c.total_calls} messages")
    return bad


def test_hugging_face_models_on_the_mesh():
    """Issue 42: parallelize() on Hugging Face GPT-2 and Llama (small configs) through their plans
    and splits: dp x tp (DDP; ZeRO-3 over GPT-2's transposed Conv1D shards; ZeRO-3 with Llama's
    sequence-parallel RMSNorms, whose gradient hooks FSDP runs on its flat gradient) and tp x pp (1F1B, GPT-2's
    tied embedding across stages, the plan and split passed by name; Llama with sequence
    parallelism and recomputation), each loss and the full state after 3 AdamW steps within 1e-5
    of one process; bad input raises before any message."""
    pytest.importorskip("transformers")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():  # import the models' modules, masks and loss here once: the forked ranks inherit them
        for name in ("gpt2", "llama"):
            _hugging_face(name)(input_ids=ids, labels=ids)
    cases = [("llama", 2, 2, 1, dict()), ("gpt2", 2, 2, 1, dict(zero_stage=3)),
             ("llama", 2, 2, 1, dict(zero_stage=3, sequence_parallel=True)),
             ("gpt2", 1, 2, 2, dict(tp_plan="gpt2", n_microbatches=4)),
             ("llama", 1, 2, 2, dict(pp_split=["model.layers.1"], sequence_parallel=True, recompute="full"))]
    preload()
    _check(workbench.launch(_hugging_face_rank, world_size=4, args=(cases,), timeout=240))


def _errors_rank() -> list[str]:
    """Bad input: a ValueError naming the argument and the fix, raised on every rank before any
    group is made or message sent (a valid mesh built afterwards would hang otherwise)."""
    bad = []

    def expect(fn, *words):
        try:
            fn()
        except ValueError as e:
            if not all(w in str(e) for w in words):
                bad.append(f"message {str(e)!r} lacks {words}")
        else:
            bad.append(f"no ValueError for {words}")

    expect(lambda: Mesh(dp=3, tp=2), "dp x tp x pp = 6", "4 ranks")
    expect(lambda: Mesh(dp=2, tp=2, pp=2), "dp x tp x pp = 8", "4 ranks")
    expect(lambda: Mesh(dp=2, tp=2).rank_of(tp=2), "tp=2", "0..1")
    mesh = Mesh(dp=2, pp=2)
    model = GPT(CONFIG)
    expect(lambda: parallelize(model, mesh, zero_stage=4), "zero_stage=4")
    expect(lambda: parallelize(model, mesh, schedule="zigzag"), "schedule='zigzag'")
    expect(lambda: parallelize(model, mesh, n_microbatches=1), "n_microbatches >= pp", "1 < 2")
    expect(lambda: parallelize(model, mesh, sequence_parallel=True), "sequence_parallel=True", "tp > 1")
    expect(lambda: parallelize(model, mesh, zero_stage=2), "zero_stage=2", "tied")
    expect(lambda: parallelize(model, mesh, recompute="some"), "recompute='some'", "'full'")
    expect(lambda: parallelize(model, mesh, recompute="selective", recompute_layers=1), "recompute_layers=1",
           "recompute='full'")
    expect(lambda: parallelize(model, mesh, schedule="zb-h1", n_microbatches=1), "ZB-H1", "1 < 2")
    expect(lambda: parallelize(model, mesh, schedule="zb-h1", recompute="full"), "schedule='zb-h1'", "recompute='full'")
    expect(lambda: parallelize(model, Mesh(dp=4), n_microbatches=2), "n_microbatches=2", "pp > 1")
    # a mesh inside a sub-group: ranks numbered in the group, its sub-groups made by its members
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rank = dist.get_rank()
    inner = Mesh(tp=2, group=halves[0]) if rank < 2 else Mesh(dp=2, group=halves[1])
    want = {"dp": 0, "tp": rank % 2, "pp": 0, "cp": 0} if rank < 2 else {"dp": rank % 2, "tp": 0, "pp": 0, "cp": 0}
    dim = "tp" if rank < 2 else "dp"
    if inner.coords != want or dist.get_process_group_ranks(inner.group(dim)) != ([0, 1] if rank < 2 else [2, 3]):
        bad.append(f"mesh in a sub-group: coords {inner.coords} (want {want}), {dim} group "
                   f"{dist.get_process_group_ranks(inner.group(dim))}")
    total = torch.ones(1)
    dist.all_reduce(total, group=inner.group(dim))
    if float(total) != 2:
        bad.append(f"mesh in a sub-group: all-reduce over {dim} gave {float(total)}")
    trained = parallelize(model, Mesh(dp=4))
    expect(lambda: trained.step(torch.zeros(6, 8, dtype=torch.long), torch.zeros(6, 8, dtype=torch.long)),
           "batch size 6", "multiple of 4")
    return bad


def test_bad_input():
    preload()
    _check(workbench.launch(_errors_rank, world_size=4, timeout=120))


def test_grid_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from workbench.measure import plots

    fig = plots.mesh_grid(layout(dp=2, tp=2, pp=2))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sorted(t for t in texts if t.startswith("rank ")) == [f"rank {r}" for r in range(8)]
    assert "pipeline stage 1" in texts and "dp1 tp0" in texts
    assert {"tp group", "dp group"} <= set(fig.axes[0].get_legend_handles_labels()[1])
    plt.close(fig)


def test_compare_3d_on_request(tmp_path, capsys):
    """``workbench compare --strategies 3d``: 8 ranks, same losses as one process; 2d runs by
    default, 3d (too slow for every run on 2 cores) only when named."""
    import json

    from workbench.apps import cli, strategies

    out = tmp_path / "report"
    assert cli.main(["compare", "--strategies", "single,3d", "--steps", "2", "--batch-size", "8",
                     "--out", str(out)]) == 0
    capsys.readouterr()
    rows = {r["strategy"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["3d"]["world_size"] == 8 and rows["3d"]["loss_diff"] < 1e-5
    # model state per rank against the formula: a stage's share of the tensor-parallel model (the
    # tied embedding's shard on both the first and the last stage), Adam's 2 moments of it / dp
    from workbench.parallel.tensor import parameters_per_rank

    cfg = GPTConfig.preset("tiny")
    state = rows["3d"]["model_state"]
    vocab_shard = -(-cfg.vocab_size // 2) * 2 * cfg.n_embd // 2
    for rank in range(4):  # rank r and r + 4 hold the two stages of the same (dp, tp) coordinates
        assert state[rank]["params"] + state[rank + 4]["params"] == 4 * (parameters_per_rank(cfg, 2) + vocab_shard)
    for s in state:  # ZeRO-1 over dp = 2: half the moments, plus padding and step counters
        assert 0 <= s["optimizer"] - 8 * (s["params"] // 4) // 2 <= 64, s
    assert strategies.get("2d").default and strategies.get("2d").world_size == 4
    assert not strategies.get("3d").default


def test_a_mesh_s_groups_are_let_go_with_the_world(tmp_path):
    """The mesh makes each sub-group once per world; destroy_process_group then frees them (their
    gloo threads end), and a new world makes its own instead of reusing destroyed ones."""
    script = textwrap.dedent(f"""
        import glob
        import torch.distributed as dist
        from workbench.parallel.mesh import Mesh

        def gloo_threads():
            return sum(open(p).read().strip().startswith(("gloo", "pt_gloo"))
                       for p in glob.glob("/proc/self/task/*/comm"))

        for world in range(2):
            store = dist.FileStore({str(tmp_path)!r} + f"/store{{world}}", 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            mesh = Mesh(dp=1, tp=1, pp=1)
            tp = mesh.group("tp")
            assert dist.get_process_group_ranks(tp) == [0]  # a group of this world, not a destroyed one
            del mesh, tp
            dist.destroy_process_group()
            print("world", world, "gloo threads left:", gloo_threads())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 0 gloo threads left: 0" in proc.stdout and "world 1 gloo threads left: 0" in proc.stdout, proc.stdout
