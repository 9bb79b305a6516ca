"""``tpcheck.inputs.files.step_store.save_step`` writes a step's safetensors file itself: the library reads it back
exactly, and the records it returns are ``tensor_record``'s."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from procs import run_forked
from safetensors.torch import load_file

from tpcheck.inputs.files.step_store import load_step, save_step
from tpcheck.inputs.files.validate import tensor_record


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.out": torch.randn(4, 96, generator=g),
        "logits": torch.randn(3, 1000, generator=g, dtype=torch.float64),
        "layers.0.q": torch.randn(5, 7, generator=g).to(torch.bfloat16),  # an odd byte count: the next is unaligned
        "layers.0.k": torch.randn(2, 3, generator=g).to(torch.float16),
        "layers.0.moe.topk_ids": torch.randint(0, 8, (4, 2), generator=g),
        "empty": torch.empty(0, 16),
        "scalar": torch.tensor(2.5),
        "mask": torch.tensor([True, False, True]),
        "strided": torch.randn(6, 8, generator=g).t(),  # not contiguous: written row-major
        "offset": torch.arange(20.0).reshape(4, 5)[1:],  # a contiguous view that starts inside its storage
    }


def test_the_library_reads_the_written_step_back_exactly(tmp_path):
    tensors = _tensors()
    records = save_step(tmp_path / "step0.safetensors", tensors)
    back = load_file(str(tmp_path / "step0.safetensors"))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
        assert records[name] == tensor_record(t), name
    assert load_step(tmp_path / "step0.safetensors", ValueError).keys() == tensors.keys()


def test_the_header_is_the_formats(tmp_path):
    """8-byte little-endian length, a JSON header padded to 8 bytes, the byte ranges back to back."""
    tensors = _tensors()
    save_step(tmp_path / "s.safetensors", tensors)
    data = (tmp_path / "s.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    assert n % 8 == 0
    header = json.loads(data[8:8 + n])
    end = 0
    for name, t in tensors.items():
        begin, stop = header[name]["data_offsets"]
        assert begin == end and stop - begin == t.numel() * t.element_size(), name
        end = stop
    assert len(data) == 8 + n + end


def test_a_dtype_the_writer_does_not_name_goes_through_the_library(tmp_path):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    t = torch.randn(4, 4).to(torch.float8_e4m3fn)
    records = save_step(tmp_path / "f8.safetensors", {"x": t, "y": torch.ones(2)})
    back = load_file(str(tmp_path / "f8.safetensors"))
    assert torch.equal(back["x"].view(torch.uint8), t.view(torch.uint8))
    assert records["x"] == tensor_record(t)


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_hashed_side_by_side_the_records_are_the_same(tmp_path, monkeypatch, threads):
    """Where threads hash a step's tensors while it is written (``HASH_THREADS``), every record is the one hashed in
    order, whatever the split of the tensors into runs (more threads than tensors included)."""
    import tpcheck.inputs.files.step_store as store
    tensors = _tensors()
    want = {n: tensor_record(t) for n, t in tensors.items()}
    monkeypatch.setattr(store, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(store, "HASH_THREADS", threads)
    monkeypatch.setattr(store, "_POOL", None)
    assert store.save_step(tmp_path / "p.safetensors", tensors) == want
    assert store._POOL is not None  # the threads did hash them
    back = load_file(str(tmp_path / "p.safetensors"))
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def _save_in_child(path) -> None:
    import tpcheck.inputs.files.step_store as store
    store.save_step(path, _tensors())


def test_a_forked_process_hashes_with_a_pool_of_its_own(tmp_path, monkeypatch):
    """A process forked after its parent hashed side by side (a rank forked from a driver that saved a golden) has
    its parent's pool object but none of its threads: it makes its own, where the inherited one never ran a job."""
    import tpcheck.inputs.files.step_store as store
    monkeypatch.setattr(store, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(store, "HASH_THREADS", 2)
    monkeypatch.setattr(store, "_POOL", None)
    store.save_step(tmp_path / "parent.safetensors", _tensors())
    assert run_forked(_save_in_child, tmp_path / "child.safetensors",
                      hung="the forked process hung waiting for its parent's hashing threads") == 0
    assert load_file(str(tmp_path / "child.safetensors")).keys() == _tensors().keys()
