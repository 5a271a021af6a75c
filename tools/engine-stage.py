#!/usr/bin/env python3
"""What the stage is: one engine's prefill rate, its cached prefill, and its decode step,
measured, and how many decode steps a cold prefill costs (the ratio that decides what a
cache hit is worth). Prints one line a figure, then the ratio, then the replay's
`--engine-floor` for these prices (the oracle floor of TTFT on this engine).

    tools/engine-stage.py URL MODEL [PROMPT_TOKENS]

URL is an OpenAI-compatible engine (vLLM, SGLang, the mock worker), MODEL its model;
PROMPT_TOKENS (default 2000) the cold prompt's length, measured with the engine's own
`/tokenize`. Each figure is the median of 5 requests, one at a time, on an idle engine;
every request is bounded in time (60 s) and the whole run in count (17 requests).
"""
import json
import random
import statistics
import sys
import time
import urllib.request

TIMEOUT = 60


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=TIMEOUT)


def tokens(base, model, text):
    with post(f"{base}/tokenize", {"model": model, "prompt": text}) as r:
        return len(json.load(r)["tokens"])


def stream(base, model, prompt, max_tokens):
    """The arrival times of a streamed completion's text chunks, from its request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    times = []
    with post(f"{base}/v1/completions", body) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter() - start)
    return times


def prompt_of(base, model, want, rng):
    """A prompt of about `want` tokens of random words (no two share a prefix)."""
    words = [f"w{rng.randrange(1 << 30):x}" for _ in range(want)]
    text = " ".join(words)
    n = tokens(base, model, text)
    # Words take a few tokens each: cut to the wanted count by proportion.
    text = " ".join(words[: max(1, len(words) * want // max(n, 1))])
    return text, tokens(base, model, text)


def main():
    base, model = sys.argv[1].rstrip("/"), sys.argv[2]
    want = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    rng = random.Random(7)
    stream(base, model, "warm up", 4)
    cold, cached, n = [], [], 0
    for _ in range(5):
        text, n = prompt_of(base, model, want, rng)
        cold.append(stream(base, model, text, 1)[0])
        cached.append(stream(base, model, text, 1)[0])
    steps = []
    for _ in range(5):
        t = stream(base, model, "one", 65)
        steps.append((t[-1] - t[0]) / (len(t) - 1))
    cold_ms, cached_ms = statistics.median(cold) * 1e3, statistics.median(cached) * 1e3
    step_ms = statistics.median(steps) * 1e3
    print(f"prefill, cold: {n} tokens in {cold_ms:.1f} ms ({n / cold_ms * 1e3:,.0f} tokens/s)")
    print(f"prefill, cached: {cached_ms:.1f} ms ({cached_ms / cold_ms:.0%} of cold)")
    print(f"decode step: {step_ms:.2f} ms")
    print(f"a cold prefill of {n} tokens costs {cold_ms / step_ms:.1f} decode steps; a hit saves {(cold_ms - cached_ms) / step_ms:.1f}")
    # The oracle floor's prices for the replay: a request all seen before costs the cached
    # prefill; each never-seen token the cold prefill's extra cost per token.
    per_1k = max(cold_ms - cached_ms, 0.0) / n * 1e3
    print(f"oracle floor: --engine-floor {cached_ms:.2f},{per_1k:.3f}")


if __name__ == "__main__":
    main()
