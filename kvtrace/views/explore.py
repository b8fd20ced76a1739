"""`kvtrace explore`: the interactive terminal explorer (Textual). Keyboard only, fits 80 × 24.

    runs      (several runs given) pick one: Enter
    overview  the dashboard's key figures, then every request: t TTFT, e E2E, p preemptions,
              r recomputed tokens sort it (again: the other way); Enter opens a request
    request   its figures and verdict, a timeline of its states against the pool's occupancy, its
              story's phases one a row (kvtrace explain's story: waits with their causes,
              preemptions with their requesters); Enter on a row opens the step it began in, g on
              a preemption jumps to the request that needed the blocks (where the trace names it)
    step      what ran in one step; Enter opens a request, [ and ] the previous and next step

Escape goes back, q quits. The figures are explore_data's (the SQL library's); this module only
lays them out. Imported only by the explore command, so that no other command pays for Textual.
"""
from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from kvtrace.errors import KvtraceError
from kvtrace.views import dashboard, explore_story
from kvtrace.views.dashboard import fmt_ms, fmt_num
from kvtrace.views.explore_data import RunData, list_runs
from kvtrace.views.explore_story import seq_name

# the requests table's sort keys: key -> (column of request_summary.sql, what the status line says)
SORTS = {"t": ("ttft_ms", "TTFT"), "e": ("e2el_ms", "E2E"), "p": ("preemptions", "preemptions"),
         "r": ("recomputed_tokens", "recomputed tokens")}


def fmt_s(value: float | None) -> str:
    """A time on the run's clock."""
    return "–" if value is None else fmt_ms(value * 1000)


class Table(DataTable):
    """A DataTable that moves by rows, its Enter shown in the footer."""

    BINDINGS = [Binding("enter", "select_cursor", "open")]

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)


class RunsScreen(Screen):
    """Several runs given: pick one."""

    BINDINGS = [Binding("q", "app.quit", "quit")]

    def __init__(self, runs: list[dict]) -> None:
        super().__init__()
        self.runs = runs

    def compose(self) -> ComposeResult:
        yield Static(Text(f"{len(self.runs)} runs: pick one (Enter)", "bold"))
        table = Table(id="runs")
        table.add_columns("run", "status", "KV pool", "preemption", "workload")
        for i, run in enumerate(self.runs):
            workload = (run["workload_path"] or "?").rsplit("/", 1)[-1]
            table.add_row(run["run_id"], run["status"] or "?", f"{run['num_gpu_blocks']} × {run['block_size']}",
                          f"{run['preemption_mode']}/{run['preemption_policy']}",
                          f"{workload}: {fmt_num(run['workload_requests'])} req", key=str(i))
        yield table
        yield Footer()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        run = self.runs[int(event.row_key.value)]
        self.app.open_run(run["path"])


class OverviewScreen(Screen):
    """The run's key figures and its requests, sortable."""

    BINDINGS = [Binding("t", "sort('t')", "TTFT"), Binding("e", "sort('e')", "E2E"),
                Binding("p", "sort('p')", "preempted"), Binding("r", "sort('r')", "recomputed"),
                Binding("escape", "back", "runs", show=False), Binding("q", "app.quit", "quit")]

    def __init__(self, run: RunData) -> None:
        super().__init__()
        self.run = run
        self.sort_key, self.descending = "p", True

    def compose(self) -> ComposeResult:
        width = self.app.size.width
        data = self.run.overview(width)
        fig = data["fig"]
        yield Static(Group(dashboard.header(fig["run"], fig["summary"]),
                           dashboard.key_figures(fig["summary"], fig["thrash"], width),
                           dashboard.thrash_verdict(fig["thrash"])), id="figures")
        yield Static(id="sorted")
        table = Table(id="requests")
        table.add_columns("request", "TTFT", "E2E", "queued", "preempted", "recomputed", "stalled", "finish")
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self.fill()

    def action_sort(self, key: str) -> None:
        self.descending = not self.descending if key == self.sort_key else True
        self.sort_key = key
        self.fill()

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 2:
            self.app.pop_screen()

    def fill(self) -> None:
        column, label = SORTS[self.sort_key]
        rows = sorted(self.run.requests, key=lambda r: (r["req_id"], r["sample"]))
        # worst first (or best first, the other way); requests without the figure last either way
        rows = sorted(rows, key=lambda r: (r[column] is None, -(r[column] or 0) if self.descending else r[column] or 0))
        self.query_one("#sorted", Static).update(Text(
            f"{len(rows)} requests by {label}, {'highest' if self.descending else 'lowest'} first · Enter: its story",
            "dim"))
        table = self.query_one("#requests", Table)
        table.clear()
        for row in rows:
            table.add_row(seq_name(row["req_id"], row["sample"]), fmt_ms(row["ttft_ms"]), fmt_ms(row["e2el_ms"]),
                          fmt_ms(row["queueing_ms"]), f"{row['preemptions']}×" if row["preemptions"] else "–",
                          fmt_num(row["recomputed_tokens"], "tok") if row["recomputed_tokens"] else "–",
                          fmt_ms(row["stall_ms"]) if row["stall_ms"] else "–", row["finish_reason"] or "–",
                          key=f"{row['sample']}:{row['req_id']}")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        sample, _, req_id = event.row_key.value.partition(":")
        self.app.open_request(self.run, req_id, int(sample))


class RequestScreen(Screen):
    """One request: its figures and verdict, its timeline against the pool, its story's phases."""

    BINDINGS = [Binding("g", "requester", "requester"),
                Binding("escape", "app.pop_screen", "back"), Binding("q", "app.quit", "quit")]

    def __init__(self, run: RunData, req_id: str, sample: int) -> None:
        super().__init__()
        self.run, self.req_id, self.sample = run, req_id, sample
        self.story = run.story(req_id, sample)
        self.phases = explore_story.phase_rows(self.story)

    def compose(self) -> ComposeResult:
        row = self.run.request(self.req_id, self.sample) or {}
        width = self.app.size.width
        title = Text()
        title.append(f" {seq_name(self.req_id, self.sample)} ", "bold reverse")
        title.append(f"  {fmt_num(row.get('prompt_tokens'))} → {fmt_num(row.get('output_tokens'))} tok · "
                     f"{row.get('finish_reason') or 'unfinished'} · arrived {fmt_s(row.get('arrival_s'))} · "
                     f"preempted {row.get('preemptions', 0)}×")
        if row.get("recomputed_tokens"):
            title.append(f", {fmt_num(row['recomputed_tokens'], 'tok')} recomputed")
        figures = Text(f"TTFT {fmt_ms(row.get('ttft_ms'))} · E2E {fmt_ms(row.get('e2el_ms'))} · queued "
                       f"{fmt_ms(row.get('queueing_ms'))} · stalled {fmt_ms(row.get('stall_ms'))}")
        verdict = Text.assemble(("verdict: ", "bold"), self.story["verdict"])
        buckets = max(width - explore_story.LABEL_WIDTH - 2, 10)
        rows = self.run.timeline(self.req_id, self.sample, buckets)
        yield Static(Group(title, figures, verdict, explore_story.timeline(rows),
                           explore_story.legend({p["phase"] for p in self.phases})), id="story")
        table = Table(id="phases")
        table.add_columns("phase", "from", "for", "step", "what")
        for i, phase in enumerate(self.phases):
            table.add_row(phase["phase"], phase["from"], phase["for"], phase["steps"], phase["note"], key=str(i))
        yield table
        yield Footer()

    def selected(self) -> dict | None:
        table = self.query_one("#phases", Table)
        return self.phases[table.cursor_row] if self.phases and table.row_count else None

    def action_step(self) -> None:
        phase = self.selected()
        if phase is None:
            return
        step = phase["step"] if phase["step"] is not None else self.run.step_at(phase["start_s"])
        if step is not None:
            self.app.push_screen(StepScreen(self.run, step))

    def action_requester(self) -> None:
        phase = self.selected()
        if not phase or phase["requester"] is None:
            self.notify("g: on a preemption whose requester the trace names (schema 3)", severity="warning")
            return
        self.app.open_request(self.run, *phase["requester"])

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_step()


class StepScreen(Screen):
    """What ran in one step."""

    BINDINGS = [Binding("left_square_bracket", "move(-1)", "previous"), Binding("right_square_bracket", "move(1)", "next"),
                Binding("escape", "app.pop_screen", "back"), Binding("q", "app.quit", "quit")]

    def __init__(self, run: RunData, step: int) -> None:
        super().__init__()
        self.run, self.number = run, step

    def compose(self) -> ComposeResult:
        yield Static(id="step")
        table = Table(id="sequences")
        table.add_columns("request", "state", "tokens", "blocks +/−", "events")
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self.fill()

    def action_move(self, delta: int) -> None:
        number = self.number + delta
        if 0 <= number <= self.run.last_step and self.run.step(number) is not None:
            self.number = number
            self.fill()

    def fill(self) -> None:
        step = self.run.step(self.number) or {"sequences": []}
        text = Text()
        text.append(f" step {self.number} ", "bold reverse")
        text.append(f"  at {fmt_s(step.get('start_s'))} · {fmt_ms(step.get('device_ms'))} on the device")
        text.append(f"\nrunning {step.get('running')} · waiting {step.get('waiting')} · swapped {step.get('swapped')}"
                    f" · {fmt_num(step.get('prefill_tokens'))} prefill + {fmt_num(step.get('decode_tokens'))}"
                    f" decode tok ({fmt_num(step.get('recompute_tokens'))} again)")
        text.append(f"\npool {step.get('used_blocks')} of {step.get('total_blocks')} blocks used, "
                    f"{step.get('free_blocks')} free ({step.get('cached_blocks')} cached)")
        if step.get("admission_stop"):     # schema 3
            text.append(f" · admission stopped: {step['admission_stop']}")
        victims = [f"{seq_name(r['req_id'], r['sample'])} for {r['preempted_for']} ({r['victim_reason'] or '?'})"
                   for r in step["sequences"] if r["preempted_for"]]
        if victims:
            text.append("\npreempted " + ", ".join(victims))
        elif step.get("preemptions"):      # a trace before schema 3 names no requester
            text.append(f"\n{step['preemptions']} preempted")
        self.query_one("#step", Static).update(text)
        table = self.query_one("#sequences", Table)
        table.clear()
        for row in step["sequences"]:
            table.add_row(seq_name(row["req_id"], row["sample"]), row["state"] or "finished", str(row["tokens"]),
                          f"+{row['blocks_allocated']} −{row['blocks_freed']}", row["events"] or "",
                          key=f"{row['sample']}:{row['req_id']}")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        sample, _, req_id = event.row_key.value.partition(":")
        self.app.open_request(self.run, req_id, int(sample))


class Explorer(App):
    """kvtrace explore: runs, requests, their stories and the steps they ran in."""

    TITLE = "kvtrace explore"
    CSS = """
    Screen { layout: vertical; }
    Static { width: 100%; height: auto; }
    DataTable { height: 1fr; }
    """
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, runs: list[str]) -> None:
        super().__init__()
        self.runs = list_runs(runs)
        self.opened: dict[str, RunData] = {}

    def on_mount(self) -> None:
        if len(self.runs) == 1:
            self.open_run(self.runs[0]["path"])
        else:
            self.push_screen(RunsScreen(self.runs))

    def open_run(self, path: str) -> None:
        if path not in self.opened:
            self.opened[path] = RunData(path)
        self.push_screen(OverviewScreen(self.opened[path]))

    def open_request(self, run: RunData, req_id: str, sample: int) -> None:
        try:
            screen = RequestScreen(run, req_id, sample)
        except KvtraceError as exc:      # e.g. a sequence still running, with no row in `requests` yet
            self.notify(str(exc), severity="warning")
            return
        self.push_screen(screen)
