"""Bounded load test of `flashdraft serve`: N concurrent clients, a fixed number of requests, loopback only.

    python benchmarks/serve_load.py --clients 16 --requests 200 --max-tokens 8 \
        --drafter none --out benchmarks/results/serve_load.json
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model smollm2-135m-instruct   # a running server

By default it starts the server in-process (uvicorn in a thread, a free loopback port) on the
default target. Half the requests stream (time to first token is measured on those). A 429 is
retried after its Retry-After (counted, not an error); 5xx answers, broken streams and
transport failures are server errors. Stops by itself after `--requests` requests; every
request has a client timeout. Prints a table and writes JSON (+ a Markdown table beside it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "Name three colors.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give one tip for learning Python.",
    "What is 12 times 7?",
    "Say hello in Spanish.",
    "Why is the sky blue? One sentence.",
    "List two fruits.",
]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Sample:
    ok: bool
    status: int
    latency_s: float
    completion_tokens: int = 0
    ttft_s: float | None = None  # streams only: time to the first content chunk
    retries_429: int = 0
    server_error: bool = False
    error: str = ""
    tau: float | None = None


@dataclass
class Report:
    clients: int
    requests: int
    max_tokens: int
    method: str
    ok: int
    server_errors: int
    client_errors: int
    retries_429: int
    wall_s: float
    requests_per_s: float
    completion_tokens: int
    tokens_per_s: float  # completion tokens / wall time, all clients together
    latency_s: dict[str, float] = field(default_factory=dict)
    ttft_s: dict[str, float] = field(default_factory=dict)
    mean_tau: float | None = None
    errors: list[str] = field(default_factory=list)


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1], "mean": statistics.fmean(s)}


def one_request(http: httpx.Client, model: str, i: int, max_tokens: int, timeout: float) -> Sample:
    stream = i % 2 == 1
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    retries = 0
    t0 = time.perf_counter()
    while True:
        try:
            if not stream:
                r = http.post("/v1/chat/completions", json=body, timeout=timeout)
                if r.status_code == 429 and retries < 50:
                    retries += 1
                    time.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                lat = time.perf_counter() - t0
                if r.status_code != 200:
                    return Sample(
                        False,
                        r.status_code,
                        lat,
                        retries_429=retries,
                        server_error=r.status_code >= 500,
                        error=r.text[:200],
                    )
                js = r.json()
                return Sample(
                    True,
                    200,
                    lat,
                    js["usage"]["completion_tokens"],
                    retries_429=retries,
                    tau=js.get("flashdraft", {}).get("mean_acceptance_length"),
                )
            with http.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
                if r.status_code == 429 and retries < 50:
                    retries += 1
                    r.read()
                    time.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                if r.status_code != 200:
                    r.read()
                    return Sample(
                        False,
                        r.status_code,
                        time.perf_counter() - t0,
                        retries_429=retries,
                        server_error=r.status_code >= 500,
                        error=r.text[:200],
                    )
                ttft, tokens, tau, done = None, 0, None, False
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    js = json.loads(data)
                    if "error" in js:
                        return Sample(
                            False,
                            200,
                            time.perf_counter() - t0,
                            retries_429=retries,
                            server_error=True,
                            error=json.dumps(js)[:200],
                        )
                    if js.get("choices") and js["choices"][0]["delta"].get("content") and ttft is None:
                        ttft = time.perf_counter() - t0
                    if js.get("usage"):
                        tokens = js["usage"]["completion_tokens"]
                    if "flashdraft" in js:
                        tau = js["flashdraft"]["mean_acceptance_length"]
                lat = time.perf_counter() - t0
                if not done:
                    return Sample(
                        False, 200, lat, retries_429=retries, server_error=True, error="stream ended early"
                    )
                return Sample(True, 200, lat, tokens, ttft, retries, tau=tau)
        except httpx.HTTPError as e:
            return Sample(
                False,
                0,
                time.perf_counter() - t0,
                retries_429=retries,
                server_error=True,
                error=f"{type(e).__name__}: {e}",
            )


def run_load(
    url: str, model: str, clients: int, requests: int, max_tokens: int, timeout: float, method: str
) -> Report:
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK:
        raise SystemExit(f"refusing to load-test {host!r}: loopback only ({', '.join(sorted(LOOPBACK))})")
    samples: list[Sample] = []
    lock = threading.Lock()
    next_i = [0]

    def client() -> None:
        with httpx.Client(base_url=url) as http:
            while True:
                with lock:
                    i = next_i[0]
                    if i >= requests:
                        return
                    next_i[0] += 1
                s = one_request(http, model, i, max_tokens, timeout)
                with lock:
                    samples.append(s)
                    done = len(samples)
                if done % 20 == 0 or done == requests:
                    print(f"  {done}/{requests} requests", flush=True)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [s for s in samples if s.ok]
    taus = [s.tau for s in ok if s.tau]
    tokens = sum(s.completion_tokens for s in ok)
    return Report(
        clients=clients,
        requests=len(samples),
        max_tokens=max_tokens,
        method=method,
        ok=len(ok),
        server_errors=sum(s.server_error for s in samples),
        client_errors=sum((not s.ok) and not s.server_error for s in samples),
        retries_429=sum(s.retries_429 for s in samples),
        wall_s=wall,
        requests_per_s=len(samples) / wall,
        completion_tokens=tokens,
        tokens_per_s=tokens / wall,
        latency_s=percentiles([s.latency_s for s in ok]),
        ttft_s=percentiles([s.ttft_s for s in ok if s.ttft_s is not None]),
        mean_tau=statistics.fmean(taus) if taus else None,
        errors=sorted({s.error for s in samples if s.error})[:10],
    )


def markdown(rep: Report, setup: str) -> str:
    lat, ttft = rep.latency_s, rep.ttft_s
    tau = f"{rep.mean_tau:.2f}" if rep.mean_tau is not None else "-"
    return "\n".join(
        [
            f"{setup}",
            "",
            "| clients | requests | ok | server errors | 429 retries | wall s | req/s | completion tok | tok/s "
            "| latency p50 / p90 / p99 / max s | TTFT p50 / p90 s (streams) | τ |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {rep.clients} | {rep.requests} | {rep.ok} | {rep.server_errors} | {rep.retries_429} | {rep.wall_s:.1f} "
            f"| {rep.requests_per_s:.2f} | {rep.completion_tokens} | {rep.tokens_per_s:.2f} "
            f"| {lat.get('p50', 0):.2f} / {lat.get('p90', 0):.2f} / {lat.get('p99', 0):.2f} / {lat.get('max', 0):.2f} "
            f"| {ttft.get('p50', 0):.2f} / {ttft.get('p90', 0):.2f} | {tau} |",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="an already running server (loopback only); default: start one in-process")
    ap.add_argument("--model", default=None, help="model id (with --url); in-process: the server's")
    ap.add_argument("--target", default="default")
    ap.add_argument(
        "--drafter", default=None, help="DFlash folder, 'none' (AR), 'random' (1-layer random drafter)"
    )
    ap.add_argument("--method", default="chain")
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600.0, help="client and server timeout per request, s")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for the in-process server")
    ap.add_argument("--out", default="benchmarks/results/serve_load.json")
    args = ap.parse_args()

    engine = server = None
    if args.url:
        url, model, method = args.url.rstrip("/"), args.model or "", args.method
        if not model:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    else:
        import torch

        from flashdraft.serve.app import create_app
        from flashdraft.serve.server import BackgroundServer, ServeOptions, build_engine

        torch.set_num_threads(args.threads)
        drafter = args.drafter
        if drafter == "random":  # a random 1-layer drafter: exercises the chain path, τ ≈ 1
            import tempfile

            from flashdraft.drafter import DFlashDrafter
            from flashdraft.target import drafter_config_for, load_target

            t = load_target(args.target)
            torch.manual_seed(0)
            d = DFlashDrafter(drafter_config_for(t, num_layers=1))
            d.reset_parameters(0.02)
            drafter = str(d.save_pretrained(Path(tempfile.mkdtemp()) / "random-drafter"))
            del t, d
        opts = ServeOptions(
            target=args.target,
            drafter=drafter,
            method=args.method,
            budget=args.budget,
            max_queue=args.max_queue,
            timeout=args.timeout,
        )
        print("loading the server ...", flush=True)
        engine = build_engine(opts)
        server = BackgroundServer(create_app(engine)).start()
        url, model, method = server.url, engine.settings.model_id, engine.settings.method
    print(
        f"{args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, {url}", flush=True
    )
    try:
        rep = run_load(url, model, args.clients, args.requests, args.max_tokens, args.timeout, method)
        metrics = httpx.get(url + "/metrics", timeout=30).text if server else ""
    finally:
        if server is not None:
            server.stop()
        if engine is not None:
            engine.stop()
    setup = (
        f"`python benchmarks/serve_load.py {' '.join(sys.argv[1:])}` — target {args.target}, "
        f"method {method}, drafter {args.drafter or 'shipped/none'}, torch threads {args.threads}"
    )
    table = markdown(rep, setup)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"setup": setup, "report": asdict(rep), "server_metrics": metrics}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.rename(out)
    print(f"wrote {out}")
    if rep.server_errors:
        raise SystemExit(f"{rep.server_errors} server errors: {rep.errors}")


if __name__ == "__main__":
    main()
