"""tools/serve_client.py against a fake SGLang HTTP server (no sglang, no GPU): readiness from the log,
greedy batch requests, the chat endpoint, the record, and the token comparison with a reference run."""

import http.server
import importlib.util
import json
import os
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("serve_client", os.path.join(ROOT, "tools", "serve_client.py"))
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)


def reply(handler, obj) -> None:
    """Answer a fake server's request with ``obj`` as JSON."""
    data = json.dumps(obj).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def fake_server(shift: int, delay: float = 0.0):
    """Answers /generate with output ids derived from the prompt (``shift`` changes prompt 1's tokens),
    after ``delay`` seconds."""
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/generate":
                time.sleep(delay)
                n = body["sampling_params"]["max_new_tokens"]
                out = []
                for i, t in enumerate(body["text"]):
                    ids = [(len(t) + k + (shift if i == 1 else 0)) % 700 for k in range(n)]
                    meta = {}
                    if body.get("return_logprob"):
                        lp = [-0.5 - 0.01 * k - (0.25 if shift and i == 1 else 0.0) for k in range(n)]
                        meta = {"output_token_logprobs": [[v, x, None] for v, x in zip(lp, ids)],
                                "output_top_logprobs": [[[v, x, None], [v - 1.5, x + 1, None]] for v, x in zip(lp, ids)]}
                    out.append({"text": t[:10], "output_ids": ids, "meta_info": meta})
            else:
                out = {"choices": [{"message": {"content": "hi"}, "finish_reason": "length"}],
                       "usage": {"completion_tokens": 16}}
            reply(self, out)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def run(tmp_path, name, shift, reference="", ready=True, extra=()):
    srv = fake_server(shift)
    log = tmp_path / f"{name}.log"
    log.write_text("purlin_sglang: group tp:0: 2 ranks\n" + (C.READY + "!\n" if ready else ""))
    try:
        rc = C.main(["run", "--url", f"http://127.0.0.1:{srv.server_port}", "--log", str(log), "--pid", str(os.getpid()),
                     "--name", name, "--out", str(tmp_path / "runs" / f"{name}.json"), "--prompts", "5",
                     "--output-tokens", "7", "--repeats", "2", "--wait", "2", "--reference", reference, *extra])
    finally:
        srv.shutdown()
    return rc, json.loads((tmp_path / "runs" / f"{name}.json").read_text())


def test_run_records_and_compare(tmp_path, capsys):
    rc, rec = run(tmp_path, "ref", 0)
    assert rc == 0 and rec["ok"] and rec["repeats_identical"] and rec["all_lengths_ok"]
    assert rec["output_tokens_total"] == 35 and rec["output_throughput_tok_s"] > 0
    assert rec["chat"]["content"] == "hi" and rec["plugin_log"] == ["purlin_sglang: group tp:0: 2 ranks"]
    assert run(tmp_path, "same", 0, "ref")[0] == 0
    capsys.readouterr()
    assert C.main(["compare", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "serving.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "compare: 2 runs, 2 ok; tokens match the reference in 1 of 1"
    assert run(tmp_path, "other", 3, "ref")[0] == 0
    assert C.main(["compare", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "serving.json")]) == 1
    rows = {r["name"]: r for r in json.loads((tmp_path / "serving.json").read_text())["runs"]}
    assert rows["ref"]["tokens_match_reference"] is None
    assert rows["same"]["tokens_match_reference"] is True and rows["same"]["prompts_matching"] == 5
    assert rows["other"]["tokens_match_reference"] is False and rows["other"]["prompts_matching"] == 4
    assert rows["other"]["first_mismatch"][0] == 1
    assert rows["same"]["logprobs_identical"] is True and rows["same"]["logprobs_max_abs_diff"] == 0
    assert rows["other"]["logprobs_identical"] is False and abs(rows["other"]["logprobs_max_abs_diff"] - 0.25) < 1e-9
    assert rows["ref"]["top2_gap_min"] == 1.5 and rows["ref"]["logprob_error"] is None


def test_server_that_never_gets_ready_is_a_failed_run(tmp_path, capsys):
    rc, rec = run(tmp_path, "late", 0, ready=False)
    assert rc == 1 and not rec["ok"] and "not ready" in rec["error"] and "tokens" not in rec
    assert C.main(["compare", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "serving.json")]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "compare: 1 runs, 0 ok; tokens match the reference in 0 of 0; failed: late"


def test_prompts_are_deterministic():
    assert C.prompts(4, 42) == C.prompts(4, 42) != C.prompts(4, 43)


def test_alone_compares_each_prompt_served_alone_with_the_batch(tmp_path):
    # the fake server shifts the tokens of whatever stands second in a batch: alone, prompt 1 differs
    rc, rec = run(tmp_path, "inv", 0, extra=("--alone", "3"))
    assert rc == 0 and rec["alone_prompts"] == 3 and rec["alone_tokens_match_batch"] and rec["alone_differ"] == []
    rc, rec = run(tmp_path, "var", 5, extra=("--alone", "3"))
    assert rec["alone_tokens_match_batch"] is False and rec["alone_differ"] == [1]
    C.main(["compare", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "serving.json")])
    rows = {r["name"]: r for r in json.loads((tmp_path / "serving.json").read_text())["runs"]}
    assert rows["inv"]["alone_tokens_match_batch"] is True and rows["var"]["alone_differ"] == [1]


def ab(tmp_path, delays, shifts=(0, 0), rounds=4):
    servers = [fake_server(sh, d) for sh, d in zip(shifts, delays)]
    logs = []
    for i in range(2):
        logs.append(tmp_path / f"s{i}.log")
        logs[-1].write_text(C.READY + "\n")
    out = tmp_path / "ab.json"
    try:
        rc = C.main(["ab", "--urls", ",".join(f"http://127.0.0.1:{s.server_port}" for s in servers),
                     "--names", "nccl,purlin", "--logs", ",".join(map(str, logs)),
                     "--pids", f"{os.getpid()},{os.getpid()}", "--out", str(out), "--prompts", "3",
                     "--output-tokens", "5", "--rounds", str(rounds), "--warmup", "1", "--wait", "2"])
    finally:
        for s in servers:
            s.shutdown()
    return rc, json.loads(out.read_text())


def test_ab_alternates_the_servers_and_decides_only_what_the_rounds_show(tmp_path):
    # purlin's server twice as slow: a ratio near 0.5, far outside 2%: "differs"
    rc, rec = ab(tmp_path, (0.02, 0.04))
    assert rc == 0 and rec["ok"], rec
    assert rec["order"] == ["AB", "BA", "AB", "BA"]  # the order flips every round
    assert len(rec["ratios"]) == 4 and rec["ratio_of"] == "purlin/nccl"
    assert 0.3 < rec["mean_ratio"] < 0.7 and rec["verdict"] == "differs", rec
    assert rec["tokens_equal"] is True
    rc, rec = ab(tmp_path, (0.0, 0.0), shifts=(0, 3))
    assert rc == 0 and rec["tokens_equal"] is False


def test_ratio_verdict_needs_the_whole_interval_inside_or_outside():
    assert C.ratio_verdict([1.001, 0.999, 1.002, 0.998, 1.0, 1.001], 0.02)["verdict"] == "within"
    assert C.ratio_verdict([0.90, 0.91, 0.89, 0.90], 0.02)["verdict"] == "differs"
    # a mean inside 2% but rounds too spread to say so: undecided
    wide = C.ratio_verdict([0.95, 1.06, 0.97, 1.04], 0.02)
    assert wide["verdict"] == "undecided" and wide["ci95"][0] < 0.98 < 1.02 < wide["ci95"][1]
    assert C.ratio_verdict([1.0], 0.02)["verdict"] == "undecided"  # one round: no interval


FAKE_SERVER_MAIN = r"""
import subprocess, sys, time
log = sys.argv[1]
victim = subprocess.Popen(["bash", "-c", "exec -a sglang::scheduler_TP1 sleep 600"])
survivor = subprocess.Popen(["bash", "-c", "exec -a sglang::scheduler_TP0 sleep 600"])
victim.wait()
time.sleep(float(sys.argv[2]))
lines = {"purlin": "[TP0] Scheduler hit an exception: purlin_sglang.errors.PurlinTimeoutError: all_reduce: rank 0 "
                   "waited for rank 1\n",
         "lost": "[TP0] purlin[tp:0]: rank 0: peer rank 1 (pid 4242) has exited; this rank's calls that need it end "
                 "with PurlinTimeoutError after timeout_s (2s)\n",
         "gloo": "[TP0] RuntimeError: Connection closed by peer\n"}
with open(log, "a") as f:
    f.write(lines[sys.argv[3]])
survivor.kill()
"""


def decoding_server(log):
    """/generate appends a decode log line (as SGLang's scheduler does) and answers; /health answers 200."""
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(log, "a") as f:
                f.write("Decode batch. #running-req: 4\n")
            n = body["sampling_params"]["max_new_tokens"]
            reply(self, [{"text": "x", "output_ids": list(range(n))} for _ in body["text"]])

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


# --timeout-s 2: the server's log must name purlin's error whenever it exits (the error watch's lost-peer
# line, or purlin's timeout where the server outlived timeout_s); a log that names only gloo's error fails
# the run, early or late; exiting after 7 s is past timeout_s + grace (3).
@pytest.mark.parametrize("delay,says,ok", [(3.0, "purlin", True), (3.0, "gloo", False), (0.5, "gloo", False),
                                           (7.0, "purlin", False), (0.5, "lost", True), (3.0, "lost", True)])
def test_fault_kills_the_victim_scheduler_and_times_the_server_exit(tmp_path, delay, says, ok):
    import subprocess
    import sys

    log = tmp_path / "server.log"
    log.write_text(C.READY + "\n")
    main = subprocess.Popen([sys.executable, "-c", FAKE_SERVER_MAIN, str(log), str(delay), says],
                            start_new_session=True)
    srv = decoding_server(log)
    try:
        time.sleep(0.5)  # its schedulers started
        rc = C.main(["fault", "--url", f"http://127.0.0.1:{srv.server_port}", "--log", str(log), "--pid",
                     str(main.pid), "--name", "f", "--out", str(tmp_path / "f.json"), "--timeout-s", "2",
                     "--grace", "3", "--limit", "20", "--settle", "1", "--prompts", "4", "--output-tokens", "4"])
    finally:
        srv.shutdown()
        main.kill()
        main.wait()
    rec = json.loads((tmp_path / "f.json").read_text())
    assert rec["killed"]["title"].startswith("sglang::scheduler_TP1")
    assert rec["exited_after_s"] is not None and delay <= rec["exited_after_s"] < delay + 3
    assert bool(rec["purlin_error_lines"]) == (says in ("purlin", "lost"))
    assert bool(rec["purlin_lost_peer_lines"]) == (says == "lost")
    assert rec["ok"] is ok and rc == (0 if ok else 1)
    assert rec["gpu_holders_after"] == []
