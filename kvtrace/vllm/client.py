"""`kvtrace record --endpoint URL`: replay a workload against a running `vllm serve` that captures.

The server runs kvtrace's scheduler (`eval "$(kvtrace vllm-env --capture-dir DIR)"` before
`vllm serve ... --scheduler-cls ...`, docs/vllm.md) and writes its chunks into DIR. The client sends
each request at its arrival time over the OpenAI-compatible completions API (token-id prompts,
streaming, `ignore_eos` and `return_token_ids`, the request id `kvt<index>` in `X-Request-Id`), stamps
every streamed token as it arrives, then takes from DIR what the server recorded while the replay
ran and writes one run folder: the engine's tables as for `--engine vllm`, and `client_tokens`, the
same tokens as the client saw them, for TTFT and ITL measured on both sides.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa

from kvtrace.errors import KvtraceError
from kvtrace.trace.schema import OPTIONAL_TABLES, write_parquet
from kvtrace.vllm.importer import convert, map_ids, read_chunks, read_json


class Endpoint:
    def __init__(self, url: str, timeout: float) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise KvtraceError(f"--endpoint {url}: expected http://HOST:PORT")
        self.url = url
        self.https = parsed.scheme == "https"
        self.host = parsed.hostname
        self.port = parsed.port or (443 if self.https else 80)
        self.base = parsed.path.rstrip("/")
        self.timeout = timeout

    def connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def served_model(self) -> str:
        conn = self.connection()
        try:
            conn.request("GET", f"{self.base}/v1/models")
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise KvtraceError(f"--endpoint {self.url}: GET /v1/models answered {response.status}")
            return json.loads(body)["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise KvtraceError(f"--endpoint {self.url}: no OpenAI-compatible server there ({exc})") from exc
        finally:
            conn.close()


class ClientReplay:
    """Threads that send the requests at their arrival times and stamp each streamed token."""

    def __init__(self, endpoint: Endpoint, model: str, items: list[dict]) -> None:
        self.endpoint, self.model, self.items = endpoint, model, items
        self.tokens: dict[tuple[int, int], list[tuple[float, int]]] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.origin = 0.0

    def run(self, stop=None) -> float:
        threads = []
        self.origin = time.monotonic()
        for item in sorted(self.items, key=lambda i: i["arrival_s"]):
            while (wait := item["arrival_s"] - (time.monotonic() - self.origin)) > 0:
                if stop is not None:
                    stop()
                time.sleep(min(wait, 0.05))
            thread = threading.Thread(target=self._send, args=(item,), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            while thread.is_alive():
                if stop is not None:
                    stop()
                thread.join(timeout=0.2)
        return time.monotonic()

    def _send(self, item: dict) -> None:
        body = {"model": self.model, "prompt": item["prompt_token_ids"], "max_tokens": item["max_tokens"],
                "n": item["n"], "temperature": item["temperature"], "top_p": item["top_p"], "seed": item["seed"],
                "ignore_eos": item["ignore_eos"], "stream": True, "return_token_ids": True}
        if item["output_tokens"] is not None:
            body["max_tokens"] = min(item["max_tokens"], item["output_tokens"])
            body["ignore_eos"] = True
        if item["priority"]:
            body["priority"] = item["priority"]
        conn = self.endpoint.connection()
        try:
            conn.request("POST", f"{self.endpoint.base}/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "X-Request-Id": f"kvt{item['index']}"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.monotonic()
                for choice in json.loads(data).get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids:
                        with self.lock:
                            self.tokens.setdefault((item["index"], choice["index"]), []).extend((now, t) for t in ids)
        except Exception as exc:   # one failed request is reported, the others go on
            with self.lock:
                self.errors.append(f"request {item['index']}: {exc}")
        finally:
            conn.close()


def wait_for_capture(capture: Path, items: list, since: float, deadline_s: float) -> None:
    """Until every replayed request's row is in a closed chunk (the server closes one when it idles)."""
    wanted = {item.req_id for item in items}
    by_index = {item.index: item for item in items}
    deadline = time.monotonic() + deadline_s
    while True:
        cols = read_chunks(capture)["requests"]
        ids = map_ids(cols["req_id"], by_index)
        found = {ids[r][0] for r, finish in zip(cols["req_id"], cols["finish_s"]) if r in ids and finish >= since}
        if wanted <= found or time.monotonic() > deadline:
            return
        time.sleep(0.5)


def write_client_tokens(run_dir: Path, run_id: str, replay: ClientReplay, items, origin: float,
                        record_token_ids: bool) -> int:
    schema = OPTIONAL_TABLES["client_tokens"]
    by_index = {item.index: item for item in items}
    cols = {name: [] for name in schema.names}
    for (index, sample), stamps in sorted(replay.tokens.items()):
        for idx, (ts, token) in enumerate(stamps):
            cols["run_id"].append(run_id)
            cols["req_id"].append(by_index[index].req_id)
            cols["sample"].append(sample)
            cols["idx"].append(idx)
            cols["token_id"].append(token if record_token_ids else None)
            cols["ts_s"].append(ts - origin)
    folder = run_dir / "client_tokens"
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pydict(cols, schema=schema)
    tmp = folder / ".part-00000.parquet.tmp"
    write_parquet(table, tmp)
    tmp.replace(folder / "part-00000.parquet")
    return table.num_rows


def record_endpoint(recording, endpoint_url: str, capture_dir: Path, *, timeout: float, stop=None) -> str:
    """Replay `recording`'s items (a prepared VllmRecording) against the server; write its run folder."""
    from kvtrace.vllm.follow import capture_status

    capture = Path(capture_dir)
    status = capture_status(capture)
    if status is not None and not status.capturing:
        raise KvtraceError(f"--capture-dir {capture}: the capture of its newest server ({status.server_id}) "
                           f"{status.status.replace('_', ' ')}: {status.error} [{status.reason}]; the replay would not "
                           f"be recorded")
    captured = read_json(capture / "capture.json")
    if captured is None:
        raise KvtraceError(f"--capture-dir {capture}: no capture.json — start the server with "
                           f"eval \"$(kvtrace vllm-env --capture-dir {capture})\" and kvtrace's --scheduler-cls")
    endpoint = Endpoint(endpoint_url, timeout)
    served = endpoint.served_model()
    run_dir = recording.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = recording.meta
    meta["started_at"] = datetime.now(timezone.utc).isoformat()
    meta["status"] = "running"
    meta["vllm"].update({"endpoint": endpoint_url, "served_model": served, "capture_dir": str(capture)})
    from kvtrace.atomic import write_json_atomic
    write_json_atomic(run_dir / "meta.json", meta)
    replay = ClientReplay(endpoint, served, recording.items)
    interrupted = False
    try:
        with recording.console.status(f"replaying {len(recording.items)} requests against {endpoint_url}"):
            end = replay.run(stop)
    except KeyboardInterrupt:
        interrupted, end = True, time.monotonic()
    origin = replay.origin
    if not interrupted:
        wait_for_capture(capture, recording.import_items, origin, deadline_s=30.0)
    rows = convert(capture, run_dir, run_dir.name, recording.import_items, origin, interrupted=interrupted,
                   record_token_ids=recording.record_token_ids, window=(origin - 0.5, end + 30.0))
    rows["client_tokens"] = write_client_tokens(run_dir, run_dir.name, replay, recording.import_items, origin,
                                                recording.record_token_ids)
    if replay.errors:
        meta["error"] = f"{len(replay.errors)} request(s) failed: " + "; ".join(replay.errors[:3])
    results = {"duration_s": end - origin, "vllm_version": captured.get("vllm_version")}
    status = "interrupted" if interrupted else ("failed" if replay.errors else "completed")
    recording._finish_meta(status, results, captured, read_json(capture / "done.json") or {}, rows)
    return status
