"""`dsv3 train` on two nodes, as two torchrun agents on this host sharing one c10d rendezvous (each agent is a
node: torchrun's GROUP_RANK). pp 2 × ep 2 on 2 agents of 2 ranks: each EP group ([0, 2], [1, 3]) has one rank
on each agent, so `moe.ranks_per_node` 1 makes the routing's nodes the agents, and n_group 2 / topk_group 1 sends
every token to experts of one node only (node-limited routing across the agents). Asserted:
- 3 steps saving at steps 2 and 3; a fresh two-agent launch resuming from step 2 reproduces step 3 bit for bit
  (same op sequence on both sides: model, optimizer, router biases, data position restored);
- two agents given different `--out` (nodes without a shared file system) are refused before any step, with one
  line saying that `--out` must be shared, every rank exiting with status 2 (torchrun reports each rank's code).
The `moe.ranks_per_node` refusal is a pure function of the gathered layout: tests/unit/test_multinode_checks.py."""

import json
import os
import shutil
import sys

import pytest
from helpers import torchrun_agents

from dsv3_plugin.parallel.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DSV3 = shutil.which("dsv3", path=os.path.dirname(sys.executable))
pytestmark = pytest.mark.skipif(DSV3 is None, reason="needs the installed `dsv3` script (make venv)")
DS = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "dsv3": {
        "preset": "tiny",
        "model": {"num_hidden_layers": 4},
        "parallel": {"pp": 2, "ep": 2},
        "moe": {"ranks_per_node": 1, "n_group": 2, "topk_group": 1},
        "train": {"seq_len": 16, "seed": 5, "save_every": 2},
    },
}
# what a step computes (not how fast): equal bit for bit between the straight and the resumed run
SAME = ("loss", "lm_loss", "mtp_loss", "balance_loss", "maxvio", "maxvio_layers", "grad_norm", "lr", "tokens_seen")


def _agents(tmp, outs, nproc, config, *args):
    """One torchrun per entry of `outs` (that agent's --out), all joining one rendezvous; returns (exit codes, the
    JSON lines of all agents' stdout, all output)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(len(outs)),
        "--nproc-per-node",
        str(nproc),
    ]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    train = ["train", "--config", str(config), "--json", "--no-progress", *args]
    codes, text = torchrun_agents([[*launcher, DSV3, *train, "--out", str(out)] for out in outs], tmp, env)
    return codes, [json.loads(x) for x in text.splitlines() if x.startswith("{")], text


def test_two_agents_train_resume_and_refuse_unshared_out(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(DS))
    # nodes without a shared file system: each agent writes into its own --out
    small = tmp_path / "ds_small.json"  # 2 agents of 1 rank (the check runs before the model is built)
    small.write_text(json.dumps({**DS, "dsv3": {"preset": "tiny", "train": {"seq_len": 16}}}))
    codes, rows, text = _agents(tmp_path, [tmp_path / "a", tmp_path / "b"], 1, small, "--steps", "1")
    errors = [x for x in text.splitlines() if x.startswith("error:")]
    assert all(c != 0 for c in codes) and rows == [] and len(errors) == 1, text[-4000:]
    assert "not shared by all ranks" in errors[0] and "needs --out on a file system all nodes share" in errors[0]
    assert text.count("exitcode  : 2") == 2, text[-4000:]  # torchrun's report of each rank
    assert not os.path.exists(tmp_path / "a" / "ckpt") and not os.path.exists(tmp_path / "b" / "ckpt")

    out = tmp_path / "run"
    codes, rows, text = _agents(tmp_path, [out, out], 2, cfg, "--steps", "3")
    assert codes == [0, 0], text[-4000:]
    straight = {r["step"]: r for r in rows if "step" in r}
    assert sorted(straight) == [1, 2, 3] and rows[-1]["summary"]["steps"] == 3
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step2", "step3", "zero_to_fp32.py", "zero_to_torch.py"]

    shutil.rmtree(out / "ckpt" / "step3")  # resume from step 2 (as if the run had stopped there)
    (out / "ckpt" / "latest").write_text("step2")
    codes, rows, text = _agents(tmp_path, [out, out], 2, cfg, "--steps", "3", "--resume", str(out))
    assert codes == [0, 0], text[-4000:]
    resumed = [r for r in rows if "step" in r]
    assert [r["step"] for r in resumed] == [3]
    assert {k: resumed[0][k] for k in SAME} == {k: straight[3][k] for k in SAME}
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [1, 2, 3]
