"""False alarms of a clean vLLM through a zero-code dump: ``benchmarks/engine_floor.py``'s prompts (the same
seeded draws: one prompt per ``LLM.generate``, then the two-prompt batches), run by a plain vLLM script with
nothing of tpcheck in it under ``TPCHECK_DUMP``, then ``tpcheck compare`` of the dump with its default verdict.
Needs the vLLM environment (``.ci/vllm`` makes ``.venv-vllm``).

    python benchmarks/vllm_floor_dump.py [--preset deep-sink] [--tp 1,2] [--dtype float32,float16] [--prompts 20]
        [--pairs 2] [--pair-len 400] [--decode 2] [--seed 0] [--json reports/vllm_floor_dump.json]
    python benchmarks/vllm_floor_dump.py --model DIR --chats 6 [--tp 1] [--dtype bfloat16,float32] [--decode 4]

``--model DIR --chats N``: a trained checkpoint (the public Gemma 3 270M) and what a served model sees: N chats in
its turn markup sharing one system prompt, tokenized by the checkpoint's tokenizer, one ``generate`` each with
vLLM's prefix cache on, so every chat after the first reads the shared prefix from the cache.

Per (tp, dtype): the dump's size, the verdict, the comparisons, the passes judged (the local pass is on by default
where ``tpcheck.capture.rounding`` says so), the inherited points, the closest point with its excess and the rows whose replicas are further apart than the
threshold (each replica is judged against the golden; where the spread itself was judged they failed). Ranks
outnumbering the cores run unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import check_json_arg, dir_bytes, make_log, print_table  # noqa: E402
from engine_floor import add_prompt_args, batches_of  # noqa: E402

# a plain vLLM script (vLLM's defaults, eager): one generate per prompt, then each batch; greedy
PLAIN = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        ckpt, tp, dtype, batches, tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.load(open(sys.argv[4])), int(sys.argv[5])
        cache = {"enable_prefix_caching": True} if sys.argv[6] == "prefix-cache" else {}
        llm = LLM(model=ckpt, tensor_parallel_size=tp, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=1024, seed=0, **cache)
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        for b in batches:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in b], sp, use_tqdm=False)
    """)


SYSTEM = ("You are the help desk of a public library. Answer in two or three sentences, plainly, and say which "
          "rule you rely on. Rule 1: books are lent for three weeks and can be renewed twice, in person, by phone or "
          "on the website, unless another reader has reserved them. Rule 2: a reader may hold twelve items at a "
          "time, of which at most four may be films or music. Rule 3: reference works, newspapers and the current "
          "issues of magazines stay in the reading room; back issues may be borrowed for one week. Rule 4: the late "
          "fee is ten cents a day per item, capped at five dollars an item; children's books have no late fee. "
          "Rule 5: a lost or damaged item is paid at its listed price plus a processing fee of three dollars. Rule "
          "6: lost cards are replaced at the front desk for two dollars on showing an identity document; the first "
          "replacement in a year is free. Rule 7: reservations are held for seven days at the branch the reader "
          "chose, and a reader may hold ten reservations at a time. Rule 8: the reading room is quiet; phone calls "
          "are taken in the lobby. Rule 9: study rooms are booked for two hours at most, once a day, and a booking "
          "not claimed within fifteen minutes is released. Rule 10: printing costs ten cents a page in black and "
          "white and fifty cents in colour, paid at the kiosk by card or coins. Rule 11: the library is open from "
          "nine to eight on weekdays, ten to five on Saturdays, and closed on Sundays and public holidays.")
QUESTIONS = ["How long can I keep a novel?", "Can I take today's newspaper home?",
             "I lost my card. What do I do?", "How many books can I borrow at once?",
             "My book is five days late. What do I owe?", "Can I renew a book a third time?"]


def chats_of(model: str, n: int) -> list[list[list[int]]]:
    """``n`` one-chat batches sharing ``SYSTEM`` (Gemma's turn markup, ``<bos>`` first): a served model's prefix."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    turn = "<start_of_turn>user\n{}\n\n{}<end_of_turn>\n<start_of_turn>model\n"
    return [[[tok.bos_token_id] + tok.encode(turn.format(SYSTEM, QUESTIONS[i % len(QUESTIONS)]),
                                             add_special_tokens=False)] for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompt_args(ap, "float32,float16", 2)
    ap.add_argument("--model", help="a trained checkpoint directory, with --chats (instead of --preset's prompts)")
    ap.add_argument("--chats", type=int, default=0, help="with --model: chats sharing a system prompt, prefix-cached")
    a = ap.parse_args(argv)
    check_json_arg(ap, a)
    if bool(a.model) != bool(a.chats):
        ap.error("--model and --chats go together (a trained checkpoint's chats), or neither (--preset's prompts)")
    log = make_log("vllm_floor_dump")
    ckpt, batches = (a.model, chats_of(a.model, a.chats)) if a.model else batches_of(a)
    rows, out, t0 = [], [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vllm-floor-dump-") as tmp:
        tmp = Path(tmp)
        (tmp / "plain.py").write_text(PLAIN)
        (tmp / "batches.json").write_text(json.dumps(batches))
        for tp in (int(x) for x in a.tp.split(",")):
            for dtype in a.dtype.split(","):
                dump, rep = tmp / f"dump-tp{tp}-{dtype}", tmp / f"r-tp{tp}-{dtype}.json"
                env = dict(os.environ, TPCHECK_DUMP=str(dump), VLLM_CPU_KVCACHE_SPACE=os.environ.get(
                    "VLLM_CPU_KVCACHE_SPACE", "1"))
                if tp > (os.cpu_count() or 1):
                    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
                s = time.monotonic()
                gen = subprocess.run([sys.executable, str(tmp / "plain.py"), str(ckpt), str(tp), dtype,
                                      str(tmp / "batches.json"), str(a.decode + 1),
                                      "prefix-cache" if a.chats else "defaults"], env=env, capture_output=True,
                                     text=True)
                if gen.returncode != 0:
                    log(f"tp={tp} {dtype}: the vLLM script failed ({gen.returncode}): {gen.stderr[-1500:]}")
                    return 1
                size, t_gen = dir_bytes(dump), time.monotonic() - s
                s = time.monotonic()
                cmp = subprocess.run([sys.executable, "-m", "tpcheck", "compare", str(dump), "--model", str(ckpt),
                                      "--json", str(rep)], capture_output=True, text=True)
                if not rep.is_file():
                    log(f"tp={tp} {dtype}: compare wrote no result ({cmp.returncode}): {cmp.stdout[-1500:]}")
                    return 1
                doc = json.loads(rep.read_text())
                r = doc["rows"]
                worst = max(r, key=lambda x: x["excess"] if x["excess"] == x["excess"] else -1)
                rec = {"tp": tp, "dtype": dtype, "passed": doc["passed"], "exit": cmp.returncode,
                       "comparisons": len(r), "modes": sorted({x["mode"] for x in r}),
                       "inherited": sum(bool(x["inherited"]) for x in r), "closest": worst["excess"],
                       "closest_at": f"{worst['point']} ({worst['mode']})", "dump_mb": size / 2**20,
                       "generate_s": t_gen, "compare_s": time.monotonic() - s,
                       # replicas further apart than the threshold (each replica is judged against the golden)
                       "spread_beyond": sum(x["rank_spread"] is not None and x["threshold"] is not None
                                            and x["rank_spread"] > x["threshold"] for x in r)}
                out.append(rec)
                log(f"tp={tp} {dtype}: {'PASS' if doc['passed'] else 'FAIL'}, {rec['comparisons']} comparisons "
                    f"({'+'.join(rec['modes'])}), {rec['inherited']} inherited, closest {rec['closest']:.3g}x at "
                    f"{rec['closest_at']}, {rec['dump_mb']:.0f} MB")
                rows.append([str(tp), dtype, "PASS" if doc["passed"] else "FAIL", str(rec["comparisons"]),
                             "+".join(rec["modes"]), str(rec["inherited"]), f"{rec['closest']:.3g}x",
                             rec["closest_at"], f"{rec['dump_mb']:.0f}", f"{rec['generate_s']:.0f}",
                             f"{rec['compare_s']:.0f}", str(rec["spread_beyond"])])
                subprocess.run(["rm", "-rf", str(dump)])
    print_table(["tp", "dtype", "verdict", "comparisons", "passes", "inherited", "closest", "at", "dump MB",
                 "generate s", "compare s", "rows: replicas apart > threshold"], rows)
    print(f"total {time.monotonic() - t0:.0f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"dumps": out}, f, indent=1)
    return 0 if all(x["passed"] for x in out) else 1


if __name__ == "__main__":
    sys.exit(main())
