"""The device as a parameter (``--device``, ``--golden-device``; ``tpcheck.inputs.devices``, ``impl.distributed``),
tested on the CPU: every name resolved or refused (exit 2, no fallback), the rank -> GPU assignment with more ranks
than GPUs, the host-staged collectives of ranks that share a GPU run for real (on CPU ranks), and every tensor that
crosses a rank's pipe on the host. A second device on a CPU-only machine: torch's TorchScript lazy-tensor backend
(``lazy``), where it is built, for the boundary helpers (what CUDA would do cannot be run here:
``benchmarks/gpu_check.py`` on a lent GPU)."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from impl.distributed import rank_device, shares_device
from impl.executor import on_host
from tpcheck.cli.app import main
from tpcheck.engines.hf_tp.adapter import check_device
from tpcheck.inputs import devices
from tpcheck.inputs.arg_types import device_name
from tpcheck.inputs.devices import devices_of, resolve_device, to_device
from tpcheck.options import DiffOptions
from tpcheck.pipeline.plan import run_devices

ROOT = Path(__file__).resolve().parents[3]
NO_CUDA = not torch.cuda.is_available()


_LAZY: list = []  # the lazy backend's init, once a process (a second init is an error)


def _lazy() -> str:
    """``lazy`` where torch's TorchScript lazy backend runs here (a device that is not the host), else skip."""
    if not _LAZY:
        try:
            import torch._lazy
            import torch._lazy.ts_backend
            torch._lazy.ts_backend.init()
            (torch.ones(2, device="lazy") * 2).cpu()
            _LAZY.append("")
        except Exception as e:  # noqa: BLE001 - a build without it, or one that dropped it
            _LAZY.append(f"{type(e).__name__}: {e}")
    if _LAZY[0]:
        pytest.skip(f"torch's lazy backend is not usable here: {_LAZY[0]}")
    return "lazy"


@pytest.mark.parametrize("name,gpus,want", [("auto", 0, "cpu"), ("auto", 1, "cuda"), ("cpu", 2, "cpu"),
                                            ("cuda", 1, "cuda"), ("cuda:1", 2, "cuda:1"), ("CUDA", 1, "cuda")])
def test_resolve_device(name, gpus, want):
    assert resolve_device(name, gpus=gpus) == want


@pytest.mark.parametrize("name,gpus,match", [("cuda", 0, "--device cuda: .*run with --device cpu"),
                                             ("cuda:2", 2, r"has 2 CUDA GPU\(s\) \(cuda:0-cuda:1\)"),
                                             ("gpu", 1, "expected a device")])
def test_resolve_device_refuses_what_is_not_there(name, gpus, match):
    with pytest.raises((ValueError, argparse.ArgumentTypeError), match=match):
        resolve_device(name, gpus=gpus)
    with pytest.raises(argparse.ArgumentTypeError):
        device_name("cuda:x")


@pytest.mark.parametrize("device,world,gpus,want,shared", [
    ("cpu", 4, 0, ["cpu"] * 4, False),
    ("cuda", 1, 1, ["cuda:0"], False),
    ("cuda", 2, 2, ["cuda:0", "cuda:1"], False),  # one rank per GPU: NCCL
    ("cuda", 2, 1, ["cuda:0", "cuda:0"], True),  # tp 2 on one lent GPU: shared, gloo staged through the host
    ("cuda", 4, 1, ["cuda:0"] * 4, True),
    ("cuda", 4, 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"], True),
    ("cuda:1", 2, 2, ["cuda:1", "cuda:1"], True),  # a GPU named: every rank on it
    ("cuda:0", 1, 1, ["cuda:0"], False),
])
def test_rank_device_assignment(device, world, gpus, want, shared):
    assert [rank_device(device, r, gpus) for r in range(world)] == want
    assert shares_device(device, world, gpus) is shared


def test_rank_device_refuses_a_gpu_that_is_not_there():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        rank_device("cuda", 0, 0)
    with pytest.raises(ValueError, match="cuda:3"):
        rank_device("cuda:3", 0, 2)


def test_hf_tp_refuses_ranks_sharing_a_gpu():
    check_device("cuda", 2, gpus=2)  # one per GPU: fine
    check_device("cpu", 4, gpus=0)
    with pytest.raises(ValueError, match="--engine hf-tp --tp 2 --device cuda: .* this machine has 1"):
        check_device("cuda", 2, gpus=1)


def test_run_devices_golden_defaults_to_the_engines(monkeypatch):
    assert run_devices(DiffOptions(device="cpu")) == ("cpu", "cpu")
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)  # a machine with one GPU, as the resolver sees it
    assert run_devices(DiffOptions()) == ("cuda", "cuda")  # auto
    assert run_devices(DiffOptions(golden_device="cpu")) == ("cuda", "cpu")
    assert run_devices(DiffOptions(), pool_device="cpu") == ("cpu", "cpu")  # auto: a pool made for a device
    assert run_devices(DiffOptions(device="cuda"), pool_device="cpu") == ("cuda", "cuda")  # named: wins
    assert run_devices(DiffOptions(streamed=True)) == ("cuda", "cpu")  # the streamed golden is a host golden
    with pytest.raises(ValueError, match="--golden-streamed with --golden-device cuda"):
        run_devices(DiffOptions(streamed=True, golden_device="cuda"))


def test_device_flags_round_trip():
    opts = DiffOptions(device="cuda:1", golden_device="cpu")
    argv = opts.to_argv()
    assert argv[argv.index("--device") + 1] == "cuda:1" and argv[argv.index("--golden-device") + 1] == "cpu"
    assert "--device" not in DiffOptions().to_argv()  # auto, the default: the repro runs wherever it is run
    assert "device cuda:1" in opts.describe() and "on device cpu" in opts.describe()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU: cuda is not absent")
@pytest.mark.parametrize("argv", [
    ["diff", "--preset", "tiny", "--tp", "1", "--device", "cuda"],
    ["diff", "--preset", "tiny", "--tp", "1", "--golden-device", "cuda:0"],
    ["check", "--preset", "tiny", "--tp", "1", "--device", "cuda"],
    ["sweep", "--preset", "tiny", "--tp", "1", "--dtype", "float32", "--decode-steps", "0", "--examples", "1",
     "--device", "cuda"],
    ["faults", "matrix", "--faults", "qkv_shard_dim1", "--device", "cuda"],
])
def test_cuda_asked_for_and_absent_is_bad_input(argv, capsys):
    """A GPU asked for on a machine without one: exit 2 and one line naming the flag, before any engine starts
    (never a silent run on the CPU)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("tpcheck: error:")]
    assert len(lines) == 1 and "device cuda" in lines[0] and "Traceback" not in err, err[-2000:]


def test_diff_records_where_it_ran(ckpt, engines):
    import tpcheck
    r = tpcheck.diff(str(ckpt("tiny")), tp=1, prompts=[[1, 2, 3, 4, 5]], pool=engines, device="cpu",
                     golden_device="cpu")
    assert r.passed and r.meta["devices"] == {"engine": "cpu", "golden": "cpu"}


def test_on_host_and_to_device_move_every_tensor():
    dev = _lazy()
    tree = {"a": (1, [torch.ones(2, device=dev), None]), "b": torch.zeros(3), "c": "text"}
    host = on_host(tree)
    assert devices_of(host) == {"cpu"} and host["c"] == "text" and host["a"][0] == 1 and host["a"][1][1] is None
    assert torch.equal(host["a"][1][0], torch.ones(2))
    moved = to_device(host, dev)
    assert devices_of(moved) == {"lazy:0"}
    same = torch.zeros(2)
    assert to_device(same, "cpu") is same  # already there: no copy


def test_rank_pipe_carries_host_tensors(ckpt, engines):
    """What the driver hands a rank (the golden's teacher inputs, the local pass's KV prefix) crosses on the host,
    wherever the golden is (``impl.executor.on_host``); the rank moves it to its own device."""
    dev = _lazy()
    llm = engines.get(ckpt("tiny"), 2)
    got = llm.call("worker_fns:received_devices", {0: (torch.ones(3, 4, device=dev), torch.ones(3, 4))})
    assert got == [["cpu"], ["cpu"]]


def test_host_staged_collectives_of_ranks_sharing_a_device(ckpt, engines):
    """The gloo path of ranks that share a GPU (every collective through a host copy), run on two CPU ranks: the
    same results as the direct path, and the right ones; a forward through it is bit-identical."""
    llm = engines.get(ckpt("tiny"), 2)
    direct, staged = (llm.call("worker_fns:staged_collectives", s) for s in (False, True))
    xs = [d["x"] for d in direct]
    for got in (direct, staged):
        for d in got:
            assert torch.equal(d["all_reduce"], xs[0] + xs[1])
            assert torch.equal(d["all_gather"], torch.cat(xs, dim=-1))
            assert d["device"] == "cpu"
        assert torch.equal(got[0]["gather"], torch.cat(xs, dim=0)) and got[1]["gather"] is None
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a, b = (llm.call("worker_fns:staged_logits", s, ids)[llm.logits_rank] for s in (False, True))
    assert torch.equal(a, b) and torch.equal(a, llm.logits(ids))


def test_gpu_check_quick_on_the_cpu(tmp_path):
    """``benchmarks/gpu_check.py``, the script a lent GPU runs whole, smoke-tested on the CPU: it runs, prints its
    figures and its verdicts pass."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--out", str(tmp_path / "gpu_check.json")], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "gpu_check: PASS" in out.stdout and (tmp_path / "gpu_check.json").is_file()
