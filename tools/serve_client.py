"""The client side of the serve step of tools/gpu.sh: wait for one SGLang server, drive it, record the run;
compare runs.

    serve_client.py run --url URL --log SERVER_LOG --pid PID --name NAME --out RUN.json [meta ...]
    serve_client.py ab --urls A,B --names NA,NB --logs LA,LB --pids PA,PB --out AB.json [--rounds 12 ...]
    serve_client.py fault --url URL --log SERVER_LOG --pid PID --name NAME --out FAULT.json --timeout-s S
    serve_client.py compare --runs DIR --out SERVING.json

``run``: waits until the server's log says it is ready (or the process dies, or --wait passes), sends
``--prompts`` greedy prompts (temperature 0, ``ignore_eos``: every prompt gives exactly ``--output-tokens``
tokens) to ``/generate`` in one batch once untimed (warm-up), then ``--repeats`` times timed (output tokens
per second of each batch; the median is the run's throughput), checks that every repeat gave the same
tokens, with ``--alone N`` sends the first N prompts again one request each and records whether each
gave the tokens it gave inside the batch (``alone_tokens_match_batch``: batch invariance), sends the batch once more asking for each output token's logprob and the top-2 logprobs (a
stronger check than the tokens: with SGLang's dummy weights the greedy continuations are nearly constant;
a failure there is recorded, not fatal), asks ``/v1/chat/completions`` once, and copies the plugin's lines (``purlin``) from the server log.
The prompts are random words from a seeded generator (the words of purlin's offline prompts), so every run
with the same ``--seed`` sends the same text. No downloads; standard library only.

``ab``: two servers of the same model up at once (e.g. the default backend and purlin on one GPU, each with
its share of memory), driven in turns so that machine drift, warm-up and the order of runs fall on both
alike: after ``--warmup`` untimed batches each, ``--rounds`` rounds of one timed batch per server, the order
flipped every round (A B, B A, ...). Per round the throughput ratio B/A; the verdict compares the 95%
interval of their mean (t distribution) with ``--tolerance`` (default 0.02): ``within`` if the whole interval
lies inside 1 +- tolerance, ``differs`` if it lies wholly outside, else ``undecided``. Also whether the two
servers gave the same greedy tokens. Writes AB.json.

``fault``: a served fault. Waits for the server, serves a short batch, sends a long greedy batch in the
background and, once the log shows it decoding, SIGKILLs the scheduler of TP rank ``--victim`` (found
by its process title, ``sglang::scheduler_TP<rank>``, among the processes under the server's setsid). Then polls the
server's ``/health`` and its main process every half second until it has exited or ``--limit``
seconds have passed, waits up to ``--settle`` seconds for every one of those processes to leave the GPU
(``nvidia-smi``), and records: seconds from the kill to the first failed health check and to the
server's exit, the log lines that name a purlin error, the processes still holding the GPU, the log's
tail. ``ok``: the server exited or reported unhealthy within ``--timeout-s`` (purlin's) plus ``--grace``
seconds of the kill, a log line names a purlin error where the server outlived purlin's ``timeout_s``
(a server that exits sooner never lets the survivors' waits expire), and no process is left on the GPU.

``compare``: reads every RUN.json of a folder and, for each run that names ``--reference``, says whether
its tokens equal the reference run's; writes ``{"runs": [...]}`` (docs/results format). Its last line
counts the runs that went well and the token matches; exit status 1 if a run failed or gave other
tokens than its reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

WORDS = ("the model token prompt request batch layer tensor kernel stream graph device memory cache buffer rank "
         "group peer chunk slot flag epoch signal stage reduce gather scatter copy server client engine worker "
         "river mountain forest garden window kitchen letter market harbor island valley bridge station morning "
         "evening winter summer number question answer story reason method result example pattern quiet bright "
         "simple careful gentle sudden steady narrow distant common ancient modern hidden one two three four").split()
READY = "The server is fired up and ready to roll"


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 96))) for _ in range(n)]


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def wait_ready(log: Path, pid: int, limit: float) -> tuple[bool, float, str]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        text = log.read_text(errors="replace") if log.exists() else ""
        if READY in text:
            return True, time.monotonic() - t0, ""
        if not alive(pid):
            return False, time.monotonic() - t0, "server process exited"
        time.sleep(1.0)
    return False, time.monotonic() - t0, f"not ready after {limit:.0f} s"


def generate(url: str, texts: list[str], tokens: int, timeout: float) -> tuple[list[list[int]], list[str], float]:
    body = {"text": texts, "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}}
    t0 = time.perf_counter()
    out = post(f"{url}/generate", body, timeout)
    secs = time.perf_counter() - t0
    out = out if isinstance(out, list) else [out]
    ids = [list(o.get("output_ids") or []) for o in out]
    return ids, [o.get("text", "") for o in out], secs


def logprobs(url: str, texts: list[str], tokens: int, timeout: float) -> tuple[list[list[float]], list[list[float]]]:
    """Per prompt: each output token's logprob, and the gap between the best and second-best logprob."""
    body = {"text": texts, "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2}
    out = post(f"{url}/generate", body, timeout)
    out = out if isinstance(out, list) else [out]
    lps, gaps = [], []
    for o in out:
        mi = o["meta_info"]
        lps.append([float(x[0]) for x in mi["output_token_logprobs"]])
        gaps.append([round(float(t[0][0]) - float(t[1][0]), 6) for t in mi.get("output_top_logprobs") or []
                     if t and len(t) >= 2])
    return lps, gaps


def plugin_lines(log: Path) -> list[str]:
    if not log.exists():
        return []
    keep = [ln for ln in log.read_text(errors="replace").splitlines() if "purlin" in ln.lower()]
    # the last report of each group, and every other plugin line once
    seen, lines = set(), []
    for ln in keep:
        key = re.sub(r"^.*?(purlin)", r"\1", ln)
        key = re.sub(r"routed .*", "routed", key)
        if key in seen and "routed" not in ln:
            continue
        seen.add(key)
        lines.append(ln.strip()[:600])
    return lines[-60:]


def await_server(log: Path, pid: int, limit: float, rec: dict) -> None:
    """Wait until the server is ready (wait_ready), recording ``startup_s``; RuntimeError if it is not."""
    ready, secs, why = wait_ready(log, pid, limit)
    rec["startup_s"] = round(secs, 1)
    if not ready:
        raise RuntimeError(f"server not ready: {why}")


def write_record(out: str, rec: dict, log: Path) -> None:
    """The run's record with the plugin's log lines, as JSON at ``out``."""
    rec["plugin_log"] = plugin_lines(log)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rec, indent=1))


def cmd_run(a: argparse.Namespace) -> int:
    rec = {"name": a.name, "backend": a.backend, "tp": a.tp, "model": a.model, "cuda_graph": a.cuda_graph,
           "nccl_free": a.nccl_free, "prompts": a.prompts, "output_tokens": a.output_tokens, "seed": a.seed,
           "repeats": a.repeats, "reference": a.reference or None, "command": a.command, "ok": False}
    log = Path(a.log)
    try:
        await_server(log, a.pid, a.wait, rec)
        url, texts = a.url, prompts(a.prompts, a.seed)
        ids0, _, warm_s = generate(url, texts, a.output_tokens, a.timeout)
        rec["warmup_batch_s"] = round(warm_s, 3)
        runs = [generate(url, texts, a.output_tokens, a.timeout) for _ in range(a.repeats)]
        ids = runs[0][0]
        rec["tokens"] = ids
        rec["texts_head"] = [t[:80] for t in runs[0][1][:4]]
        counts = [sum(len(x) for x in r[0]) for r in runs]
        rec["batch_s"] = [round(r[2], 4) for r in runs]
        rec["output_tokens_total"] = counts[0]
        rec["output_throughput_tok_s"] = round(statistics.median(c / r[2] for c, r in zip(counts, runs)), 2)
        rec["repeats_identical"] = all(r[0] == ids for r in runs) and ids0 == ids
        rec["distinct_outputs"] = len({tuple(x) for x in ids})
        rec["all_lengths_ok"] = all(len(x) == a.output_tokens for x in ids)
        if a.alone:  # batch invariance: the first --alone prompts again, one request each
            alone = [generate(url, [t], a.output_tokens, a.timeout)[0][0] for t in texts[: a.alone]]
            differ = [i for i, toks in enumerate(alone) if toks != ids[i]]
            rec["alone_prompts"] = len(alone)
            rec["alone_tokens_match_batch"] = not differ
            rec["alone_differ"] = differ
        try:
            rec["logprobs"], gaps = logprobs(url, texts, a.output_tokens, a.timeout)
            flat = [g for row in gaps for g in row]
            rec["top2_gap_min"] = min(flat) if flat else None
            rec["top2_gap_median"] = statistics.median(flat) if flat else None
        except (OSError, urllib.error.URLError, KeyError, ValueError, TypeError, IndexError) as e:
            rec["logprob_error"] = f"{type(e).__name__}: {e}"[:500]
        chat = post(f"{url}/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": texts[0][:200]}],
            "max_tokens": 16, "temperature": 0.0}, a.timeout)
        rec["chat"] = {"content": chat["choices"][0]["message"].get("content"), "usage": chat.get("usage"),
                       "finish_reason": chat["choices"][0].get("finish_reason")}
        rec["ok"] = rec["all_lengths_ok"]
    except (RuntimeError, OSError, urllib.error.URLError, KeyError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
    write_record(a.out, rec, log)
    print(f"{a.name}: ok={rec['ok']} startup {rec['startup_s']} s, "
          f"{rec.get('output_throughput_tok_s', '-')} output tok/s, distinct {rec.get('distinct_outputs', '-')}"
          f"{'; ' + rec['error'] if 'error' in rec else ''}", flush=True)
    return 0 if rec["ok"] else 1


# two-sided 95% t quantiles for n - 1 degrees of freedom (n = 2..30); beyond: the normal 1.96
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11,
        2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05)


def ratio_verdict(ratios: list[float], tolerance: float) -> dict:
    """Mean of the per-round ratios, its 95% interval (t), and within / differs / undecided against 1 +- tolerance."""
    n = len(ratios)
    mean = statistics.fmean(ratios)
    if n < 2:
        return {"rounds": n, "mean_ratio": round(mean, 4), "ci95": None, "verdict": "undecided"}
    half = (_T95[n - 2] if n - 2 < len(_T95) else 1.96) * statistics.stdev(ratios) / n ** 0.5
    lo, hi = mean - half, mean + half
    if 1 - tolerance <= lo and hi <= 1 + tolerance:
        verdict = "within"
    elif hi < 1 - tolerance or lo > 1 + tolerance:
        verdict = "differs"
    else:
        verdict = "undecided"
    return {"rounds": n, "mean_ratio": round(mean, 4), "ci95": [round(lo, 4), round(hi, 4)], "verdict": verdict}


def cmd_ab(a: argparse.Namespace) -> int:
    urls, names, logs = a.urls.split(","), a.names.split(","), a.logs.split(",")
    pids = [int(x) for x in a.pids.split(",")]
    if not (len(urls) == len(names) == len(logs) == len(pids) == 2):
        raise SystemExit("ab: --urls, --names, --logs and --pids each take two comma-separated values")
    rec = {"names": names, "prompts": a.prompts, "output_tokens": a.output_tokens, "seed": a.seed,
           "rounds": a.rounds, "warmup": a.warmup, "tolerance": a.tolerance, "command": a.command, "ok": False}
    try:
        for name, log, pid in zip(names, logs, pids):
            ready, secs, why = wait_ready(Path(log), pid, a.wait)
            rec[f"startup_s_{name}"] = round(secs, 1)
            if not ready:
                raise RuntimeError(f"{name}: server not ready: {why}")
        texts = prompts(a.prompts, a.seed)
        tokens = {}
        for _ in range(a.warmup):
            for name, url in zip(names, urls):
                tokens[name] = generate(url, texts, a.output_tokens, a.timeout)[0]
        tput: dict[str, list[float]] = {n: [] for n in names}
        order = []
        for r in range(a.rounds):
            turn = [0, 1] if r % 2 == 0 else [1, 0]
            order.append("".join("AB"[i] for i in turn))
            for i in turn:
                ids, _, secs = generate(urls[i], texts, a.output_tokens, a.timeout)
                tput[names[i]].append(sum(len(x) for x in ids) / secs)
                if ids != tokens[names[i]]:
                    raise RuntimeError(f"{names[i]}: round {r} gave other tokens than its warm-up (not greedy-stable)")
            done = ", ".join(f"{n} {tput[n][-1]:.0f} tok/s" for n in names)
            print(f"  round {r + 1}/{a.rounds} ({order[-1]}): {done}", flush=True)
        ratios = [b / x for x, b in zip(tput[names[0]], tput[names[1]])]
        rec.update({"order": order, "throughput_tok_s": {n: [round(v, 2) for v in tput[n]] for n in names},
                    "median_tok_s": {n: round(statistics.median(tput[n]), 2) for n in names},
                    "ratios": [round(x, 4) for x in ratios], "ratio_of": f"{names[1]}/{names[0]}",
                    "tokens_equal": tokens[names[0]] == tokens[names[1]], **ratio_verdict(ratios, a.tolerance)})
        rec["ok"] = True
    except (RuntimeError, OSError, urllib.error.URLError, KeyError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
    rec["plugin_log"] = {n: plugin_lines(Path(log)) for n, log in zip(names, logs)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))
    if rec["ok"]:
        print(f"ab: {rec['ratio_of']} = {rec['mean_ratio']} (95% interval {rec['ci95']}, {rec['rounds']} rounds): "
              f"{rec['verdict']} {a.tolerance:.0%}; tokens equal: {rec['tokens_equal']}", flush=True)
    else:
        print(f"ab: failed: {rec['error']}", flush=True)
    return 0 if rec["ok"] else 1


def group_pids(sid: int) -> dict[int, str]:
    """The processes started under the server's setsid (``os.getsid`` equal to the server's pid ``sid``),
    pid -> command line (the process title where SGLang set one)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) != sid:
                continue
            out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie (the server is a child of the step's shell, which reaps it later)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def gpu_pids() -> list[int]:
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(x) for x in text.split() if x.strip().isdigit()]


PURLIN_ERROR = re.compile(r"Purlin\w*Error")
LOST_PEER = re.compile(r"purlin\[[^\]]*\]: rank \d+: peer rank \d+ \(pid \d+\) has exited")  # the error watch


def cmd_fault(a: argparse.Namespace) -> int:
    rec = {"name": a.name, "tp": a.tp, "victim": a.victim, "cuda_graph": a.cuda_graph, "timeout_s": a.timeout_s,
           "grace_s": a.grace, "command": a.command, "ok": False}
    log = Path(a.log)
    try:
        await_server(log, a.pid, a.wait, rec)
        texts = prompts(a.prompts, a.seed)
        generate(a.url, texts[:4], 8, a.wait)  # serving works before the fault
        procs = group_pids(a.pid)
        victims = [p for p, cmd in procs.items() if re.match(rf"sglang::scheduler_TP{a.victim}(\b|_)", cmd)]
        rec["processes"] = {str(p): c[:120] for p, c in procs.items()}
        if len(victims) != 1:
            raise RuntimeError(f"found {len(victims)} processes titled scheduler_TP{a.victim} under the server's "
                               "setsid")
        marks = log.read_text(errors="replace").count("Decode batch")
        reply: dict = {}

        def long_batch() -> None:
            try:
                generate(a.url, texts, a.output_tokens, a.limit + 60)
                reply["result"] = "finished"
            except (OSError, urllib.error.URLError, ValueError) as e:
                reply["result"] = f"{type(e).__name__}: {e}"[:300]

        threading.Thread(target=long_batch, daemon=True).start()
        t0 = time.monotonic()
        while log.read_text(errors="replace").count("Decode batch") <= marks:  # decoding, by the server's log
            if time.monotonic() - t0 > 60 or "result" in reply:
                raise RuntimeError("the long batch did not reach a decode log line within 60 s")
            time.sleep(0.2)
        os.kill(victims[0], signal.SIGKILL)
        t_kill = time.monotonic()
        rec["killed"] = {"pid": victims[0], "title": procs[victims[0]][:120],
                         "after_decode_log_s": round(t_kill - t0, 2)}
        unhealthy = exited = None
        while time.monotonic() - t_kill < a.limit:
            now = time.monotonic() - t_kill
            if exited is None and not running(a.pid):
                exited = now
            if unhealthy is None and (exited is not None or not healthy(a.url)):
                unhealthy = now
            if exited is not None:
                break
            time.sleep(0.5)
        rec["unhealthy_after_s"] = None if unhealthy is None else round(unhealthy, 1)
        rec["exited_after_s"] = None if exited is None else round(exited, 1)
        mine = set(group_pids(a.pid)) | {a.pid}
        t1, left = time.monotonic(), []
        while time.monotonic() - t1 < a.settle:
            left = [p for p in gpu_pids() if p in mine or p in set(group_pids(a.pid))]
            if not left:
                break
            time.sleep(1.0)
        rec["gpu_holders_after"] = left
        rec["long_batch"] = reply.get("result", "no reply yet")
        text = log.read_text(errors="replace").splitlines()
        errs = [ln.strip()[:400] for ln in text if PURLIN_ERROR.search(ln)]
        rec["purlin_error_lines"] = errs[:8]
        rec["purlin_lost_peer_lines"] = [ln.strip()[:400] for ln in text if LOST_PEER.search(ln)][:8]
        first_err = next((ln.strip()[:400] for ln in text if re.search(r"Error|error|Traceback", ln)
                          and "INFO" not in ln), None)
        rec["first_error_line"] = first_err
        rec["log_tail"] = [ln[:300] for ln in text[-25:]]
        first = min(x for x in (unhealthy, exited) if x is not None) if (unhealthy is not None or exited is not None) \
            else None
        # The log must name purlin's error: the survivors' error watch names the lost peer within
        # error_watch_s of the kill, and a server that outlives their wait (timeout_s) logs the timeout too.
        rec["purlin_timeout_reached"] = exited is None or exited >= a.timeout_s
        named = bool(errs)
        rec["ok"] = bool(first is not None and first <= a.timeout_s + a.grace and named and not left)
    except (RuntimeError, OSError, urllib.error.URLError, KeyError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
    write_record(a.out, rec, log)
    print(f"{a.name}: ok={rec['ok']} killed {rec.get('killed', {}).get('title', '-')}; unhealthy after "
          f"{rec.get('unhealthy_after_s')} s, exited after {rec.get('exited_after_s')} s (timeout_s {a.timeout_s:g}); "
          f"purlin error lines {len(rec.get('purlin_error_lines', []))} (lost peer "
          f"{len(rec.get('purlin_lost_peer_lines', []))}); GPU holders after "
          f"{rec.get('gpu_holders_after')}{'; ' + rec['error'] if 'error' in rec else ''}", flush=True)
    return 0 if rec["ok"] else 1


def cmd_compare(a: argparse.Namespace) -> int:
    runs = {}
    for p in sorted(Path(a.runs).glob("*.json")):
        try:
            r = json.loads(p.read_text())
        except ValueError:
            continue
        if isinstance(r, dict) and "name" in r:
            runs[r["name"]] = r
    out = []
    for name, r in runs.items():
        ref = r.get("reference")
        row = {k: r.get(k) for k in ("name", "backend", "tp", "model", "cuda_graph", "nccl_free", "prompts",
                                     "output_tokens", "output_throughput_tok_s", "startup_s", "distinct_outputs",
                                     "repeats_identical", "top2_gap_min", "top2_gap_median", "logprob_error", "ok",
                                     "error", "command", "chat", "plugin_log", "alone_prompts",
                                     "alone_tokens_match_batch", "alone_differ")}
        row["tokens_match_reference"] = None
        row["reference"] = ref
        if ref:
            base = runs.get(ref)
            if base is None or "tokens" not in base or "tokens" not in r:
                row["reference_note"] = f"no tokens to compare ({ref} missing or failed)"
            else:
                same = base["tokens"] == r["tokens"]
                row["tokens_match_reference"] = same
                row["prompts_matching"] = sum(x == y for x, y in zip(base["tokens"], r["tokens"]))
                if not same:
                    row["first_mismatch"] = next(
                        (i, x[:8], y[:8]) for i, (x, y) in enumerate(zip(base["tokens"], r["tokens"])) if x != y) \
                        if any(x != y for x, y in zip(base["tokens"], r["tokens"])) else "lengths differ"
                la, lb = base.get("logprobs"), r.get("logprobs")
                if la and lb and [len(x) for x in la] == [len(x) for x in lb]:
                    diffs = [abs(x - y) for xa, xb in zip(la, lb) for x, y in zip(xa, xb)]
                    row["logprobs_identical"] = la == lb
                    row["logprobs_max_abs_diff"] = max(diffs) if diffs else 0.0
                t0, t1 = base.get("output_throughput_tok_s"), r.get("output_throughput_tok_s")
                if t0 and t1:
                    row["throughput_ratio_to_reference"] = round(t1 / t0, 4)
        out.append(row)
        print(f"{name:28s} ok={r.get('ok')} tok/s={r.get('output_throughput_tok_s')} "
              f"match[{ref}]={row['tokens_match_reference']} ratio={row.get('throughput_ratio_to_reference')}")
    Path(a.out).write_text(json.dumps({"runs": out}, indent=1))
    matches = [r["tokens_match_reference"] for r in out if r["tokens_match_reference"] is not None]
    failed = [r["name"] for r in out if not r.get("ok")]
    print(f"compare: {len(out)} runs, {len(out) - len(failed)} ok; tokens match the reference in "
          f"{sum(matches)} of {len(matches)}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed or not all(matches) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    for k, t, d in (("url", str, None), ("log", str, None), ("pid", int, None), ("name", str, None),
                    ("out", str, None), ("backend", str, "nccl"), ("tp", int, 1), ("model", str, ""),
                    ("command", str, ""), ("reference", str, ""), ("prompts", int, 16),
                    ("output-tokens", int, 32), ("seed", int, 42), ("repeats", int, 3), ("wait", float, 300.0),
                    ("timeout", float, 300.0), ("alone", int, 0)):
        r.add_argument(f"--{k}", type=t, default=d, required=d is None)
    r.add_argument("--cuda-graph", type=lambda s: s.lower() in ("1", "true", "yes", "on"), default=True)
    r.add_argument("--nccl-free", action="store_true")
    b = sub.add_parser("ab")
    for k, t, d in (("urls", str, None), ("names", str, None), ("logs", str, None), ("pids", str, None),
                    ("out", str, None), ("command", str, ""), ("prompts", int, 16), ("output-tokens", int, 128),
                    ("seed", int, 42), ("rounds", int, 12), ("warmup", int, 2), ("tolerance", float, 0.02),
                    ("wait", float, 300.0), ("timeout", float, 300.0)):
        b.add_argument(f"--{k}", type=t, default=d, required=d is None)
    f = sub.add_parser("fault")
    for k, t, d in (("url", str, None), ("log", str, None), ("pid", int, None), ("name", str, None),
                    ("out", str, None), ("tp", int, 2), ("victim", int, 1), ("command", str, ""),
                    ("prompts", int, 16), ("output-tokens", int, 2048), ("seed", int, 42), ("wait", float, 300.0),
                    ("timeout-s", float, None), ("grace", float, 15.0), ("limit", float, 180.0),
                    ("settle", float, 30.0)):
        f.add_argument(f"--{k}", type=t, default=d, required=d is None)
    f.add_argument("--cuda-graph", type=lambda s: s.lower() in ("1", "true", "yes", "on"), default=False)
    c = sub.add_parser("compare")
    c.add_argument("--runs", required=True)
    c.add_argument("--out", required=True)
    a = p.parse_args(argv)
    return {"run": cmd_run, "ab": cmd_ab, "fault": cmd_fault, "compare": cmd_compare}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
