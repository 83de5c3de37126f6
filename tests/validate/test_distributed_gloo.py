"""Real 2-rank gloo runs (torchrun): DDP, ZeRO-1, FSDP2, TP, CP, EP and MoE TP plans validated with
`--mode run` on CPU, every rank's tracker peak against the planner's per-rank peak. Apart from
test_distributed.py so that its one launch (a module fixture) pins only these tests to one xdist worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_distributed import SMALL, SMALL_MOE, _plan  # noqa: E402

# its module-scoped fixture is built once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("test_distributed_gloo")

ROOT = Path(__file__).resolve().parents[2]

# (ZeRO stage, accumulation, precision, FSDP2 gradient sync, tensor-, context-, expert-parallel degree,
# model); "moe" is a small Mixtral-style model (4 experts: 2 per rank under expert parallelism,
# every expert's inner size split under tensor parallelism)
# (ZeRO-2 fp32 and ZeRO-3 without accumulation are left to the fake-process-group tests, as FSDP2's
# other cases here cover its real collectives)
# (dense TP is left to the MoE TP case, whose attention and dense parts are sharded the same way)
GLOO_CASES = [(0, 1, "fp32", "every", 1, 1, 1, "dense"), (1, 2, "fp32", "every", 1, 1, 1, "dense"),
              (3, 3, "bf16-mixed", "last", 1, 1, 1, "dense"), (3, 2, "bf16-mixed", "every", 1, 2, 1, "dense"),
              (3, 2, "bf16-mixed", "every", 1, 1, 2, "moe"), (0, 2, "bf16-mixed", "every", 2, 1, 1, "moe")]
GLOO_MODELS = {"dense": SMALL, "moe": SMALL_MOE}

# torchrun starts each rank as `python WORKER plan0.json plan1.json ...`; the worker validates
# every plan with `--mode run --device cpu --steps 1 --json`, one after another in the same two
# ranks. The first plan runs exactly as `torchrun -m roofplan validate PLAN ...` does (roofplan/__main__.py,
# which creates, and afterwards destroys, the gloo process group); the others go through the same
# CLI (roofplan.validate_cli.main) in one group the worker creates under its own store prefix (creating a
# second default group on torchrun's store races with the first one's keys: a rank can join the
# old group and hang). Rank 0 prints one line per plan; a rank that fails ends the launch (the
# other would wait in a collective).
GLOO_WORKER = """
import contextlib, io, json, os, runpy, sys
import torch.distributed as dist
from roofplan.validate_cli import main


def validate(index, path, as_module=False):
    argv = [path, "--mode", "run", "--device", "cpu", "--steps", "1", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if as_module:  # python -m roofplan validate ARGV
            sys.argv = ["roofplan", "validate", *argv]
            try:
                runpy.run_module("roofplan", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as stop:
                code = stop.code or 0
        else:
            code = main(argv)
    if os.environ["RANK"] == "0":
        print("PLAN " + json.dumps({"index": index, "code": code, "stdout": out.getvalue()}), flush=True)
    if code != 0 and not out.getvalue():
        sys.exit(code)

first, *others = sys.argv[1:]
validate(0, first, as_module=True)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
dist.init_process_group("gloo", store=dist.PrefixStore("roofplan-tests", store), rank=rank, world_size=world)
for index, path in enumerate(others, start=1):
    validate(index, path)
    dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def gloo_reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, dict], str]:
    """One 2-rank torchrun launch (gloo) running every GLOO_CASES plan: starting torchrun and its
    ranks (three processes importing torch) cost more than the steps when each case had its own.
    Returns rank 0's results by case index and, if the launch failed, why."""
    tmp = tmp_path_factory.mktemp("gloo")
    plans = [str(_plan(2, stage, accum=accum, precision=precision, blocks=(1,), sync=sync, tp=tp, cp=cp, ep=ep,
                       model=GLOO_MODELS[model]).save(tmp / f"plan{i}.json"))
             for i, (stage, accum, precision, sync, tp, cp, ep, model) in enumerate(GLOO_CASES)]
    worker = tmp / "worker.py"
    worker.write_text(GLOO_WORKER)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker), *plans],
        capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("PLAN "):
            result = json.loads(line[len("PLAN "):])
            results[result["index"]] = result
    failure = ""
    if done.returncode != 0:  # the failing rank's own lines first: torchrun's summary alone says little
        lines = done.stderr.splitlines()
        causes = [line for line in lines if any(w in line for w in ("Error", "error:", "Signal", "what()", "terminate"))]
        failure = (f"torchrun exited {done.returncode}:\n" + "\n".join(causes[-20:]) + "\n--- stderr tail ---\n"
                   + "\n".join(lines[-30:]))
    return results, failure


@pytest.mark.parametrize("case", range(len(GLOO_CASES)), ids=["-".join(map(str, case)) for case in GLOO_CASES])
def test_two_ranks_over_gloo(case: int, gloo_reports: tuple[dict[int, dict], str]) -> None:
    """A real 2-rank CPU run (torchrun, gloo): every rank measured by the tracker, the largest
    within 5% of the predicted per-rank peak (issue 5 asks 5%; the planner is built to match).
    The last three cases are context parallelism (torch's ring attention over gloo, FSDP2 over both
    ranks), expert parallelism (all_to_all_single over gloo, the experts FSDP2 units of one rank)
    and tensor parallelism of MoE blocks (DTensor over gloo with sequence parallelism: attention
    sharded by heads, each rank half of every expert's inner size, the router whole)."""
    results, failure = gloo_reports
    if case not in results or results[case]["code"] != 0 and not results[case]["stdout"]:
        pytest.fail(failure or "no report for this plan")
    report = json.loads(results[case]["stdout"][results[case]["stdout"].index("{"):])
    assert len(report["per_rank"]) == 2
    assert abs(report["errors"]["peak_allocated"]) < 0.05
    assert report["verdict"] == "pass"
    assert results[case]["code"] == 0
