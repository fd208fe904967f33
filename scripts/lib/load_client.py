#!/usr/bin/env python3
"""Sends completions with token-id prompts to a tether HTTP API, for the GPU scripts.

    load_client.py URL one N_PROMPT MAX_TOKENS VOCAB
        one request of N_PROMPT random tokens; prints its seconds and finish reason
    load_client.py URL many COUNT PARALLEL MAX_PROMPT MAX_GEN VOCAB SEED
        COUNT requests, PARALLEL at a time, prompt lengths uniform in 1..MAX_PROMPT and
        max_tokens in 1..MAX_GEN; prints a JSON summary; exits 1 if any request failed
    load_client.py URL fixed COUNT CLIENTS N_PROMPT N_GEN VOCAB SEED
        COUNT requests of exactly N_PROMPT random tokens and max_tokens N_GEN (greedy,
        not streamed), CLIENTS at a time; prints a JSON summary with the aggregate
        generated tokens/s (the `usage.completion_tokens` of every answer over the wall
        time from the first request to the last answer) and how many answers stopped
        short of N_GEN; exits 1 if any request failed

Prompts are random ids in [16, VOCAB), away from the low ids where synthesized and real
vocabularies keep their control tokens.
"""
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request


def complete(url, prompt, max_tokens, timeout=900):
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            reply = json.load(r)
            return r.status, reply["choices"][0].get("finish_reason"), reply.get("usage", {})
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300], {}
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        return 0, str(e)[:300], {}


def one(url, n_prompt, max_tokens, vocab):
    rng = random.Random(n_prompt)
    prompt = [rng.randrange(16, vocab) for _ in range(n_prompt)]
    start = time.monotonic()
    status, finish, usage = complete(url, prompt, max_tokens)
    secs = time.monotonic() - start
    print(json.dumps({"status": status, "finish": finish, "seconds": round(secs, 3),
                      "prompt_tokens": usage.get("prompt_tokens")}))
    return 0 if status == 200 else 1


def many(url, count, parallel, max_prompt, max_gen, vocab, seed):
    rng = random.Random(seed)
    jobs = [(rng.randint(1, max_prompt), rng.randint(1, max_gen)) for _ in range(count)]
    lock = threading.Lock()
    results = []
    errors = []

    def worker():
        local = random.Random()
        while True:
            with lock:
                if not jobs:
                    return
                n_prompt, max_tokens = jobs.pop()
            prompt = [local.randrange(16, vocab) for _ in range(n_prompt)]
            status, finish, usage = complete(url, prompt, max_tokens)
            with lock:
                results.append(status)
                if status != 200:
                    errors.append(f"{status}: {finish}")

    start = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({
        "requests": len(results),
        "ok": sum(1 for s in results if s == 200),
        "seconds": round(time.monotonic() - start, 1),
        "errors": errors[:5],
    }))
    return 0 if not errors and len(results) == count else 1


def fixed(url, count, clients, n_prompt, n_gen, vocab, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(16, vocab) for _ in range(n_prompt)] for _ in range(count)]
    lock = threading.Lock()
    answers = []  # (status, completion tokens, prompt tokens)
    errors = []

    def client():
        while True:
            with lock:
                if not prompts:
                    return
                prompt = prompts.pop()
            status, finish, usage = complete(url, prompt, n_gen)
            with lock:
                answers.append((status, usage.get("completion_tokens", 0),
                                usage.get("prompt_tokens", 0)))
                if status != 200:
                    errors.append(f"{status}: {finish}")

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.monotonic() - start
    ok = [a for a in answers if a[0] == 200]
    generated = sum(a[1] for a in ok)
    print(json.dumps({
        "requests": len(answers),
        "ok": len(ok),
        "clients": clients,
        "seconds": round(secs, 3),
        "generated_tokens": generated,
        "prompt_tokens": sum(a[2] for a in ok),
        "short": sum(1 for a in ok if a[1] < n_gen),
        "gen_tps": round(generated / secs, 1) if secs > 0 else 0.0,
        "errors": errors[:5],
    }))
    return 0 if not errors and len(answers) == count else 1


def main():
    a = sys.argv
    if len(a) >= 6 and a[2] == "one":
        sys.exit(one(a[1], int(a[3]), int(a[4]), int(a[5])))
    if len(a) >= 9 and a[2] == "many":
        sys.exit(many(a[1], *map(int, a[3:9])))
    if len(a) >= 9 and a[2] == "fixed":
        sys.exit(fixed(a[1], *map(int, a[3:9])))
    print(__doc__, file=sys.stderr)
    sys.exit(64)


if __name__ == "__main__":
    main()
