"""A plain vLLM chat script under ``TPCHECK_DUMP``, as a user runs it: vLLM's defaults (prefix caching on), tp 2,
one system prompt shared by every chat (a full CPU block of 128 tokens), n = 2 sampling, and a KV cache too small
for the batch (``num_gpu_blocks_override``), so that vLLM preempts and recomputes. The dump compares clean, and the
same script with a fault seeded in one rank (``TPCHECK_DUMP_FAULT``) is found at the fault's origin.

vLLM tests, skipped without vLLM (the main venv); ``.ci/vllm`` runs this file. The variable's parsing, without vLLM,
is tested in ``test_vllm_plugin_fault.py``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from test_vllm import ckpt, vllm_env  # noqa: F401 - the vLLM fixtures (test_vllm.py's)

SYSTEM = [(11 * j + 5) % 256 for j in range(130)]  # one full CPU block (128 tokens) and two tokens more
# each chat: the system prompt and a user turn; prompts end a few tokens short of 256, so each sequence needs a
# third block while it decodes: with 6 blocks for 4 chats x 2 samples, vLLM must preempt
USERS = [[(7 * i + 3 * j + 1) % 256 for j in range(n)] for i, n in enumerate([120, 123, 121, 119])]
CHAT_SCRIPT = textwrap.dedent("""
    import sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        ckpt, dtype, system, users = sys.argv[1], sys.argv[2], %r, %r
        llm = LLM(model=ckpt, tensor_parallel_size=2, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=512, seed=0, num_gpu_blocks_override=6)
        sp = SamplingParams(n=2, max_tokens=10, temperature=0.8, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=system + u) for u in users], sp, use_tqdm=False)
        print("OUT", [[list(c.token_ids) for c in o.outputs] for o in outs])
    """ % (SYSTEM, USERS))


def _run(tmp_path, ckpt, name: str, fault: str | None = None):  # noqa: F811 - ckpt is the fixture's value
    """The chat script dumped to ``tmp_path/name`` (with ``fault`` seeded), then ``tpcheck compare`` of it: the
    compare's process and its JSON document."""
    script = tmp_path / "chat.py"
    script.write_text(CHAT_SCRIPT)
    dump, out = tmp_path / name, tmp_path / f"{name}.json"
    env = dict(os.environ, TPCHECK_DUMP=str(dump))
    if fault:
        env["TPCHECK_DUMP_FAULT"] = fault
    run = subprocess.run([sys.executable, str(script), str(ckpt), "float32"], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "prefix-cache hit" not in run.stderr  # every request's prompt was recorded
    cmp = subprocess.run([sys.executable, "-m", "tpcheck", "compare", str(dump), "--model", str(ckpt), "--json",
                          str(out)], capture_output=True, text=True, timeout=900)
    return dump, cmp, (json.loads(out.read_text()) if out.is_file() else None)


def test_chat_script_with_prefix_caching_n2_and_preemption_compares_clean_and_finds_a_seeded_fault(
        vllm_env, ckpt, tmp_path):  # noqa: F811 - the imported fixtures
    from tpcheck.engines.dump.replay import read_dump
    dump, cmp, doc = _run(tmp_path, ckpt, "clean")
    end, cached, recomputed = {}, 0, 0
    for b in read_dump(dump).batches:
        for rid, start, toks in zip(b.ids, b.starts, b.tokens):
            if rid in b.prompts and start > 0:
                cached += 1  # a first scheduled step past 0: blocks another sequence computed
            if start < end.get(rid, 0):
                recomputed += 1  # back before where it had got to: preempted, then recomputed
            end[rid] = start + len(toks)
    assert len(end) == 8, end  # 4 chats x 2 samples
    assert cached >= 1 and recomputed >= 1, (cached, recomputed)
    assert cmp.returncode == 0, cmp.stdout[-3000:] + cmp.stderr[-2000:]
    assert doc["passed"] and "PASS: tp=2 float32" in cmp.stdout
    # the same run with one rank's o_proj partial off in layer 1: found there, at its origin
    _, bad, doc = _run(tmp_path, ckpt, "fault", "o-proj-partial@1:1")
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    assert "origin: layers.1.attn.out" in bad.stdout, bad.stdout[-3000:]
    print(cmp.stdout[-1200:], bad.stdout[-1200:])  # the figures, with -s
