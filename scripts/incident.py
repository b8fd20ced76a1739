"""Write docs/incident.md: an incident followed from a real capture to the vLLM flag to change.

    KVTRACE_VLLM_PYTHON=~/.cache/kvtrace/vllm-venv-0.32.0/bin/python python scripts/incident.py [--work DIR]

Serves SmolLM2-135M with vLLM's CPU build (`vllm serve`, kvtrace's capture on, as docs/vllm.md says,
token ids not kept), under the name an operator would give it, on a tight KV pool; drives it with the
`openai` client, each request with its own `X-Request-Id`: a calm minute, a bad minute (a burst the pool
cannot hold: preemptions), calm again. Then it runs, as an operator would, the commands of `steps`
(capture ls, capture run of the bad minute in wall-clock time, analyze, explain of the request a user
named by its X-Request-Id, explain --at the worst moment, calibrate on the window, a sweep of the
window's traffic with everything else read from the run) and writes their real output into the page.
tests/cli/test_incident.py runs the same `steps` on the capture fixture.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVED_AS = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVE = ["--dtype", "float32", "--block-size", "32", "--num-gpu-blocks-override", "12", "--max-model-len", "256",
         "--max-num-seqs", "8", "--gpu-memory-utilization", "0.3", "--enforce-eager",
         "--served-model-name", SERVED_AS]
COMPLAINT = "checkout-7f3a"          # the X-Request-Id a user quotes
SWEPT = "num_gpu_blocks=11,16,24,32,48,64,96"   # the pool, from the server's 11 usable blocks up


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def steps(capture: Path, work: Path, since: str, until: str, request: str, at: str, sweep: str) -> list[list[str]]:
    """The operator's commands, in order (kvtrace's arguments)."""
    run = str(work / "runs" / "incident")
    profile = str(work / "server.json")
    return [
        ["capture", "ls", str(capture)],
        ["capture", "run", str(capture), "-o", run, "--since", since, "--until", until],
        ["analyze", run],
        ["explain", run, request],
        ["explain", run, "--at", at],
        ["calibrate", run, "-o", profile],
        ["sweep", "--from-run", run, "--hardware", profile, "--objective", "ttft_p99", "--set", sweep,
         "-o", str(work / "sweeps" / "incident"), "--jobs", "2"],
    ]


def run_step(args: list[str], cwd: Path) -> str:
    """One command's output as a terminal 100 columns wide shows it (stderr's lines first); raises if it fails."""
    proc = subprocess.run([sys.executable, "-m", "kvtrace", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"kvtrace {shlex.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return (proc.stderr + proc.stdout).rstrip()


def serve_and_drive(python: str, work: Path, capture: Path) -> dict:
    """Serve with the capture, send the traffic, stop the server; the times and ids the page needs."""
    import openai

    from kvtrace.vllm.record import model_folder
    from tests.helpers.vllm_runs import start_vllm_server

    lines = subprocess.run([sys.executable, "-m", "kvtrace", "vllm-env", "--capture-dir", str(capture)],
                           capture_output=True, text=True, check=True).stdout
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    for line in lines.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip('"').replace("${PYTHONPATH:+:$PYTHONPATH}", "")
    proc, port = start_vllm_server(python, str(model_folder("smollm2-135m")),
                                   ["--scheduler-cls", env["KVTRACE_SCHEDULER_CLS"], *SERVE], env,
                                   work / "serve.log", cwd=work)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=900, max_retries=0)
    errors: list[str] = []

    def one(rid: str, words: int, max_tokens: int) -> None:
        try:
            stream = client.completions.create(
                model=SERVED_AS, prompt=f"Order {rid}: " + "please summarise the basket and the delivery " * words,
                max_tokens=max_tokens, stream=True, temperature=0.0, extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": rid})
            for _ in stream:
                pass
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(f"{rid}: {exc!r}")

    def send(rid: str, words: int, max_tokens: int) -> threading.Thread:
        t = threading.Thread(target=one, args=(rid, words, max_tokens), daemon=True)
        t.start()
        return t

    threads = []
    try:
        started = time.time()
        for i in range(6):                       # a calm minute: one request at a time, now and then
            send(f"calm-{i}", 3, 24).join()
            time.sleep(3)
        bad_start = time.time()
        for i in range(11):                      # the bad minute: a burst the pool cannot hold
            threads.append(send(f"burst-{i}" if i != 5 else COMPLAINT, 6 + i % 4, 96))
            time.sleep(0.2)
        for t in threads:
            t.join(timeout=1800)
        bad_end = time.time()
        for i in range(4):                       # calm again
            send(f"after-{i}", 3, 24).join()
            time.sleep(2)
        time.sleep(4)                            # the last chunk: the capture writes one when the engine idles
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    return {"started": started, "bad_start": bad_start, "bad_end": bad_end, "vllm": version}


def worst_moment(run: Path) -> str:
    """The wall-clock time (HH:MM:SS, UTC) of the run's step with the most requests preempted or waiting."""
    from kvtrace.trace import db

    meta = json.loads((run / "meta.json").read_text())["capture"]["window"]
    con = db.connect([run])
    start_s, = con.execute("SELECT start_s FROM steps ORDER BY preemptions DESC, waiting DESC, step LIMIT 1").fetchone()
    unix = meta["since_unix"] + start_s - meta["start_s"]
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%H:%M:%S")


PAGE = """# An incident, from the capture to the vLLM flag to change

*Generated by `scripts/incident.py` on {date} from a real `vllm serve` (vLLM {vllm}, its CPU build,
SmolLM2-135M served as `{served}` on a KV pool of 11 usable blocks of 32 tokens) with kvtrace's
capture on, driven by the `openai` client. Every output below is the command's own; rerun the script
to see it again on your machine. tests/cli/test_incident.py runs the same commands on a capture fixture.*

A user writes: "my request `{complaint}` hung around {bad_clock} UTC". The capture has been on all
along (docs/vllm.md, *In production*), token ids not kept. The operator's questions, in order.

## 1. What does the folder hold?

```
$ {cmd0}
{out0}
```

One server, the span it covers, its requests and the bytes they take. A gap line would say what
retention removed, or what a disk slower than the capture made it drop.

## 2. The bad minute, as a run

The user's time is wall-clock time; `capture run` takes it as it is (ISO 8601, UTC unless it names a zone).

```
$ {cmd1}
{out1}
```

## 3. What happened in it

```
$ {cmd2}
{out2}
```

## 4. The request the user named

`explain` takes the client's `X-Request-Id` (vLLM names the request `cmpl-<X-Request-Id>-0-<suffix>`), or
any unique start of a request id, and prints a capture's times on the wall clock (UTC):

```
$ {cmd3}
{out3}
```

## 5. Everything in flight at the worst moment

`--at` takes a time of day on the window's date (or an ISO time): here the step with the most
requests preempted or waiting.

```
$ {cmd4}
{out4}
```

## 6. The server's speed, from the capture itself

A what-if must run at the speed of the server that served the traffic, or a burst that overwhelmed it
does not overwhelm the model of it. The capture does not say which GPU served it, so the operator fits
the simulator's step cost to the window's own steps (docs/simulation.md):

```
$ {cmd5}
{out5}
```

## 7. What would have helped: a what-if on the window's own traffic

`sweep --from-run` reads the model (the capture names it as served: mapped to the simulator's model
of the same shape, or refused in one line that says what to pass), the KV pool and the scheduler's
limits from the run; only the knob to try, the profile and what "better" means are given (here the
TTFT p99, what the user felt). The requests in flight at the window's edges are kept and the rule
for them is said (docs/sweep.md, *A window's edges*).

```
$ {cmd6}
{out6}
```

The first row is the incident replayed: its preemptions and its TTFT p99 are the capture's own, within
the fit's error (section 3).

## 8. The answer, as the engine argument to change

The line before the recommendation is the best point as vLLM engine arguments (docs/sweep.md maps
every knob to its flag; kvtrace counts usable blocks, vLLM's number holds its null block too). On a
GPU server the same pool comes from `--gpu-memory-utilization` or `--kv-cache-memory-bytes` (the
blocks times the bytes of one block, which `kvtrace analyze` shows a run's pool in). Read it with the
table: where the server's compute is the limit, as on this CPU, more KV ends the preemptions and the
recomputation and shortens the queue, and the steps of a fuller batch get slower (ITL p50).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=os.environ.get("KVTRACE_VLLM_PYTHON"))
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a new temporary one)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "incident.md")
    args = parser.parse_args()
    if not args.vllm_python:
        raise SystemExit("give --vllm-python (the Python of vLLM's CPU build: scripts/vllm_env.sh)")
    import tempfile
    work = args.work or Path(tempfile.mkdtemp(prefix="kvtrace-incident-"))
    work.mkdir(parents=True, exist_ok=True)
    capture = work / "capture"
    sys.path.insert(0, str(ROOT))
    told = serve_and_drive(args.vllm_python, work, capture)
    since, until = iso(told["bad_start"] - 5), iso(told["bad_end"] + 5)
    commands = steps(capture, work, since, until, COMPLAINT, "HH:MM:SS", SWEPT)
    outputs = [run_step(commands[0], work), run_step(commands[1], work)]
    at = worst_moment(work / "runs" / "incident")
    commands = steps(capture, work, since, until, COMPLAINT, at, SWEPT)
    outputs += [run_step(c, work) for c in commands[2:]]
    shown = [shlex.join(["kvtrace", *c]).replace(str(work) + "/", "").replace(str(work), ".") for c in commands]
    text = PAGE.format(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), vllm=told["vllm"], served=SERVED_AS,
                       complaint=COMPLAINT, bad_clock=datetime.fromtimestamp(told["bad_start"], timezone.utc)
                       .strftime("%H:%M"),
                       **{f"cmd{i}": c for i, c in enumerate(shown)},
                       **{f"out{i}": o.replace(str(work) + "/", "").replace(str(work), ".")
                          for i, o in enumerate(outputs)})
    args.out.write_text(text)
    print(f"wrote {args.out} (work folder {work})")


if __name__ == "__main__":
    main()
