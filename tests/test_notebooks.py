"""Lessons: every notebook has a paired script in sync with it, and the scripts run under torchrun.

nbval itself (``pytest --nbval notebooks``, part of ``make test``) re-executes every notebook and
compares the stored outputs; these tests check what nbval cannot: the pairing and the torchrun path.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

REPO = Path(__file__).resolve().parent.parent
# NN_topic, and NNx_topic for a short lesson slotted in after NN (00b_live_ranks)
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
SCRIPTS = sorted((REPO / "notebooks").glob("[0-9][0-9]*_*.py"))


def _cells(notebook) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


def test_every_lesson_has_both_files():
    assert NOTEBOOKS, "no lessons found"
    assert {p.stem for p in NOTEBOOKS} == {p.stem for p in SCRIPTS}, \
        "each notebooks/NN_topic.ipynb needs its paired NN_topic.py (make notebook NB=notebooks/NN_topic.py)"


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_and_script_in_sync(ipynb):
    script = ipynb.with_suffix(".py")
    assert _cells(jupytext.read(ipynb)) == _cells(jupytext.read(script)), \
        f"{ipynb.name} and {script.name} differ: run `make notebook NB=notebooks/{script.name}`"


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_stored_with_outputs_and_workbench_kernel(ipynb):
    nb = json.loads(ipynb.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "workbench"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code), f"{ipynb.name} has cells that were never run"
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in code for o in c.get("outputs", [])), f"{ipynb.name} is stored without a plot"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # the lessons' smallest sizes (workbench.smoke_test): every code path, in seconds; nbval runs the
    # notebooks at full size and their check cells assert the timing claims there
    env.update(MPLBACKEND="Agg", OMP_NUM_THREADS="1", WORKBENCH_SMOKE_TEST="1")
    return env


def _on_two_torchrun_nodes(script: Path, nproc_per_node: int, timeout: float = 300) -> list[str]:
    """Run ``script`` as two torchrun agents (two 'nodes' on localhost meeting at a master address,
    ``nproc_per_node`` processes each); every agent must succeed. Returns each agent's output."""
    port = str(_free_port())
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", str(nproc_per_node), "--master-addr", "127.0.0.1", "--master-port", port, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_torchrun_env(), cwd=REPO)
        for node in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    for node, (agent, out) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"node {node}:\n{out[-3000:]}"
    return outputs


def test_lesson_00_script_across_two_nodes_on_localhost():
    """The multi-machine path: two torchrun agents of one process each."""
    for out in _on_two_torchrun_nodes(REPO / "notebooks" / "00_launching_ranks.py", 1):
        assert "all checks passed" in out


def test_lesson_07_script_on_two_torchrun_nodes_of_two_ranks():
    """Lesson 07 in a world of 4 (2 agents x 2 processes): its 4-rank sections (the emulated
    cluster, the placements, which torchrun's default world of 2 skips) run under torchrun too."""
    for out in _on_two_torchrun_nodes(REPO / "notebooks" / "07_3d_parallelism_and_topology.py", 2):
        assert len(re.findall(r"check passed: parity with one process, hierarchical", out)) == 2, out[-3000:]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_lesson_ends_with_a_check_cell(script):
    """The last code cell asserts the lesson's claim (issue 16): a lesson ends by checking what it taught."""
    code = [c.source for c in jupytext.read(script).cells if c.cell_type == "code"]
    # a trailing clean-up cell of line magics only (00b's `%ranks stop`) may follow the check
    while code and all(line.lstrip("# ").startswith("%") or not line.strip() for line in code[-1].splitlines()):
        code.pop()
    assert code, f"{script.name} has no code cells"
    last = code[-1]
    asserts = [line for line in last.splitlines() if line.lstrip().startswith("assert ")]
    assert asserts, f"{script.name}: the last code cell asserts nothing; end the lesson with a check cell"


@pytest.fixture(scope="module")
def lessons_under_torchrun(tmp_path_factory) -> dict[str, list[str]]:
    """Every lesson's script under one ``torchrun --standalone --nproc-per-node 2`` (as a smoke test,
    see ``_torchrun_env``), one after another in the same two processes
    (``tests/lessons_under_torchrun.py``): one interpreter start and one import of torch for all of
    them. torchrun writes each rank's output to its own file (``--redirects 3``). Returns, for each
    lesson (the script's stem), its output on each rank, in rank order."""
    logs = tmp_path_factory.mktemp("torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3",
           str(REPO / "tests" / "lessons_under_torchrun.py"), *map(str, SCRIPTS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_torchrun_env(), cwd=REPO)
    per_rank = {int(f.parent.name): f.read_text() for f in logs.rglob("stdout.log")}
    errors = "\n".join(f.read_text()[-2000:] for f in logs.rglob("stderr.log"))
    assert sorted(per_rank) == [0, 1], (sorted(per_rank), proc.stdout[-2000:], proc.stderr[-2000:])
    out: dict[str, list[str]] = {}
    for rank in (0, 1):
        for part in re.split(r"(?m)^=== lesson ", per_rank[rank])[1:]:
            name = part.split(" ", 1)[0]
            out.setdefault(name, ["", ""])[rank] += part
    out["__stderr__"] = [errors, f"torchrun exit status {proc.returncode}"]
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_lesson_script_under_torchrun_standalone(script, lessons_under_torchrun):
    """Every lesson's paired script runs unchanged under torchrun (2 processes): each launch() runs
    in torchrun's world, and the script ends by printing that its check passed, on both ranks."""
    ranks = lessons_under_torchrun.get(script.stem)
    assert ranks is not None, f"{script.stem} did not run: {lessons_under_torchrun['__stderr__']}"
    for rank, out in enumerate(ranks):
        assert f"{script.stem} end: ok" in out, (rank, out[-3000:], lessons_under_torchrun["__stderr__"])
        assert len(re.findall(r"checks? passed", out)) == 1, (rank, out[-3000:])


# --- what nbval compares: markers it honours, and the sanitizer for machine-dependent numbers ---

SANITIZE = REPO / "notebooks" / "nbval_sanitize.cfg"


def _sanitize(text: str) -> str:
    from nbval.plugin import get_sanitize_patterns

    for regex, replacement in get_sanitize_patterns(SANITIZE.read_text()):
        text = re.sub(regex, replacement, text)
    return text


@pytest.mark.parametrize("ipynb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_nbval_marker_is_one_nbval_honours(ipynb):
    """nbval honours a marker only when the comment is the marker alone (``# NBVAL_IGNORE_OUTPUT``):
    words after it switch it off silently (nbval.plugin.find_comment_markers), and the cell's
    output is compared after all."""
    from nbval.plugin import comment_markers

    bad = [(i, line.strip()) for i, cell in enumerate(c for c in jupytext.read(ipynb).cells if c.cell_type == "code")
           for line in cell.source.splitlines()
           if line.strip().startswith("#") and re.search(r"\b(NBVAL|PYTEST_VALIDATE)_[A-Z_]+", line)
           and line.strip().lstrip("#").strip() not in comment_markers]
    assert not bad, f"{ipynb.name}: markers nbval ignores (code cell, line): {bad}; put the marker alone on its line"


def test_lessons_asserting_a_timing_claim_run_on_cores_nothing_else_uses():
    """make test runs the unit tests and most lessons on several pytest-xdist workers, then the
    lessons listed in TIMED_LESSONS alone: a lesson whose check asserts a wall-clock time or speed-up
    says so in a comment ("timing claim") and must be in that list; every name listed must exist. A
    claim on CPU time (02's: the GIL, one interpreter against one per rank) is not one: other work
    on the cores stretches the wall clock, not a process's own CPU time. Nor is one asserted only
    where ``workbench.runtime.busy.were_free`` says other work left the cores free (05, 07, 08), nor
    one whose margins other work cannot flip, which the lesson says ("load-robust timing claim": 00's
    message times held 20 of 20 beside two busy loops on the 2 cores)."""
    makefile = (REPO / "Makefile").read_text()
    block = re.search(r"^TIMED_LESSONS := \$\(addprefix notebooks/,(.*?)\)$", makefile, re.M | re.S)
    assert block, "Makefile: TIMED_LESSONS := $(addprefix notebooks/,...) not found"
    listed = set(block.group(1).replace("\\", " ").split())
    # a lesson that asserts its timing claims only where were_free(...) says the cores were free may
    # run beside other work: there it states them without asserting them
    timed = {s.with_suffix(".ipynb").name for s in SCRIPTS
             if "timing claim" in (text := s.read_text()) and "were_free(" not in text
             and "load-robust timing claim" not in text}
    assert listed == timed, f"listed but asserting no timing claim: {sorted(listed - timed)}; asserting a " \
                            f"timing claim but not listed: {sorted(timed - listed)}"
    assert all((REPO / "notebooks" / name).exists() for name in listed), sorted(listed)


def test_make_test_sanitizes_with_the_repository_s_file():
    makefile = (REPO / "Makefile").read_text()
    assert f"--nbval-sanitize-with {SANITIZE.relative_to(REPO)}" in makefile


def test_the_sanitizer_hides_rounding_and_timings_and_keeps_counts():
    # the same lesson output on two CPUs (issue 36's four failing cells) sanitizes to the same text
    for stored, here in [("largest parameter difference **1.1e-13**;", "largest parameter difference **9.1e-14**;"),
                         ("'output diff': 1.34e-07, 'all-reduces': 2", "'output diff': 1.1920928955078125e-07, 'all-reduces': 2"),
                         ("single 4.1825314   tensor-parallel 4.1825323   |diff| 9.5e-07",
                          "single 4.1825311   tensor-parallel 4.1825316   |diff| 4.8e-07"),
                         ("| dp=2 tp=2 pp=1 | 1 | 4.8e-07 | 0.0e+00 |", "| dp=2 tp=2 pp=1 | 1 | 2.4e-07 | 1.2e-08 |"),
                         ("a step takes 24.1 ms, 310 us here", "a step takes 31.9 ms, 94 µs here")]:
        assert _sanitize(stored) == _sanitize(here), (stored, here)
    # what is deterministic stays compared: shapes, counts, bytes, ratios of formulas, pass/fail words
    for kept in ["logits on this rank (4, 32, 33) (vocabulary 65 padded to 66)", "2 calls, 65536 B",
                 "48.97 MiB 48.96 MiB 1.0000", "tensor([10., 12., 14., 16.])", "check passed", "| dp=2 tp=2 pp=1 | 1 |"]:
        assert _sanitize(kept) == kept, kept
    assert _sanitize("2 calls, 65536 B") != _sanitize("3 calls, 65536 B")
    # a check cell run on a busy machine notes the timing claims it did not assert (05, 07): the
    # note is blanked, what it did assert is still compared
    stored = "all checks passed: parity with one process, bubbles on the formulas"
    busy = (stored + " (bubbles' upper bound and ZB-H1 against GPipe not asserted: other work kept the cores "
            "38% busy around the sweep)")
    assert _sanitize(busy) == _sanitize(stored)
    stored = "check passed: parity with one process, hierarchical beats the ring, TP inside beats TP across"
    assert _sanitize(stored + " (all-reduce timings not asserted: other work kept the cores 41% busy)"
                     " (placement timings not asserted: other work kept the cores 30% busy)") == _sanitize(stored)
    assert _sanitize("check passed (smoke test: timings not asserted)") != _sanitize("check passed")


def test_smoke_test_is_read_from_the_environment(monkeypatch):
    import workbench

    monkeypatch.delenv("WORKBENCH_SMOKE_TEST", raising=False)
    assert not workbench.smoke_test()
    for value, expected in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("WORKBENCH_SMOKE_TEST", value)
        assert workbench.smoke_test() is expected
