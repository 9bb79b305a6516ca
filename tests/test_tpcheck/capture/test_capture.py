"""tpcheck.capture: name-map hooks inside an engine's rank (impl, Hugging Face, a vLLM-style module tree).

* IMPL_MAP gives exactly capture_impl's points, placements and tensors (tp 1 in-process; tp 2 as simulated ranks).
* HF_MAP gives HFCapture's tensors.
* from_env: no env var, no hook; TPCHECK_DUMP writes a dump read_dump accepts (and tpcheck's comparison passes).
* VLLM_MAP on a stand-in with vLLM's module names, fused qkv / gate_up, fused in-place add + RMSNorm, in-place
  RoPE and a last-rows-only logits processor: every point it reports equals HF's (so the splits are right)."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fake_tp import fake_rank
from impl.placements import Fused, Partial, Replicate, Shard
from tpcheck.engines.impl import ranks as capture_impl
from tpcheck.capture import (HF_MAP, IMPL_MAP, VLLM_MAP, VLLM_NORMS_ONLY_MAP, Rule, from_env, install)
from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache
from tpcheck.capture.maps import vllm_gate_up_placement, vllm_qkv_placement
from tpcheck.engines.dump.replay import DumpAdapter, read_dump
from tpcheck.measure.unshard import unshard

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 7]]


def n_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def runner_at(model_dir, rank=0, tp=1):
    """impl's ModelRunner built in this process: tp 1 directly, else as simulated rank ``rank`` of ``tp``."""
    from impl.model_runner import ModelRunner
    with fake_rank(rank, tp):
        return ModelRunner(str(model_dir), "float32")


def impl_steps(steps: int = 3):
    """``(tokens, starts, tables)`` of each step: both prompts' prefill, then one token each per step."""
    tables, nxt = [], 0
    for p in PROMPTS:
        n = -(-(len(p) + steps) // 4)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    tokens, starts, out = PROMPTS, [0] * len(PROMPTS), []
    for s in range(steps):
        out.append((tokens, starts, tables))
        starts = [a + len(t) for a, t in zip(starts, tokens)]
        tokens = [[7 + s], [11 + s]]
    return out


def assert_same_points(got: dict, ref: dict):
    assert list(got) == list(ref)  # same names, same (execution) order
    for name, (placement, t) in ref.items():
        p, g = got[name]
        assert p == placement, name
        assert g.dtype == t.dtype and torch.equal(g, t), name


# ---- (1) IMPL_MAP == capture_impl ---------------------------------------------------------------------------

def test_impl_map_matches_capture_impl_at_tp1(ckpt):
    runner = runner_at(ckpt("tiny"))
    capture_impl.setup(runner, 8, 4)
    cap = install(runner.model, IMPL_MAP)
    for step, (tokens, starts, tables) in enumerate(impl_steps()):
        ref = capture_impl.step(runner, list(zip(tokens, starts, tables)))
        got = cap.step_done(step, tokens, starts)
        assert_same_points(got, ref)
        names = {u.name for n, (p, t) in got.items() for u in unshard(n, p, [t])}
        assert sorted(names) == sorted(IMPL_MAP.reports(2))  # every canonical point but the KV cache
    assert not cap.dropped
    before = n_hooks(runner.model)
    cap.remove()
    assert n_hooks(runner.model) == before - len({(s.module_name, s.rule.input) for s in cap.sites})


@pytest.mark.parametrize("rank", [0, 1])
def test_impl_map_matches_capture_impl_on_a_simulated_rank(rank, ckpt):
    """tp 2 of a 1-KV-head model: local fused widths and KV replicas as capture_impl declares them."""
    runner = runner_at(ckpt("tiny-mqa"), rank, 2)
    with fake_rank(rank, 2):
        capture_impl.setup(runner, 8, 4)
        cap = install(runner.model, IMPL_MAP)
        for step, (tokens, starts, tables) in enumerate(impl_steps(2)):
            ref = capture_impl.step(runner, list(zip(tokens, starts, tables)))
            assert_same_points(cap.step_done(step, tokens, starts), ref)
    qkv = ref["layers.0.attn."][0]
    assert qkv == Fused((("q", 32, Shard(-1)), ("k", 16, Shard(-1, 2)), ("v", 16, Shard(-1, 2))))
    assert ref["layers.0.attn.k_rope"][0] == Shard(-1, 2)
    cap.remove()


# ---- (2) HF_MAP == HFCapture ---------------------------------------------------------------------------------

def test_hf_map_matches_hf_capture(ckpt):
    model = load_hf_model(ckpt("tiny"))
    hf = HFCapture(model)
    before = n_hooks(model)
    cap = install(model, HF_MAP)
    caches, starts, tokens = [new_cache(model) for _ in PROMPTS], [0, 0], PROMPTS
    for step in range(2):
        ref = hf.step(tokens, caches, starts)
        got = cap.step_done(step, tokens, starts)
        assert set(got) == set(ref) - {n for n in ref if n.endswith("_rope")}
        assert sorted(got) == sorted(HF_MAP.reports(2))
        for name, (placement, t) in got.items():
            assert placement == Replicate() and torch.equal(t, ref[name]), name
        starts = [s + len(t) for s, t in zip(starts, tokens)]
        tokens = [[5], [6]]
    cap.remove()
    assert n_hooks(model) == before  # HFCapture's own hooks stay


def test_a_disarmed_capture_copies_nothing(ckpt):
    """``Capture.armed`` False: the hooks stay installed and a forward copies and keeps nothing; armed again, the
    next step is captured whole (the same points as a capture that was never disarmed)."""
    model = load_hf_model(ckpt("tiny"))
    cap = install(model, HF_MAP)
    cap.armed = False
    HFCapture(model).step(PROMPTS, [new_cache(model) for _ in PROMPTS], [0, 0])
    assert cap.step_done(0) == {}
    cap.armed = True
    HFCapture(model).step(PROMPTS, [new_cache(model) for _ in PROMPTS], [0, 0])
    assert sorted(cap.step_done(1, PROMPTS, [0, 0])) == sorted(HF_MAP.reports(2))
    cap.remove()


# ---- (3) from_env --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [None, ""])
def test_from_env_off_registers_nothing(value, ckpt, monkeypatch):
    if value is None:
        monkeypatch.delenv("TPCHECK_DUMP", raising=False)
    else:
        monkeypatch.setenv("TPCHECK_DUMP", value)
    runner = runner_at(ckpt("tiny"))
    assert n_hooks(runner.model) == 0
    assert from_env(runner.model, IMPL_MAP, 0, 1, "float32", "impl") is None
    assert n_hooks(runner.model) == 0


def run_impl(runner, cap, steps=3):
    runner.allocate_kv_cache(8, 4)
    for step, (tokens, starts, tables) in enumerate(impl_steps(steps)):
        runner.step(list(zip(tokens, starts, tables)), all_logits=True)
        cap.step_done(step, tokens, starts)


def test_from_env_writes_a_dump_tpcheck_compares(ckpt, tmp_path, monkeypatch):
    from tpcheck.pipeline.diff import compare_engine
    d = ckpt("tiny")
    monkeypatch.setenv("TPCHECK_DUMP", str(tmp_path / "dump"))
    monkeypatch.delenv("TPCHECK_DUMP_POINTS", raising=False)
    monkeypatch.delenv("TPCHECK_DUMP_BUDGET_MB", raising=False)
    runner = runner_at(d)
    cap = from_env(runner.model, IMPL_MAP, 0, 1, torch.float32, "impl")
    assert n_hooks(runner.model) > 0
    run_impl(runner, cap)
    cap.remove()
    assert n_hooks(runner.model) == 0
    assert (tmp_path / "dump/rank0/step0.json").is_file() and (tmp_path / "dump/rank0/step0.safetensors").is_file()
    dump = read_dump(tmp_path / "dump")
    assert (dump.tp, dump.dtype, dump.engine) == (1, "float32", "impl")
    assert dump.tokens[0] == PROMPTS and dump.starts[1] == [5, 3]
    pts = dump.points(0)
    assert pts["layers.0.attn."][0] == Fused((("q", 64, Shard(-1)), ("k", 16, Shard(-1)), ("v", 16, Shard(-1))))
    assert pts["logits"][1][0].shape == (8, 250)
    # the offline comparison judges the dump as it judges the live engine
    r = compare_engine(DumpAdapter(dump), str(d), dump.tokens[0], "float32", decode_steps=2)
    assert r.passed, r.summary()


def test_from_env_points_and_budget(ckpt, tmp_path, monkeypatch):
    d = ckpt("tiny")
    runner = runner_at(d)
    monkeypatch.setenv("TPCHECK_DUMP", str(tmp_path / "a"))
    monkeypatch.setenv("TPCHECK_DUMP_POINTS", r"layers\.0\.attn\.(q|k)|logits")
    cap = from_env(runner.model, IMPL_MAP, 0, 1, "float32", "impl")
    assert n_hooks(runner.model) == 2  # layer 0's qkv_proj and the LM head only
    run_impl(runner, cap, 2)
    cap.remove()
    pts = read_dump(tmp_path / "a").points(1)
    assert sorted(pts) == ["layers.0.attn.k", "layers.0.attn.q", "logits"]  # v not kept: the fused qkv is split
    assert pts["layers.0.attn.q"][0] == Shard(-1) and pts["layers.0.attn.q"][1][0].shape == (2, 64)

    monkeypatch.setenv("TPCHECK_DUMP", str(tmp_path / "b"))
    monkeypatch.delenv("TPCHECK_DUMP_POINTS")
    monkeypatch.setenv("TPCHECK_DUMP_BUDGET_MB", "0.01")  # 10 KiB: less than one prefill step
    cap = from_env(runner.model, IMPL_MAP, 0, 1, "float32", "impl")
    run_impl(runner, cap, 2)  # does not raise: the dump stops, the engine runs on
    assert "budget" in cap.error and n_hooks(runner.model) == 0
    assert not list((tmp_path / "b/rank0").glob("step*"))

    monkeypatch.setenv("TPCHECK_DUMP_BUDGET_MB", "lots")
    with pytest.raises(ValueError, match="TPCHECK_DUMP_BUDGET_MB"):
        from_env(runner.model, IMPL_MAP, 0, 1, "float32", "impl")


# ---- name maps ------------------------------------------------------------------------------------------------

def test_rules_are_checked():
    with pytest.raises(ValueError, match="not a canonical point"):
        Rule(r"model\.layers\.{layer}\.mlp", "layers.{layer}.mlp.output")
    with pytest.raises(ValueError, match="parts"):
        Rule(r"model\.layers\.{layer}\.qkv", "layers.{layer}.attn.")
    with pytest.raises(ValueError, match="needs \\{layer\\}"):
        Rule(r"model\.norm", "layers.{layer}.out")
    with pytest.raises(ValueError, match="matches no module"):
        install(nn.Sequential(nn.Linear(2, 2)), VLLM_MAP)


def test_vllm_placements_from_the_layer_attributes():
    """vLLM's QKVParallelLinear at tp 4 over 2 KV heads: 1 local KV head, each held by 2 ranks."""
    qkv = types.SimpleNamespace(output_partition_sizes=[32, 16, 16], num_kv_head_replicas=2)
    want = Fused((("q", 32, Shard(-1)), ("k", 16, Shard(-1, 2)), ("v", 16, Shard(-1, 2))))
    assert vllm_qkv_placement(qkv, None) == want
    bare = types.SimpleNamespace(num_heads=2, num_kv_heads=1, head_size=16, num_kv_head_replicas=2)
    assert vllm_qkv_placement(bare, None) == want
    gate_up = types.SimpleNamespace(output_sizes=[96, 96], tp_size=4)
    assert vllm_gate_up_placement(gate_up, None) == Fused((("gate", 24, Shard(-1)), ("up", 24, Shard(-1))))
    m = VLLM_MAP.with_placement("layers.{layer}.attn.out", Partial())
    assert [r.placement for r in m.rules if r.point.endswith("attn.out")] == [Partial()]
    assert VLLM_NORMS_ONLY_MAP.not_reported(2) == ["layers.0.attn.residual", "layers.0.out",
                                                   "layers.1.attn.residual", "layers.1.out"]


# ---- (4) VLLM_MAP on a vLLM-style module tree ----------------------------------------------------------------

class VLinear(nn.Module):
    """vLLM's linear layers return ``(output, output_bias)``."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight, self.bias = weight.clone(), None if bias is None else bias.clone()

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class VQKV(VLinear):
    def __init__(self, a, heads, kv_heads, d):
        super().__init__(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                         torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        self.num_heads, self.num_kv_heads, self.head_size, self.num_kv_head_replicas = heads, kv_heads, d, 1
        self.output_partition_sizes = [heads * d, kv_heads * d, kv_heads * d]


class VMerged(VLinear):
    def __init__(self, mlp):
        super().__init__(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.output_sizes, self.tp_size = [mlp.gate_proj.out_features] * 2, 1  # no output_partition_sizes


class VRMSNorm(nn.Module):
    """vLLM's RMSNorm: with a residual, the fused kernel adds and normalises *in place*."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = weight.clone(), eps

    def _norm(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def forward(self, x, residual=None):
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        x.copy_(self._norm(residual))
        return x, residual


class VRotary(nn.Module):
    """Rotates q and k in place (they are views into the qkv buffer, as in vLLM)."""

    def __init__(self, hf_rotary, d):
        super().__init__()
        self.hf_rotary, self.d = hf_rotary, d

    def forward(self, positions, q, k):
        cos, sin = self.hf_rotary(q[None], positions[None])
        cos, sin = cos[0, :, None], sin[0, :, None]
        for x in (q, k):
            h = x.view(x.shape[0], -1, self.d)
            rot = torch.cat([-h[..., self.d // 2:], h[..., : self.d // 2]], dim=-1)
            h.copy_(h * cos + rot * sin)
        return q, k


class VAttention(nn.Module):
    def __init__(self, heads, kv_heads, d):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, d

    def forward(self, q, k, v):  # one prompt's prefill: [T, heads * d] each
        T = q.shape[0]
        o = F.scaled_dot_product_attention(*(x.view(T, -1, self.d).transpose(0, 1) for x in (q, k, v)),
                                           is_causal=True, enable_gqa=True)
        return o.transpose(0, 1).reshape(T, -1)


class VSelfAttn(nn.Module):
    def __init__(self, a, cfg, rotary):
        super().__init__()
        d = cfg.hidden_size // cfg.num_attention_heads
        self.qkv_proj = VQKV(a, cfg.num_attention_heads, cfg.num_key_value_heads, d)
        self.o_proj = VLinear(a.o_proj.weight)
        self.rotary_emb = VRotary(rotary, d)
        self.attn = VAttention(cfg.num_attention_heads, cfg.num_key_value_heads, d)
        self.q_size, self.kv_size = self.qkv_proj.output_partition_sizes[:2]

    def forward(self, positions, x):
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class VMLP(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.gate_up_proj, self.down_proj = VMerged(mlp), VLinear(mlp.down_proj.weight)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        x, _ = self.down_proj(F.silu(gate) * up)
        return x


class VLayer(nn.Module):
    def __init__(self, layer, cfg, rotary):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = VRMSNorm(layer.input_layernorm.weight, eps)
        self.self_attn = VSelfAttn(layer.self_attn, cfg, rotary)
        self.post_attention_layernorm = VRMSNorm(layer.post_attention_layernorm.weight, eps)
        self.mlp = VMLP(layer.mlp)

    def forward(self, positions, hidden_states, residual):  # vLLM's Qwen2DecoderLayer.forward
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class VModel(nn.Module):
    def __init__(self, hf):
        super().__init__()
        cfg, m = hf.config, hf.model
        self.embed_tokens = nn.Embedding.from_pretrained(m.embed_tokens.weight.clone())
        self.layers = nn.ModuleList(VLayer(layer, cfg, m.rotary_emb) for layer in m.layers)
        self.norm = VRMSNorm(m.norm.weight, cfg.rms_norm_eps)

    def forward(self, ids, positions):
        hidden_states, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class VLogits(nn.Module):
    def forward(self, lm_head, hidden):
        return F.linear(hidden, lm_head.weight)


class VForCausalLM(nn.Module):
    """vLLM's module tree for Qwen2, with HF's weights (q|k|v and gate|up fused); never calls ``lm_head``."""

    def __init__(self, hf):
        super().__init__()
        self.model = VModel(hf)
        self.lm_head = nn.Module()
        self.lm_head.weight = hf.lm_head.weight.clone()
        self.logits_processor = VLogits()

    @torch.no_grad()
    def run(self, ids: list[int], all_logits: bool):
        hidden = self.model(torch.tensor(ids), torch.arange(len(ids)))
        return self.logits_processor(self.lm_head, hidden if all_logits else hidden[-1:])


@pytest.mark.parametrize("all_logits", [True, False])
def test_vllm_map_on_a_vllm_style_model_equals_hf(all_logits, ckpt):
    model = load_hf_model(ckpt("tiny"))
    ref = HFCapture(model).step(PROMPTS, [new_cache(model) for _ in PROMPTS], [0, 0])
    engine = VForCausalLM(model)
    cap = install(engine, VLLM_MAP)
    for p in PROMPTS:  # one prompt per forward: the capture concatenates the rows
        engine.run(p, all_logits)
    points = cap.step_done(0, PROMPTS, [0, 0])
    got = {u.name: u.tensor for n, (p, t) in points.items() for u in unshard(n, p, [t])}
    want = set(VLLM_MAP.reports(2)) - (set() if all_logits else {"logits"})
    assert set(got) == want
    if not all_logits:  # vLLM-style: logits of the last row of each prompt only
        assert "logits" in cap.dropped and "8 tokens" in cap.dropped["logits"]
    assert points["layers.0.attn."][0] == Fused((("q", 64, Shard(-1)), ("k", 16, Shard(-1)), ("v", 16, Shard(-1))))
    for name, t in got.items():
        # embed is mutated in place by layer 0's fused add+norm, q/k by the RoPE: captured before that
        torch.testing.assert_close(t, ref[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    cap.remove()
    assert n_hooks(engine) == 0


def test_a_dtensor_output_is_read_from_the_dtensor(tmp_path):
    """A module that returns a DTensor (a TP plan with use_local_output=False) is captured as its local tensor
    with the DTensor's own placement, whatever the rule declares."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate as DReplicate, Shard as DShard
    from tpcheck.capture.core import NameMap
    if dist.is_initialized():
        pytest.skip("a process group is already up in this worker")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        class Out(nn.Module):
            def __init__(self, placement):
                super().__init__()
                self.placement = placement

            def forward(self, x):
                return DTensor.from_local(x * 2, mesh, [self.placement], run_check=False)

        model = nn.Module()
        model.a, model.b = Out(DShard(1)), Out(DReplicate())
        cap = install(model, NameMap("dt", (Rule("a", "embed", Replicate()), Rule("b", "final_norm", Shard(-1)))))
        x = torch.arange(6.0).reshape(3, 2)
        model.a(x), model.b(x)
        got = cap.step_done(0)
        assert got["embed"][0] == Shard(-1) and got["final_norm"][0] == Replicate()
        assert type(got["embed"][1]) is torch.Tensor and torch.equal(got["embed"][1], x * 2)
    finally:
        dist.destroy_process_group()


def test_from_env_records_the_checkpoint_it_is_told(ckpt, tmp_path, monkeypatch, caplog):
    """``from_env(..., checkpoint=DIR)``: the dump records DIR's fingerprint, so ``compare`` refuses another
    checkpoint; without it ``compare`` warns that the model identity is not checked."""
    from tpcheck.capture.dump import DumpError
    d = ckpt("tiny")
    for name, told in (("told", str(d)), ("untold", None)):
        monkeypatch.setenv("TPCHECK_DUMP", str(tmp_path / name))
        runner = runner_at(d)
        cap = from_env(runner.model, IMPL_MAP, 0, 1, torch.float32, "impl", told)
        run_impl(runner, cap)
        cap.remove()
    with pytest.raises(DumpError, match="model_fingerprint is not that of --model"):
        read_dump(tmp_path / "told").check_model(str(ckpt("tiny-untied")))
    read_dump(tmp_path / "told").check_model(str(d))
    with caplog.at_level("WARNING", logger="tpcheck"):
        read_dump(tmp_path / "untold").check_model(str(d))
    assert "records no checkpoint fingerprint" in caplog.text


# ---- (7) a CUDA engine's hooks queue their copies: the forward never waits for the GPU -------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (queued host copies); "
                                "the CPU path is the plain copy the tests above check")


def on_device(engine: nn.Module, device: str) -> nn.Module:
    """``engine`` with every tensor on ``device``: the stand-in keeps its weights as plain attributes."""
    for m in engine.modules():
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor):
                setattr(m, k, v.to(device))
    return engine.to(device)


@needs_cuda
def test_a_cuda_capture_queues_its_copies_and_waits_once_a_step(ckpt, monkeypatch):
    """On CUDA a hook's copy is queued into pinned memory (``queued_host_copy``): under torch's sync debug mode
    ("error": a call that makes the host wait for the GPU raises) the forward with every point hooked runs, where
    the plain ``.cpu()`` copy raises at its first hook; ``step_done`` waits once, and every point is the plain
    copy's bit for bit, those the forward later changes in place (the fused add + RMSNorm's residual, RoPE's q and
    k) as they were at their hook."""
    import tpcheck.capture.core as core
    engine = on_device(VForCausalLM(load_hf_model(ckpt("tiny"))), "cuda")
    inputs = [(torch.tensor(p, device="cuda"), torch.arange(len(p), device="cuda")) for p in PROMPTS]

    def forward():
        with torch.no_grad():
            for ids, pos in inputs:
                engine.logits_processor(engine.lm_head, engine.model(ids, pos))

    def points(strict: bool) -> dict:
        cap = install(engine, VLLM_MAP)
        try:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if strict else "default")
            try:
                forward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            return cap.step_done(0, PROMPTS, [0, 0])
        finally:
            cap.remove()

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward()  # the stand-in alone never waits: what the strict capture below is held to
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = points(strict=True)
    assert cap_devices(got) == {"cpu"}
    monkeypatch.setattr(core, "queued_host_copy", lambda t, devices: t.to("cpu", copy=True))  # the plain copy
    with pytest.raises(RuntimeError, match="synchroniz"):
        points(strict=True)
    want = points(strict=False)
    assert list(got) == list(want)
    for name, (p, t) in want.items():
        assert got[name][0] == p and torch.equal(got[name][1], t), name


def cap_devices(points: dict) -> set[str]:
    return {t.device.type for _, t in points.values()}
