#!/usr/bin/env python3
"""Load generator for scripts/bench-serve.sh (standard library only).

    bench_serve_client.py URL CLIENTS REQUESTS N_GEN BAN_ID [EXTRA_JSON]

CLIENTS threads each send REQUESTS streaming POST /v1/completions one after another
(greedy, max_tokens N_GEN, token BAN_ID banned with logit_bias -100 and ignore_eos set,
so that every request generates N_GEN tokens on both servers). Prints one JSON line:
generated tokens (from each stream's usage chunk, else its text chunks), wall seconds,
aggregate tokens/s, median time to first token (ms), errors. EXTRA_JSON, an object, is
merged into every request's body (e.g. a response_format, to measure constrained decoding).
"""

import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "The history of the printing press begins",
    "A function in Python is",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "To make bread you need flour, water and",
    "The largest planets of the solar system are",
    "In computer science, a hash table is",
    "The river flows from the mountains to",
]


def one(host, port, body):
    """-> (tokens, ttft seconds) for one streaming request."""
    c = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    ttft, chunks, usage = None, 0, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        v = json.loads(data)
        if v.get("usage"):
            usage = v["usage"].get("completion_tokens")
        for ch in v.get("choices") or []:
            if ch.get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    c.close()
    return (usage if usage is not None else chunks), (ttft if ttft is not None else time.perf_counter() - t0)


def main():
    url, clients, requests, n_gen, ban = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] else {}
    u = urllib.parse.urlparse(url)
    tokens, ttfts, errors = [], [], []
    lock = threading.Lock()

    def client(k):
        for j in range(requests):
            body = {
                "prompt": PROMPTS[(k + j) % len(PROMPTS)],
                "max_tokens": n_gen,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logit_bias": {ban: -100},
                "ignore_eos": True,
                **extra,
            }
            try:
                n, t = one(u.hostname, u.port, body)
                with lock:
                    tokens.append(n)
                    ttfts.append(t)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    print(json.dumps({
        "clients": clients,
        "requests": len(tokens),
        "tokens": sum(tokens),
        "wall_s": round(wall, 3),
        "tok_s": round(sum(tokens) / wall, 2) if wall > 0 else 0,
        "ttft_ms_median": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }))


if __name__ == "__main__":
    main()
