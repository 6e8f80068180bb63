"""The table of scripts/bench.sh: reads BENCH_DIR/results and prints markdown.

usage: bench_table.py BENCH_DIR BANDWIDTH_GBS N_PROMPT N_GEN "MODELS" "QUANTS" LLAMA_ONLY

tok/s are medians over the repetitions. Krafla's generation rate is decode steps over
the generation time mlb-run reports: its first generated token comes from the prompt's
logits, so N tokens take N - 1 decode steps (the tg run asks for N_GEN + 1 tokens after
a one-token prompt: N_GEN steps from an empty context, as llama-bench's tg).
"""

import json
import os
import re
import statistics
import sys

bench, bw, n_prompt, n_gen, models, quants, llama_only = sys.argv[1:8]
bw, n_prompt, n_gen = float(bw), int(n_prompt), int(n_gen)
res = os.path.join(bench, "results")


def med(xs):
    return statistics.median(xs) if xs else None


def fmt(x, nd=1):
    return "—" if x is None else f"{x:.{nd}f}"


def rss_of_time(path):
    try:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(path).read())
        return int(m.group(1)) / 1024 if m else None
    except OSError:
        return None


def llama(m, q):
    """{(n_prompt, n_gen, n_depth): median tok/s}, peak RSS MiB of the llama-bench process."""
    out = {}
    try:
        for line in open(os.path.join(res, f"llama-{m}-{q}.jsonl")):
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            ts = r.get("samples_ts") or [r["avg_ts"]]
            # One record per test and llama-bench run (several when the script alternates).
            out.setdefault((r["n_prompt"], r["n_gen"], r.get("n_depth", 0)), []).extend(ts)
    except OSError:
        pass
    return {k: med(v) for k, v in out.items()}, rss_of_time(os.path.join(res, f"llama-{m}-{q}.time"))


LINE = re.compile(
    r"run=(\w+) rss_kib=(\d*) prompt: (\d+) tokens in ([\d.]+) s .*?generated: (\d+) tokens in ([\d.]+) s"
)


def krafla(m, q):
    """pp tok/s, tg tok/s at depth 0, tg at depth n_prompt, peak RSS MiB, short runs."""
    pp, tg0, tgd, rss, short = [], [], [], [], []
    try:
        lines = open(os.path.join(res, f"krafla-{m}-{q}.txt")).read().splitlines()
    except OSError:
        return None
    for line in lines:
        x = LINE.search(line)
        if not x:
            continue
        kind, kib = x.group(1), x.group(2)
        np_, ps, ng, gs = int(x.group(3)), float(x.group(4)), int(x.group(5)), float(x.group(6))
        if kib:
            rss.append(int(kib) / 1024)
        steps = ng - 1
        if kind == "pp":
            pp.append(np_ / ps)
            if steps > 0:
                tgd.append(steps / gs)
            if ng < n_gen:
                short.append(f"pp run generated {ng}")
        else:
            if steps > 0:
                tg0.append(steps / gs)
            if ng < n_gen + 1:
                short.append(f"tg run generated {ng}")
    return med(pp), med(tg0), med(tgd), max(rss) if rss else None, short


def size_mb(path):
    try:
        return os.path.getsize(path) / 1e6
    except OSError:
        return None


rows, notes, bounds = [], [], []
for m in models.split():
    for q in quants.split():
        l, lrss = llama(m, q)
        k = None if llama_only == "1" else krafla(m, q)
        kpp, ktg0, ktgd, krss, short = k if k else (None, None, None, None, [])
        if short:
            notes.append(f"{m} {q}: stopped early (EOS?): {', '.join(sorted(set(short)))}")
        tests = [
            (f"pp{n_prompt}", l.get((n_prompt, 0, 0)), kpp),
            (f"tg{n_gen}", l.get((0, n_gen, 0)), ktg0),
            (f"tg{n_gen} @ d{n_prompt}", l.get((0, n_gen, n_prompt)), ktgd),
        ]
        for name, lv, kv in tests:
            ratio = kv / lv if (kv and lv) else None
            rows.append(f"| {m} | {q.upper()} | {name} | {fmt(lv)} | {fmt(kv)} | {fmt(ratio, 2)} |")
        rows.append(f"| {m} | {q.upper()} | peak RSS MiB | {fmt(lrss)} | {fmt(krss)} | {fmt(krss / lrss if (krss and lrss) else None, 2)} |")
        fq = "bf16" if q == "bf16a" else q  # bf16a runs the bf16 files
        g = size_mb(os.path.join(bench, "gguf", f"{m}-{fq}.gguf"))
        kb = size_mb(os.path.join(bench, "mlb", f"{m}-{fq}.mlb"))
        bounds.append(
            f"| {m} | {q.upper()} | {fmt(g)} | {fmt(bw * 1e3 / g if g else None)} | {fmt(kb)} | {fmt(bw * 1e3 / kb if kb else None)} |"
        )

print("| model | quant | test | llama.cpp tok/s | Krafla tok/s | Krafla / llama.cpp |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
print()
print(f"Generation bound: weight bytes read per token (≈ the file: both models tie the classifier to the")
print(f"embeddings, so every matrix is read once per token) over {bw:.1f} GB/s measured read bandwidth.")
print()
print("| model | quant | GGUF MB | bound tok/s | .mlb MB | bound tok/s |")
print("|---|---|---|---|---|---|")
print("\n".join(bounds))
for n in notes:
    print(f"\nnote: {n}")
