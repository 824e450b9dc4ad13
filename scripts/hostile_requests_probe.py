"""Issue 40, items 4 and 5: what one hostile request costs everyone else.

Starts ``prefixkv serve`` (the demo model) on PORT, measures an 8-token completions request
alone, then posts each case (a 10 MB body on every prompt route, 100k tiny messages, 100k stop
strings with n=64, 100k logit_bias entries, 32 slow stop regexes, a lone surrogate) while that
request loops beside it, printing the status, the time, the error body's size, the server's RSS
before/after (``/proc/PID/status``) and the victim's latencies.

    python scripts/hostile_requests_probe.py [PORT]
"""
import json, statistics, subprocess, sys, threading, time
import httpx

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 18431
URL = f"http://127.0.0.1:{PORT}"
proc = subprocess.Popen(["prefixkv", "serve", "--port", str(PORT), "--log-level", "warning"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

def rss():  # MB
    for line in open(f"/proc/{proc.pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

c = httpx.Client(base_url=URL, timeout=600)
for _ in range(300):
    try:
        if c.get("/health").status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.5)
VICTIM = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
def victim_once(cl):
    t = time.perf_counter(); r = cl.post("/v1/completions", json=VICTIM); assert r.status_code == 200, r.text
    return time.perf_counter() - t
for _ in range(5): victim_once(c)
base = [victim_once(c) for _ in range(20)]
print(f"victim alone: p50 {statistics.median(base)*1000:.0f} ms, max {max(base)*1000:.0f} ms")

def with_victim(label, send):
    lat, stop = [], threading.Event()
    def loop():
        with httpx.Client(base_url=URL, timeout=600) as v:
            while not stop.is_set():
                lat.append(victim_once(v))
    th = threading.Thread(target=loop); th.start(); time.sleep(0.3)
    r0 = rss(); t = time.perf_counter(); r = send(); el = time.perf_counter() - t; r1 = rss()
    time.sleep(0.3); stop.set(); th.join()
    body = r.text[:110].replace("\n", " ")
    print(f"{label}: {r.status_code} in {el*1000:.0f} ms, body {len(r.content)} B, RSS {r0:.0f}->{r1:.0f} MB "
          f"(+{r1-r0:.0f}); victim n={len(lat)} p50 {statistics.median(lat)*1000:.0f} ms max {max(lat)*1000:.0f} ms | {body}")

BIG = "word " * 2_000_000
cases = [
    ("/v1/completions", {"prompt": BIG, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": BIG}]}),
    ("/v1/responses", {"input": BIG}),
    ("/tokenize", {"prompt": BIG}),
    ("/tokenize", {"messages": [{"role": "user", "content": BIG}]}),
    ("/generate", {"text": BIG, "sampling_params": {"max_new_tokens": 1}}),
    ("/v1/chat/completions many messages", {"messages": [{"role": "user", "content": "w " * 50}] * 100_000}),
]
for path, body in cases:
    raw = json.dumps(body).encode()
    p = path.split()[0]
    with_victim(f"{path} ({len(raw)/1e6:.1f} MB)", lambda: httpx.post(URL + p, content=raw, timeout=600,
                headers={"content-type": "application/json"}))
stall = [
    ("100k stop strings, n=64", "/v1/completions", {"prompt": "hi", "n": 64, "max_tokens": 32,
        "stop": [f"s{i}" for i in range(100_000)]}),
    ("100k logit_bias", "/v1/completions", {"prompt": "hi", "max_tokens": 1,
        "logit_bias": {str(i): 1.0 for i in range(100_000)}}),
    ("32 slow stop_regex, n=4", "/v1/completions", {"prompt": "hi", "n": 4, "max_tokens": 64, "ignore_eos": True,
        "allowed_token_ids": [ord("a")], "stop_regex": [f"^(a|aa)+{ch}" for ch in "0123456789bcdefghijklmnopqrstuvw"]}),
    ("tokenize lone surrogate", "/tokenize", None),
]
for label, p, body in stall:
    if body is None:
        send = lambda: httpx.post(URL + p, content=b'{"prompt": "\\ud800x"}', headers={"content-type": "application/json"})
    else:
        raw = json.dumps(body).encode()
        send = lambda raw=raw: httpx.post(URL + p, content=raw, timeout=600, headers={"content-type": "application/json"})
    with_victim(label, send)
print("health after:", c.get("/health").status_code, "final RSS", f"{rss():.0f} MB")
proc.terminate(); proc.wait()
